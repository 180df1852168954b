"""Transition DAG and schedule between two plans (``nereus transition --from A.json --to B.json``).

Reads plans as ``nereus plan --json`` writes them (a ``{"job", "plan"}`` document or a bare plan;
``docs/files.md``); the job comes from ``--job``/job options, else from the jobs inside the plan files
(which must agree; the larger cluster gives the GPU ids, so ``--nodes 2`` -> ``--nodes 4`` works),
else the defaults. Both plans are checked against their jobs before anything is scheduled.
Prints the primitives with their schedule (a Load names its source: storage or a train EMU), the cross-model-stage edges, ``L_tran`` and the bytes
moved against the minimum; ``--gantt`` writes a PNG, ``--json`` prints everything as JSON,
``--exact`` also solves the schedule with CP-SAT for comparison.
"""

from __future__ import annotations

import argparse
import json

from nereus.cli.plan import add_job_arguments, job_from_args
from nereus.planner.notation import format_candidate, format_gpus
from nereus.planner.validate import check_plan, check_same_job
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan, read_plan_document

__all__ = ["add_arguments", "main"]

GB = 1e9
_JOB_OPTS = ("job", "model", "algo", "gpu", "nodes", "gpus_per_node")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_plan", required=True, metavar="PLAN.json", help="current plan")
    p.add_argument("--to", dest="to_plan", required=True, metavar="PLAN.json", help="target plan")
    add_job_arguments(p)
    t = p.add_argument_group("transition")
    t.add_argument("--pool", type=int, default=None, help="GPUs available (P_gpu): ids 0..N-1 [all]")
    t.add_argument("--reserved-gib", type=float, default=0.0,
                   help="GiB per GPU kept for workspace/activations during the transition")
    t.add_argument("--order", choices=("critical", "stage"), default="critical",
                   help="greedy priority: critical path first, or the paper's stage order")
    t.add_argument("--exact", action="store_true", help="also solve the schedule exactly (CP-SAT)")
    t.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds for --exact")
    o = p.add_argument_group("output")
    o.add_argument("--gantt", metavar="PNG", help="write a Gantt chart of the schedule")
    o.add_argument("--json", action="store_true", help="print the estimate, DAG and schedule as JSON")


def _job_of(doc: dict | None, path: str) -> JobSpec | None:
    if doc is None:
        return None
    try:
        return JobSpec.from_dict(doc)
    except ValueError as e:
        raise ValueError(f"plan file {path!r}: its job: {e}") from e


def plans_and_job(args) -> tuple[Plan, Plan, JobSpec]:
    """Both plans and the job to plan the transition in, every one checked (``docs/files.md``).

    The job: the job options (``--job``, ``--model``, ``--nodes``...) when any is given; else the
    jobs the plan files carry (``nereus plan --json`` writes them), which must describe one job
    (same model, workload and GPU type; lengths and node counts may differ), the one with the larger
    cluster giving the GPU ids (so growing 16 -> 32 GPUs works); else the defaults. Each plan is
    checked against its own job and against the chosen one.

    Raises:
        ValueError: a missing or malformed file, an illegal plan, or plans of different jobs.
    """
    current, cur_doc = read_plan_document(args.from_plan)
    target, tgt_doc = read_plan_document(args.to_plan)
    labels = (f"current plan ({args.from_plan})", f"target plan ({args.to_plan})")
    own = (_job_of(cur_doc, args.from_plan), _job_of(tgt_doc, args.to_plan))
    if any(getattr(args, k, None) is not None for k in _JOB_OPTS):
        job = job_from_args(args)
    elif own[0] and own[1]:
        check_same_job(own[0], own[1], *labels)
        job = own[1] if own[1].cluster.num_gpus > own[0].cluster.num_gpus else own[0]
    else:
        job = own[0] or own[1] or job_from_args(args)
    for plan, j, label in ((current, own[0], labels[0]), (target, own[1], labels[1])):
        if j is not None and j is not job:
            check_plan(plan, j, label, complete=False)
        check_plan(plan, job, label, complete=False)
    return current, target, job


def main(args) -> int:
    """Run the sub-command; returns 0, or 1 when the target is infeasible.

    Raises:
        ValueError: missing or malformed plan files, bad options (printed by ``nereus``).
    """
    from nereus.transition.estimate import estimate_transition

    current, target, job = plans_and_job(args)
    pool = None
    if args.pool is not None:
        if not 0 < args.pool <= job.cluster.num_gpus:
            raise ValueError(f"--pool={args.pool} must be between 1 and the cluster's {job.cluster.num_gpus} GPUs")
        pool = frozenset(range(args.pool))
    if args.reserved_gib < 0:
        raise ValueError(f"--reserved-gib must be >= 0, got {args.reserved_gib}")
    reserved = {g: args.reserved_gib * 2**30 for g in range(job.cluster.num_gpus)} if args.reserved_gib else None
    est = estimate_transition(job, current, target, pool=pool, reserved_bytes=reserved, order=args.order)
    exact = None
    if est.feasible and args.exact:
        from nereus.transition.cost import ports
        from nereus.transition.exact import exact_schedule

        prt = {n.pid: ports(n, job.cluster) for n in est.dag.nodes}
        exact = exact_schedule(est.dag, est.durations, prt, time_limit_s=args.time_limit, hint=est.schedule)
    if args.gantt and est.feasible:
        from nereus.transition.gantt import write_gantt

        write_gantt(est.dag, est.schedule, args.gantt)
    if args.json:
        doc = est.to_dict()
        if exact is not None:
            doc["exact"] = {"status": exact.status, "makespan_s": exact.schedule.makespan if exact.schedule
                            else None, "solve_s": exact.solve_s,
                            "schedule": exact.schedule.to_dict() if exact.schedule else None}
        print(json.dumps(doc, indent=1))
        return 0 if est.feasible else 1
    if not est.feasible:
        print(f"infeasible: {est.reason}")
        return 1
    c = job.cluster
    print(f"job: {job.actor.name} {job.workload.algorithm.upper()} on {c.num_gpus} x {c.gpu.name} "
          f"({c.num_nodes} node(s) x {c.gpus_per_node}); pool: "
          + (f"GPUs 0-{args.pool - 1}" if args.pool is not None else f"all {c.num_gpus} GPUs"))
    print(f"transition: {est.num_primitives} primitives, L_tran = {est.l_tran:.3f} s "
          f"(critical path without link contention {est.critical_path_s:.3f} s)")
    print("L_tran: predicted seconds from the first primitive's start to the last one's end (the schedule's "
          "makespan)")
    print(f"bytes moved: {est.bytes_moved / GB:.2f} GB (minimum any transition moves: {est.min_bytes / GB:.2f} GB)")
    print("\nlocal DAGs (Split -> Destroy -> Extend -> Merge; Load when every replica was lost):")
    for ld in est.dag.local:
        cur = [e for e in est.dag.initial if e.model_stage == ld.model_stage]
        kinds = [n.kind for n in ld.nodes]
        counts = ", ".join(f"{k} x{kinds.count(k)}" for k in ("split", "destroy", "extend", "load", "merge", "offload", "restore")
                           if k in kinds)
        idle = current[ld.model_stage].idle_off_gpu  # host copies are EMUs; a dropped state has none
        was = format_candidate(current[ld.model_stage], "GPUs") if cur or idle else "lost"
        src = (est.reloads or {}).get(ld.model_stage)
        how = f" (reloaded from {src})" if src else ""
        print(f"  {ld.model_stage:16s} {was} -> {format_candidate(target[ld.model_stage], 'GPUs')}  "
              f"T_sub {ld.t_sub}: {counts or 'unchanged'}{how}")
    s = est.schedule
    print(f"\n{'start s':>8} {'end s':>8}  {'primitive':40s} {'GPUs':24s} {'GB':>8}")
    for n in est.dag.nodes:
        if n.kind == "extend":
            g = f"{format_gpus(n.gpus[:len(n.gpus) // 2])} -> {format_gpus(n.acquires)}"
        elif n.kind == "load":
            g = f"{n.source} -> {format_gpus(n.acquires)}"
        else:
            g = format_gpus(n.gpus)
        mark = " *" if n.pid in s.critical_path else ""
        print(f"{s.start[n.pid]:8.3f} {s.end[n.pid]:8.3f}  {n.pid:40s} {g[:24]:24s} {n.bytes_moved / GB:8.2f}{mark}")
    cross = [(a, b, k) for a, b, k in est.dag.edges if k != "state"]
    if cross:
        print("\ncross-model-stage edges:")
        for a, b, k in cross:
            print(f"  {a} -> {b}  ({k})")
    print("\n* on the critical path")
    if exact is not None:
        ms = f"{exact.schedule.makespan:.3f} s" if exact.schedule else "none"
        print(f"exact (CP-SAT): {exact.status}, makespan {ms}, solved in {exact.solve_s:.2f} s")
    if args.gantt:
        print(f"Gantt chart: {args.gantt}")
    return 0
