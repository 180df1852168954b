"""What an adaptive run did, for people: a summary of its plan changes and a PNG timeline.

The timeline has three panels over the RL steps: measured step seconds; workers in the pool and
workers the plan uses; mean response length in tokens. Every plan change is a vertical line at the
boundary where it happened (before step k for a pool change, after step k otherwise): green for a
live transition, red for a restart from the checkpoint, labelled with its kind and moved megabytes.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["change_rows", "write_timeline"]


def _at(ev: dict) -> float:
    """Boundary position of an event on the step axis."""
    return ev["step"] - 0.5 if ev["when"] in ("pool change", "recovery") else ev["step"] + 0.5


def change_rows(events: list[dict]) -> list[dict]:
    """One row per applied plan change: ``{"boundary", "how", "primitives", "mb", "predicted_s",
    "measured_s", "seconds"}`` (``how``: ``live`` or ``restart``; seconds of the change itself)."""
    rows = []
    for ev in events:
        when = {"pool change": f"before step {ev['step']}", "recovery": f"during step {ev['step']}"}.get(
            ev["when"], f"after step {ev['step']}")
        if ev.get("source") == "recovered":
            continue  # interrupted by a lost worker: its recovery is the next row
        t = ev.get("transition")
        if t is not None:
            kinds: dict[str, int] = {}
            for p in t["primitives"]:
                kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
            prims = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none (batch sizes only)"
            how = "recovery, live" if ev["when"] == "recovery" else "live"
            rows.append({"boundary": when, "how": how, "primitives": prims,
                         "mb": t["bytes_moved"] / 1e6, "predicted_s": t["predicted_l_tran"],
                         "measured_s": t["measured_l_tran"], "seconds": t["seconds"]})
        else:
            lost = ev.get("steps_lost", 0)
            rows.append({"boundary": when, "how": "restart" if ev["when"] != "recovery" else "recovery, restart",
                         "primitives": f"durable checkpoint, {lost} step(s) lost", "mb": None, "predicted_s": None,
                         "measured_s": None, "seconds": ev.get("seconds", 0.0)})
    return rows


def write_timeline(history: list[dict], events: list[dict], path: str | Path, title: str = "") -> Path:
    """Write the PNG timeline (module docstring) of ``history`` (per-step metrics with ``seconds``,
    ``pool``, ``workers_used``, ``response_len``) and ``events`` (``AdaptiveRun.events``).

    Raises:
        ValueError: an empty history.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("write_timeline needs at least one step")
    steps = [m["step"] for m in history]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].bar(steps, [m["seconds"] for m in history], color="#4c72b0")
    axes[0].set_ylabel("step (s)")
    axes[1].step(steps, [m.get("pool", 0) for m in history], where="mid", label="workers in pool", color="black")
    axes[1].step(steps, [m.get("workers_used", 0) for m in history], where="mid", label="workers used",
                 color="#55a868", linestyle="--")
    axes[1].set_ylabel("workers")
    axes[1].legend(loc="lower left", fontsize=8)
    axes[2].plot(steps, [m["response_len"] for m in history], marker="o", color="#c44e52")
    axes[2].set_ylabel("response (tokens)")
    axes[2].set_xlabel("RL step")
    for ev in events:
        if ev.get("source") == "recovered":
            continue
        live = ev.get("transition") is not None
        x = _at(ev)
        for ax in axes:
            ax.axvline(x, color="#2ca02c" if live else "#d62728", alpha=0.7, linewidth=1.5)
        mb = f" {ev['transition']['bytes_moved'] / 1e6:.0f} MB" if live else ""
        axes[0].annotate(("live" if live else "restart") + mb, (x, 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=7)
    fig.suptitle(title or "adaptive run: green = live transition, red = restart from checkpoint", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
