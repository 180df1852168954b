"""The resident-level branch and bound: the plan search before colocation, kept as a second exact
algorithm for all-disjoint jobs that tests compare with the transient-bound search of
:mod:`nereus.planner.search` (``_LEVEL_SEARCH`` switches the search to it).

Per stage a min-max knapsack over its model-stages' (GPUs, time) staircases under the GPU budget
(:func:`minmax_knapsack`: give more GPUs to the slowest model-stage), cached per resident bound β
and transient bound τ (:class:`_Stage`); over stages a branch and bound on resident levels
``(β_s)`` with ``τ = usable - Σ β_s``, visited in order of a memory-free lower bound
(:func:`_search_sync`; :func:`_search_async` for generation on GPUs of its own).
"""

from __future__ import annotations

import math

import numpy as np

from nereus.planner.candidates import CandidateSet

__all__ = ["minmax_knapsack"]

#: resident levels per stage at which the memory-free lower bound is computed
LB_POINTS = 12


def _staircase(n, t):
    """Indices sorting (n, t) into a strictly improving staircase: n ascending, t descending."""
    order = np.lexsort((t, n))
    ts = t[order]
    prev = np.minimum.accumulate(ts)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = ts[1:] < prev[:-1]
    return order[keep]


def minmax_knapsack(stairs: list[tuple[np.ndarray, np.ndarray]], budget: int):
    """Min over choices of max time subject to Σ GPUs ≤ budget.

    ``stairs[i] = (n, t)`` is model-stage i's staircase (n ascending, t strictly descending).
    Returns ``(best_max_time, positions)`` or ``(inf, None)`` when even the smallest choices exceed
    the budget.
    """
    return _minmax_lists([s[0].tolist() for s in stairs], [s[1].tolist() for s in stairs], budget)


def _minmax_lists(ns: list[list], ts: list[list], budget: int):
    """:func:`minmax_knapsack` on staircases given as Python lists."""
    pos = [0] * len(ns)
    used = sum(n[0] for n in ns)
    if used > budget:
        return math.inf, None
    cur = [t[0] for t in ts]
    while True:
        worst = max(range(len(cur)), key=cur.__getitem__)
        best = cur[worst]
        p = pos[worst]
        n = ns[worst]
        if p + 1 >= len(n):
            return best, list(pos)
        extra = n[p + 1] - n[p]
        if used + extra > budget:
            return best, list(pos)
        used += extra
        pos[worst] = p + 1
        cur[worst] = ts[worst][p + 1]


class _Stage:
    """One stage's frontiers and its cached knapsack solutions."""

    def __init__(self, name: str, sets: list[CandidateSet], budget: int):
        self.name, self.sets, self.budget = name, sets, budget
        self.r_levels = np.unique(np.concatenate([s.r for s in sets])) if sets else np.zeros(0)
        self.x_levels = np.unique(np.concatenate([s.x for s in sets])) if sets else np.zeros(0)
        self.cache: dict = {}
        self.calls = 0
        # Model-stages with the same frontier (actor.infer and reference.infer; critic.infer and
        # reward.infer) share its arrays. Each frontier's staircase under (β, τ, budget) depends only on
        # how many of its own resident and transient levels lie at or below β and τ, so it is cached
        # under those counts and shared by every (β, τ) that selects the same rows.
        self._own = [(id(st.t), np.unique(st.r), np.unique(st.x)) for st in sets]
        self._stairs: dict = {}

    def solve(self, beta: float, tau: float, budget: int | None = None, keys: tuple[int, int] | None = None):
        """(time, rows) of the best assignment with resident ≤ beta, transient ≤ tau.

        ``keys``: the cache key ``(beta_key, tau_key)`` (the counts of resident and transient levels
        at or below ``beta`` and ``tau``) when the caller has computed it for many calls at once."""
        budget = self.budget if budget is None else budget
        if keys is None:
            keys = (int(np.searchsorted(self.r_levels, beta, side="right")),
                    int(np.searchsorted(self.x_levels, tau, side="right")))
        key = (keys[0], keys[1], budget)
        if key in self.cache:
            return self.cache[key]
        self.calls += 1
        ns, ts, idxs = [], [], []
        for s, (ident, own_r, own_x) in zip(self.sets, self._own):
            skey = (ident, int(own_r.searchsorted(beta, side="right")), int(own_x.searchsorted(tau, side="right")),
                    budget)
            stair = self._stairs.get(skey)
            if stair is None:
                # frontier rows are sorted by (n, t): the staircase is a running minimum
                ok = np.nonzero((s.r <= beta) & (s.x <= tau) & (s.n <= budget))[0]
                if ok.size == 0:
                    stair = ()
                else:
                    t = s.t[ok]
                    keep = np.ones(ok.size, dtype=bool)
                    keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1]
                    st = ok[keep]
                    stair = (st.tolist(), s.n[st].tolist(), s.t[st].tolist())
                self._stairs[skey] = stair
            if not stair:
                self.cache[key] = (math.inf, None)
                return self.cache[key]
            idxs.append(stair[0])
            ns.append(stair[1])
            ts.append(stair[2])
        best, pos = _minmax_lists(ns, ts, budget)
        res = (best, None if pos is None else [ix[p] for ix, p in zip(idxs, pos)])
        self.cache[key] = res
        return res


def _search_sync(stages: list[_Stage], usable: float):
    """Branch and bound over resident levels; returns (l_step, {stage: rows}) or None."""
    levels = [s.r_levels for s in stages]
    # Memory-free lower bound per resident level. F_s(β, ∞) is non-increasing in β, so its value at
    # any computed level β' ≥ β bounds F_s(β, τ) from below: compute it on at most LB_POINTS levels.
    lbs = []
    for s in stages:
        lv = s.r_levels
        pts = np.unique(np.linspace(0, len(lv) - 1, min(len(lv), LB_POINTS)).round().astype(int))
        vals = np.array([s.solve(float(lv[i]), math.inf)[0] for i in pts])
        lbs.append(vals[np.searchsorted(pts, np.arange(len(lv)), side="left")])
    grids = np.meshgrid(*[np.arange(len(lv)) for lv in levels], indexing="ij")
    idx_all = np.stack([g.reshape(-1) for g in grids], axis=1)
    rsum = sum(np.asarray(levels[i])[idx_all[:, i]] for i in range(len(levels)))
    lb = sum(lbs[i][idx_all[:, i]] for i in range(len(levels)))
    ok = (rsum <= usable) & np.isfinite(lb)
    order = np.nonzero(ok)[0][np.argsort(lb[ok], kind="stable")]
    best = None
    chunk = 256
    for start in range(0, len(order), chunk):  # lazily, in order of the lower bound
        ks = order[start:start + chunk]
        taus = usable - rsum[ks]
        # cache keys of the chunk at once: level index + 1 (levels are unique and sorted) and the
        # count of transient levels at or below tau
        bkeys = [(idx_all[ks, i] + 1).tolist() for i in range(len(stages))]
        tkeys = [np.searchsorted(s.x_levels, taus, side="right").tolist() for s in stages]
        lbs_c, taus_l, idx_c = lb[ks].tolist(), taus.tolist(), idx_all[ks].tolist()
        for c in range(len(ks)):
            if best is not None and lbs_c[c] >= best[0] * (1 - 1e-12):
                return best
            tau = taus_l[c]
            total, rows = 0.0, {}
            for i, j in enumerate(idx_c[c]):
                t, r = stages[i].solve(float(levels[i][j]), tau, keys=(bkeys[i][c], tkeys[i][c]))
                if r is None:
                    total = math.inf
                    break
                total += t
                rows[stages[i].name] = r
            if total < (best[0] if best else math.inf):
                best = (total, rows)
    return best


def generation_stair(g, usable: float) -> np.ndarray:
    """Rows of generation's candidate set ``g`` on its (GPUs, time) staircase among those that fit
    ``usable`` bytes alone (an asynchronous job's generation has GPUs of its own), fewest GPUs first."""
    ok = np.nonzero((g.r + g.x) <= usable)[0]
    return ok[_staircase(g.n[ok], g.t[ok])] if ok.size else ok


def _search_async(stages: dict, usable: float, pool_size: int):
    """Generation on its own GPUs; inference and training share the rest."""
    gen = stages["generate"]
    rest = [s for n, s in stages.items() if n != "generate"]
    g = gen.sets[0]
    stair = generation_stair(g, usable)
    if stair.size == 0:
        return None
    best = None
    for row in stair:
        left = pool_size - int(g.n[row])
        if left < 1:
            break
        for s in rest:
            s.budget = left
        sub = _search_sync(rest, usable) if rest else (0.0, {})
        if sub is None:
            continue
        val = max(float(g.t[row]), sub[0])
        if best is None or val < best[0]:
            rows = dict(sub[1])
            rows["generate"] = [int(row)]
            best = (val, rows)
    return best
