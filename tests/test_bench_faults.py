"""The fault benchmark's quick sample (``benchmarks/bench_faults.py --quick``), in-process: about six
workers killed or hung (SIGSTOP) in a step, a transition and a checkpoint save of a PPO run on Ray
CPU workers; every fault is survived, no run hangs, and the run ends at the weights of a fault-free
run with the same samples wherever no step was lost."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_faults.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_faults", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_fault_sample_survives_every_fault_and_ends_at_the_fault_free_weights():
    pytest.importorskip("ray")
    out = _bench().run_benchmark(quick=True, seed=0)
    s = out["summary"]
    assert s["runs_hung"] == 0 and s["reference_runs_hung"] == 0, s
    assert s["runs_failed"] == 0, [r["error"] for r in out["runs"]]
    assert s["faults_injected"] >= 4, s
    assert s["faults_survived"] == s["faults_injected"], s
    assert s["steps_lost_full_copy_max"] == 0 and s["steps_lost_bound_violations"] == 0, s
    assert s["detect_s_max"] < 15, s  # heartbeats, well before any communicator timeout
    for r in out["runs"]:
        assert r["completed"]
        if all(ev["steps_lost"] == 0 for ev in r["recoveries"]):
            assert r["weights_equal"], (r["max_abs_diff"], r["log"][-20:])
