"""Replay the ``L_tran`` model over a recorded ``bench_live_transition.py --json`` run (no Ray, no workers).

For each case, a fresh :class:`~nereus.transition.calibrate.TransitionCalibration` observes the
run's recorded transitions before the case (``observed[:case_starts[case]]``: the warm-up's second
pass, the earlier cases and the untimed moves between them, as the benchmark's snapshot did), the
case is planned on the calibrated job (``estimate_transition``) and its makespan is compared with
the median measured ``L_tran`` of the case's live repetitions. With the code the run was recorded
with, the predictions equal the run's own; with changed model code, they show what the change
would have predicted on the same measurements.

    python benchmarks/replay_live_transition.py bench-live-transition.json [more.json ...]

Prints per run: ``<file>: <case> <ratio>, ...; max X.XXx (N of M within 1.5x)`` (for a run with the
workers' fault probes, also the line with ``φ`` from the primitives alone), and the
per-Destroy error of the Destroy term against the median it replaced (:func:`destroys`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_live_transition import CASES, JOB  # noqa: E402

from nereus.runtime.run.device_model import worker_cores  # noqa: E402
from nereus.transition.calibrate import TransitionCalibration  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402


def replay(run: dict, cores: float | None = None, probes: bool = True) -> list[tuple[str, float, float]]:
    """``(case, predicted s, measured s)`` per case of ``run`` (a ``--json`` output); ``probes=False``:
    the workers' fault probes (``fault_s_per_byte``) dropped, ``φ`` from the primitives alone."""
    out = []
    for name, src, dst, _ in CASES:
        if name not in run["cases"]:
            continue
        cal = TransitionCalibration(cores=cores if cores is not None else worker_cores())
        for recs in run["observed"][:run["case_starts"][name]]:
            cal.observe(recs if probes else [{**r, "fault_s_per_byte": {}} for r in recs])
        est = estimate_transition(cal.apply(JOB), src, dst, frozenset(range(run["workers"])), params=cal.params())
        meas = statistics.median(r["l_tran_s"] for r in run["cases"][name]["live"])
        out.append((name, float(est.l_tran), meas))
    return out


def destroys(run: dict, window: int = 64) -> dict:
    """Each recorded Destroy predicted from the up to ``window`` before it: the mean |ln(predicted /
    measured)| with their median seconds (the model before the Destroy term) and with
    ``calibrate.fit_teardown`` over ``(freed_tensors, seconds)`` (spans; one worker each or
    concurrent, no core-sharing correction). Records without ``freed_tensors`` count 0 tensors."""
    from nereus.transition.calibrate import fit_teardown

    seq = [(float(r.get("freed_tensors") or 0), r["t_end"] - r["t_ready"]) for t in run["observed"] for r in t
           if r["kind"] == "destroy" and r["t_end"] > r["t_ready"]]
    err = {"median": [], "tensors": []}
    for j in range(5, len(seq)):
        past, (n, s) = seq[max(0, j - window):j], seq[j]
        err["median"].append(abs(math.log(statistics.median(x for _, x in past) / s)))
        f, a = fit_teardown(past)
        err["tensors"].append(abs(math.log((f + a * n) / s)))
    return {k: statistics.mean(v) if v else float("nan") for k, v in err.items()} | {"destroys": len(seq)}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[0])
        return 2
    for path in argv:
        with open(path) as fh:
            run = json.load(fh)
        probed = any(r.get("fault_s_per_byte") for t in run["observed"] for r in t)
        for probes in (True, False) if probed else (True,):
            ratios = [(n, p / m) for n, p, m in replay(run, probes=probes)]
            worst = max(max(r, 1 / r) for _, r in ratios)
            ok = sum(max(r, 1 / r) <= 1.5 for _, r in ratios)
            print(f"{path}{'' if probes else ' (phi without the fault probes)'}: "
                  + ", ".join(f"{n} {r:.2f}" for n, r in ratios) + f"; max {worst:.2f}x ({ok} of {len(ratios)} within 1.5x)")
        with open(path) as fh:
            dd = destroys(json.load(fh))
        print(f"{path}: {dd['destroys']} Destroys, mean |ln(predicted / measured)|: median of earlier "
              f"{dd['median']:.2f}, tensors line with warm-up discount {dd['tensors']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
