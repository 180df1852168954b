"""Exhaustive enumeration of the plan space, for tests and for measuring the search's gap.

It scores every combination of one candidate per model-stage (all candidates of
:func:`~nereus.planner.candidates.enumerate_candidates`, no frontier, no bounds) with the model the
search optimizes (:mod:`nereus.planner.search` docstring): stage GPU budgets, the aligned per-GPU
memory bound and ``L_step`` as the critical path. Exact duplicates in (GPUs, time, resident,
transient) are merged first; nothing else is pruned. Exponential in the number of model-stages:
meant for 2-4 model-stages on small pools.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from nereus.cost.model import CostModel
from nereus.planner.candidates import enumerate_candidates

__all__ = ["exhaustive_optimum"]


def _dedupe(cs):
    keys = np.stack([cs.n.astype(float), cs.t, cs.r, cs.x], axis=1)
    _, idx = np.unique(keys, axis=0, return_index=True)
    return cs.take(np.sort(idx))


def exhaustive_optimum(cost: CostModel, pool_size: int, multi_node: bool) -> tuple[float, dict | None]:
    """The minimum ``L_step`` over the whole plan space and one plan attaining it.

    Returns:
        ``(l_step, {model-stage: Candidate})``, or ``(inf, None)`` when nothing is feasible.
    """
    wf = cost.workflow
    usable = cost.usable
    names = [m.name for m in wf.model_stages]
    stage_of = {m.name: m.stage for m in wf.model_stages}
    sets = [_dedupe(enumerate_candidates(cost, m, pool_size, multi_node)) for m in wf.model_stages]
    if any(len(s) == 0 for s in sets):
        return math.inf, None
    asyn = wf.asynchronous and "generate" in wf.stages
    stages = list(wf.stages)
    k = len(sets)
    head, tail = sets[: max(k - 2, 0)], sets[max(k - 2, 0):]
    # Last two model-stages as a broadcast grid, the rest looped.
    grids = np.meshgrid(*[np.arange(len(s)) for s in tail], indexing="ij")
    tail_idx = [g.reshape(-1) for g in grids]
    best, arg = math.inf, None
    for combo in itertools.product(*[range(len(s)) for s in head]):
        cols = {}
        for i, j in enumerate(combo):
            s = sets[i]
            cols[names[i]] = {f: np.full(tail_idx[0].shape, getattr(s, f)[j]) for f in "ntrx"}
        for i, ti in enumerate(tail_idx):
            s = tail[i]
            cols[names[len(head) + i]] = {f: getattr(s, f)[ti] for f in "ntrx"}
        ok = np.ones(tail_idx[0].shape, dtype=bool)
        st_t, st_n, st_r, st_x = {}, {}, {}, {}
        for name in names:
            st = stage_of[name]
            c = cols[name]
            st_t[st] = np.maximum(st_t.get(st, 0.0), c["t"])
            st_n[st] = st_n.get(st, 0) + c["n"]
            st_r[st] = np.maximum(st_r.get(st, 0.0), c["r"])
            st_x[st] = np.maximum(st_x.get(st, 0.0), c["x"])
        if asyn:
            rest = [s for s in stages if s != "generate"]
            gpus_rest = np.max([st_n[s] for s in rest], axis=0) if rest else 0
            ok &= st_n["generate"] + gpus_rest <= pool_size
            ok &= st_r["generate"] + st_x["generate"] <= usable
            if rest:
                ok &= sum(st_r[s] for s in rest) + np.max([st_x[s] for s in rest], axis=0) <= usable
            val = np.maximum(st_t["generate"], sum(st_t[s] for s in rest) if rest else 0.0)
        else:
            for s in stages:
                ok &= st_n[s] <= pool_size
            ok &= sum(st_r[s] for s in stages) + np.max([st_x[s] for s in stages], axis=0) <= usable
            val = sum(st_t[s] for s in stages)
        if not ok.any():
            continue
        val = np.where(ok, val, np.inf)
        j = int(np.argmin(val))
        if val[j] < best:
            best = float(val[j])
            mb = cost.job.workload.mini_batch_size
            arg = {names[i]: sets[i].candidate(combo[i], mb) for i in range(len(head))}
            for i, ti in enumerate(tail_idx):
                arg[names[len(head) + i]] = tail[i].candidate(int(ti[j]), mb)
    return best, arg
