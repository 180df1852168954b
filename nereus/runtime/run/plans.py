"""Plans the runtime builds by itself: fixed layouts placed round-robin (``nereus run`` without
``--adaptive``) and the time-shared fallback of an adaptive run when the planner finds nothing."""

from __future__ import annotations

from nereus.spec.plan import Candidate, Plan
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

__all__ = ["simple_plan", "shared_plan", "arrange"]


def simple_plan(workload: WorkloadSpec, layouts: dict[str, tuple[int, int, int]], num_workers: int,
                micro_batch: int = 0) -> Plan:
    """A plan placing each model-stage's ``(tp, pp, dp)`` on workers, round-robin within its stage.

    Raises:
        ValueError: a model-stage of the workflow missing from ``layouts`` or needing more workers
            than ``num_workers``.
    """
    wf = workflow_for(workload)
    cands, offset = [], {}
    for ms in wf.model_stages:
        if ms.name not in layouts:
            raise ValueError(f"layouts lack model-stage {ms.name!r}; the {wf.algorithm} workflow needs "
                             f"{[m.name for m in wf.model_stages]}")
        tp, pp, dp = layouts[ms.name]
        n = tp * pp * dp
        if n > num_workers:
            raise ValueError(f"model-stage {ms.name}: layout tp={tp} pp={pp} dp={dp} needs {n} workers, "
                             f"only {num_workers} given")
        o = offset.get(ms.stage, 0)
        gpus = tuple((o + i) % num_workers for i in range(n))
        offset[ms.stage] = (o + n) % num_workers
        b = micro_batch if ms.stage != "generate" else 0
        cands.append(Candidate(ms.name, tp, pp, dp, micro_batch=b, gpus=gpus))
    return Plan(candidates=tuple(cands))


def shared_plan(workload: WorkloadSpec, workers, micro_batch: int = 0) -> Plan:
    """Every model-stage at (tp, pp, dp) = (1, 1, 1), round-robin over ``workers`` (ids), model-stages
    of one stage sharing workers when there are fewer workers than model-stages. The runtime can run
    it (each worker runs its calls in order); the cost model's plans never share a GPU within a stage.
    """
    ids = sorted(workers)
    if not ids:
        raise ValueError("shared_plan needs at least one worker")
    base = simple_plan(workload, {ms.name: (1, 1, 1) for ms in workflow_for(workload).model_stages}, len(ids),
                       micro_batch=micro_batch)
    return Plan(candidates=tuple(c.with_gpus(ids[g] for g in c.gpus) for c in base.candidates))


def arrange(plan: Plan, colocate: bool = False, zero: int = 0, keep: tuple = ()) -> Plan:
    """``plan`` with its training model-stages at ZeRO stage ``zero`` (``zero=3`` also its
    forward-only ``infer`` model-stages: FSDP / DeepSpeed ZeRO-3 reference, reward and log-prob
    passes; ZeRO-3 training runs each layer under activation checkpointing, so its recompute is
    ``full``) wherever ``dp > 1`` and, with ``colocate``, every model-stage of a stage on the same
    workers (the first ``tp·pp·dp`` ids of the stage's largest GPU set) taking turns, as verl's hybrid
    engine runs them: idle trained state offloaded to host memory (``offload="host"``), idle frozen
    weights and derived actor copies dropped and reloaded (``offload="drop"``;
    ``worker/memory_pool.py``). Model-stages in ``keep`` stay where they are (``--async``: generation
    keeps workers of its own, after the others').

    Raises:
        ValueError: ``zero`` not 0-3 (what the runtime executes).
    """
    from dataclasses import replace

    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3 (the ZeRO stages the runtime executes), got {zero!r}")
    out = []
    for c in plan.candidates:
        train = c.model_stage.endswith(".train")
        z = zero if train or (zero == 3 and c.model_stage.endswith(".infer")) else 0
        c = replace(c, zero=z if c.dp > 1 else 0)
        if c.zero == 3 and train:
            c = replace(c, recompute="full")
        if colocate and c.model_stage not in keep:
            c = replace(c, gpus=tuple(range(c.num_gpus)), offload="host" if train else "drop")
        out.append(c)
    return Plan(candidates=tuple(out))


def plan_diff(a: Plan, b: Plan) -> str:
    """The candidates of ``a`` that differ from ``b``'s (fields and GPU order), ``ms: a -> b`` each."""
    bb = {c.model_stage: c for c in b.candidates}
    out = [f"{c.model_stage}: {c.short()} {c.gpus} -> {bb[c.model_stage].short()} {bb[c.model_stage].gpus}"
           for c in a.candidates if c.model_stage in bb and (c.key(), c.gpus) != (bb[c.model_stage].key(),
                                                                                  bb[c.model_stage].gpus)]
    return "; ".join(out) or "no candidate differs"


def format_workers(ids) -> str:
    """``worker 3`` or ``workers 4-6`` (ids as :func:`nereus.planner.notation.format_gpus` writes them)."""
    from nereus.planner.notation import format_gpus

    return f"worker{'s' if len(ids) != 1 else ''} {format_gpus(ids)}"
