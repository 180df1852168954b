"""Risk of losing trainable state, priced in seconds per step (an extension beyond the paper).

Why: a spot or preemptible pool takes GPUs without notice. Trained weights and optimizer state live
only in the ``*.train`` EMUs (DESIGN.md §4.9: state survives as long as one copy does); a plan whose
``*.train`` model-stage keeps all its replicas inside the GPUs one loss event can take loses that
state and falls back to checkpoint/restart (paper §4.3). The paper's objective is the step latency
alone, so the fastest plan often has one training replica; on a volatile pool that plan is slower in
expectation than a plan with two replicas on different nodes. Pricing the risk lets planning and
admission compare both (Bamboo, NSDI'23, and Oobleck, SOSP'23, keep redundant copies for the same
reason; Gemini, SOSP'23, replicates checkpoints in peer CPU memory).

Model (all times in seconds)::

    risk(S) = L_step(S) · λ · (P_hit(S) · C(S) + P_touch(S) · (L_step(S) / 2 + detect_s))
    C(S)    = restart_s + (checkpoint_interval / 2) · L_step(S)   restart + redone steps on average
              (with save_s: restart_s + sqrt(2 · save_s / (λ · P_hit)) / 2, Young's interval)
    P_hit(S)= min(1, Σ_m [ Σ_{n ∈ ∩_d nodes(copy d of m)} q_n  +  straddle_m ])
    P_touch(S) = min(1, Σ_{n ∈ nodes(S)} q_n)

* ``λ``: loss events per second of run time observed so far (:class:`LossRate`). Only *unannounced*
  losses count: GPUs that left ``alive`` while still in ``P_gpu`` (with a preemption notice they leave
  ``P_gpu`` first and their state is moved, not lost). Before the first such loss ``λ = 0`` unless a
  prior is given, so a stable pool pays nothing.
* ``P_hit``: a loss event takes ``m_nodes`` whole nodes (the mean size of the observed events, in
  nodes, at least 1) uniformly among the pool's nodes (with ``sites``, each node instead with its
  hit probability learned from the losses seen, ``nereus.controller.loss_sites``; issue 29); it
  destroys model-stage ``m`` when it takes a
  node every replica of ``m`` uses (the intersection of their node sets: all of a single replica's
  nodes; none when two replicas share no node). The union bound over model-stages, capped at 1.
* ``straddle_m`` (issue 29, third round): one event can take GPUs of several nodes at once (the
  count traces remove GPUs by id, not whole nodes; clouds reclaim a zone's instances together), so
  it can take one node of *each* replica: for two copies on node sets ``A`` and ``B`` the bound
  ``Σ_{a ∈ A, b ∈ B} p_ab`` with ``p_ab`` the probability that one event takes both nodes (uniform
  ``m (m − 1) / (N (N − 1))``, 0 for whole-node events; learned per pair with ``sites``).
* ``P_touch`` and ``detect_s`` (issue 29, third round; priced when ``RiskModel.detect_s`` is set):
  an event that takes any GPU of the plan aborts the running step (half of it is lost on average)
  and is seen only after failure detection, whether or not the state survives; so a plan that
  spreads onto the nodes most likely to go pays for it even when it is redundant.
* ``save_s`` (third round): with Young's checkpoint interval (the simulator's executor,
  ``nereus.sim.checkpoint``) the redone work is half of ``sqrt(2 · save_s · M)`` with ``M`` the plan's
  mean time between state losses, not half of a fixed 25 steps (hours of 70B work, against the
  few minutes the executor actually redoes: 188-357 s on 70B bamboo-g4dn).

Enabled through ``ControllerConfig(risk=RiskModel(...))``; the simulator's controller policies use
it by default (``nereus-paper`` does not). Measured (benchmarks/bench_admission.py, 9 shipped
traces x seeds 0-2, 4 h, no notice): 1.04x the paper's rule in throughput (geometric mean), restarts
75 → 38; with a 2-minute notice identical to it (no unannounced loss, λ = 0). Before the transition
planner learned drop and reload and host staging it was 0.97x on a 6-run subset (Bamboo/Oobleck
p3): infeasible transitions held the redundant layouts back (docs/simulate.md, Results).

The controller asks the planner for the fastest plan and, when that plan carries risk, also for the
fastest plan with two replicas of every ``*.train`` model-stage on distinct nodes
(``SearchOptions.min_train_replicas``), and keeps whichever has the smaller ``L_step + risk``;
admission compares risk-adjusted step times. Assumptions: losses hit nodes uniformly (real spot
reclaims are correlated within an instance type and zone, so this underestimates multi-node events),
a checkpoint happens every ``checkpoint_interval`` steps, and restart_s comes from the executor's
restart-cost model (``nereus.sim.restart`` in the simulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nereus.controller.loss_sites import LossSites
from nereus.spec.hardware import ClusterSpec
from nereus.spec.plan import Plan

__all__ = ["LossRate", "RiskModel", "state_copies", "state_survives", "vulnerable_nodes", "hit_probability",
           "touch_probability", "DETECT_S"]


@dataclass
class LossRate:
    """Unannounced GPU-loss events per second, from what the executor reports.

    Attributes:
        prior_events, prior_seconds: pseudo-observations (0, 0: no prior; λ = 0 until a loss).
        events: unannounced loss events seen.
        gpus_lost: GPUs those events took (for the mean event size).
        seconds: run time observed (from ``StepReport.elapsed_s`` when given, else summed step times).

    Raises:
        ValueError: negative prior.
    """

    prior_events: float = 0.0
    prior_seconds: float = 0.0
    events: int = 0
    gpus_lost: int = 0
    seconds: float = 0.0
    _last_pool: frozenset | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prior_events < 0 or self.prior_seconds < 0:
            raise ValueError(f"loss-rate prior must be >= 0, got events={self.prior_events!r}, "
                             f"seconds={self.prior_seconds!r}")

    def observe(self, pool: frozenset, alive: frozenset, elapsed_s: float | None, step_time: float) -> int:
        """Record one step report; returns the number of GPUs lost without notice since the last one."""
        if elapsed_s is not None:
            self.seconds = max(self.seconds, float(elapsed_s))
        else:
            self.seconds += max(0.0, float(step_time))
        lost = 0
        if self._last_pool is not None:
            lost = len(self._last_pool - alive)  # were usable at the last boundary, gone without notice
            if lost:
                self.events += 1
                self.gpus_lost += lost
        self._last_pool = frozenset(pool)
        return lost

    @property
    def rate(self) -> float:
        """λ in events per second (0 before any event or prior)."""
        t = self.seconds + self.prior_seconds
        n = self.events + self.prior_events
        return n / t if t > 0 and n > 0 else 0.0

    def mean_event_gpus(self) -> float:
        """Mean GPUs per observed event (1 before the first)."""
        return self.gpus_lost / self.events if self.events else 1.0


def state_copies(candidate) -> tuple[tuple[int, ...], ...]:
    """The GPU sets of ``candidate`` that each hold a whole copy of its trained state (weights and
    optimizer state): one per DP replica, or, when ZeRO shards the state over the DP ranks
    (``zero >= 1`` with ``dp > 1``: stage 1 shards the optimizer state, 2 also gradients, 3 also
    weights; Rajbhandari et al., SC'20; Megatron-LM's distributed optimizer is stage 1), a single
    copy over all its GPUs: losing any of them loses a shard nobody else holds (the transition
    planner's Φ makes such a group one EMU, ``nereus.transition.emu.phi``)."""
    if getattr(candidate, "zero", 0) and candidate.dp > 1:
        return (tuple(candidate.gpus),)
    return tuple(candidate.replica_gpus(d) for d in range(candidate.dp))


def vulnerable_nodes(plan: Plan, cluster: ClusterSpec) -> dict[str, frozenset]:
    """``*.train`` model-stage → nodes whose loss alone destroys every copy of its state
    (:func:`state_copies`; may be empty)."""
    out = {}
    for c in plan.candidates:
        if not c.model_stage.endswith(".train") or not c.gpus:
            continue
        common = None
        for gpus in state_copies(c):
            nodes = frozenset(cluster.node_of(g) for g in gpus)
            common = nodes if common is None else common & nodes
        out[c.model_stage] = common or frozenset()
    return out


def _node_model(cluster: ClusterSpec, pool, event_nodes: float, sites: LossSites | None):
    """``(pool nodes, q(n), p(a, b))``: per-node and per-pair hit probabilities of one event, uniform
    (``m = max(1, event_nodes)`` whole nodes among ``N``: ``q = m / N``, ``p = m (m − 1) / (N (N − 1))``)
    or learned from ``sites`` once they have seen an event (``nereus.controller.loss_sites``)."""
    pool_nodes = frozenset(cluster.node_of(g) for g in pool)
    n = len(pool_nodes)
    m = max(1.0, event_nodes)
    q0 = min(1.0, m / n) if n else 0.0
    if sites is not None and sites.events > 0:
        mh = max(1.0, sites.mean_nodes_hit())
        p0 = min(1.0, mh * (mh - 1.0) / (n * (n - 1))) if n > 1 else 0.0
        return pool_nodes, (lambda a: sites.probability(a, q0)), (lambda a, b: sites.pair_probability(a, b, p0))
    p0 = min(1.0, m * (m - 1.0) / (n * (n - 1))) if n > 1 else 0.0
    return pool_nodes, (lambda a: m / n), (lambda a, b: p0)


def _copies_hit_together(copies, common, q, p) -> float:
    """Union bound on the probability that one event takes a GPU of every copy in ``copies`` (node
    sets) through nodes outside ``common`` (the nodes all copies share, priced separately): for each
    pair of copies ``d, d'``, ``Σ_{a ∈ d ∩ d' − common} q_a + Σ_{a ∈ d − d', b ∈ d' − d} p_ab``;
    every copy must be hit, so the smallest pair bounds the whole. 0 with fewer than two copies."""
    if len(copies) < 2:
        return 0.0
    best = math.inf
    for i, x in enumerate(copies):
        for y in copies[i + 1:]:
            both = sum(q(a) for a in (x & y) - common)
            both += sum(p(a, b) for a in x - y for b in y - x)
            best = min(best, both)
    return best


def hit_probability(plan: Plan, cluster: ClusterSpec, pool, event_nodes: float = 1.0,
                    sites: LossSites | None = None) -> float:
    """``P_hit``: probability that one loss event of ``event_nodes`` nodes destroys the trainable
    state of some model-stage (module docstring). 0 for an empty pool.

    Two ways an event destroys a model-stage's state: it takes a node every copy uses (the
    vulnerable nodes, ``Σ q_n``), or it takes GPUs of several nodes at once, one of each copy
    (``_copies_hit_together``: the pair terms ``p_ab``, 0 under the uniform model of whole-node
    events, ``event_nodes ≤ 1``). With ``sites`` that have seen a loss, ``q_n`` and ``p_ab`` are
    learned (``nereus.controller.loss_sites``, priors ``q0 = min(1, m / |nodes(pool)|)`` and
    ``p0 = m_h (m_h − 1) / (N (N − 1))``); otherwise uniform. The sum over model-stages is capped
    at 1 (union bound).
    """
    pool_nodes, q, p = _node_model(cluster, pool, event_nodes, sites)
    if not pool_nodes:
        return 0.0
    total = 0.0
    for c in plan.candidates:
        if not c.model_stage.endswith(".train") or not c.gpus:
            continue
        copies = [frozenset(cluster.node_of(g) for g in gpus) & pool_nodes for gpus in state_copies(c)]
        common = frozenset.intersection(*copies)
        total += sum(q(n) for n in common) + _copies_hit_together(copies, common, q, p)
    return min(1.0, total)


def touch_probability(plan: Plan, cluster: ClusterSpec, pool, event_nodes: float = 1.0,
                      sites: LossSites | None = None) -> float:
    """``P_touch``: probability that one loss event takes some GPU of ``plan`` (and so aborts its
    step), ``min(1, Σ_{n ∈ nodes(plan)} q_n)`` over the plan's nodes in the pool, ``q_n`` uniform
    or learned as in :func:`hit_probability`. 0 for an empty pool."""
    pool_nodes, q, _ = _node_model(cluster, pool, event_nodes, sites)
    nodes = frozenset(cluster.node_of(g) for g in plan.gpus_used()) & pool_nodes
    return min(1.0, sum(q(n) for n in nodes))


#: seconds from an unannounced loss until Ray declares the node dead: the middle of Ray's 15-50 s
#: (5 failed health checks 3 s apart, each allowed 10 s; ``src/ray/common/ray_config_def.h``)
DETECT_S = 32.5


@dataclass(frozen=True)
class RiskModel:
    """Prices a plan's state-loss risk (module docstring).

    Attributes:
        restart_s: seconds of a checkpoint/restart (process restart, state load, warm-up).
        checkpoint_interval: RL steps between checkpoints (half of them are redone on average);
            used when ``save_s`` is None (a fixed checkpoint interval).
        save_s: seconds one checkpoint save takes, when the executor checkpoints at Young's
            interval (``nereus.sim.checkpoint``): the redone work is then half of
            ``sqrt(2 · save_s · M)`` with ``M = 1 / (λ · P_hit)`` the plan's mean time between
            state losses (:meth:`redo_s`). None: the fixed interval.
        detect_s: seconds from an unannounced loss until the executor sees it (:data:`DETECT_S`);
            given, every event that takes a GPU of the plan also costs the aborted step (half of
            ``L_step`` on average) and the detection (:meth:`risk`). None: interruptions not priced.

    Raises:
        ValueError: negative or non-finite seconds or a non-positive interval.
    """

    restart_s: float = 180.0
    checkpoint_interval: int = 25
    save_s: float | None = None
    detect_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise ValueError(f"risk field 'restart_s' must be a finite number >= 0 s, got {self.restart_s!r}")
        if not (isinstance(self.checkpoint_interval, int) and self.checkpoint_interval >= 1):
            raise ValueError(f"risk field 'checkpoint_interval' must be an integer >= 1 step, "
                             f"got {self.checkpoint_interval!r}")
        for f in ("save_s", "detect_s"):
            v = getattr(self, f)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"risk field {f!r} must be None or a finite number >= 0 s, got {v!r}")

    @property
    def forced_restart_s(self) -> float:
        """Seconds of a restart that saves a checkpoint first: ``restart_s + save_s`` (0 s of save when
        None); the cost of a move off announced GPUs that cannot end in time (``loss_order``)."""
        return self.restart_s + (self.save_s or 0.0)

    def redo_s(self, l_step: float, failure_rate: float = 0.0) -> float:
        """Seconds of completed work redone after one state loss: half the checkpoint interval,
        ``checkpoint_interval · l_step / 2`` (fixed), or with ``save_s`` and a ``failure_rate`` > 0
        (state losses per second) half of Young's interval, ``sqrt(2 · save_s / failure_rate) / 2``
        (Young, CACM 17(9), 1974; the executor's rule, ``nereus.sim.checkpoint``)."""
        if self.save_s is None or not failure_rate > 0:
            return 0.5 * self.checkpoint_interval * l_step
        return 0.5 * math.sqrt(2.0 * self.save_s / failure_rate)

    def loss_cost(self, l_step: float, failure_rate: float = 0.0) -> float:
        """``C``: seconds lost by one state-loss event for a plan with step time ``l_step``
        (restart plus :meth:`redo_s`)."""
        return self.restart_s + self.redo_s(l_step, failure_rate)

    def risk(self, plan: Plan, cluster: ClusterSpec, pool, rate: float, event_gpus: float = 1.0,
             sites: LossSites | None = None, adjust=None) -> float:
        """Expected seconds lost per step on ``plan`` (0 when ``rate`` is 0)::

            risk = L · λ · (P_hit · C  +  P_touch · (L / 2 + detect_s))     (the last term with detect_s)

        ``L · λ`` is the expected events per step; ``C`` = :meth:`loss_cost` at the plan's failure
        rate ``λ · P_hit``; ``P_touch`` (:func:`touch_probability`, at least ``P_hit``) the chance
        an event aborts the step. The urgent transition after a touch that spares the state is not
        priced (9-50 s in the 70B replays of docs/simulate.md, against ``L / 2`` of 60-100 s).
        ``sites``: learned per-node and per-pair hit probabilities (:func:`hit_probability`).
        ``adjust``: ``(P_hit, P_touch) -> (P_hit, P_touch)`` applied to them (the LIFO mixture of
        ``nereus.controller.loss_order``); None keeps them."""
        if rate <= 0 or not math.isfinite(plan.l_step):
            return 0.0
        m = event_gpus / cluster.gpus_per_node
        p = hit_probability(plan, cluster, pool, m, sites)
        t = max(p, touch_probability(plan, cluster, pool, m, sites))
        if adjust is not None:
            p, t = adjust(p, t)
        return self.risk_at_rates(plan.l_step, rate * p, rate * t)

    def risk_at_rates(self, l_step: float, hit_rate: float, touch_rate: float) -> float:
        """Expected seconds lost per step of ``l_step`` seconds given the rates (events/s) at which
        the plan's trained state is destroyed and its step is aborted::

            risk = L · (r_hit · C(r_hit)  +  r_touch · (L / 2 + detect_s))   (the last term with detect_s)

        :meth:`risk` calls it with ``r = λ · P``; ``nereus.controller.loss_replay`` gives GPU-exact
        rates. 0 for a non-finite ``l_step``.

        Raises:
            ValueError: a negative rate.
        """
        if hit_rate < 0 or touch_rate < 0:
            raise ValueError(f"risk rates must be >= 0 events/s, got hit {hit_rate!r}, touch {touch_rate!r}")
        if not math.isfinite(l_step):
            return 0.0
        lost = hit_rate * self.loss_cost(l_step, hit_rate) if hit_rate > 0 else 0.0
        if self.detect_s is not None:
            lost += max(hit_rate, touch_rate) * (0.5 * l_step + self.detect_s)
        return l_step * lost


def state_survives(plan: Plan, pool: frozenset) -> bool:
    """Every trainable model-stage keeps at least one whole copy of its state on ``pool``: a whole
    DP replica, or all the GPUs of a ZeRO-sharded one (``nereus.controller.risk.state_copies``).

    Frozen models and generation/inference copies are re-created by the transition planner's
    ``Load``; the only live copy of trained state is in the ``*.train`` EMUs (DESIGN.md §4.9). The
    controller restarts only when this is False or no target's transition is feasible (as
    ``nereus.transition.estimate_transition``, which reports a lost ``*.train`` as infeasible)."""
    for c in plan.candidates:
        if not c.model_stage.endswith(".train"):
            continue
        if not any(set(gpus) <= pool for gpus in state_copies(c)):
            return False
    return True
