"""Admission across traces and seeds: Nereus against replan-on-every-trigger and its ablations.

One simulated run is one draw (restarts after unannounced losses dominate the spread), so the
comparison the issue asks for is printed per run and as a geometric mean over runs. Policies
(``nereus/sim/policies.py``): ``nereus`` (γ = 0.5, with state-loss risk pricing), ``nereus-paper``
(the paper's rule, no risk pricing), ``replan-all`` / ``replan-all-paper`` (no payback admission;
same planner, transitions and risk pricing or not), ``static``; opt-in: ``nereus+grow``,
``nereus+revisit``.

Usage::

    python benchmarks/bench_admission.py                      # bamboo-p3, oobleck-p3; seeds 0-2; 4 h
    python benchmarks/bench_admission.py --traces bamboo-p3 --seeds 0 --hours 1
    python benchmarks/bench_admission.py --notice 120          # with AWS's 2-minute spot notice

Prints tokens/s and restarts per run, Nereus / policy per run, and geometric means. Measured on
2 cores (two worker processes): 9 traces x 3 seeds x 5 policies (135 runs at 4 h) in 4-5 minutes;
the default (2 traces) in under 2.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nereus.sim.cluster import Truth  # noqa: E402
from nereus.sim.scenario import Scenario, run_policy  # noqa: E402

POLICIES = ("nereus", "nereus-paper", "replan-all", "replan-all-paper", "static")


def _one(args):
    trace, seed, hours, notice, policy = args
    r = run_policy(Scenario(trace=trace, seed=seed, hours=hours, truth=Truth(notice_s=notice)), policy)
    return trace, seed, policy, r.throughput, r.restarts, r.transitions, r.transition_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="bamboo-p3,oobleck-p3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--notice", type=float, default=0.0, help="preemption notice, s (AWS spot: 120)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    traces, seeds = a.traces.split(","), [int(s) for s in a.seeds.split(",")]
    policies = a.policies.split(",")
    if policies[0] != "nereus":
        ap.error("--policies must start with nereus (the ratios are Nereus / policy)")
    work = list(itertools.product(traces, seeds, [a.hours], [a.notice], policies))
    res = {}
    with ProcessPoolExecutor(max(1, a.jobs)) as ex:
        for i, (t, s, p, thr, rs, tr, tt) in enumerate(ex.map(_one, work), 1):
            res[(t, s, p)] = thr
            print(f"[{i}/{len(work)}] {t:12s} seed {s} {p:14s} {thr:9,.0f} tokens/s  restarts {rs}  "
                  f"transitions {tr} ({tt:.0f} s)", flush=True)
    others = policies[1:]
    print("\nNereus / policy")
    print(f"{'trace':12s} seed " + " ".join(f"{p:>14s}" for p in others))
    logs = {p: [] for p in others}
    for t in traces:
        for s in seeds:
            ratios = [res[(t, s, "nereus")] / res[(t, s, p)] for p in others]
            for p, r in zip(others, ratios):
                logs[p].append(math.log(r))
            print(f"{t:12s} {s:4d} " + " ".join(f"{r:14.3f}" for r in ratios))
    print(f"{'geo-mean':17s} " + " ".join(f"{math.exp(sum(v) / len(v)):14.3f}" for v in logs.values()))
    wins = {p: sum(v > 0 for v in logs[p]) for p in others}
    print(f"{'runs won':17s} " + " ".join(f"{wins[p]:>11d}/{len(logs[p])}" for p in others))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
