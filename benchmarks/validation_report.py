"""Output of the cost-model validation benchmark (``benchmarks/validate_cost_model.py``): the printed
tables, the Markdown tables of docs/planner.md and the log-log PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _fmt(st: dict) -> str:
    if not st["n"]:
        return "    -           -      0"
    return f"{st['median']:6.1f}%   {st['mean']:6.1f}%  {st['n']:4d}"


def report(res: dict) -> str:
    """The printed tables."""
    out = []
    caps = res["capabilities"]
    out.append("cost-model features handed over: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in caps.items()))
    nm: dict = {}
    for x in res["rows"]:
        for f in x["not_modelled"]:
            nm[f] = nm.get(f, 0) + 1
    out.append("not modelled (rows): " + (", ".join(f"{k} ({v})" for k, v in sorted(nm.items())) or "none"))
    out.append("")
    out.append("BEFORE calibration (default efficiencies): iteration time APE")
    out.append(f"{'source':28s} {'median':>7s}   {'mean':>7s}  {'rows':>4s}")
    for s, st in res["before"]["by_source"].items():
        out.append(f"{s:28s} {_fmt(st)}")
    out.append(f"{'overall':28s} {_fmt(res['before']['overall'])}")
    out.append(f"{'overall, bf16 rows':28s} {_fmt(res['before']['overall_bf16'])}")
    mem = res["before"]["memory"]
    out.append(f"memory: {'no row publishes a memory figure' if not mem['n'] else _fmt(mem)}")
    out.append("")
    out.append("AFTER calibration, leave-one-source-out (fit on one source, error on the others)")
    for s, d in res["loso"].items():
        sc = ", ".join(f"{g} x{v:.2f}" for g, v in sorted(d["scales"].items()))
        out.append(f"fit on {s} ({d['fit_rows']} rows): {sc}" + (f"; at bound: {d['at_bound']}" if d["at_bound"] else "")
                   + ("" if d.get("converged", True) else " (solver stopped at its evaluation cap)"))
        out.append(f"   {'in-sample':25s} {_fmt(d['in_sample'])}")
        for k, st in d["held_out_by_source"].items():
            out.append(f"   held out {k:16s} {_fmt(st)}")
        out.append(f"   {'held out, all':25s} {_fmt(d['held_out'])}")
        out.append(f"   {'held out, bf16 rows':25s} {_fmt(d['held_out_bf16'])}")
        out.append(f"   {'held out, same GPU (' + '/'.join(d['gpus']) + ')':25s} {_fmt(d['held_out_same_gpu'])}")
    lp = res["loso_pooled"]
    out.append(f"{'pooled over the fits (each row under every fit but its own source)':70s}")
    out.append(f"   {'held out, all':25s} {_fmt(lp['all'])}")
    out.append(f"   {'held out, bf16 rows':25s} {_fmt(lp['bf16'])}")
    out.append("")
    out.append("Floor: one calibration on all rows of a group, error in-sample (what calibration cannot absorb)")
    for k, d in res["floor"].items():
        sc = ", ".join(f"{g} x{v:.2f}" for g, v in sorted(d["scales"].items()))
        out.append(f"   {k:25s} {_fmt(d['in_sample'])}   (before {d['before']['median']:.1f}%; {sc})")
    out.append("")
    out.append("Spearman rank correlation, predicted vs measured, across the rows of one model")
    out.append(f"{'model':16s} {'rows':>4s} {'time':>6s} {'time/token':>10s}")
    for m, d in res["spearman"].items():
        out.append(f"{m:16s} {d['n']:4d} {d['time']:6.3f} {d['time_per_token']:10.3f}")
    return "\n".join(out)


def markdown(res: dict) -> str:
    """The figures as the Markdown tables of docs/planner.md ("Validation against published
    measurements")."""
    def cell(st):
        return "-" if not st["n"] else f"{st['median']:.1f}% / {st['mean']:.1f}% ({st['n']})"

    b = res["before"]
    out = ["| source | rows | before: median / mean APE |", "|---|---:|---|"]
    for s, st in b["by_source"].items():
        out.append(f"| `{s}` | {st['n']} | {cell(st)} |")
    out.append(f"| all | {b['overall']['n']} | {cell(b['overall'])} |")
    out.append(f"| all bf16 | {b['overall_bf16']['n']} | {cell(b['overall_bf16'])} |")
    groups = ("gemm", "gemm_fp8", "attention", "memory", "comm@nvlink", "comm@ib")
    out += ["", "| fitted on | fitted scales (GEMM, FP8 GEMM, attention, HBM, NVLink, NIC) | in-sample | "
                "held out: all | held out: bf16 | held out: same GPU type |", "|---|---|---|---|---|---|"]
    for s, d in res["loso"].items():
        sc = d["scales"]
        scs = ", ".join(f"{sc.get(g, 1.0):.2f}" for g in groups)
        flag = " (NIC at bound)" if any(c.endswith("@ib") for c in d["at_bound"]) else ""
        out.append(f"| `{s}` ({d['fit_rows']}) | {scs}{flag} | {cell(d['in_sample'])} | {cell(d['held_out'])} | "
                   f"{cell(d['held_out_bf16'])} | {cell(d['held_out_same_gpu'])} |")
    lp = res["loso_pooled"]
    out.append(f"| pooled over the fits | | | {cell(lp['all'])} | {cell(lp['bf16'])} | |")
    out += ["", "| calibrated on all rows of | rows | before | after, in-sample | fitted scales (as above) |",
            "|---|---:|---|---|---|"]
    for k, d in res["floor"].items():
        scs = ", ".join(f"{d['scales'].get(g, 1.0):.2f}" for g in groups)
        out.append(f"| {k} | {d['in_sample']['n']} | {cell(d['before'])} | {cell(d['in_sample'])} | {scs} |")
    out += ["", "| model | rows | Spearman, time | Spearman, time per token |", "|---|---:|---:|---:|"]
    for m, d in res["spearman"].items():
        out.append(f"| {m} | {d['n']} | {d['time']:.2f} | {d['time_per_token']:.2f} |")
    return "\n".join(out)


def plot(res: dict, path: str | Path) -> None:
    """Log-log predicted vs measured (left: default efficiencies; right: each row predicted with the
    fit on the largest other source), one colour per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    sources = res["sources"]
    gpus_of = {s: set(res["loso"][s]["gpus"]) for s in res["loso"]}
    sizes = {s: sum(1 for x in rows if x["source"] == s) for s in sources}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    meas = np.array([x["measured_s"] for x in rows])
    for ax, title in zip(axes, ("default efficiencies",
                                "fitted on another source (same GPU type where one exists)")):
        for k, s in enumerate(sources):
            idx = [i for i, x in enumerate(rows) if x["source"] == s]
            if title.startswith("default"):
                p = np.array([rows[i]["predicted_s"] for i in idx])
            else:
                mine = {x["gpu"] for x in rows if x["source"] == s}
                others = [o for o in sorted(sources, key=lambda o: (not (gpus_of.get(o, set()) & mine), -sizes[o]))
                          if o != s and o in res["held_predictions"]]
                if not others:
                    continue
                p = np.array(res["held_predictions"][others[0]])[idx]
            ax.scatter(meas[idx], p, s=18, color=colours[k % len(colours)], label=f"{s} ({len(idx)})", alpha=0.8)
        lo = min(meas.min(), min(x["predicted_s"] for x in rows)) / 1.5
        hi = max(meas.max(), max(x["predicted_s"] for x in rows)) * 1.5
        xs = np.array([lo, hi])
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, xs * 1.1, "k:", lw=0.6)
        ax.plot(xs, xs / 1.1, "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured iteration time (s)")
        ax.set_title(title)
    axes[0].set_ylabel("predicted iteration time (s)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Nereus cost model vs published training iterations (dotted: ±10%)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
