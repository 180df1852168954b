"""The placements of one stage the plan search scores, as partitions of its model-stages into
blocks (a block shares one GPU set and runs its members one after another; blocks run side by side
on disjoint GPUs), and the memory-free bound that decides which mixed partitions are worth a knapsack
(:mod:`nereus.planner.search` explains the search and why these steps keep it exact)."""

from __future__ import annotations

import math

import numpy as np

from nereus.cost.model import CostModel
from nereus.planner.staircase import partition_mode

__all__ = ["stage_modes", "set_partitions", "stage_partitions", "memory_free_times", "promising_mixed"]


def stage_modes(cost: CostModel, stage: str) -> tuple[str, ...]:
    """Placement modes the framework allows for ``stage``: ``disjoint`` (concurrent model-stages on
    disjoint GPUs) and/or ``colocated`` (one after another on shared GPUs)."""
    k = len(cost.workflow.in_stage(stage))
    mode = cost.job.framework.colocate
    if k < 2 or mode == "never":
        return ("disjoint",)
    return ("colocated",) if mode == "always" else ("disjoint", "colocated")


def set_partitions(k: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every partition of ``range(k)`` into blocks (Bell(k) of them: 1, 2, 5, 15 for k = 1..4),
    each block a sorted tuple, blocks ordered by their first element."""
    if k == 0:
        return [()]
    out = []
    for p in set_partitions(k - 1):
        for i in range(len(p)):
            out.append(p[:i] + (p[i] + (k - 1,),) + p[i + 1:])
        out.append(p + ((k - 1,),))
    return out


def stage_partitions(cost: CostModel, stage: str) -> list[tuple[tuple[int, ...], ...]]:
    """Placements the framework allows for ``stage``, as partitions of its model-stages (indices
    in workflow order) into blocks: a block's model-stages share one GPU set and run one after
    another, distinct blocks run concurrently on disjoint GPUs. ``colocate: never``: singletons
    (disjoint) only; ``always``: one block (colocated); ``auto``: every partition, in the order
    disjoint, colocated, then the mixed ones (a stage with 2 model-stages has no mixed one)."""
    k = len(cost.workflow.in_stage(stage))
    modes = stage_modes(cost, stage)
    single = tuple((i,) for i in range(k))
    one = (tuple(range(k)),)
    out = []
    if "disjoint" in modes:
        out.append(single)
    if "colocated" in modes and one not in out:
        out.append(one)
    if modes == ("disjoint", "colocated"):
        out += [p for p in set_partitions(k) if p not in (single, one)]
    return out


def memory_free_times(parts: list, names: list, fronts: dict, pool: int) -> list[float]:
    """Per partition of one stage, its least time with memory ignored: blocks get ``g_B`` GPUs with
    ``Σ g_B ≤ pool``; a block on ``g`` GPUs takes ``f_B(g) = Σ_{M in block} f_M(g)``, ``f_M(g)``
    the fastest row of ``M`` with at most ``g`` GPUs (exact for this relaxation: a colocated
    block's members each use any of its GPUs). Min-max over blocks by scanning the candidate
    times: the least ``T`` with ``Σ_B (fewest g with f_B(g) ≤ T) ≤ pool``."""
    gs = np.unique(np.concatenate([fronts[n].n for n in names]))
    gs = gs[gs <= pool]
    if gs.size == 0:
        return [math.inf] * len(parts)
    f = {}
    for n in set(names):
        fs = fronts[n]
        o = np.argsort(fs.n, kind="stable")
        run = np.minimum.accumulate(fs.t[o])
        j = np.searchsorted(fs.n[o], gs, side="right") - 1
        f[n] = np.where(j >= 0, run[np.maximum(j, 0)], np.inf)
    out = []
    for p in parts:
        fb = [np.sum([f[names[i]] for i in b], axis=0) for b in p]
        ts = np.unique(np.concatenate(fb))
        ts = ts[np.isfinite(ts)]
        need = np.zeros(ts.size)
        for arr in fb:  # arr is non-increasing in g: the GPUs needed for time ≤ T
            k = np.searchsorted(-arr, -ts, side="left")
            need += np.where(k < gs.size, gs[np.minimum(k, gs.size - 1)], np.inf)
        ok = np.nonzero(need <= pool)[0]
        out.append(float(ts[ok[0]]) if ok.size else math.inf)
    return out


def promising_mixed(parts: dict, names: dict, fronts: dict, pool: int, incumbent: float, asyn: bool) -> dict:
    """Per stage, the mixed partitions that could give a plan faster than ``incumbent`` (the best
    plan without mixed placements): with memory ignored a stage placed by partition ``P`` takes at
    least its memory-free time (:func:`memory_free_times`) and any other stage at least the least
    of its partitions'; ``P`` is kept when that bound on ``L_step`` is below the incumbent
    (asynchronous: generation does not add, it overlaps)."""
    mf = {s: memory_free_times(ps, names[s], fronts, pool) for s, ps in parts.items()}
    low = {s: min(v) for s, v in mf.items()}
    counted = [s for s in parts if not (asyn and s == "generate")]
    out = {}
    for s, ps in parts.items():
        others = sum(low[o] for o in counted if o != s)
        keep = [p for p, v in zip(ps, mf[s]) if partition_mode(p) == "mixed"
                and v + others < incumbent * (1 - 1e-12)]
        if keep:
            out[s] = keep
    return out
