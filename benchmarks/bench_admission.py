"""Nereus against every baseline across traces, seeds and notice settings (issue 15's report).

One simulated run is one draw (restarts after unannounced losses dominate the spread), so the
comparison is printed per run and as a geometric mean over runs with wins / losses / ties (a tie is
within ``TIE`` = 0.1%). Policies (``nereus/sim/policies.py``): ``nereus`` (γ = 0.5, risk pricing,
``H_x`` from the elapsed quiet time before a first crossing), ``nereus-paper`` (the paper's rule),
``static``, ``elastic`` and ``elastic-oracle`` (checkpoint/restart onto the best plan when it pays),
``replan-all`` (no payback admission), ``nereus-h1`` (``H_x`` = 1 before the first interval),
``uncalibrated`` (the same controller on the offline cost model, no calibration).

Usage::

    python benchmarks/bench_admission.py                          # every shipped trace, seeds 0-2, 4 h
    python benchmarks/bench_admission.py --notice 0,120 --json out.json
    python benchmarks/bench_admission.py --traces bamboo-p3 --seeds 0 --hours 1

Prints one line per finished run (progress), then Nereus / policy per run, geometric means and
wins / losses / ties per notice setting. ``--jobs`` defaults to 2 worker processes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nereus.sim.cluster import Truth  # noqa: E402
from nereus.sim.scenario import Scenario, run_policy  # noqa: E402

POLICIES = ("nereus", "nereus-paper", "static", "elastic", "elastic-oracle", "replan-all", "nereus-h1", "uncalibrated")
TIE = 0.001


def _one(args):
    trace, seed, hours, notice, policy = args
    r = run_policy(Scenario(trace=trace, seed=seed, hours=hours, truth=Truth(notice_s=notice)), policy)
    return (trace, seed, notice, policy, r.throughput, r.restarts, r.transitions, r.transition_time,
            dict(r.restart_causes), r.steps, r.lost_time)


def summarize(res: dict, traces, seeds, notices, policies) -> dict:
    """Per notice and baseline: geometric mean of Nereus / policy, range, wins / losses / ties."""
    out = {}
    for n in notices:
        for p in policies[1:]:
            rs = [res[(t, s, n, "nereus")] / res[(t, s, n, p)] for t in traces for s in seeds
                  if res.get((t, s, n, p), 0) > 0 and (t, s, n, "nereus") in res]
            if not rs:
                continue
            logs = [math.log(r) for r in rs]
            out[(n, p)] = {"geo_mean": math.exp(sum(logs) / len(logs)), "min": min(rs), "max": max(rs),
                           "wins": sum(r > 1 + TIE for r in rs), "losses": sum(r < 1 - TIE for r in rs),
                           "ties": sum(abs(r - 1) <= TIE for r in rs), "runs": len(rs)}
    return out


def main(argv=None) -> int:
    from nereus.sim.traces import SHIPPED_TRACES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(SHIPPED_TRACES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--notice", default="0,120", help="preemption notices, s, comma-separated (AWS spot: 120)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every run and the summary here")
    a = ap.parse_args(argv)
    traces, seeds = a.traces.split(","), [int(s) for s in a.seeds.split(",")]
    notices = [float(x) for x in a.notice.split(",")]
    policies = a.policies.split(",")
    if policies[0] != "nereus":
        ap.error("--policies must start with nereus (the ratios are Nereus / policy)")
    work = list(itertools.product(traces, seeds, [a.hours], notices, policies))
    res, runs = {}, []
    with ProcessPoolExecutor(max(1, a.jobs)) as ex:
        for i, (t, s, n, p, thr, rs, tr, tt, causes, steps, lost) in enumerate(ex.map(_one, work), 1):
            res[(t, s, n, p)] = thr
            runs.append({"trace": t, "seed": s, "notice": n, "policy": p, "tokens_per_s": thr, "restarts": rs,
                         "restart_causes": causes, "transitions": tr, "transition_s": tt, "steps": steps,
                         "lost_step_s": lost})
            print(f"[{i}/{len(work)}] {t:15s} seed {s} notice {n:g} {p:14s} {thr:9,.0f} tokens/s  restarts {rs}  "
                  f"transitions {tr} ({tt:.0f} s)", flush=True)
    others = policies[1:]
    for n in notices:
        print(f"\nNereus / policy, notice {n:g} s")
        print(f"{'trace':15s} seed " + " ".join(f"{p:>14s}" for p in others))
        for t in traces:
            for s in seeds:
                print(f"{t:15s} {s:4d} " + " ".join(f"{res[(t, s, n, 'nereus')] / res[(t, s, n, p)]:14.3f}"
                                                   if res[(t, s, n, p)] > 0 else f"{'inf':>14s}" for p in others))
    summ = summarize(res, traces, seeds, notices, policies)
    print("\nnotice  policy          geo-mean  (range)        won/lost/tied")
    for (n, p), v in summ.items():
        print(f"{n:6g}  {p:14s}  {v['geo_mean']:8.3f}  ({v['min']:.2f}-{v['max']:.2f})  "
              f"{v['wins']}/{v['losses']}/{v['ties']} of {v['runs']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "summary": [{"notice": n, "policy": p} | v for (n, p), v in summ.items()],
                       "hours": a.hours, "seeds": seeds, "traces": traces}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
