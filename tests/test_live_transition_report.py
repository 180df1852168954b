"""The last lines of ``benchmarks/bench_live_transition.py`` (issue 26's figures), from hand-made
rows: the minimum and median speedup, the byte ratio, and the ``--live-only`` form that has no
restart to compare with."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from live_transition_report import final_line, l_tran_line  # noqa: E402

NAN = float("nan")


def _row(case, speedup, live_x_min, pred, meas):
    return {"case": case, "speedup": speedup, "live_x_min": live_x_min, "pred_l_tran_s": pred,
            "live_l_tran_s": meas, "l_tran_ratio": max(pred / meas, meas / pred)}


def test_the_last_line_gives_the_minimum_and_median_speedup_and_the_worst_byte_ratio():
    rows = [_row("a", 40.0, 1.0, 1.0, 1.0), _row("b", 100.0, 1.0, 1.0, 1.0), _row("c", 300.0, 1.25, 1.0, 1.0)]
    assert final_line(rows) == ("live vs faithful restart: min 40.0x, median 100.0x over 3 cases; "
                                "live bytes / minimum: max 1.25")


def test_without_a_restart_the_last_line_says_so_instead_of_printing_nan():
    rows = [_row("a", NAN, 1.0, 1.0, 1.0), _row("b", NAN, 1.0, 1.0, 1.0)]
    assert final_line(rows) == ("live vs faithful restart: not run (--live-only) over 2 cases; "
                                "live bytes / minimum: max 1.00")


def test_the_l_tran_line_counts_a_case_over_by_either_way_against_the_1_5x_bound():
    # 0.3 predicted for 0.2 measured is 1.50x (within); 0.1 for 0.2 is 0.50 (2.00x either way: not within)
    rows = [_row("x", 1.0, 1.0, 0.3, 0.2), _row("y", 1.0, 1.0, 0.1, 0.2)]
    assert l_tran_line(rows) == "L_tran predicted / measured: x 1.50, y 0.50; max 2.00x over 2 cases (1 within 1.5x)"
