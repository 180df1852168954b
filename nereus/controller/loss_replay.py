"""GPU-exact loss rates: replay the unannounced loss events seen against a plan's own GPU set.

Why (issue 29, fourth round): ``loss_sites`` learns hit probabilities per node and per pair of
nodes, but pools do not lose nodes: the count traces take GPU *ids* (in the simulator the GPUs that
joined last leave first; a cloud reclaims the instances of a zone or type together), and a plan's
exposure is a property of the exact GPUs it uses. On ``bamboo-gcp-v100`` (70B PPO, no notice, seed
0, 2 h) the GPUs 0-31 were never hit while GPUs 44-63 were hit again and again, but the node and
pair estimates, one pseudo-event each and averaged over the whole run's ``λ``, priced a plan on 60
GPUs that the next loss of the burst would abort close to a plan on 32 that no event of the run ever
touched. docs/simulate.md ("Issue 29, third round") named the fix: estimate the rates per *set of
GPUs* by replaying the observed events against it, which needs no node or pair approximation.

Model (the Gamma-Poisson conjugate estimate of an event rate; the rate of an event kind for a GPU
set ``G`` is the rate at which *it* would have been hit had it been running)::

    T(G)       = seconds during which every GPU of G was in P_gpu (its exposure)
    n_hit(G)   = loss events seen while G ⊆ P_gpu that took a GPU of every copy of the trained
                 state of some ``*.train`` model-stage (``risk.state_copies``)
    n_touch(G) = loss events seen while G ⊆ P_gpu that took some GPU of G
    r_x(G)     = (n_x(G) + P0_x) / (T(G) + 1/λ)        events per second, x ∈ {hit, touch}

* ``P0_x``: the uniform model's probability that one event hits or touches the plan
  (``risk.hit_probability``/``touch_probability`` without learned sites), so the prior rate is
  ``λ · P0_x``, the uniform model's rate, exactly what risk pricing used before;
* ``1/λ`` seconds of prior exposure: one mean inter-event time, i.e. one pseudo-event of weight, the
  same weakest prior as ``loss_sites.PRIOR_WEIGHT`` (not fitted to any trace). With no exposure the
  estimate is the uniform model's rate; a set exposed for ``k`` mean intervals without a hit has
  ``λ · P0 / (k + 1)``; a set hit at every event converges to the rate it was hit at while present.
* before the first unannounced loss of the run, the uniform rates ``λ · P0`` for every set, not
  discounted by exposure: the seconds without a loss are already the evidence behind ``λ``
  (``risk.LossRate`` counts the same seconds, or ``pool_process``'s prior stands in for them), and
  discounting a set by them again counted that evidence twice, making the GPUs present longest look
  safest before any loss had shown where losses fall (issue 29, fifth round: 70B PPO, no notice,
  seed 0, 2 h, ``nereus+replay`` against static: ``oobleck-gcp`` 0.614 → 0.807x, geometric mean
  over the 13 shipped traces 1.006 → 1.023x, docs/simulate.md).

``RiskModel.risk_at_rates`` prices a plan from these two rates (``λ · P_hit`` and ``λ · P_touch`` of
the per-event model are exactly such rates). Assumptions: a GPU id keeps its identity across leave
and rejoin (as ``ClusterSpec`` numbers GPUs, and as the executor reports ``P_gpu``); the pool between
two reports is the one of the earlier report; the loss pattern does not change within the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.controller.risk import RiskModel, hit_probability, state_copies, touch_probability
from nereus.spec.hardware import ClusterSpec
from nereus.spec.plan import Plan

__all__ = ["LossReplay"]


@dataclass
class LossReplay:
    """Pool history and unannounced loss events, for GPU-exact rates (module docstring).

    Attributes:
        spans: ``[pool, seconds]`` per stretch of reports with the same ``P_gpu`` (consecutive equal
            pools merged).
        events: ``(P_gpu before, GPUs gone)`` of each unannounced loss event seen.
    """

    spans: list = field(default_factory=list)
    events: list = field(default_factory=list)
    _last_pool: frozenset | None = field(default=None, repr=False)
    _last_t: float = field(default=0.0, repr=False)

    def observe(self, pool, alive, now_s: float) -> frozenset:
        """Record one step report at clock ``now_s`` (s): ``P_gpu`` and the GPUs still running.
        Returns the GPUs lost without notice since the last report (in the last ``P_gpu``, no longer
        alive; announced GPUs leave ``P_gpu`` first and are not counted, as in ``risk.LossRate``)."""
        pool, alive = frozenset(pool), frozenset(alive)
        gone: frozenset = frozenset()
        if self._last_pool is not None:
            dt = max(0.0, float(now_s) - self._last_t)
            if self.spans and self.spans[-1][0] == self._last_pool:
                self.spans[-1][1] += dt
            else:
                self.spans.append([self._last_pool, dt])
            gone = self._last_pool - alive
            if gone:
                self.events.append((self._last_pool, gone))
        self._last_pool, self._last_t = pool, max(self._last_t, float(now_s))
        return gone

    def exposure(self, gpus) -> float:
        """``T(G)``: seconds during which every GPU of ``gpus`` was in ``P_gpu``."""
        g = frozenset(gpus)
        return sum(dt for pool, dt in self.spans if g <= pool)

    def counts(self, plan: Plan) -> tuple[int, int]:
        """``(n_hit, n_touch)`` of ``plan``'s GPU set (module docstring)."""
        g = plan.gpus_used()
        copies = [[frozenset(c) for c in state_copies(cand)] for cand in plan.candidates
                  if cand.model_stage.endswith(".train") and cand.gpus]
        hit = touch = 0
        for before, gone in self.events:
            if not g <= before or not gone & g:
                continue
            touch += 1
            if any(cs and all(c & gone for c in cs) for cs in copies):
                hit += 1
        return hit, touch

    def rates(self, plan: Plan, rate: float, p0_hit: float, p0_touch: float) -> tuple[float, float]:
        """``(r_hit, r_touch)`` in events per second for ``plan`` given the pool's event rate
        ``rate`` (λ, events/s) and the uniform per-event probabilities ``p0_hit``, ``p0_touch`` in
        [0, 1]; ``(0, 0)`` when ``rate`` is 0.

        Raises:
            ValueError: a negative rate or a probability outside [0, 1].
        """
        if rate < 0:
            raise ValueError(f"loss replay: rate must be >= 0 events/s, got {rate!r}")
        for name, p in (("p0_hit", p0_hit), ("p0_touch", p0_touch)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"loss replay: {name} must be a probability in [0, 1], got {p!r}")
        if rate == 0:
            return 0.0, 0.0
        if not self.events:  # no loss seen: the uniform rates, undiscounted (module docstring)
            return rate * p0_hit, rate * max(p0_hit, p0_touch)
        hit, touch = self.counts(plan)
        t = self.exposure(plan.gpus_used()) + 1.0 / rate
        r_hit = (hit + p0_hit) / t
        return r_hit, max(r_hit, (touch + p0_touch) / t)

    def risk(self, model: RiskModel, plan: Plan, cluster: ClusterSpec, pool, rate: float,
             event_gpus: float = 1.0) -> float:
        """Priced risk of ``plan``, s per step: ``model.risk_at_rates`` at :meth:`rates`, with the
        uniform per-event probabilities of events of ``event_gpus`` GPUs as the prior (0 when
        ``rate``, λ in events/s, is 0)."""
        if rate <= 0:
            return 0.0
        m = event_gpus / cluster.gpus_per_node
        p0 = hit_probability(plan, cluster, pool, m)
        r = self.rates(plan, rate, p0, max(p0, touch_probability(plan, cluster, pool, m)))
        return model.risk_at_rates(plan.l_step, *r)
