"""Nereus against every baseline across traces, seeds, notice settings and job classes (issues 15, 29).

One simulated run is one draw (restarts after unannounced losses dominate the spread), so the
comparison is printed per run and as a geometric mean over runs with wins / losses / ties (a tie is
within ``TIE`` = 0.1%), and for every policy how often it loses to ``static``. Policies
(``nereus/sim/policies.py``): ``nereus`` (γ = 0.5, risk pricing, the pool-loss process horizon,
look-ahead plan choice and the learned loss order), ``nereus-lifo-blind`` (without the loss order),
``nereus-ema`` (the same before issue 29), ``nereus-paper`` (the paper's
rule), ``static``, ``elastic`` and ``elastic-oracle`` (checkpoint/restart onto the best plan when it
pays), ``replan-all`` (no payback admission), ``gamma=<g>`` (the γ sensitivity sweep).

Job classes (``--jobs``; :data:`JOB_CLASSES`):

* ``8b``: the default scenario (Llama-3.1-8B PPO on 4 x 8 H100, SYNTHETIC growth 500 → 8,000 tokens);
* ``70b-ppo``: Llama-3.3-70B PPO on 8 x 8 H100 with the Megatron feature set, the same growth;
* ``qwen3-32b-grpo``: Qwen3-32B GRPO on 4 x 8 H100 driven by a real verl response-length log
  (``traces/response_length/verl_amd_deepseek-llm-7b-chat_gsm8k_grpo_resp1024.csv``, lengths as
  logged; ``--length-log`` overrides the path).

Usage::

    python benchmarks/bench_admission.py                          # every trace, seeds 0-2, 4 h, all jobs
    python benchmarks/bench_admission.py --traces bamboo-p3 --seeds 0 --hours 1 --jobs 8b --notice 0
    python benchmarks/bench_admission.py --policies nereus,static,gamma=0.25,gamma=1 --json sweep.json
    python benchmarks/bench_admission.py --jobs 70b-ppo --framework 70b-ppo=megatron   # the plan space

Prints one line per finished run (progress), then per job class and notice the Nereus / policy
ratio per run, geometric means, wins / losses / ties and losses to static. ``--workers`` sets the
worker processes (default 2).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from nereus.sim.cluster import Truth  # noqa: E402
from nereus.sim.scenario import Scenario, run_policy  # noqa: E402

POLICIES = ("nereus", "nereus-ema", "nereus-paper", "static", "elastic", "elastic-oracle", "replan-all")
TIE = 0.001
LOG_NAME = "verl_amd_deepseek-llm-7b-chat_gsm8k_grpo_resp1024.csv"


def default_length_log() -> str:
    """The verl GRPO log under the project's shared folder (``../shared`` or ``../../shared`` of the repo)."""
    for up in ("..", os.path.join("..", "..")):
        p = os.path.normpath(os.path.join(ROOT, up, "shared", "traces", "response_length", LOG_NAME))
        if os.path.isfile(p):
            return p
    return os.path.join("shared", "traces", "response_length", LOG_NAME)


#: job class → Scenario fields (module docstring); ``length_trace=None`` is filled from ``--length-log``.
JOB_CLASSES = {
    "8b": {},
    "70b-ppo": {"model": "llama-3.3-70b", "nodes": 8, "framework": "megatron"},
    "qwen3-32b-grpo": {"model": "qwen3-32b", "algo": "grpo", "length_trace": None, "length_scale": ("none", 0.0)},
}


def scenario(job: str, trace: str, seed: int, hours: float, notice: float, length_log: str,
             framework: str | None = None) -> Scenario:
    """The :class:`Scenario` of one run of job class ``job``. The plan space is the job class's
    ``framework`` preset (``nereus.spec.framework``; the Scenario default ``nereus`` when the class
    names none) unless ``framework`` overrides it, so a wider preset is picked up by rerunning."""
    kw = dict(JOB_CLASSES[job])
    if "length_trace" in kw:
        kw["length_trace"] = length_log
    if framework is not None:
        kw["framework"] = framework
    return Scenario(trace=trace, seed=seed, hours=hours, truth=Truth(notice_s=notice), **kw)


def parse_frameworks(spec: str | None, jobs) -> dict:
    """``--framework`` (``NAME`` for every job class, or ``JOB=NAME,...``) → job class → preset name.

    Raises:
        ValueError: an unknown job class or framework preset, naming it and the valid ones.
    """
    from nereus.spec.framework import get_framework

    if not spec:
        return {}
    pairs = [p.split("=", 1) if "=" in p else (None, p) for p in spec.split(",")]
    out = {}
    for j, name in pairs:
        get_framework(name)  # raises ValueError naming the valid presets
        if j is not None and j not in JOB_CLASSES:
            raise ValueError(f"--framework: unknown job class {j!r}; valid: {list(JOB_CLASSES)}")
        for k in ([j] if j is not None else jobs):
            out[k] = name
    return out


def _one(args):
    job, trace, seed, hours, notice, policy, log, framework = args
    sc = scenario(job, trace, seed, hours, notice, log, framework)
    r = run_policy(sc, policy)
    return (job, trace, seed, notice, policy, r.throughput, r.restarts, r.transitions, r.urgent_transitions,
            r.transition_time, dict(r.restart_causes), r.steps, r.lost_time, sc.framework)


def _geo(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(res: dict, keys, policies) -> dict:
    """Per (job, notice) and baseline, and over all: geometric mean of Nereus / policy, range,
    wins / losses / ties; and per policy the runs it loses to static (policy / static < 1 − TIE).

    Args:
        res: (job, trace, seed, notice, policy) → tokens/s.
        keys: the (job, trace, seed, notice) tuples run.
    """
    groups: dict = {}
    for k in keys:
        groups.setdefault((k[0], k[3]), []).append(k)
        groups.setdefault(("all", "all"), []).append(k)
    out = {}
    for g, ks in groups.items():
        for p in policies:
            ratios = [res[(*k, "nereus")] / res[(*k, p)] for k in ks
                      if res.get((*k, p), 0) > 0 and res.get((*k, "nereus"), 0) > 0]
            vs_static = [res[(*k, p)] / res[(*k, "static")] for k in ks
                         if res.get((*k, "static"), 0) > 0 and (*k, p) in res]
            row = {"runs": len(ratios)}
            if ratios and p != "nereus":
                row |= {"geo_mean": _geo(ratios), "min": min(ratios), "max": max(ratios),
                        "wins": sum(r > 1 + TIE for r in ratios), "losses": sum(r < 1 - TIE for r in ratios),
                        "ties": sum(abs(r - 1) <= TIE for r in ratios)}
            if vs_static:
                row |= {"loses_to_static": sum(r < 1 - TIE for r in vs_static), "vs_static_min": min(vs_static),
                        "below_0.98_static": sum(r < 0.98 for r in vs_static), "static_runs": len(vs_static)}
            out[(*g, p)] = row
    return out


def main(argv=None) -> int:
    from nereus.sim.traces import SHIPPED_TRACES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(SHIPPED_TRACES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--notice", default="0,120", help="preemption notices, s, comma-separated (AWS spot: 120)")
    ap.add_argument("--jobs", default=",".join(JOB_CLASSES), help=f"job classes: {', '.join(JOB_CLASSES)}")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--length-log", default=None, help="response-length log of qwen3-32b-grpo")
    ap.add_argument("--framework", default=None,
                    help="plan space: a framework preset for every job class, or JOB=NAME,... (default: the "
                         "job class's own, JOB_CLASSES)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--json", default=None, help="write every run and the summary here")
    a = ap.parse_args(argv)
    traces, seeds = a.traces.split(","), [int(s) for s in a.seeds.split(",")]
    notices = [float(x) for x in a.notice.split(",")]
    jobs, policies = a.jobs.split(","), a.policies.split(",")
    bad = [j for j in jobs if j not in JOB_CLASSES]
    if bad:
        ap.error(f"--jobs: unknown job class(es) {bad}; valid: {list(JOB_CLASSES)}")
    if policies[0] != "nereus" or "static" not in policies:
        ap.error("--policies must start with nereus and include static (ratios are Nereus / policy, "
                 "and every policy is compared with static)")
    try:
        fw = parse_frameworks(a.framework, jobs)
    except ValueError as e:
        ap.error(str(e))
    log = a.length_log or default_length_log()
    if "qwen3-32b-grpo" in jobs and not os.path.isfile(log):
        ap.error(f"--length-log: no such file {log!r} (the verl log {LOG_NAME})")
    work = [(*w, fw.get(w[0])) for w in itertools.product(jobs, traces, seeds, [a.hours], notices, policies, [log])]
    res, runs = {}, []
    with ProcessPoolExecutor(max(1, a.workers)) as ex:
        for i, (j, t, s, n, p, thr, rs, tr, urg, tt, causes, steps, lost, fwk) in enumerate(ex.map(_one, work), 1):
            res[(j, t, s, n, p)] = thr
            runs.append({"job": j, "framework": fwk, "trace": t, "seed": s, "notice": n, "policy": p, "tokens_per_s": thr,
                         "restarts": rs, "restart_causes": causes, "transitions": tr, "urgent_transitions": urg,
                         "transition_s": tt, "steps": steps, "lost_step_s": lost})
            print(f"[{i}/{len(work)}] {j:14s} {t:15s} seed {s} notice {n:g} {p:14s} {thr:9,.0f} tokens/s  "
                  f"restarts {rs}  transitions {tr} ({urg} urgent, {tt:.0f} s)", flush=True)
    keys = sorted({k[:4] for k in res})
    others = policies[1:]
    for j in jobs:
        for n in notices:
            print(f"\n{j}, notice {n:g} s: Nereus / policy per run (tokens/s of nereus)")
            print(f"{'trace':15s} seed {'nereus':>9s} " + " ".join(f"{p:>14s}" for p in others))
            for t in traces:
                for s in seeds:
                    k = (j, t, s, n)
                    cells = [f"{res[(*k, 'nereus')] / res[(*k, p)]:14.3f}" if res[(*k, p)] > 0 else f"{'inf':>14s}"
                             for p in others]
                    print(f"{t:15s} {s:4d} {res[(*k, 'nereus')]:9,.0f} " + " ".join(cells))
    summ = summarize(res, keys, policies)
    print("\njob             notice  policy          geo-mean  (range)        won/lost/tied   loses to static "
          "(min policy/static, runs < 0.98x)")
    for (j, n, p), v in summ.items():
        gm = (f"{v['geo_mean']:8.3f}  ({v['min']:.2f}-{v['max']:.2f})  {v['wins']}/{v['losses']}/{v['ties']} of "
              f"{v['runs']}") if "geo_mean" in v else f"{'':8s}  {'':11s}  {'':14s}"
        st = (f"{v['loses_to_static']}/{v['static_runs']} ({v['vs_static_min']:.3f}, {v['below_0.98_static']})"
              if "loses_to_static" in v else "")
        print(f"{j:15s} {n!s:6s}  {p:14s}  {gm:32s}  {st}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "summary": [{"job": j, "notice": n, "policy": p} | v
                                                 for (j, n, p), v in summ.items()],
                       "hours": a.hours, "seeds": seeds, "traces": traces, "jobs": jobs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
