"""Reports of a simulation: a rich table, a JSON log per policy, and a PNG timeline per policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

from nereus.sim.run import RunResult
from nereus.sim.traces import AvailabilityTrace, LengthTrace

__all__ = ["summary_table", "ratios", "write_json", "plot_timeline"]


def ratios(results: dict, base: str = "nereus") -> dict:
    """``throughput(base) / throughput(policy)`` for every other policy (inf when the policy made none)."""
    if base not in results:
        return {}
    b = results[base].throughput
    return {n: (b / r.throughput if r.throughput > 0 else math.inf) for n, r in results.items() if n != base}


def summary_table(results: dict, title: str):
    """A :class:`rich.table.Table` with one row per policy."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("policy", "tokens/s", "vs nereus", "steps", "transitions (n, urgent, s)", "restarts (n, s)",
                "aborted+redone s", "waiting s", "time lost s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    base = results.get("nereus")
    for name, r in results.items():
        rel = f"{r.throughput / base.throughput:.2f}x" if base and base.throughput > 0 else "-"
        t.add_row(name, f"{r.throughput:,.0f}", rel, str(r.steps),
                  f"{r.transitions}, {r.urgent_transitions}, {r.transition_time:,.0f}",
                  f"{r.restarts}, {r.restart_time:,.0f}", f"{r.lost_time:,.0f}", f"{r.wait_time:,.0f}",
                  f"{r.time_lost:,.0f}")
    return t


def write_json(path: Path, result: RunResult, scenario: dict) -> None:
    """The run's summary, timeline, plan-change events and replan decisions (``no trigger`` keeps omitted)."""
    decisions = [e for e in result.log if e.get("decision", {}).get("reason") != "no trigger"]
    doc = {"scenario": scenario, "summary": result.summary(), "events": result.events,
           "decisions": decisions, "timeline": result.timeline}
    path.write_text(json.dumps(doc, indent=1, default=_json_default))


def _json_default(o):
    if isinstance(o, (frozenset, set)):
        return sorted(o)
    return str(o)


def plot_timeline(path: Path, result: RunResult, trace: AvailabilityTrace, lengths: LengthTrace, hours: float) -> None:
    """Three stacked panels over hours: GPUs (available and used), response length, step latency;
    transitions (green, urgent orange) and restarts (red) marked on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    ts = [p["t"] / 3600 for p in result.timeline]
    xs = list(t / 3600 for t in trace.times) + [hours]
    ys = list(trace.counts) + [trace.counts[-1]]
    axes[0].step(xs, ys, where="post", color="0.5", label="GPUs available (trace)")
    axes[0].plot(ts, [p["plan_gpus"] for p in result.timeline], ".", ms=2, color="tab:blue", label="GPUs in plan")
    axes[0].set_ylabel("GPUs")
    axes[0].legend(loc="lower right", fontsize=7)
    axes[1].plot(ts, [p["response_len"] for p in result.timeline], ".", ms=2, color="tab:purple")
    axes[1].set_ylabel("response tokens" + ("\n(SYNTHETIC)" if lengths.synthetic else ""))
    axes[2].plot(ts, [p["step_time"] for p in result.timeline], ".", ms=2, color="tab:brown")
    axes[2].set_ylabel("step latency (s)")
    axes[2].set_xlabel("hours")
    for e in result.events:
        color = "tab:red" if e["kind"] == "restart" else ("tab:orange" if e.get("urgent") else "tab:green")
        for ax in axes:
            ax.axvline(e["t"] / 3600, color=color, lw=0.5, alpha=0.6)
    axes[0].set_title(f"{result.policy}: {result.throughput:,.0f} response tokens/s; {result.transitions} transitions "
                      f"(green; urgent orange), {result.restarts} restarts (red)\ntrace {trace.name}; lengths "
                      f"{lengths.label}", fontsize=9)
    axes[0].set_xlim(0, hours)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
