"""The controller API for external trainers: the example script on the shipped step log, decisions as data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus.controller.api import NereusController, read_step_log
from nereus.spec.job import JobSpec

ROOT = Path(__file__).resolve().parents[1]


def test_example_replays_the_recorded_log():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "controller_api_replay.py"), "--json"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    ds = [json.loads(x) for x in r.stdout.splitlines()]
    assert [d["step"] for d in ds] == list(range(12))
    kinds = [d["kind"] for d in ds]
    # responses grow 2048 -> 3300 at step 4: the plan no longer fits (urgent transition); GPUs 12-15 leave
    # after step 8 with the only copy of critic.train on GPUs 8-15: restart
    assert kinds[:4] == ["keep"] * 4 and kinds[4] == "transition" and kinds[8] == "restart"
    tr = ds[4]["transition"]
    assert tr["feasible"] and tr["dag"]["nodes"] and {n["kind"] for n in tr["dag"]["nodes"]} <= {
        "split", "merge", "extend", "destroy", "load", "offload", "restore"}
    assert ds[4]["plan"]["candidates"]


def test_bad_records_are_named(tmp_path):
    ctl = NereusController.for_job(JobSpec.from_file(ROOT / "examples" / "data" / "job.json"))
    with pytest.raises(ValueError, match="missing field 'pool'"):
        ctl.observe_record({"step": 0, "response_len": 100, "step_time": 1.0})
    with pytest.raises(ValueError, match="unknown field"):
        ctl.observe_record({"step": 0, "response_len": 100, "step_time": 1.0, "pool": [0], "gpu_util": 1})
    p = tmp_path / "log.jsonl"
    p.write_text('{"step": 0}\n[1]\n')
    with pytest.raises(ValueError, match="line 2"):
        read_step_log(p)
