"""Trace-driven simulation of the Nereus controller against static and replan-everything policies.

``nereus simulate`` with no arguments runs the default scenario: Llama-3.1-8B PPO on 4x8 H100, the
Bamboo AWS p3 spot trace (real, shipped) scaled to 32 GPUs, its first 4 hours (``--hours 0`` for
all 11.4), and the SYNTHETIC
response-length growth scenario (500 -> 8,000 tokens in 1,000 steps, noise fitted to real verl
logs). It prints a table per policy and the restarts per cause, and writes ``<out>/summary.json``,
``<out>/<policy>.json`` and
``<out>/<policy>.png``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from nereus.sim.cluster import Truth
from nereus.sim.scenario import DEFAULT_GAMMAS, Scenario, run_scenario
from nereus.sim.traces import DEFAULT_TRACE, SHIPPED_TRACES
from nereus.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORK_PRESETS

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="model preset, or a config.json path or directory")
    p.add_argument("--algo", default="ppo", choices=["ppo", "grpo", "remax"], help="RL algorithm")
    p.add_argument("--gpu", default="h100", help="GPU preset: h100, h200, a100, mi250x, cpu")
    p.add_argument("--nodes", type=int, default=4, help="nodes in the cluster")
    p.add_argument("--framework", default=DEFAULT_FRAMEWORK, choices=sorted(FRAMEWORK_PRESETS),
                   help="what the training framework supports, which sets the plan space every policy searches "
                        f"(docs/planner.md, Frameworks) [{DEFAULT_FRAMEWORK}: what `nereus run` executes]")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help=f"GPU availability trace: a path, or a shipped trace {sorted(SHIPPED_TRACES)}")
    p.add_argument("--time-unit", default=None, choices=["ms", "s", "h"],
                   help="time unit of a two-column 't,count' trace (guessed when omitted)")
    p.add_argument("--length-trace", default=None,
                   help="verl response-length CSV (step, mean_response_length); default: SYNTHETIC growth")
    p.add_argument("--length-scale", default="max:8000",
                   help="scale a --length-trace to the job: MODE:TOKENS with MODE mean or max (the log's mean or "
                        "max becomes TOKENS), or none to replay it unchanged (default max:8000, the synthetic "
                        "scenario's end length)")
    p.add_argument("--start", type=float, default=0.0, help="hours into the availability trace where the run starts")
    p.add_argument("--prompts-per-step", type=int, default=256, help="prompts per RL step (global batch = prompts x "
                   "--samples-per-prompt)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="responses sampled per prompt")
    p.add_argument("--mini-batch", type=int, default=256, help="sequences per optimizer update (divides the global "
                   "batch)")
    p.add_argument("--growth", default="500:8000:1000",
                   help="synthetic growth START:END:STEPS in tokens and RL steps")
    p.add_argument("--hours", type=float, default=4.0,
                   help="simulated hours (0: the whole trace; the default keeps the run under a minute)")
    p.add_argument("--gamma", type=float, default=0.5, help="payback margin γ of the nereus policy")
    p.add_argument("--gammas", default=",".join(f"{g:g}" for g in DEFAULT_GAMMAS),
                   help="γ values of the sweep (comma-separated; empty for none)")
    p.add_argument("--policies", default="nereus,nereus-paper,static,elastic,elastic-oracle,replan-all,uncalibrated",
                   help="comma-separated: nereus, nereus-paper (the paper's rule: no state-loss risk pricing, H_x = 1 "
                        "before a signal's first interval), static, elastic (checkpoint/restart onto the best plan "
                        "when it pays), elastic-oracle (the same, knowing when GPUs leave), replan-all, "
                        "replan-all-paper, uncalibrated, nereus-h1 (H_x = 1 before the first interval), gamma=<g>; "
                        "opt-in extensions: nereus+grow, nereus+revisit, nereus+tcal, nereus+margin, nereus+replay, "
                        "nereus+replay+margin; nereus-lifo-blind (nereus without the learned loss order)")
    p.add_argument("--notice", type=float, default=0.0,
                   help="preemption notice in seconds before GPUs leave (AWS spot: 120; default 0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of noise, congestion and length noise")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="one-step-off asynchronous RL: generation on GPUs of its own overlaps training, the step "
                        "is max(generate, infer + train) (what nereus run --async runs)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--out", default="nereus-sim", help="output directory for JSON logs and PNG timelines")


def _parse_growth(text: str) -> tuple[float, float, int]:
    try:
        a, b, c = text.split(":")
        return float(a), float(b), int(c)
    except ValueError as e:
        raise ValueError(f"--growth must look like START:END:STEPS (e.g. 500:8000:1000), got {text!r}") from e


def _parse_length_scale(text: str) -> tuple[str, float]:
    from nereus.sim.traces import LENGTH_SCALES

    if text.strip() == "none":
        return ("none", 1.0)
    mode, _, tok = text.partition(":")
    try:
        tokens = float(tok)
    except ValueError:
        tokens = float("nan")
    if mode not in LENGTH_SCALES[1:] or not tokens > 0:
        raise ValueError(f"--length-scale must be none, mean:TOKENS or max:TOKENS with TOKENS > 0, got {text!r}")
    return (mode, tokens)


def _policies(args) -> list[str]:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for g in (x.strip() for x in args.gammas.split(",") if x.strip()):
        try:
            name = f"gamma={float(g):g}"
        except ValueError as e:
            raise ValueError(f"--gammas must be numbers in [0, 1], got {g!r}") from e
        if not 0.0 <= float(g) <= 1.0:
            raise ValueError(f"--gammas must be numbers in [0, 1], got {g!r}")
        if name not in names and float(g) != args.gamma:
            names.append(name)
    if not names:
        raise ValueError("--policies is empty; valid: nereus, nereus-paper, static, elastic, elastic-oracle, "
                         "replan-all, replan-all-paper, uncalibrated, nereus-h1, gamma=<g>")
    for n in names:
        check_policy_name(n)
    return names


#: policy names :func:`nereus.sim.policies.make_policy` builds, besides ``gamma=<g>``
EXTRA_POLICIES = ("nereus+risk", "nereus+revisit", "nereus+grow", "nereus+tcal", "nereus+margin", "nereus+replay",
                  "nereus+replay+margin", "nereus-lifo-blind")


def check_policy_name(name: str) -> None:
    """Refuse an unknown policy before anything starts (``make_policy`` would refuse it in a worker).

    Raises:
        ValueError: naming the policy and the valid names.
    """
    from nereus.sim.policies import POLICY_NAMES

    if name in POLICY_NAMES or name in EXTRA_POLICIES:
        return
    if name.startswith("gamma="):
        try:
            g = float(name.split("=", 1)[1])
        except ValueError:
            g = None
        if g is not None and 0.0 <= g <= 1.0:
            return
        raise ValueError(f"policy {name!r}: γ must be a number in [0, 1], e.g. gamma=0.25")
    raise ValueError(f"unknown policy {name!r} in --policies; valid: {', '.join(POLICY_NAMES)}, "
                     f"{', '.join(EXTRA_POLICIES[1:])}, gamma=<g>")


def main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nereus.sim.report import plot_timeline, ratios, summary_table, write_json

    if not 0.0 <= args.gamma <= 1.0:
        raise ValueError(f"--gamma must be in [0, 1], got {args.gamma}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1 worker processes, got {args.jobs}")
    for f in ("prompts_per_step", "samples_per_prompt", "mini_batch"):
        if getattr(args, f) < 1:
            raise ValueError(f"--{f.replace('_', '-')} must be a positive integer, got {getattr(args, f)}")
    if not args.start >= 0:
        raise ValueError(f"--start must be >= 0 hours into the trace, got {args.start}")
    if not args.notice >= 0:
        raise ValueError(f"--notice must be >= 0 seconds, got {args.notice}")
    scenario = Scenario(model=args.model, algo=args.algo, gpu=args.gpu, nodes=args.nodes,
                        gpus_per_node=args.gpus_per_node, trace=args.trace, length_trace=args.length_trace,
                        growth=_parse_growth(args.growth), hours=args.hours or None, gamma=args.gamma, seed=args.seed,
                        time_unit=args.time_unit, truth=Truth(notice_s=args.notice), start=args.start,
                        length_scale=_parse_length_scale(args.length_scale), prompts_per_step=args.prompts_per_step,
                        samples_per_prompt=args.samples_per_prompt, mini_batch=args.mini_batch,
                        asynchronous=args.asynchronous, framework=args.framework)
    names = _policies(args)
    scenario.validate()
    hours = scenario.duration_hours()
    trace, lengths = scenario.availability(), scenario.lengths()
    console = Console(width=max(Console().width, 150))
    console.print(f"[bold]nereus simulate[/]: {args.model} {args.algo.upper()} on {args.nodes}x{args.gpus_per_node} "
                  f"{args.gpu}{' (asynchronous)' if args.asynchronous else ''}; trace {trace.name} ({trace.num_changes} changes, {min(trace.counts)}-"
                  f"{max(trace.counts)} GPUs) for {hours:.1f} h"
                  + (f" from {args.start:g} h" if args.start else "") + f"; lengths {lengths.label}")
    notes = []
    if trace.time_note and (args.trace not in SHIPPED_TRACES or args.time_unit):
        notes.append(f"trace {trace.time_note}")
    if "scale" in lengths.meta:
        m = lengths.meta
        notes.append(f"length trace scaled x{m['scale']:.3g} ({m['scale_mode']} {m['scale_from']:,.0f} -> "
                     f"{m['scale_tokens']:,.0f} tokens; --length-scale none to replay it unchanged)")
    if not lengths.synthetic:
        notes.append(f"length trace has {len(lengths.lengths)} steps; a longer run replays it in a loop "
                     "(loops per policy below)")
    for n in notes:
        console.print(n)
    t0 = time.time()
    with Progress(TextColumn("{task.description:>14}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        tasks = {n: progress.add_task(n, total=hours * 3600.0) for n in names}
        results = run_scenario(scenario, names, jobs=args.jobs,
                               on_progress=lambda n, t: progress.update(tasks[n], completed=t))
        for n in names:
            progress.update(tasks[n], completed=hours * 3600.0)
    console.print(summary_table(results, f"{hours:.1f} simulated hours; response lengths {lengths.label}"))
    causes = [f"{n} " + ", ".join(f"{c} {k}" for c, k in sorted(r.restart_causes.items()))
              for n, r in results.items() if r.restart_causes]
    if causes:
        console.print("restart causes: " + "; ".join(causes))
    if not lengths.synthetic:
        n = len(lengths.lengths)
        console.print("length trace loops: " + ", ".join(f"{k} {r.steps / n:.1f}" for k, r in results.items()))
    rel = ratios(results)
    if rel:
        console.print("nereus throughput / policy: " + ", ".join(f"{n} {r:.2f}x" for n, r in rel.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = asdict(scenario) | {"hours": hours, "trace_source": trace.source, "length_source": lengths.source,
                               "lengths_synthetic": lengths.synthetic}
    for n, r in results.items():
        stem = n.replace("=", "")
        write_json(out / f"{stem}.json", r, meta)
        plot_timeline(out / f"{stem}.png", r, trace, lengths, hours)
    (out / "summary.json").write_text(json.dumps(
        {"scenario": meta, "policies": {n: r.summary() for n, r in results.items()},
         "nereus_over": rel, "wall_s": time.time() - t0}, indent=1, default=str))
    console.print(f"wrote {out}/summary.json and a JSON log and PNG timeline per policy ({time.time() - t0:.0f} s)")
    return 0
