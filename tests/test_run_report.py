"""The adaptive run's PNG timeline (``run/report.py``; issue 30): changes at one boundary share one
label (they printed on top of each other), and joins and departures are marked."""

from __future__ import annotations

from nereus.runtime.run.report import boundary_labels, pool_marks, write_timeline


def _live(step, when, mb):
    return {"step": step, "when": when, "kind": "transition", "source": "live",
            "transition": {"bytes_moved": mb * 1e6, "primitives": [], "predicted_l_tran": 0.1,
                           "measured_l_tran": 0.1, "seconds": 0.2}}


EVENTS = [_live(2, "pool change", 57), _live(1, "after step", 3),  # both at the boundary x = 1.5
          {"step": 4, "when": "after step", "kind": "restart", "source": "checkpoint", "steps_lost": 1},
          {"step": 6, "when": "after step", "kind": "transition", "source": "recovered"},  # interrupted: its own row
          {"step": 7, "when": "pool change", "kind": "transition", "source": "unchanged"}]
HISTORY = [{"step": k, "seconds": 1.0, "response_len": 4.0, "pool": p, "workers_used": p}
           for k, p in enumerate([4, 4, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6])]


def test_changes_at_one_boundary_share_one_label():
    assert boundary_labels(EVENTS) == [(1.5, "live 57 MB + live 3 MB", True), (4.5, "restart", False)]


def test_joins_and_departures_are_marked_where_the_pool_changed():
    assert pool_marks(HISTORY) == [(1.5, -1), (9.5, 3)]
    # a step re-run after a restore (same step number twice) with the pool unchanged marks nothing
    assert pool_marks([{"step": 3, "pool": 2}, {"step": 2, "pool": 2}]) == []


def test_the_timeline_is_written(tmp_path):
    out = write_timeline(HISTORY, EVENTS, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_change_that_moves_no_state_says_so_and_recovered_steps_get_no_row():
    """A transition with no primitive (new micro-batch sizes, or a new layout of an engine that is
    dropped between steps and rebuilt at the next weight sync) is a row that says no state moved; an
    interrupted transition (``recovered``) and a target that was the current plan (``unchanged``: no
    transition ran) have none; a restart from the checkpoint has its row."""
    from nereus.runtime.run.report import change_rows

    rows = change_rows(EVENTS)
    assert [(r["boundary"], r["how"], r["primitives"]) for r in rows] == [
        ("before step 2", "live", "none (no state moved: batch sizes, dropped engines)"),
        ("after step 1", "live", "none (no state moved: batch sizes, dropped engines)"),
        ("after step 4", "restart", "durable checkpoint, 1 step(s) lost")]
