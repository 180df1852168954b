"""vLLM's memory beside co-located model-stages by vLLM version (nereus/cost/vllm_startup.py), and
the plan check's headroom on the predicted bytes only: hand-computed."""

from dataclasses import replace

import pytest

from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.cost.vllm_startup import engine_bytes_for, gpu_excess, startup_bytes, startup_shortfall
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan, StageEstimate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

G = 2**30
H100 = get_gpu("h100")
OWN = {"weights": 3 * G, "activations": 1 * G, "logits": 0.0}  # the engine's own terms: 4 GiB


def test_startup_bytes_by_hand():
    # a training model-stage before its first step: weights + the fp32 master copy (12 B Adam / 3 = 4 B)
    assert startup_bytes("train", {"weights": 3 * G, "optimizer": 18 * G}, resident=21 * G) == 9 * G
    assert startup_bytes("infer", {"weights": 3 * G, "activations": 5 * G}, resident=3 * G) == 3 * G
    assert startup_bytes("train", {"weights": 3 * G, "optimizer": 18 * G}, resident=0.0) == 0.0  # offloaded


def test_engine_bytes_per_rule_by_hand():
    m, ws, f = 80 * G, 1.5 * G, 0.4
    # vLLM >= 0.9.1: f·M = 32 GiB whatever else is there; 80 - 1.5 - 20 = 58.5 GiB free at start >= 32
    e, kv = engine_bytes_for("startup_check", f, m, ws, 20 * G, OWN)
    assert (e, kv) == (pytest.approx(30.5 * G), pytest.approx(26.5 * G))
    assert engine_bytes_for(None, f, m, ws, 20 * G, OWN) == (e, kv)  # None is startup_check
    # 50 GiB beside it: 28.5 GiB free < 32: refused at start, 3.5 GiB short, marked above the device
    assert startup_shortfall(f, m, ws, 50 * G) == pytest.approx(3.5 * G)
    e, _ = engine_bytes_for("startup_check", f, m, ws, 50 * G, OWN)
    assert e == pytest.approx(80 * G + 3.5 * G)
    # vLLM 0.8: fills the device to f·M counting the 20 GiB already there: 32 - 1.5 - 20 = 10.5
    e, kv = engine_bytes_for("device_total", f, m, ws, 20 * G, OWN)
    assert (e, kv) == (pytest.approx(10.5 * G), pytest.approx(6.5 * G))
    # verl's vLLM <= 0.6.3: KV = 0.4 · (80 - 1.5 - 20 - 4) = 21.8 GiB, plus its own 4 GiB
    e, kv = engine_bytes_for("free_share", f, m, ws, 20 * G, OWN)
    assert (e, kv) == (pytest.approx(25.8 * G), pytest.approx(21.8 * G))
    with pytest.raises(ValueError, match="vllm_memory_rule"):
        engine_bytes_for("v0", f, m, ws, 0.0, OWN)
    with pytest.raises(ValueError, match="vllm_memory_rule"):
        WorkloadSpec(vllm_memory_rule="v0")


def _plan(engine_resident: bool):
    gpus = (0, 1)
    c = [Candidate("actor.generate", 1, 1, 2, gpus=gpus), Candidate("actor.train", 1, 1, 2, 1, 1, gpus=gpus),
         Candidate("critic.train", 1, 1, 2, 1, 1, gpus=gpus)]
    e = 30 * G
    ests = {"actor.generate": StageEstimate(1.0, resident=e if engine_resident else 0.0,
                                            transient=0.0 if engine_resident else e),
            "actor.train": StageEstimate(1.0, resident=20 * G, transient=15 * G),
            "critic.train": StageEstimate(1.0, resident=20 * G, transient=25 * G)}
    return Plan(candidates=tuple(c), estimates=ests)


def test_headroom_on_predicted_bytes_only_by_hand():
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(H100, 1, 2), WorkloadSpec(rollout_memory_fraction=0.4),
                  framework=get_framework("fsdp"))
    m, ws = H100.memory_bytes, WORKSPACE_BYTES
    # engine sleeps: training phase 1.5 + 40 + 25 = 66.5 GiB of 0.9·M; generation 1.5 + 40 of 0.9·(M - 30 GiB)
    ex = gpu_excess(job, _plan(False), 0.1, ws)
    want = max(ws + 40 * G + 25 * G - 0.9 * m, ws + 40 * G - 0.9 * (m - 30 * G))
    assert ex == {0: pytest.approx(want), 1: pytest.approx(want)}
    assert want == pytest.approx(ws + 40 * G - 0.9 * (m - 30 * G))  # the generation phase is the tighter one here
    # engine kept resident: the training phase runs in what vLLM leaves: 66.5 GiB against 0.9·(M - 30 GiB)
    ex = gpu_excess(job, _plan(True), 0.1, ws)
    assert ex[0] == pytest.approx(ws + 40 * G + 25 * G - 0.9 * (m - 30 * G))
    # without a pre-allocated engine it is the usual check: workspace + Σ resident + max transient vs 0.9·M
    plain = JobSpec(job.models, job.cluster, WorkloadSpec(), framework=job.framework)
    ex = gpu_excess(plain, _plan(False), 0.1, ws)
    assert ex[0] == pytest.approx(ws + 40 * G + 30 * G - 0.9 * m)


def test_free_share_engine_in_a_plan_by_hand():
    # a TinyZero-like PPO layout (verl's hybrid engine) on 2 A100-80GB under verl 0.1: the engine's KV is 0.4 of what the
    # training engines' start-up state (weights + fp32 master) and its own terms leave
    model = get_model("qwen2.5-0.5b")
    wl = WorkloadSpec(prompts_per_step=64, samples_per_prompt=2, prompt_len=256, response_len=1024, mini_batch_size=64,
                      reference_model=False, reward_model=False, rollout_memory_fraction=0.4,
                      vllm_memory_rule="free_share")
    a100 = get_gpu("a100")
    job = JobSpec(model, ClusterSpec(a100, 1, 2), wl, framework=replace(get_framework("fsdp"), shared_engine=True))
    assert job.framework.shared_engine
    g = (0, 1)
    cands = (Candidate("actor.generate", 1, 1, 2, concurrency=64, offload="drop", gpus=g),
             Candidate("actor.infer", 1, 1, 2, 8, gpus=g), Candidate("critic.infer", 1, 1, 2, 8, gpus=g),
             Candidate("actor.train", 1, 1, 2, 4, 8, zero=3, gpus=g), Candidate("critic.train", 1, 1, 2, 4, 8, zero=3, gpus=g))
    cost = CostModel(job)
    plan = cost.estimate(Plan(candidates=cands))
    est = plan.estimates
    s = 0.0
    for name in ("actor.train", "critic.train"):  # the inference passes are their engines' (counted once)
        s += est[name].memory["weights"] + est[name].memory["optimizer"] / 3
    gen = est["actor.generate"].memory
    own = gen["weights"] + gen["activations"] + gen["logits"]
    kv = 0.4 * (a100.memory_bytes - WORKSPACE_BYTES - s - own)
    assert gen["kv_cache"] == pytest.approx(kv)
    assert est["actor.generate"].transient == pytest.approx(own + kv) and est["actor.generate"].resident == 0


def test_apply_rule_refuses_a_cache_below_one_sequence_by_hand():
    from nereus.cost.vllm_startup import apply_vllm_rule

    # vLLM 0.8 beside 30 GiB of start-up state (20 GiB weights + 30/3 GiB fp32 master): 0.4·M - 1.5 - 30 GiB
    # leaves 0.36 GiB, less than the engine's own 4 GiB: no KV blocks; one 2,048-token sequence needs
    # 2048 x 131,072 B (Llama-3.1-8B at TP 1) = 256 MiB, so vLLM does not start: M + the shortfall
    wl = WorkloadSpec(prompt_len=1024, response_len=1024, rollout_memory_fraction=0.4, vllm_memory_rule="device_total")
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(H100, 1, 1), wl, framework=get_framework("fsdp"))
    g = (0,)
    cands = (Candidate("actor.generate", 1, 1, 1, gpus=g), Candidate("actor.train", 1, 1, 1, 1, 1, gpus=g))
    ests = {"actor.generate": StageEstimate(1.0, memory=dict(OWN), resident=0.0, transient=25 * G),
            "actor.train": StageEstimate(1.0, memory={"weights": 20 * G, "optimizer": 30 * G}, resident=50 * G)}
    out = apply_vllm_rule(job, cands, ests, WORKSPACE_BYTES)
    kv = 0.4 * H100.memory_bytes - WORKSPACE_BYTES - 30 * G - 4 * G
    assert kv < 0
    assert out["actor.generate"].transient == pytest.approx(H100.memory_bytes + 2048 * 131_072 - kv)
    assert out["actor.generate"].memory["kv_cache"] == 0.0 and out["actor.generate"].resident == 0.0
    # with 10 GiB less beside it the same engine starts: E = 0.4·M - 1.5 - 20 GiB, its KV the rest after 4 GiB
    ests["actor.train"] = StageEstimate(1.0, memory={"weights": 10 * G, "optimizer": 30 * G}, resident=40 * G)
    e = apply_vllm_rule(job, cands, ests, WORKSPACE_BYTES)["actor.generate"]
    assert e.transient == pytest.approx(0.4 * H100.memory_bytes - WORKSPACE_BYTES - 20 * G)
