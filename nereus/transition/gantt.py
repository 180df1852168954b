"""Gantt chart of a transition schedule (PNG, matplotlib Agg backend; no display needed)."""

from __future__ import annotations

from pathlib import Path

from nereus.transition.global_dag import GlobalDAG
from nereus.transition.schedule import Schedule

__all__ = ["write_gantt"]

COLORS = {"split": "#4c72b0", "merge": "#55a868", "extend": "#dd8452", "destroy": "#c44e52", "load": "#8172b3", "offload": "#937860", "restore": "#da8bc3"}


def write_gantt(dag: GlobalDAG, schedule: Schedule, path: str | Path, title: str = "") -> Path:
    """Draw one bar per primitive (rows in start order, colored by kind) and save it to ``path``.

    Raises:
        ValueError: ``path`` does not end in ``.png``.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"Gantt output must be a .png file, got {str(path)!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(dag.nodes, key=lambda n: (schedule.start[n.pid], n.pid))
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.28 * max(len(rows), 1)))
    crit = set(schedule.critical_path)
    for i, n in enumerate(rows):
        s, e = schedule.start[n.pid], schedule.end[n.pid]
        ax.barh(i, max(e - s, 1e-4), left=s, color=COLORS[n.kind],
                edgecolor="black" if n.pid in crit else "none", linewidth=1.2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([n.pid for n in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the transition")
    ax.set_title(title or f"transition schedule ({schedule.algo}): L_tran = {schedule.makespan:.3f} s")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()]
              + [Patch(facecolor="white", edgecolor="black", label="critical path")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
