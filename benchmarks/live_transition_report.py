"""The report of ``bench_live_transition.py``: per-case medians of its measurements, the printed table,
the PNG bar chart, and the last lines (``L_tran`` predicted / measured over the cases; live vs faithful
restart and live bytes / minimum). Pure functions of the benchmark's ``out`` dictionary."""

from __future__ import annotations

import statistics


def median(xs) -> float:
    """Median of ``xs``; nan when empty (a baseline not run: ``--live-only``)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def summarize(out: dict) -> list[dict]:
    rows = []
    for name, res in out["cases"].items():
        med = {m: {k: median(r[k] for r in res[m]) for k in ("seconds", "bytes")}
               for m in ("live", "faithful", "reload")}
        nan = {"save_s": float("nan"), "stop_s": float("nan"), "start_s": float("nan"), "load_s": float("nan")}
        fr = res["faithful"][0] if res["faithful"] else nan
        mn = res["live"][0]["min_bytes"]
        lv = res["live"]
        rows.append({"case": name, "live_s": med["live"]["seconds"], "faithful_s": med["faithful"]["seconds"],
                     "reload_s": med["reload"]["seconds"],
                     "speedup": med["faithful"]["seconds"] / med["live"]["seconds"],
                     "reload_speedup": med["reload"]["seconds"] / med["live"]["seconds"],
                     "live_mb": med["live"]["bytes"] / 1e6, "faithful_mb": med["faithful"]["bytes"] / 1e6,
                     "reload_mb": med["reload"]["bytes"] / 1e6, "min_mb": mn / 1e6,
                     "dag": "+".join(lv[0]["primitives"]),
                     "live_setup_s": statistics.median(r["setup_s"] for r in lv),
                     "live_copy_s": statistics.median(r["copy_s"] for r in lv),
                     "live_transfer_s": statistics.median(r["transfer_s"] for r in lv),
                     "live_l_tran_s": statistics.median(r["l_tran_s"] for r in lv),
                     "pred_l_tran_s": statistics.median(r["predicted_l_tran_s"] for r in lv),
                     "faithful_save_s": fr["save_s"], "faithful_stop_s": fr["stop_s"],
                     "faithful_start_s": fr["start_s"], "faithful_load_s": fr["load_s"],
                     "live_x_min": max(r["bytes"] for r in lv) / mn if mn else (1.0 if max(r["bytes"] for r in lv) == 0
                                                                              else float("inf")),
                     "faithful_x_min": med["faithful"]["bytes"] / mn if mn else float("nan"),
                     "reload_x_min": med["reload"]["bytes"] / mn if mn else float("nan")})
        r = rows[-1]
        r["l_tran_ratio"] = (max(r["pred_l_tran_s"], r["live_l_tran_s"]) / min(r["pred_l_tran_s"], r["live_l_tran_s"])
                             if min(r["pred_l_tran_s"], r["live_l_tran_s"]) > 0 else float("nan"))
    return rows


def print_table(rows: list[dict], out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"live transition vs faithful restart and in-process DCP reload ({out['preset']} model, PPO, "
                    f"{out['workers']} Ray CPU workers; live: median of {out.get('live_reps', out['reps'])}, reload: median of {out['reps']}, restart: one)")
    cols = [("case", "case", "{}"), ("live s", "live_s", "{:.3f}"), ("restart s", "faithful_s", "{:.2f}"),
            ("restart/live", "speedup", "{:.1f}x"), ("reload s", "reload_s", "{:.3f}"),
            ("reload/live", "reload_speedup", "{:.1f}x"), ("live MB", "live_mb", "{:.1f}"),
            ("restart MB", "faithful_mb", "{:.1f}"), ("reload MB", "reload_mb", "{:.1f}"),
            ("min MB", "min_mb", "{:.1f}"), ("live/min", "live_x_min", "{:.2f}"),
            ("restart/min", "faithful_x_min", "{:.2f}")]
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head == "case" else "right")
    for r in rows:
        t.add_row(*[_fmt(f, r[k]) for _, k, f in cols])
    con = Console(width=180)
    con.print(t)
    b = Table(title="where the seconds go: live L_tran predicted (calibrated from earlier transitions) and measured, "
                    "its setup, copy and wire seconds (sums over primitives); faithful restart's phases")
    cols = [("case", "case", "{}"), ("live DAG", "dag", "{}"), ("L_tran pred s", "pred_l_tran_s", "{:.3f}"),
            ("L_tran meas s", "live_l_tran_s", "{:.3f}"), ("ratio", "l_tran_ratio", "{:.2f}"),
            ("setup s", "live_setup_s", "{:.3f}"), ("copy s", "live_copy_s", "{:.3f}"),
            ("wire s", "live_transfer_s", "{:.3f}"), ("save s", "faithful_save_s", "{:.2f}"),
            ("stop s", "faithful_stop_s", "{:.2f}"), ("start s", "faithful_start_s", "{:.2f}"),
            ("load+sync s", "faithful_load_s", "{:.2f}")]
    for head, _, _ in cols:
        b.add_column(head, justify="left" if head in ("case", "live DAG") else "right")
    for r in rows:
        b.add_row(*[_fmt(f, r[k]) for _, k, f in cols])
    con.print(b)


def _fmt(f: str, v) -> str:
    return "-" if isinstance(v, float) and v != v else f.format(v)


def plot(rows: list[dict], out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in rows]
    x = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 4.8))
    w = 0.27
    a1.bar([i - w for i in x], [r["live_s"] for r in rows], w, label="live transition")
    a1.bar(list(x), [r["faithful_s"] for r in rows], w, label="faithful restart")
    a1.bar([i + w for i in x], [r["reload_s"] for r in rows], w, label="in-process DCP reload")
    a1.set_ylabel("seconds")
    a1.set_yscale("log")
    a1.set_title("time")
    a2.bar([i - w for i in x], [r["live_mb"] for r in rows], w, label="live: bytes moved")
    a2.bar(list(x), [r["faithful_mb"] for r in rows], w, label="restart: written + read")
    a2.bar([i + w for i in x], [r["min_mb"] for r in rows], w, label="minimum (est.min_bytes)", color="0.6")
    a2.set_ylabel("MB")
    a2.set_title("bytes")
    for a in (a1, a2):
        a.set_xticks(list(x))
        a.set_xticklabels(names, rotation=30, ha="right")
        a.legend(fontsize=8)
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Live transition vs restart ({out['preset']} model, PPO, {out['workers']} Ray CPU "
                 f"workers on {out['cpus']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def l_tran_line(rows: list[dict]) -> str:
    """Every case's L_tran predicted / measured (medians of its live repetitions; predicted from the
    transitions before the case), and the worst ratio either way (issue 26: within 1.5x)."""
    ok = [r for r in rows if r["l_tran_ratio"] == r["l_tran_ratio"]]
    each = ", ".join(f"{r['case']} {r['pred_l_tran_s'] / r['live_l_tran_s']:.2f}" for r in ok)
    worst = max((r["l_tran_ratio"] for r in ok), default=float("nan"))
    return (f"L_tran predicted / measured: {each}; max {worst:.2f}x over {len(ok)} cases "
            f"({sum(r['l_tran_ratio'] <= 1.5 for r in ok)} within 1.5x)")


def final_line(rows: list[dict]) -> str:
    """The benchmark's last line (issue 26)."""
    sp = [r["speedup"] for r in rows if r["speedup"] == r["speedup"]]
    ratio = f"live bytes / minimum: max {max(r['live_x_min'] for r in rows):.2f}"
    if not sp:  # --live-only: no restart was run, so there is no ratio to print
        return f"live vs faithful restart: not run (--live-only) over {len(rows)} cases; {ratio}"
    return (f"live vs faithful restart: min {min(sp):.1f}x, median {statistics.median(sp):.1f}x over {len(sp)} "
            f"cases; {ratio}")
