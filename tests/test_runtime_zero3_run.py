"""ZeRO-3 in the RL driver on Ray: a colocated PPO step with ZeRO-3 trainers and ZeRO-3 inference
passes (actor log-probs, critic values, reference, reward; the weight syncs into ZeRO-3 copies)
equals the plain disjoint step (fp32 reduction tolerance), under a capacity one plain trainer's state
exceeds; re-layouts through the driver, ZeRO-3 -> ZeRO-1 on other workers and back, bit for bit. ``nereus run --zero 3`` end
to end: the small model on 2 workers of 0.05 GiB each (enforced) fits only with ZeRO-3 (colocated
ZeRO-1 is refused before Ray starts); it runs with every worker's accounted peak within the capacity
and within 10% of the cost model's, and the ZeRO reduce-scatter and all-gather bytes per step equal
the formulas (``run/memreport.py``, ``worker/zero3.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.workflow import workflow_for  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=2, reward_model=True)


def _plans() -> tuple[Plan, Plan]:
    """(plain disjoint, colocated ZeRO-3): every model-stage at dp 2; disjoint spreads them over
    workers 0-3, colocated puts all on workers 0-1 with trainers and infer passes at ZeRO-3."""
    dis, col = [], []
    for i, ms in enumerate(workflow_for(W).model_stages):
        mb = 1 if ms.stage == "train" else 2
        c = Candidate(ms.name, 1, 1, 2, micro_batch=mb, gpus=((0, 1), (2, 3))[i % 2])
        dis.append(c)
        z = 3 if ms.stage in ("train", "infer") else 0
        col.append(Candidate(ms.name, 1, 1, 2, micro_batch=mb, gpus=(0, 1), zero=z,
                             offload="host" if ms.stage == "train" else "drop",
                             recompute="full" if ms.stage == "train" else "none"))
    return Plan(candidates=tuple(dis)), Plan(candidates=tuple(col))


def _states(d) -> dict:
    return {ms: d.gather_logical_state(ms) for ms in d.layouts}


@pytest.mark.slow
def test_zero3_colocated_step_equals_plain_disjoint_and_relayouts(pool):
    from dataclasses import replace

    from nereus.runtime.run.relayout import relayout

    dis, col = _plans()
    cfg = RLConfig(actor_lr=1e-2, critic_lr=1e-2, kl_coef=0.05, timeout_s=30)
    d = RLDriver(SPEC, W, dis, TASK, 4, cfg).start(pool)
    try:
        m_d, s_d = d.step(), _states(d)
    finally:
        d.close()
    cap = 1_800_000  # bytes: one plain (ZeRO-0) tiny trainer alone holds 12 B x 156k parameters = 1.87 MB
    d = RLDriver(SPEC, W, col, TASK, 4, replace(cfg, device_capacity=cap)).start(pool)
    try:
        d.reset_measurements()  # the pool's workers ran the disjoint plan before
        m_c, s_c = d.step(), _states(d)
        meas = d.measurements()
        for k in ("reward", "score", "response_len"):
            assert m_c[k] == m_d[k], k
        for k in ("kl", "actor_loss", "critic_loss"):
            assert m_c[k] == pytest.approx(m_d[k], rel=1e-5, abs=1e-6), k
        for ms in s_d:
            for kind in ("params", "exp_avg", "exp_avg_sq"):
                for n, t in s_d[ms].get(kind, {}).items():
                    assert float((s_c[ms][kind][n] - t).abs().max()) <= 2e-5 * max(1.0, float(t.abs().max())), \
                        (ms, kind, n)
        for pw in meas["per_worker"]:
            assert pw["peak_bytes"] <= cap and (pw["peak_bytes"] > 0) == (pw["worker"] in (0, 1)), pw["worker"]
        assert meas["op_bytes"]["allgather@gloo"] > 0 and meas["op_bytes"]["reducescatter@gloo"] > 0
        # re-layout through the driver: ZeRO-3 actor -> ZeRO-1 on workers 2-3 (plain DP would not fit), and back
        for target in (Plan(candidates=tuple(replace(c, zero=1, gpus=(2, 3)) if c.model_stage == "actor.train"
                                             else c for c in col.candidates)), col):
            before = d.gather_logical_state("actor.train")
            relayout(d, target)
            after = d.gather_logical_state("actor.train")
            for kind in ("params", "exp_avg", "exp_avg_sq"):
                for n, t in before[kind].items():
                    assert torch.equal(after[kind][n], t), (kind, n)
            assert after["update_count"] == before["update_count"]
        assert torch.isfinite(torch.tensor(d.step()["actor_loss"]))
    finally:
        d.close()

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
    # offload per step: the trainers out and back, the frozen reference reloaded, and the ZeRO-3 trainers'
    # dropped derived copies written at the sync and offloaded (memreport.move_rows)
    got, want = meas["moves_vs_predicted"]["offload"]
    assert want > 0 and got == pytest.approx(want, rel=1e-6)
