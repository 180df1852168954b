"""What an adaptive run did, for people: a summary of its plan changes and a PNG timeline.

The timeline has three panels over the RL steps: measured step seconds; workers in the pool and
workers the plan uses; mean response length in tokens. Every plan change is a vertical line at the
boundary where it happened (before step k for a pool change, after step k otherwise): green for a
live transition, red for a restart from the checkpoint, labelled with its kind and moved megabytes
(one label per boundary: changes at the same boundary share it, :func:`boundary_labels`); joins and
departures are arrows on the workers panel, labelled ``+3 joined`` / ``-1 left`` (:func:`pool_marks`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["change_rows", "write_timeline", "boundary_labels", "pool_marks"]

_BOX = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}  # labels stay readable over lines


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
        if ev.get("source") in ("recovered", "unchanged"):
            continue  # interrupted by a lost worker (its recovery is the next row), or nothing ran
        t = ev.get("transition")
        if t is not None:
            kinds: dict[str, int] = {}
            for p in t["primitives"]:
                kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
            prims = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none (no state moved: batch sizes, dropped engines)"
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


def boundary_labels(events: list[dict]) -> list[tuple[float, str, bool]]:
    """One label per boundary with plan changes, ``(x, text, all live)``: the changes at one boundary
    (e.g. a departure's transition and the growth after it) are joined into one text, so their labels
    never print on top of each other: ``"live 57 MB + live 3 MB"``."""
    at: dict[float, list[tuple[str, bool]]] = {}
    for ev in events:
        if ev.get("source") not in ("live", "checkpoint") and ev.get("transition") is None:
            continue  # kept, unchanged, or interrupted by a lost worker (its recovery is its own event)
        live = ev.get("transition") is not None
        mb = f" {ev['transition']['bytes_moved'] / 1e6:.0f} MB" if live else ""
        at.setdefault(_at(ev), []).append((("live" if live else "restart") + mb, live))
    return [(x, " + ".join(t for t, _ in items), all(lv for _, lv in items)) for x, items in sorted(at.items())]


def pool_marks(history: list[dict]) -> list[tuple[float, int]]:
    """Where the pool changed, ``(x, workers joined (+) or left (-))``, at the boundary before the
    first step that ran on the new pool (from the steps' ``pool``)."""
    out = []
    for prev, m in zip(history, history[1:]):
        delta = int(m.get("pool", 0)) - int(prev.get("pool", 0))
        if delta:
            out.append((m["step"] - 0.5, delta))
    return out


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
    for x, text, live in boundary_labels(events):
        for ax in axes:
            ax.axvline(x, color="#2ca02c" if live else "#d62728", alpha=0.7, linewidth=1.5)
        axes[0].annotate(text, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                         fontsize=7, bbox=_BOX)
    top = max(max(m.get("pool", 0) for m in history), 1)
    for x, delta in pool_marks(history):
        joined = delta > 0
        colour = "#1f77b4" if joined else "#9467bd"
        axes[1].annotate(f"{delta:+d} {'joined' if joined else 'left'}", (x, top + 0.5), xytext=(x + 0.12, top + 1.3),
                         ha="left", va="bottom", fontsize=7, color=colour, bbox=_BOX,
                         arrowprops={"arrowstyle": "->", "color": colour})
    axes[1].set_ylim(0, top + 2.4)
    fig.suptitle(title or "adaptive run: green = live transition, red = restart from checkpoint; arrows: workers "
                          "joined (+) or left (-)", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
