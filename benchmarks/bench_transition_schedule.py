"""Greedy transition schedule vs the exact CP-SAT optimum (DESIGN.md §5; paper §7.4.3).

For growing pools, draws random feasible plan pairs (``nereus.transition.instances``), plans each
with the greedy global DAG + list schedule (both the default ``critical`` order and the paper's
``stage`` order) and with CP-SAT (1 worker, time limit per instance), and prints per size: makespan
ratio greedy/optimum, the share of instances within 10%, planning and solve times. Stops growing
once CP-SAT proves optimality on fewer than half of a size's instances.

    python benchmarks/bench_transition_schedule.py --instances 8 --time-limit 60
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from nereus.transition.cost import CostParams, duration, ports
from nereus.transition.emu import model_of, phi, state_bytes_per_param
from nereus.transition.estimate import capacities, estimate_transition
from nereus.transition.exact import exact_schedule
from nereus.transition.global_dag import rule_dag
from nereus.transition.instances import random_instance
from nereus.transition.local_dag import Infeasible, build_local_dag


def completeness(nodes: int, n: int, time_limit: float, seed: int, workers: int) -> dict:
    """On random instances the greedy calls infeasible, can CP-SAT schedule the same local DAGs?"""
    rng = random.Random(seed * 7919 + nodes)
    out = {"greedy_infeasible": 0, "exact_feasible": 0, "exact_infeasible": 0, "exact_unknown": 0,
           "no_local_dag": 0}
    tries = 0
    while out["greedy_infeasible"] < n and tries < 5000:
        tries += 1
        inst = random_instance(rng, num_nodes=nodes, num_model_stages=4, max_gpus_per_stage=nodes * 8,
                               max_dp=2 * nodes, memory_gib=64)
        if inst is None:
            continue
        est = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool)
        if est.feasible or "lost GPUs" in est.reason:
            continue
        out["greedy_infeasible"] += 1
        job = inst.job
        initial, final, locals_ = [], [], []
        try:
            for c in inst.current.candidates:
                ms = c.model_stage
                cur = tuple(e for e in phi(job, c) if set(e.gpus) <= inst.pool)
                tgt = phi(job, inst.target[ms], prefix="*")
                initial += cur
                final += tgt
                locals_.append(build_local_dag(ms, cur, tgt, model_of(job, ms), state_bytes_per_param(job, ms),
                                               job.cluster))
        except Infeasible:
            out["no_local_dag"] += 1
            continue
        gpus = {g for e in initial + final for g in e.gpus}
        dag = rule_dag(locals_, tuple(initial), tuple(final), capacities(job, gpus))
        dur = {p.pid: duration(p, job.cluster, CostParams()) for p in dag.nodes}
        prt = {p.pid: ports(p, job.cluster) for p in dag.nodes}
        ex = exact_schedule(dag, dur, prt, time_limit_s=time_limit, num_workers=workers)
        key = {"OPTIMAL": "exact_feasible", "FEASIBLE": "exact_feasible",
               "INFEASIBLE": "exact_infeasible"}.get(ex.status, "exact_unknown")
        out[key] += 1
    return out


def run_size(nodes: int, n: int, time_limit: float, seed: int, workers: int, planner_like: bool) -> list[dict]:
    rng = random.Random(seed * 1000 + nodes)
    rows, tries = [], 0
    while len(rows) < n and tries < 2000:
        tries += 1
        inst = random_instance(rng, num_nodes=nodes, num_model_stages=4, max_gpus_per_stage=nodes * 8,
                               max_dp=2 * nodes, memory_gib=64, planner_like=planner_like)
        if inst is None:
            continue
        t0 = time.perf_counter()
        est = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool)
        t_greedy = time.perf_counter() - t0
        if not est.feasible:
            continue
        t0 = time.perf_counter()
        est_stage = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool, order="stage")
        t_stage = time.perf_counter() - t0
        prt = {p.pid: ports(p, inst.job.cluster) for p in est.dag.nodes}
        ex = exact_schedule(est.dag, est.durations, prt, time_limit_s=time_limit, num_workers=workers)
        opt = ex.schedule.makespan if ex.schedule else None
        rows.append({"gpus": nodes * 8, "primitives": len(est.dag.nodes), "greedy_s": est.l_tran,
                     "stage_s": est_stage.l_tran if est_stage.feasible else None,
                     "greedy_plan_ms": t_greedy * 1e3, "stage_plan_ms": t_stage * 1e3,
                     "exact_status": ex.status, "exact_s": opt, "exact_bound_s": ex.lower_bound,
                     "exact_solve_s": ex.solve_s})
        print(f"  {nodes * 8:4d} GPUs  {len(est.dag.nodes):4d} prims  greedy {est.l_tran:7.3f} s  "
              f"exact {opt if opt is None else round(opt, 3)} s ({ex.status}, {ex.solve_s:.2f} s)",
              file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    opt = [r for r in rows if r["exact_status"] == "OPTIMAL"]
    ratios = [r["greedy_s"] / r["exact_s"] for r in opt]
    stage = [r["stage_s"] / r["exact_s"] for r in opt if r["stage_s"] is not None]
    return {
        "gpus": rows[0]["gpus"] if rows else 0,
        "instances": len(rows),
        "optimal": len(opt),
        "prims_median": statistics.median(r["primitives"] for r in rows) if rows else 0,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "within10": sum(x <= 1.10 + 1e-9 for x in ratios) / len(ratios) if ratios else None,
        "stage_within10": sum(x <= 1.10 + 1e-9 for x in stage) / len(stage) if stage else None,
        "greedy_ms_median": statistics.median(r["greedy_plan_ms"] for r in rows) if rows else None,
        "exact_s_median": statistics.median(r["exact_solve_s"] for r in rows) if rows else None,
        "exact_s_max": max(r["exact_solve_s"] for r in rows) if rows else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="8-GPU nodes per size")
    ap.add_argument("--instances", type=int, default=8, help="feasible instances per size")
    ap.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per instance")
    ap.add_argument("--workers", type=int, default=1, help="CP-SAT workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placement", choices=("mixed", "planner"), default="mixed",
                    help="mixed: contiguous and arbitrary GPU sets; planner: contiguous, existing GPUs kept")
    ap.add_argument("--json", help="write all rows and the summary to this file")
    ap.add_argument("--completeness", type=int, default=0, metavar="N",
                    help="instead: on N greedy-infeasible instances per size, does CP-SAT find a schedule?")
    a = ap.parse_args(argv)
    if a.completeness:
        print(f"{'GPUs':>5} {'greedy infeasible':>17} {'exact feasible':>14} {'exact infeasible':>16} "
              f"{'unknown':>7} {'no local DAG':>12}")
        for nodes in a.nodes:
            c = completeness(nodes, a.completeness, a.time_limit, a.seed, a.workers)
            print(f"{nodes * 8:>5} {c['greedy_infeasible']:>17} {c['exact_feasible']:>14} "
                  f"{c['exact_infeasible']:>16} {c['exact_unknown']:>7} {c['no_local_dag']:>12}", flush=True)
        return 0
    all_rows, summary = [], []
    for nodes in a.nodes:
        rows = run_size(nodes, a.instances, a.time_limit, a.seed, a.workers, a.placement == "planner")
        all_rows += rows
        s = summarize(rows)
        summary.append(s)
        if s["optimal"] < max(1, s["instances"]) / 2:
            break
    hdr = (f"{'GPUs':>5} {'inst':>4} {'opt':>4} {'prims':>5} {'ratio med':>9} {'ratio max':>9} "
           f"{'<=1.1':>6} {'<=1.1 stage':>11} {'greedy ms':>9} {'exact s med':>11} {'exact s max':>11} {'speedup':>8}")
    print(hdr)
    f = (lambda x, d=3: "-" if x is None else f"{x:.{d}f}")  # noqa: E731
    for s in summary:
        sp = (s["exact_s_median"] * 1e3 / s["greedy_ms_median"]) if s["greedy_ms_median"] else None
        print(f"{s['gpus']:>5} {s['instances']:>4} {s['optimal']:>4} {s['prims_median']:>5} "
              f"{f(s['ratio_median']):>9} {f(s['ratio_max']):>9} {f(s['within10'], 2):>6} "
              f"{f(s['stage_within10'], 2):>11} {f(s['greedy_ms_median'], 1):>9} {f(s['exact_s_median'], 2):>11} "
              f"{f(s['exact_s_max'], 2):>11} {f(sp, 0):>8}")
    ratios = [r["greedy_s"] / r["exact_s"] for r in all_rows if r["exact_status"] == "OPTIMAL"]
    if ratios:
        print(f"overall: {len(ratios)} instances solved to optimality, greedy within 10% on "
              f"{100 * sum(x <= 1.1 + 1e-9 for x in ratios) / len(ratios):.0f}%")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": all_rows, "summary": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
