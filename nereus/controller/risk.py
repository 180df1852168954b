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

    risk(S) = L_step(S) · λ · P_hit(S) · C(S)          expected seconds lost per step
    C(S)    = restart_s + (checkpoint_interval / 2) · L_step(S)   restart + redone steps on average
    P_hit(S)= min(1, Σ_m  m_nodes · |∩_d nodes(replica d of m)| / |nodes(pool)|)

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

__all__ = ["LossRate", "RiskModel", "state_copies", "vulnerable_nodes", "hit_probability"]


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


def hit_probability(plan: Plan, cluster: ClusterSpec, pool, event_nodes: float = 1.0,
                    sites: LossSites | None = None) -> float:
    """``P_hit``: probability that one loss event of ``event_nodes`` nodes destroys the trainable
    state of some model-stage (module docstring). 0 for an empty pool.

    With ``sites`` that have seen a loss, each vulnerable node counts its learned hit probability
    ``q_n`` (``nereus.controller.loss_sites``, prior ``q0 = min(1, m / |nodes(pool)|)``) instead of
    the uniform ``m / |nodes(pool)|``; the sum over model-stages and nodes is capped at 1 (union bound).
    """
    pool_nodes = {cluster.node_of(g) for g in pool}
    if not pool_nodes:
        return 0.0
    m = max(1.0, event_nodes)
    vuln = [v & pool_nodes for v in vulnerable_nodes(plan, cluster).values()]
    if sites is not None and sites.events > 0:
        q0 = min(1.0, m / len(pool_nodes))
        return min(1.0, sum(sites.probability(n, q0) for v in vuln for n in v))
    return min(1.0, sum(m * len(v) / len(pool_nodes) for v in vuln))


@dataclass(frozen=True)
class RiskModel:
    """Prices a plan's state-loss risk (module docstring).

    Attributes:
        restart_s: seconds of a checkpoint/restart (process restart, state load, warm-up).
        checkpoint_interval: RL steps between checkpoints (half of them are redone on average).

    Raises:
        ValueError: negative ``restart_s`` or a non-positive interval.
    """

    restart_s: float = 180.0
    checkpoint_interval: int = 25

    def __post_init__(self) -> None:
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise ValueError(f"risk field 'restart_s' must be a finite number >= 0 s, got {self.restart_s!r}")
        if not (isinstance(self.checkpoint_interval, int) and self.checkpoint_interval >= 1):
            raise ValueError(f"risk field 'checkpoint_interval' must be an integer >= 1 step, "
                             f"got {self.checkpoint_interval!r}")

    def loss_cost(self, l_step: float) -> float:
        """``C``: seconds lost by one state-loss event for a plan with step time ``l_step``."""
        return self.restart_s + 0.5 * self.checkpoint_interval * l_step

    def risk(self, plan: Plan, cluster: ClusterSpec, pool, rate: float, event_gpus: float = 1.0,
             sites: LossSites | None = None) -> float:
        """Expected seconds lost per step on ``plan`` (0 when ``rate`` is 0 or the plan is redundant);
        ``sites``: learned per-node hit probabilities (:func:`hit_probability`)."""
        if rate <= 0 or not math.isfinite(plan.l_step):
            return 0.0
        p = hit_probability(plan, cluster, pool, event_gpus / cluster.gpus_per_node, sites)
        return plan.l_step * rate * p * self.loss_cost(plan.l_step)
