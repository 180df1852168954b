"""Why no plan fits: the messages of :class:`~nereus.planner.search.NoFeasiblePlan`.

A model-stage that fits on no layout alone gets its closest candidate and largest memory term
(:func:`diagnose_alone`); when each fits alone but not together, the message says whether the GPU
count or memory is the cause, and which framework features (colocation, offload, ZeRO) would help
when the job's framework lacks them (:func:`diagnose_joint`).
"""

from __future__ import annotations

import math

import numpy as np

from nereus.cost.model import CostModel

__all__ = ["diagnose_alone", "diagnose_joint"]

GIB = 1024**3


def _dominant(terms: dict) -> str:
    return max(terms, key=lambda k: terms[k])


def diagnose_alone(cost: CostModel, sets: dict, names: list[str], pool: int) -> str:
    lines = [f"no plan fits: {', '.join(names)} cannot fit on {pool} GPU(s) of "
             f"{cost.job.cluster.gpu.memory_bytes / GIB:.1f} GiB even alone "
             f"({cost.capacity / GIB:.1f} GiB allowed after {cost.headroom:.0%} headroom, "
             f"{cost.usable / GIB:.1f} GiB after the {cost.workspace / GIB:.1f} GiB workspace)"]
    for name in names:
        cs = sets[name]
        if len(cs) == 0:
            lines.append(f"  {name}: no valid (tp, pp, dp) layout on {pool} GPU(s)")
            continue
        i = int(np.argmin(cs.r + cs.x))
        cand = cs.candidate(i, cost.job.workload.mini_batch_size)
        est = cost.estimate_candidate(cand)
        over = (cs.r[i] + cs.x[i] - cost.usable) / GIB
        terms = {k: v for k, v in est.memory.items() if v > 0}
        dom = _dominant(terms)
        lines.append(f"  {name}: closest {cand.short()} needs {(cs.r[i] + cs.x[i]) / GIB:.1f} GiB, "
                     f"{over:.1f} GiB over; largest term {dom} = {terms[dom] / GIB:.1f} GiB")
    return "\n".join(lines)


def _missing_features(cost: CostModel) -> list[str]:
    """Memory-saving features the job's framework lacks (for the infeasibility message)."""
    fw = cost.job.framework
    out = []
    if fw.colocate == "never" and any(len(cost.workflow.in_stage(s)) > 1 for s in cost.workflow.stages):
        out.append("colocation (model-stages of a stage taking turns on the same GPUs)")
    if not fw.allows_offload():
        out.append("offload of idle weights and optimizer state")
    if not any(z > 0 for z in fw.zero_stages):
        out.append("ZeRO/FSDP sharding of optimizer state")
    return out


def _suggestion(cost: CostModel) -> str:
    missing = _missing_features(cost)
    if not missing:
        return ""
    from nereus.spec.framework import FRAMEWORK_PRESETS

    have = [n for n, f in FRAMEWORK_PRESETS.items() if f.colocate != "never" and f.allows_offload()
            and any(z > 0 for z in f.zero_stages)]
    return (f"; the job's framework ({cost.job.framework.name}) has no {', no '.join(missing)}: a framework "
            f"with them ({', '.join(have)}; `--framework`) may fit")


def diagnose_joint(cost: CostModel, fronts: dict, pool: int) -> str:
    """Why no plan fits when every model-stage fits alone: GPUs (the smallest layouts of a stage
    need more GPUs together than the pool has, in every placement mode the framework allows) or
    memory (the pool has the GPUs, but co-resident state overflows)."""
    from nereus.planner.partitions import stage_modes

    wf = cost.workflow

    def stage_gpus(s):
        ns = [int(fronts[m.name].n.min()) for m in wf.in_stage(s)]
        modes = stage_modes(cost, s)
        return min(sum(ns) if "disjoint" in modes else math.inf, max(ns) if "colocated" in modes else math.inf)

    need_gpus = max(stage_gpus(s) for s in wf.stages)
    rmin = sum(max(float(fronts[m.name].r.min()) for m in wf.in_stage(s)) for s in wf.stages)
    xmin = max(float(f.x.min()) for f in fronts.values())
    over = (rmin + xmin - cost.usable) / GIB
    tip = _suggestion(cost)
    if need_gpus <= pool:  # enough GPUs for the smallest layouts: memory is what does not fit
        total = sum(float((f.r * f.n).min()) for f in fronts.values())
        return (f"no plan fits on {pool} GPU(s), and memory is the cause, not the GPU count: the smallest layouts "
                f"of each stage need {need_gpus} GPU(s), which the pool has, but each GPU must also hold the "
                f"resident weights and optimizer state of every model-stage placed on it (at least "
                f"{total / GIB:.1f} GiB over all model-stages, {total / pool / GIB:.1f} GiB per GPU on average, "
                f"plus up to {xmin / GIB:.1f} GiB of activations or KV cache while one runs) and no placement keeps "
                f"every GPU within {cost.usable / GIB:.1f} GiB usable; use more GPUs or GPUs with more memory{tip}")
    msg = (f"no plan fits on {pool} GPU(s): every model-stage fits alone, but together they need at least "
           f"{need_gpus} GPU(s) in one stage")
    if over > 0:
        msg += (f", and co-resident state needs at least {(rmin + xmin) / GIB:.1f} GiB per GPU "
                f"({over:.1f} GiB over; resident weights/optimizer {rmin / GIB:.1f} GiB dominate)")
    return msg + tip
