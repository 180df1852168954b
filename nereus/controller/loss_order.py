"""Last in, first out: whether unannounced losses take the GPUs that joined the pool last.

Why (issue 29, seventh round): over seeds 0-2 the 70B PPO job lost to ``static`` in 20 of 39 runs
without notice, and the pattern was one: Nereus grew onto GPUs that had just arrived, with a single
replica of ``actor.train`` or ``critic.train`` reaching onto them, and the next loss took those
GPUs first (70B ``oobleck-gcp`` seed 1: six urgent moves off lost GPUs, then GPUs 38-39 took every
copy of both trained model-stages and 1,606 s were redone; ``static``, on the GPUs it started on,
never lost a GPU). The risk models before this one learn *where* losses fell by node
(``loss_sites``) or by GPU id (``loss_replay``), but capacity is not taken back by identity: the
GPUs that left last time are gone, and the next loss takes whatever is now newest. Reclamation is
often last-in-first-out: Kubernetes' ReplicaSet controller, on scale-down, "prioritizes deleting pods
with a more recent creation/readiness timestamp" (KEP-2255, kubernetes.dev); in the simulator
the GPUs ``0 .. n-1`` are the pool, so the newest are the highest ids and leave first
(``nereus.sim.cluster``). Whether a pool behaves so is learned from its losses, not assumed.

Model (all probabilities per loss event)::

    key(g)   = (time g last joined P_gpu, g)             newest = largest key (ties: the higher id)
    rank(g)  = GPUs of P_gpu with a larger key            (0 = the newest GPU)
    LIFO event: the GPUs it took are the |gone| largest keys of the pool before it
    ρ        = n_lifo / (n_events + α)                   α = 1 pseudo-event of "not LIFO"
    S(r)     = (#events that took more than r GPUs) / n_events       the event sizes seen
    P_hit    = ρ · S(t_hit)   + (1 − ρ) · P_hit,other
    P_touch  = ρ · S(t_touch) + (1 − ρ) · P_touch,other
    t_hit    = min over *.train model-stages m of  max over copies c of m (``risk.state_copies``)
               of  min_{g ∈ c} rank(g)        an event of k newest GPUs destroys m iff k > that
    t_touch  = min_{g ∈ plan} rank(g)          it takes some GPU of the plan iff k > that

* A LIFO event of ``k`` GPUs takes exactly the ranks ``0 .. k-1``, so the events that destroy some
  model-stage are those with ``k > t_hit`` (nested, so no union bound is needed), and ``S`` is the
  empirical survival function of the sizes seen.
* ``P_*,other``: the model risk pricing used before (uniform hits, or ``loss_sites``' learned
  per-node estimates), for the events that are not LIFO.
* ``α = 1``: one pseudo-event of prior weight against LIFO, the same weakest prior as
  ``loss_sites.PRIOR_WEIGHT`` (not fitted to any trace): before any loss ``ρ = 0`` and pricing is
  exactly what it was; after ``n`` LIFO events ``ρ = n / (n + 1)``; a pool whose losses fall
  anywhere keeps ``ρ`` near 0 (a uniform event of ``k`` of ``N`` GPUs is LIFO with probability
  ``1 / C(N, k)``).

Plans on the oldest GPUs (:func:`oldest_pools`): the planner places plans on whichever GPUs its
search prefers, so the controller also asks for the fastest plan on the pool without its newest
``s`` GPUs, for the event sizes ``s`` seen, and keeps it when its step time plus priced risk is
smaller (``Controller.best_plan``).

Announced losses (issue 29, seventh round, second part): with a preemption notice the GPUs leave
``P_gpu`` before they stop (``StepReport.leave_in_s``), so nothing is lost unless the move off them
cannot end in time: a plan whose every copy of some ``*.train`` model-stage is on the announced
GPUs must move that state within the window or restart (``nereus.controller.notice``), which for a
70B job is the rule (215 s moves against 120 s windows: 36 of the 38 restarts of 39 70B runs with a
notice). Announced events follow the same order, so they count in ``ρ`` and ``S`` like the others,
and :meth:`LossOrder.announced_risk` prices them::

    risk_a(S) = L_step(S) · λ_a · P_hit(S) · C_a
    λ_a = announced events / run seconds          (0 before the first: nothing to price)
    C_a = (Σ forced-move seconds seen + α · restart_s) / (n_forced + α)

``C_a`` is the mean cost of the forced moves this run has made (the ``L_tran`` of the move, or
``restart_s`` plus the save for a restart; :meth:`LossOrder.forced`), with the restart as one
pseudo-observation of prior (the same weight α): a job whose forced moves fit the window learns a
small ``C_a``, one whose forced moves restart keeps the restart's. ``P_hit`` is the one above with
the uniform model of ``risk.hit_probability`` as the other model (announced losses are not learned by
node).

Assumptions: ties in join time (GPUs that arrived together, the first pool) are broken by GPU id,
the higher first, as ``ClusterSpec`` numbers GPUs and the simulator takes them; a GPU that leaves
and rejoins is new again; the event sizes of the run so far are those of the next event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nereus.controller.decisions import Restart, Transition
from nereus.controller.risk import hit_probability, state_copies, state_survives
from nereus.spec.plan import Plan

__all__ = ["LossOrder", "PRIOR_WEIGHT"]

#: α, the prior's weight against LIFO, in pseudo-events (module docstring)
PRIOR_WEIGHT = 1.0


@dataclass
class LossOrder:
    """Join times of the pool's GPUs and the loss events seen (module docstring).

    Attributes:
        joined: GPU → run time (s) it last joined ``P_gpu``.
        events: loss events seen, unannounced and announced.
        lifo: those that took the newest GPUs of the pool before them.
        sizes: GPUs each event took.
        announced: the announced ones (GPUs that left ``P_gpu`` while still running).
        forced_s: seconds of each forced move off announced GPUs seen (:meth:`forced`).
    """

    joined: dict = field(default_factory=dict)
    events: int = 0
    lifo: int = 0
    sizes: list = field(default_factory=list)
    announced: int = 0
    forced_s: list = field(default_factory=list)
    _last_pool: frozenset | None = field(default=None, repr=False)

    def observe(self, pool, alive, now_s: float) -> frozenset:
        """Record one step report at run time ``now_s`` (s): ``P_gpu`` and the GPUs still running.
        Returns the GPUs lost without notice since the last report (in the last ``P_gpu`` and no
        longer alive, as in ``risk.LossRate``). GPUs that left ``P_gpu`` but still run were
        announced: they count as an announced event (:attr:`announced`); both kinds count in ``ρ``
        and the sizes."""
        pool, alive = frozenset(pool), frozenset(alive)
        gone: frozenset = frozenset()
        if self._last_pool is not None:
            gone = self._last_pool - alive
            noticed = (self._last_pool - pool) & alive
            self.announced += int(bool(noticed))
            for left in (gone, noticed):
                if left:
                    self.events += 1
                    self.sizes.append(len(left))
                    self.lifo += int(self.newest(self._last_pool, len(left)) == left)
        for g in set(self.joined) - pool:
            del self.joined[g]
        for g in pool - set(self.joined):
            self.joined[g] = float(now_s)
        self._last_pool = pool
        return gone

    def _key(self, g: int) -> tuple[float, int]:
        return (self.joined.get(g, 0.0), g)

    def newest(self, pool, k: int) -> frozenset:
        """The ``k`` GPUs of ``pool`` that joined last (module docstring's key)."""
        return frozenset(sorted(pool, key=self._key, reverse=True)[:max(0, k)])

    def ranks(self, pool) -> dict:
        """GPU → rank in ``pool``: how many of its GPUs joined later (0 = the newest)."""
        return {g: i for i, g in enumerate(sorted(pool, key=self._key, reverse=True))}

    @property
    def rho(self) -> float:
        """``ρ``, the estimated share of loss events that are LIFO (0 before any event)."""
        return self.lifo / (self.events + PRIOR_WEIGHT)

    def survival(self, r: int) -> float:
        """``S(r)``: share of the events seen that took more than ``r`` GPUs (0 before any)."""
        return sum(s > r for s in self.sizes) / len(self.sizes) if self.sizes else 0.0

    def thresholds(self, plan: Plan, pool) -> tuple[int, int]:
        """``(t_hit, t_touch)`` of ``plan`` in ``pool`` (module docstring). GPUs of the plan outside
        ``pool`` rank 0 (they are as good as gone); a plan with no ``*.train`` model-stage has
        ``t_hit = len(pool)`` (no event of the pool's size can destroy it)."""
        rank = self.ranks(pool)
        gpus = plan.gpus_used()
        t_touch = min((rank.get(g, 0) for g in gpus), default=len(rank))
        t_hit = len(rank)
        for c in plan.candidates:
            if not c.model_stage.endswith(".train") or not c.gpus:
                continue
            t_hit = min(t_hit, max(min(rank.get(g, 0) for g in copy) for copy in state_copies(c)))
        return t_hit, t_touch

    def probabilities(self, plan: Plan, pool, p_hit_other: float, p_touch_other: float) -> tuple[float, float]:
        """``(P_hit, P_touch)`` of one event for ``plan``, mixing the LIFO estimate with the other
        model's probabilities ``p_hit_other`` and ``p_touch_other`` in [0, 1] by ``ρ``.

        Raises:
            ValueError: a probability outside [0, 1].
        """
        for name, p in (("p_hit_other", p_hit_other), ("p_touch_other", p_touch_other)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"loss order: {name} must be a probability in [0, 1], got {p!r}")
        rho = self.rho
        if rho == 0:
            return p_hit_other, p_touch_other
        t_hit, t_touch = self.thresholds(plan, pool)
        p_hit = rho * self.survival(t_hit) + (1 - rho) * p_hit_other
        p_touch = rho * self.survival(t_touch) + (1 - rho) * p_touch_other
        return p_hit, max(p_hit, p_touch)

    def oldest_pools(self, pool) -> list[frozenset]:
        """``pool`` without its newest ``s`` GPUs, for the distinct event sizes ``s`` seen (smallest
        first, each leaving at least one GPU); empty before a LIFO event."""
        if self.lifo == 0:
            return []
        order = sorted(pool, key=self._key, reverse=True)
        out = []
        for s in sorted(set(self.sizes)):
            if s >= len(order):
                break
            out.append(frozenset(order[s:]))
        return out

    def forced(self, plan: Plan, pool, alive, decision, restart_s: float) -> None:
        """Record the decision taken for ``plan`` at a boundary where announced GPUs (``alive`` outside
        ``pool``) held every copy of some ``*.train`` model-stage: its cost in seconds, the
        ``L_tran`` of a transition or ``restart_s`` for a restart (module docstring). Other
        boundaries are ignored."""
        if not (state_survives(plan, frozenset(alive)) and not state_survives(plan, frozenset(pool))):
            return
        if isinstance(decision, Transition):
            self.forced_s.append(float(decision.estimate.l_tran))
        elif isinstance(decision, Restart):
            self.forced_s.append(float(restart_s))

    def announced_risk(self, plan: Plan, cluster, pool, seconds: float, restart_s: float) -> float:
        """``risk_a``, s per step (module docstring): 0 before an announced event, for a non-finite
        ``L_step`` or no run time yet. ``restart_s``: seconds of a restart (the prior of ``C_a``)."""
        if not self.announced or seconds <= 0 or not math.isfinite(plan.l_step):
            return 0.0
        p_hit, _ = self.probabilities(plan, pool, hit_probability(plan, cluster, pool), 0.0)
        c_a = (sum(self.forced_s) + PRIOR_WEIGHT * restart_s) / (len(self.forced_s) + PRIOR_WEIGHT)
        return plan.l_step * (self.announced / seconds) * p_hit * c_a
