"""``H_pool`` on the shipped traces: the EMA of crossing intervals against the loss process (issue 29).

For every shipped trace (window ``[0, hours)`` scaled to ``--gpus`` GPUs, sampled at safe
boundaries every ``--step`` seconds, the step time of a job that does not change) this replays the
pool through the monitor's EMA horizon (``Horizon(first="elapsed")``, α = 0.5, what the simulator's
``nereus-ema`` policy uses) and through :class:`~nereus.controller.pool_process.PoolProcess`, and at
every pool change that only adds GPUs (the changes whose transitions need the payback rule) compares
both with what happened: the steps until the pool next lost GPUs (the rest of the window when it did
not; such events are counted as censored).

Printed per trace: growth events, the median of each estimate and of the realised steps, and the
median of ``log2(estimate / realised)`` over uncensored events (0 is unbiased, −1 a factor of two
short). No simulation runs; it takes a second.

Usage::

    python benchmarks/bench_horizon.py [--hours 4] [--gpus 32] [--step 60]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nereus.controller.horizon import Horizon  # noqa: E402
from nereus.controller.pool_process import PoolProcess  # noqa: E402
from nereus.sim.traces import SHIPPED_TRACES, load_availability  # noqa: E402


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def replay(name: str, hours: float, gpus: int, step_s: float) -> dict:
    """EMA and process horizons at each growth event of trace ``name`` against the realised steps."""
    tr = load_availability(name).window(0.0, hours).scaled(gpus)
    end = hours * 3600.0
    counts = [tr.count_at(k * step_s) for k in range(int(end // step_s) + 1)]
    ema, proc = Horizon(alpha=0.5, first="elapsed"), PoolProcess()
    losses = [k for k in range(1, len(counts)) if counts[k] < counts[k - 1]]
    rows = []
    for k, n in enumerate(counts):
        pool = frozenset(range(n))
        proc.observe(pool, k * step_s)
        if k == 0 or n == counts[k - 1]:
            continue
        h_ema = ema.crossing(k)
        if n > counts[k - 1]:
            nxt = next((j for j in losses if j > k), None)
            real = (nxt - k) if nxt is not None else len(counts) - 1 - k
            rows.append((h_ema, proc.horizon_steps(step_s), real, nxt is None))
    return {"trace": name, "growths": len(rows), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--step", type=float, default=60.0, help="seconds per RL step")
    a = ap.parse_args(argv)
    print(f"{'trace':16s} growths  median H_ema  median H_process  median realised  "
          "log2 err ema  log2 err process  (censored)")
    all_e, all_p = [], []
    for name in SHIPPED_TRACES:
        r = replay(name, a.hours, a.gpus, a.step)
        rows = r["rows"]
        done = [x for x in rows if not x[3]]
        le = [math.log2(max(x[0], 1e-9) / max(x[2], 1)) for x in done]
        lp = [math.log2(max(x[1], 1e-9) / max(x[2], 1)) for x in done]
        all_e += le
        all_p += lp
        print(f"{name:16s} {len(rows):7d}  {_median([x[0] for x in rows]):12.1f}  {_median([x[1] for x in rows]):16.1f}  "
              f"{_median([x[2] for x in rows]):15.1f}  {_median(le):12.2f}  {_median(lp):16.2f}  "
              f"({len(rows) - len(done)})")
    print(f"{'all':16s} {'':7s}  {'':12s}  {'':16s}  {'':15s}  {_median(all_e):12.2f}  {_median(all_p):16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
