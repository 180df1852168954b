"""Colocated model-stages on Ray: the model-stages of each stage taking turns on the same workers, idle
state offloaded to the host pool (trained) or dropped (frozen and derived copies), actor ZeRO-1, under
a per-worker device capacity that the job fits only that way; each PPO, GRPO and ReMax step equals the
disjoint-placement step on the same samples, and the accounted device bytes never exceed the capacity.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.worker.failures import WorkerFailure  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.workflow import workflow_for  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
#: bytes each worker may account: a trained tiny model's state (12 B/element fp32) with its
#: activations fits, all seven model-stages of worker 0 resident at once do not
CAPACITY = 4_000_000


def workload(algo: str, reward_model: bool) -> WorkloadSpec:
    return WorkloadSpec(algorithm=algo, prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                        mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=reward_model)


def plans(w: WorkloadSpec) -> tuple[Plan, Plan]:
    """(disjoint, colocated): the same degrees; disjoint gives each inference model-stage its own worker
    and the critic its own two, colocated puts every inference model-stage on worker 0 and both trainers
    on workers 0-1, with offload and actor ZeRO-1."""
    dis, col = [], []
    infer = 0
    for ms in workflow_for(w).model_stages:
        if ms.stage == "generate":
            c = Candidate(ms.name, 1, 1, 2, gpus=(0, 1))
            dis.append(c)
            col.append(replace(c, offload="drop"))
        elif ms.stage == "train":
            c = Candidate(ms.name, 1, 1, 2, micro_batch=1, gpus=(0, 1) if ms.model == "actor" else (2, 3))
            dis.append(c)
            col.append(replace(c, gpus=(0, 1), offload="host", zero=1 if ms.model == "actor" else 0))
        else:
            c = Candidate(ms.name, 1, 1, 1, micro_batch=4, gpus=(infer,))
            infer += 1
            dis.append(c)
            col.append(replace(c, gpus=(0,), offload="drop"))
    return Plan(candidates=tuple(dis)), Plan(candidates=tuple(col))


def _run(pool, w, plan, capacity=0):
    d = RLDriver(SPEC, w, plan, TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, kl_coef=0.05, timeout_s=30,
                                                   device_capacity=capacity)).start(pool)
    try:
        d.reset_measurements()
        m = d.step()
        meas = d.measurements()
        states = {ms: d.gather_logical_state(ms) for ms in d.layouts if ms.endswith(".train")}
        states["actor.generate"] = d.gather_logical_state("actor.generate")
        return m, states, meas
    finally:
        d.close()


@pytest.mark.slow
@pytest.mark.parametrize("algo,reward_model", [("ppo", True), ("grpo", False), ("remax", True)])
def test_colocated_step_equals_disjoint(pool, algo, reward_model):
    w = workload(algo, reward_model)
    dis, col = plans(w)
    m_d, s_d, _ = _run(pool, w, dis)
    m_c, s_c, meas = _run(pool, w, col, CAPACITY)
    for k in ("reward", "score", "response_len", "kl", "actor_loss") + (("critic_loss",) if algo == "ppo" else ()):
        assert m_c[k] == m_d[k], (k, m_c[k], m_d[k])
    for ms in s_d:
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            for n, t in s_d[ms].get(kind, {}).items():
                assert torch.equal(s_c[ms][kind][n], t), (ms, kind, n)
        for k in ("step", "update_count", "version", "position"):
            assert s_c[ms][k] == s_d[ms][k]
    # the generation copies hold the trained weights after the sync in both placements
    for n, t in s_d["actor.train"]["params"].items():
        assert torch.equal(s_c["actor.generate"]["params"][n], t)
    # every worker's accounted device bytes stayed within its capacity, and state really moved
    for pw in meas["per_worker"]:
        assert pw["peak_bytes"] <= CAPACITY, pw["worker"]
        assert pw["memory"]["capacity"] in (CAPACITY, None)
    assert meas["memory"]["offload_bytes"] > 0 and meas["memory"]["restore_bytes"] > 0
    assert meas["memory"]["offload_s"] > 0 and meas["memory"]["restore_s"] > 0


@pytest.mark.slow
def test_colocated_job_needs_offload_under_capacity(pool):
    w = workload("ppo", True)
    _, col = plans(w)
    resident = Plan(candidates=tuple(replace(c, offload="none") for c in col.candidates))
    d = RLDriver(SPEC, w, resident, TASK, 4, RLConfig(timeout_s=30, device_capacity=CAPACITY))
    with pytest.raises(WorkerFailure, match="capacity"):
        d.start(pool)
    d.close()


def _relaid(plan: Plan, **changes) -> Plan:
    """``plan`` with candidates replaced: ``changes[model_stage] = {field: value}``."""
    return Plan(candidates=tuple(replace(c, **changes.get(c.model_stage, {})) for c in plan.candidates))


def _assert_same_state(a: dict, b: dict) -> None:
    for ms in a:
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            for n, t in a[ms][kind].items():
                assert torch.equal(b[ms][kind][n], t), (ms, kind, n)
        for k in ("step", "update_count", "version", "policy_version", "position"):
            assert a[ms][k] == b[ms][k], (ms, k)


@pytest.mark.slow
def test_relayout_of_sharded_offloaded_colocated_state(pool):
    """Re-layouts between steps (``run/relayout.py``, through the driver) of the new state: ZeRO DP 2->4,
    colocated -> disjoint, offloaded state restored onto new workers, ZeRO DP 4->2, ZeRO-1 -> plain DP
    and back to colocated; the gathered state equals the state before each, bit for bit, and training
    goes on."""
    import ray

    from nereus.runtime.run.relayout import relayout

    w = workload("ppo", True)
    _, col = plans(w)
    d = RLDriver(SPEC, w, col, TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30,
                                                 device_capacity=CAPACITY)).start(pool)
    train = ("actor.train", "critic.train")
    try:
        d.step()
        # the critic's sync ran last: the actor's trained state waits in worker 0's host pool
        assert ray.get(d.workers[0].measurements.remote())["memory"]["host_bytes"] > 0
        targets = [
            # ZeRO DP 2 -> 4, critic colocated -> disjoint (workers 2-3), actor restored onto new workers
            _relaid(col, **{"actor.train": {"dp": 4, "gpus": (0, 1, 2, 3)}, "critic.train": {"gpus": (2, 3)}}),
            # ZeRO DP 4 -> 2 on workers 2-3 (the actor's state leaves workers 0-1)
            _relaid(col, **{"actor.train": {"gpus": (2, 3)}, "critic.train": {"gpus": (2, 3)}}),
            # ZeRO-1 -> plain DP, back to the colocated placement on workers 0-1
            _relaid(col, **{"actor.train": {"zero": 0}}),
        ]
        for target in targets:
            before = {ms: d.gather_logical_state(ms) for ms in train}
            relayout(d, target)
            after = {ms: d.gather_logical_state(ms) for ms in train}
            _assert_same_state(before, after)
            m = d.step()
            assert all(torch.isfinite(torch.tensor(m[k])) for k in ("actor_loss", "critic_loss", "reward"))
        assert d.gather_logical_state("actor.train")["update_count"] == 8
    finally:
        d.close()


@pytest.mark.slow
def test_nereus_run_accepts_a_job_that_fits_only_colocated(tmp_path):
    """``nereus run`` with the small model on 2 workers of 0.1 GiB each (enforced): the disjoint
    layout is refused before Ray starts; colocated with offload and ZeRO-1 it runs, every worker's
    peak within its capacity and within 10% of the cost model's, the ZeRO reduce-scatter bytes the
    payload formula gives."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "nereus.cli", "run", "--model", "small", "--workers", "2", "--steps", "2",
            "--enforce-memory", "--memory-gib", "0.1", "--layout", "actor.train=1,1,2",
            "--layout", "critic.train=1,1,2"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "does not fit" in refused.stderr
    out = tmp_path / "run.json"
    proc = subprocess.run(base + ["--colocate", "--zero", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reward=") == 2 and "z1 off:host" in proc.stdout
    meas = json.loads(out.read_text())["measurements"]
    cap = int(0.1 * 2**30)
    for row in meas["workers_vs_predicted"]:
        assert row["measured"] <= cap
        assert abs(row["ratio"] - 1) <= 0.10, row
    rs_meas, rs_pred = meas["moves_vs_predicted"]["reduce_scatter"]
    assert rs_pred > 0 and rs_meas == pytest.approx(rs_pred, rel=1e-9)
    assert meas["memory"]["offload_bytes"] > 0
    off_meas, off_pred = meas["moves_vs_predicted"]["offload"]
    assert off_pred > 0 and off_meas == pytest.approx(off_pred, rel=1e-6)


@pytest.mark.slow
def test_nereus_run_async_colocated_zero(tmp_path):
    """``nereus run --async`` with the trainers and inference colocated on workers 0-1 (offload, ZeRO-1)
    and generation on worker 2 of its own, under an enforced 0.01 GiB per worker."""
    import json
    import math
    import subprocess
    import sys

    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "nereus.cli", "run", "--async", "--workers", "3", "--steps", "3",
                           "--colocate", "--zero", "1", "--layout", "actor.train=1,1,2", "--layout",
                           "critic.train=1,1,2", "--enforce-memory", "--memory-gib", "0.01", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actor.train      tp1 pp1 dp2 z1 off:host on workers 0-1" in proc.stdout
    assert "actor.generate   tp1 pp1 dp1 on workers 2" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 3 and all(math.isfinite(s["actor_loss"]) for s in data["steps"])
    assert data["steps"][-1]["train_version"] == 2
