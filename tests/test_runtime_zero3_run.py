"""``nereus run --zero 3`` end to end on Ray: the small model on 2 workers of 0.05 GiB each (enforced)
fits only with ZeRO-3 (colocated ZeRO-1 is refused before Ray starts); it runs with every worker's
accounted peak within the capacity and within 10% of the cost model's, and the ZeRO reduce-scatter
and all-gather bytes per step equal the formulas (``run/memreport.py``, ``worker/zero3.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BASE = [sys.executable, "-m", "nereus.cli", "run", "--model", "small", "--workers", "2", "--steps", "2",
        "--enforce-memory", "--memory-gib", "0.05", "--layout", "actor.train=1,1,2",
        "--layout", "critic.train=1,1,2", "--colocate"]


@pytest.mark.slow
def test_nereus_run_accepts_a_job_that_fits_only_with_zero3(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    refused = subprocess.run(BASE + ["--zero", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "does not fit" in refused.stderr
    out = tmp_path / "run.json"
    proc = subprocess.run(BASE + ["--zero", "3", "--json", str(out)], capture_output=True, text=True,
                          timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reward=") == 2 and "dp2 z3 off:host" in proc.stdout
    meas = json.loads(out.read_text())["measurements"]
    cap = int(0.05 * 2**30)
    for row in meas["workers_vs_predicted"]:
        assert row["measured"] <= cap
        assert abs(row["ratio"] - 1) <= 0.10, row
    for key in ("reduce_scatter", "all_gather"):
        got, want = meas["moves_vs_predicted"][key]
        assert want > 0 and got == pytest.approx(want, rel=1e-9), key
