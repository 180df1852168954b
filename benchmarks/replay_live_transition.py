"""Replay the ``L_tran`` model over a recorded ``bench_live_transition.py --json`` run (no Ray, no workers).

For each case, a fresh :class:`~nereus.transition.calibrate.TransitionCalibration` observes the
run's recorded transitions before the case (``observed[:case_starts[case]]``: the warm-up's second
pass, the earlier cases and the untimed moves between them, as the benchmark's snapshot did), the
case is planned on the calibrated job (``estimate_transition``) and its makespan is compared with
the median measured ``L_tran`` of the case's live repetitions. With the code the run was recorded
with, the predictions equal the run's own; with changed model code, they show what the change
would have predicted on the same measurements.

    python benchmarks/replay_live_transition.py bench-live-transition.json [more.json ...]

Prints one line per run: ``<file>: <case> <ratio>, ...; max X.XXx (N of M within 1.5x)``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_live_transition import CASES, JOB  # noqa: E402

from nereus.runtime.run.device_model import worker_cores  # noqa: E402
from nereus.transition.calibrate import TransitionCalibration  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402


def replay(run: dict, cores: float | None = None) -> list[tuple[str, float, float]]:
    """``(case, predicted s, measured s)`` per case of ``run`` (a ``--json`` output)."""
    out = []
    for name, src, dst, _ in CASES:
        if name not in run["cases"]:
            continue
        cal = TransitionCalibration(cores=cores if cores is not None else worker_cores())
        for recs in run["observed"][:run["case_starts"][name]]:
            cal.observe(recs)
        est = estimate_transition(cal.apply(JOB), src, dst, frozenset(range(run["workers"])), params=cal.params())
        meas = statistics.median(r["l_tran_s"] for r in run["cases"][name]["live"])
        out.append((name, float(est.l_tran), meas))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[0])
        return 2
    for path in argv:
        with open(path) as fh:
            rows = replay(json.load(fh))
        ratios = [(n, p / m) for n, p, m in rows]
        worst = max(max(r, 1 / r) for _, r in ratios)
        ok = sum(max(r, 1 / r) <= 1.5 for _, r in ratios)
        print(f"{path}: " + ", ".join(f"{n} {r:.2f}" for n, r in ratios)
              + f"; max {worst:.2f}x ({ok} of {len(ratios)} within 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
