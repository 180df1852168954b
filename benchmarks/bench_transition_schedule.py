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

from nereus.transition.cost import ports
from nereus.transition.estimate import estimate_transition
from nereus.transition.exact import exact_schedule
from nereus.transition.instances import random_instance


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
    a = ap.parse_args(argv)
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
