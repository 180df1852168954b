"""End-to-end RL on Ray: PPO, GRPO and ReMax steps with a different layout per model-stage, errors.

One local Ray cluster and one pool of 4 CPU workers serve every Ray test of this module (starting
workers costs seconds); the failing-worker test runs last because it kills a worker.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask, Tokenizer  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.runtime.worker.failures import WorkerFailure  # noqa: E402
from nereus.spec.model import ModelSpec  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
LAYOUTS = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
           "critic.infer": (1, 1, 1), "reward.infer": (1, 1, 1), "actor.train": (2, 1, 2),
           "critic.train": (1, 2, 2)}


def workload(algo: str, **kw) -> WorkloadSpec:
    base = dict(algorithm=algo, prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
    base.update(kw)
    return WorkloadSpec(**base)



def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.mark.slow
@pytest.mark.parametrize("algo,reward_model", [("ppo", True), ("grpo", False), ("remax", True)])
def test_rl_steps_end_to_end(pool, algo, reward_model):
    w = workload(algo, reward_model=reward_model)
    plan = simple_plan(w, LAYOUTS, 4, micro_batch=1)
    if algo == "ppo":  # the candidate's recompute choice reaches the training engines
        plan = Plan(candidates=tuple(replace(c, recompute="full") if c.model_stage == "actor.train" else c
                                     for c in plan.candidates))
    d = RLDriver(SPEC, w, plan, TASK, 4,
                 RLConfig(actor_lr=1e-2, critic_lr=1e-2, kl_coef=0.05, timeout_s=30)).start(pool)
    try:
        before = d.gather_logical_state("actor.train")
        d.reset_measurements()
        steps = [d.step() for _ in range(2)]
        for m in steps:
            for k in ("reward", "score", "actor_loss", "kl", "seconds"):
                assert _finite(m[k]), (algo, k, m)
            assert 0.0 <= m["reward"] <= 1.0
            if algo == "ppo":
                assert _finite(m["critic_loss"])
        after = d.gather_logical_state("actor.train")
        # mini-batch 4 of a global batch 8: two updates per step
        assert after["update_count"] == 4 and after["step"] == 4 and after["position"] == 4
        moved = max(float((after["params"][n] - before["params"][n]).abs().max()) for n in before["params"])
        assert moved > 1e-4
        for n, t in after["params"].items():
            assert torch.isfinite(t).all(), n
        # the per-step weight sync left the generation layout with the training weights
        gen = d.gather_logical_state("actor.generate")
        assert gen["policy_version"] == 4
        for n, t in after["params"].items():
            assert torch.equal(gen["params"][n], t), n
        if algo == "ppo":
            crit = d.gather_logical_state("critic.train")
            assert crit["update_count"] == 4
        meas = d.measurements()
        for ms in d.layouts:
            assert meas["stage_seconds"][ms] > 0, ms
        for k in ("gemm", "attention", "allreduce@gloo", "p2p@gloo", "broadcast@gloo"):
            assert meas["op_seconds"][k] > 0, k
        assert meas["peak_bytes"] > 0 and meas["bytes_sent"] > 0
        assert meas["op_seconds_by_stage"]["actor.train"]["allreduce@gloo"] > 0
        assert meas["op_seconds_by_stage"]["actor.generate"]["gemm"] > 0
        assert set(meas["peak_bytes_by_stage"]) >= set(d.layouts)
        rep = d.step_report(steps[-1])
        assert rep.step == 1 and rep.op_seconds["actor.train"]["gemm"] > 0 and rep.pool == frozenset(range(4))
    finally:
        d.close()


@pytest.mark.slow
def test_no_reference_model_runs_no_reference_pass(pool):
    """WorkloadSpec.reference_model false (`nereus run --no-reference`): the workflow has no
    reference.infer, the driver submits no reference log-probs and reports no KL; a KL coefficient
    without a reference is refused at construction."""
    w = workload("grpo", reference_model=False)
    lay = {k: v for k, v in LAYOUTS.items() if k not in ("reference.infer", "critic.infer", "critic.train")}
    plan = simple_plan(w, lay, 4, micro_batch=1)
    assert "reference.infer" not in {c.model_stage for c in plan.candidates}
    with pytest.raises(ValueError, match="kl_coef.*needs a reference model"):
        RLDriver(SPEC, w, plan, TASK, 4, RLConfig(kl_coef=0.05))
    d = RLDriver(SPEC, w, plan, TASK, 4, RLConfig(actor_lr=1e-2, timeout_s=30)).start(pool)
    try:
        d.reset_measurements()
        m = d.step()
        assert _finite(m["reward"]) and _finite(m["actor_loss"]) and "kl" not in m
        meas = d.measurements()
        assert "reference.infer" not in meas["stage_seconds"] and meas["stage_seconds"]["actor.infer"] > 0
    finally:
        d.close()


def test_impossible_layouts_and_configs_raise():
    w = workload("ppo")
    base = {**LAYOUTS}
    with pytest.raises(ValueError, match="needs 8 workers, only 4"):
        simple_plan(w, {**base, "actor.train": (8, 1, 1)}, 4)
    bad = simple_plan(w, base, 4)
    cands = tuple(Candidate(c.model_stage, 3, 1, 1) if c.model_stage == "actor.train" else c
                  for c in bad.candidates)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        RLDriver(SPEC, w, Plan(candidates=cands), TASK, 4)
    cands = tuple(Candidate(c.model_stage, 8, 1, 1) if c.model_stage == "actor.train" else c
                  for c in bad.candidates)
    with pytest.raises(ValueError, match="only 4 workers"):
        RLDriver(SPEC, w, Plan(candidates=cands), TASK, 4)
    cands = tuple(Candidate(c.model_stage, 1, 1, 2, micro_batch=1, grad_accum=3, gpus=(0, 1))
                  if c.model_stage == "actor.train" else c for c in bad.candidates)
    with pytest.raises(ValueError, match="mini_batch_size=4"):
        RLDriver(SPEC, w, Plan(candidates=cands), TASK, 4)
    with pytest.raises(ValueError, match="lacks model-stage 'critic.train'"):
        RLDriver(SPEC, w, Plan(candidates=tuple(c for c in bad.candidates if c.model_stage != "critic.train")),
                 TASK, 4)
    for field, value in (("offload", "cpu_adam"), ("vpp", 2)):  # what it cannot run is refused, named (ZeRO 0-3 runs)
        cands = tuple(replace(c, **{field: value}) if c.model_stage == "critic.train" else c for c in bad.candidates)
        with pytest.raises(ValueError, match=f"critic.train: {field}={value!r} is not executed by the Nereus runtime"):
            RLDriver(SPEC, w, Plan(candidates=cands), TASK, 4)
    cands = tuple(replace(c, zero=1) if c.model_stage == "critic.train" else c for c in bad.candidates)
    RLDriver(SPEC, w, Plan(candidates=cands), TASK, 4)  # ZeRO-1 training is run
    with pytest.raises(ValueError, match="rl field 'device_capacity'"):
        RLConfig(device_capacity=-1)
    small = ModelSpec(name="small-vocab", hidden_size=64, intermediate_size=128, num_layers=2,
                      num_attention_heads=4, num_kv_heads=2, head_dim=16, vocab_size=8)
    with pytest.raises(ValueError, match="vocab_size=8 is smaller"):
        RLDriver(small, w, bad, TASK, 4)
    with pytest.raises(ValueError, match="pp=5"):
        RLDriver(SPEC, w, simple_plan(w, {**base, "reference.infer": (1, 5, 1)}, 8), TASK, 8)
    with pytest.raises(ValueError, match="temperature"):
        RLConfig(temperature=0.0)


def test_task_data_and_reward():
    tok = Tokenizer()
    assert tok.decode(tok.encode("12+3=")) == "12+3="
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("1a")
    t = DigitTask("reverse", 3, seed=5)
    # data depends on the global index only: any split across DP replicas sees the same samples
    a, ia = t.prompts(0, 8)
    b1, i1 = t.prompts(0, 4)
    b2, i2 = t.prompts(4, 4)
    assert torch.equal(a, torch.cat([b1, b2])) and ia == i1 + i2
    assert a.shape == (8, t.prompt_len)
    target = tok.encode(t.target_text(3)) + [tok.eos_id]
    assert t.reward(3, target) == 1.0
    assert t.reward(3, [target[0], 0, 0, 0]) == 0.25
    digits = t.prompt_text(3)[:3]
    assert t.target_text(3) == digits[::-1]
    add = DigitTask("add", 2, seed=1)
    x, y = add.prompt_text(0)[:-1].split("+")
    assert add.target_text(0) == str(int(x) + int(y)).zfill(3)
    with pytest.raises(ValueError, match="kind"):
        DigitTask("sort", 3)


@pytest.mark.slow
def test_worker_joins_running_job(pool):
    """A worker added to the running pool takes part in new groups with no world-wide init."""
    (new,) = pool.add(1)
    assert new == 4
    w = workload("grpo")
    plan = simple_plan(w, {k: (1, 1, 1) for k in LAYOUTS}, 4, micro_batch=1)
    cands = tuple(Candidate("actor.train", 1, 1, 2, micro_batch=1, gpus=(new, 2)) if c.model_stage == "actor.train"
                  else c for c in plan.candidates)
    d = RLDriver(SPEC, w, Plan(candidates=cands), TASK, 5, RLConfig(actor_lr=1e-2, timeout_s=30)).start(pool)
    try:
        m = d.step()
        assert _finite(m["actor_loss"]) and _finite(m["reward"])
        st = d.gather_logical_state("actor.train")
        assert st["update_count"] == 2
        import ray

        inv = ray.get(pool.workers[new].inventory.remote())
        assert inv["cpus"] >= 1 and inv["ray"].get("CPU", 0) >= 5
    finally:
        d.close()


@pytest.mark.slow
def test_reward_rises_on_builtin_task(pool):
    """GRPO on 2-digit reversal from a random init: the mean reward of the last 10 of 40 steps beats
    the first 10 (format and first digits get learned). Deterministic: fixed seeds, fixed layouts."""
    w = workload("grpo", prompts_per_step=8, samples_per_prompt=8, mini_batch_size=32, micro_batch_size=8,
                 infer_micro_batch_size=8)
    task = DigitTask("reverse", 2)
    plan = simple_plan(w, {k: (1, 1, 1) for k in LAYOUTS}, 4, micro_batch=8)
    d = RLDriver(SPEC, w, plan, task, 4, RLConfig(actor_lr=2e-3, timeout_s=30)).start(pool)
    try:
        rewards = [d.step()["reward"] for _ in range(40)]
    finally:
        d.close()
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"GRPO reward, mean of steps 0-9: {first:.3f}, steps 30-39: {last:.3f}")
    assert last > first + 0.03, rewards


def test_cli_rejects_bad_layout_before_starting():
    import argparse

    from nereus.cli import run as cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--workers", "4", "--layout", "actor.train=3,1,1"])
    with pytest.raises(ValueError, match="tp=3"):
        cli.main(args)
    with pytest.raises(ValueError, match="must look like"):
        cli.main(p.parse_args(["--layout", "actor.train=2"]))


@pytest.mark.slow
def test_failing_worker_raises_without_hang(pool):
    w = workload("grpo")
    d = RLDriver(SPEC, w, simple_plan(w, LAYOUTS, 4, micro_batch=1), TASK, 4,
                 RLConfig(timeout_s=30)).start(pool)
    d.step()
    import ray

    ray.kill(pool.workers[1])  # worker 1 holds actor.generate's second replica and actor.train shards
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure):
        d.step()
    assert time.perf_counter() - t0 < 120
    pool.remove(1)
    with pytest.raises(WorkerFailure, match="worker 1 has left the pool"):
        d.step()


@pytest.mark.slow
def test_nereus_run_cli_end_to_end(tmp_path):
    """``nereus run`` in its own process (its own Ray cluster): a few PPO steps on 2 workers."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nereus.cli", "run", "--workers", "2", "--steps", "2",
                           "--prompts", "4", "--samples", "2", "--mini-batch", "8", "--micro-batch", "2",
                           "--layout", "actor.train=1,1,2", "--layout", "actor.generate=2,1,1",
                           "--json", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reward=") == 2
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 2 and all(math.isfinite(s["actor_loss"]) for s in data["steps"])
    assert data["measurements"]["op_seconds"]["gemm"] > 0
