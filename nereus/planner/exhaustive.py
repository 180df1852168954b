"""Exhaustive enumeration of the plan space, for tests and for measuring the search's gap.

It scores every combination of one candidate per model-stage (all candidates of
:func:`~nereus.planner.candidates.enumerate_candidates`, no frontier, no bounds) and every placement
per stage the job's framework allows, as a partition of the stage's model-stages into blocks
(:func:`~nereus.planner.partitions.stage_partitions`): a block runs its model-stages one after another
on the GPUs of its largest (time and resident the sums, GPUs the max), blocks run concurrently on
disjoint GPUs (stage time and resident the max over blocks, ``Σ GPUs ≤ pool``); ``disjoint`` is all
singletons, ``colocated`` one block. Scored with the model the search optimizes
(:mod:`nereus.planner.search` docstring): stage GPU budgets, the per-GPU memory bound and ``L_step``
as the critical path. Exact duplicates in (GPUs, time, resident, transient) are
merged first, and a candidate no better than another of its model-stage in all of GPUs, time,
resident and transient bytes is dropped (replacing it by that one keeps every constraint and no
time grows, in either mode); nothing else is pruned. Exponential in the number of model-stages: meant for 2-4
model-stages on small pools.
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
    cs = cs.take(np.sort(idx))
    # drop rows weakly dominated in all four columns by another (distinct) row
    k = np.stack([cs.n.astype(float), cs.t, cs.r, cs.x], axis=1)
    dominated = np.zeros(len(cs), dtype=bool)
    for start in range(0, len(cs), 256):
        blk = k[start:start + 256]
        le = np.all(k[None, :, :] <= blk[:, None, :], axis=2)  # row j no worse than row i
        le[np.arange(blk.shape[0]), np.arange(start, start + blk.shape[0])] = False
        dominated[start:start + blk.shape[0]] = le.any(axis=1)
    return cs.take(np.nonzero(~dominated)[0])


def exhaustive_optimum(cost: CostModel, pool_size: int, multi_node: bool,
                      with_modes: bool = False):
    """The minimum ``L_step`` over the whole plan space and one plan attaining it.

    Returns:
        ``(l_step, {model-stage: Candidate})``, or ``(inf, None)`` when nothing is feasible; with
        ``with_modes`` also ``{stage: blocks}`` of that plan as a third item (blocks: tuples of
        model-stage names; see :func:`nereus.planner.search.partition_mode`).
    """
    from nereus.planner.partitions import stage_partitions

    wf = cost.workflow
    usable = cost.usable
    names = [m.name for m in wf.model_stages]
    stage_of = {m.name: m.stage for m in wf.model_stages}
    sets = [_dedupe(enumerate_candidates(cost, m, pool_size, multi_node)) for m in wf.model_stages]
    if any(len(s) == 0 for s in sets):
        return (math.inf, None, None) if with_modes else (math.inf, None)
    asyn = wf.asynchronous and "generate" in wf.stages
    stages = list(wf.stages)
    allowed = {s: stage_partitions(cost, s) for s in stages}
    members = {s: [n for n in names if stage_of[n] == s] for s in stages}
    mode_combos = list(itertools.product(*[allowed[s] for s in stages]))
    k = len(sets)
    head, tail = sets[: max(k - 2, 0)], sets[max(k - 2, 0):]
    # Last two model-stages as a broadcast grid, the rest looped.
    grids = np.meshgrid(*[np.arange(len(s)) for s in tail], indexing="ij")
    tail_idx = [g.reshape(-1) for g in grids]
    best, arg, arg_modes = math.inf, None, None
    for combo in itertools.product(*[range(len(s)) for s in head]):
        cols = {}
        for i, j in enumerate(combo):
            s = sets[i]
            cols[names[i]] = {f: np.full(tail_idx[0].shape, getattr(s, f)[j]) for f in "ntrx"}
        for i, ti in enumerate(tail_idx):
            s = tail[i]
            cols[names[len(head) + i]] = {f: getattr(s, f)[ti] for f in "ntrx"}
        # per stage and mode: (time, GPUs needed from the pool, resident bound, transient bound)
        per: dict = {}
        for st in stages:
            ms = [cols[n] for n in members[st]]
            x = np.max([c["x"] for c in ms], axis=0)
            for part in allowed[st]:
                bt = [np.sum([ms[i]["t"] for i in b], axis=0) for b in part]
                bn = [np.max([ms[i]["n"] for i in b], axis=0) for b in part]
                br = [np.sum([ms[i]["r"] for i in b], axis=0) for b in part]
                per[(st, part)] = (np.max(bt, axis=0), np.sum(bn, axis=0), np.max(br, axis=0), x)
        for modes in mode_combos:
            st_t, st_n, st_r, st_x = ({s: per[(s, m)][i] for s, m in zip(stages, modes)} for i in range(4))
            ok = np.ones(tail_idx[0].shape, dtype=bool)
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
                arg_modes = {s: tuple(tuple(members[s][i] for i in b) for b in part) for s, part in zip(stages, modes)}
    return (best, arg, arg_modes) if with_modes else (best, arg)
