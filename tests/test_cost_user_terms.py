"""Hand-computed tests of the terms users' layouts need (issue 28): ZeRO-3 at DP 1, LoRA, vLLM's
pre-allocated memory fraction, and sequence splitting (Ulysses / context parallelism)."""

import numpy as np
import pytest

from nereus.cost.latency import LinkModel
from nereus.cost.lora import adapter_params_layer, lora_sync_share, trainable_params_rank
from nereus.cost.memory import WORKSPACE_BYTES, stage_memory
from nereus.cost.model import CostModel
from nereus.cost.seqpar import seq_split_comm
from nereus.cost.shapes import layer_params_rank, params_rank
from nereus.cost.vllm_memory import kv_capacity
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

M8 = get_model("llama-3.1-8b")
H100 = get_gpu("h100")


def _job(n=8, fw="fsdp", **wl):
    return JobSpec(M8, ClusterSpec(H100, 1, n), WorkloadSpec(**wl), framework=get_framework(fw))


def test_zero3_at_dp1_counts_the_weights_once():
    wl = WorkloadSpec()
    p = params_rank(M8, 1, 1)
    one = stage_memory("train", M8, wl, 1, 1, dp=1, zero=3)
    assert one["weights"] == p * 2  # nothing sharded, nothing gathered
    four = stage_memory("train", M8, wl, 1, 1, dp=4, zero=3)
    assert four["weights"] == pytest.approx(p * 2 / 4 + 2 * layer_params_rank(M8, 1) * 2)
    assert stage_memory("infer", M8, wl, 1, 1, dp=1, zero=3)["weights"] == p * 2


def test_lora_adapter_parameters_by_hand():
    # Llama-3.1-8B, r = 8, all-linear: 8·(7·4096 + 2·4096 + 2·1024 + 3·14336) = 655,360 per layer
    assert adapter_params_layer(M8, 8, 1) == 655_360
    # TP 2: column layers keep A (r·h) whole and split B; row layers split A: q 8·(4096+2048),
    # k,v 2·8·(4096+512), o 8·(2048+4096), gate,up 2·8·(4096+7168), down 8·(7168+4096)
    assert adapter_params_layer(M8, 8, 2) == 8 * (6144 + 2 * 4608 + 6144 + 2 * 11264 + 11264)
    assert trainable_params_rank(M8, 8, 1, 1) == 32 * 655_360
    assert trainable_params_rank(M8, None, 1, 1) == params_rank(M8, 1, 1)
    assert lora_sync_share(M8, 8) == pytest.approx(32 * 655_360 / M8.num_params)


def test_lora_memory_freezes_the_base():
    wl = WorkloadSpec(lora_rank=8)
    a = 32 * 655_360
    m = stage_memory("train", M8, wl, 1, 1, dp=1, zero=0)
    assert m["optimizer"] == a * 12 and m["gradients"] == a * 4
    assert m["weights"] == params_rank(M8, 1, 1) * 2 + a * 2
    full = stage_memory("train", M8, WorkloadSpec(), 1, 1, dp=1, zero=0)
    assert m["activations"] == full["activations"]
    z = stage_memory("train", M8, wl, 1, 1, dp=8, zero=3)
    assert z["optimizer"] == a * 12 / 8 and z["gradients"] == a * 4 / 8


def test_lora_time_drops_weight_gradients_and_shrinks_sync():
    base, lora = CostModel(_job()), CostModel(_job(lora_rank=8))
    ms = base.workflow.get("actor.train")
    kw = dict(micro_batch=4, zero=3, breakdown=True)
    b, lo = base.candidate_arrays(ms, 1, 1, 8, **kw)["breakdown"], lora.candidate_arrays(ms, 1, 1, 8, **kw)["breakdown"]
    assert lo["gemm"][0] == pytest.approx(b["gemm"][0] * 2 / 3)  # 3 forward-equivalents -> 2
    assert lo["attention"][0] == b["attention"][0]
    # the weight sync moves the adapters only
    g = base.workflow.get("actor.generate")
    sb = base.candidate_arrays(g, 1, 1, 8, concurrency=64, breakdown=True)
    sl = lora.candidate_arrays(g, 1, 1, 8, concurrency=64, breakdown=True)
    k = "broadcast@nvlink"
    assert sl["breakdown"][k][0] < sb["breakdown"][k][0] * 0.01


def test_vllm_preallocation_takes_the_fraction():
    # 0.9 of an H100 (81,559 MiB): E = 0.9·M - 1.5 GiB; the engine holds E whatever it decodes
    f = 0.9
    job = _job(rollout_memory_fraction=f, prompt_len=1024, response_len=1024)
    cost = CostModel(job)
    g = cost.workflow.get("actor.generate")
    e = f * H100.memory_bytes - WORKSPACE_BYTES
    a = cost.candidate_arrays(g, 1, 1, 8, concurrency=8, offload="none")
    assert a["resident"][0] == pytest.approx(e) and a["transient"][0] == 0
    s = cost.candidate_arrays(g, 1, 1, 8, concurrency=8, offload="drop")
    assert s["resident"][0] == 0 and s["transient"][0] == pytest.approx(e)
    # the KV blocks cap the concurrency: budget / (2048 tokens · 131,072 B per token at TP 1)
    m = stage_memory("generate", M8, job.workload, 1, 1, concurrency=1024)
    cap = int((e - m["weights"] - m["activations"] - m["logits"]) // (2048 * 131_072))
    assert kv_capacity(M8, job.workload, 1, 1, 1024, f, H100.memory_bytes, WORKSPACE_BYTES) == cap
    # asking for more than fits runs at the cap (vLLM preempts the rest): the same time as asking for it
    t_big = cost.candidate_arrays(g, 1, 1, 8, concurrency=1024)["time"][0]
    t_cap = cost.candidate_arrays(g, 1, 1, 8, concurrency=cap)["time"][0]
    assert t_big == t_cap
    # a fraction too small to hold the weights never fits
    tiny = CostModel(_job(rollout_memory_fraction=0.1))
    r = tiny.candidate_arrays(g, 1, 1, 8, concurrency=8)["resident"][0]
    assert r > H100.memory_bytes and np.isfinite(r)


def test_vllm_fraction_plan_check_matches_startup():
    # vLLM at 0.9 with every other model-stage offloaded fits a 0.9 capacity exactly: workspace + E = 0.9·M
    job = _job(rollout_memory_fraction=0.9)
    cost = CostModel(job)
    g = cost.workflow.get("actor.generate")
    a = cost.candidate_arrays(g, 1, 1, 8, concurrency=8, offload="drop")
    assert WORKSPACE_BYTES + a["transient"][0] == pytest.approx(cost.capacity)


def test_sequence_split_memory_and_comm_by_hand():
    job = _job(prompt_len=2048, response_len=2048)
    cost = CostModel(job)
    ms = cost.workflow.get("actor.train")
    c2 = Candidate("actor.train", 1, 1, 4, micro_batch=2, grad_accum=job.workload.mini_batch_size // 8, zero=3,
                   cp=2, gpus=tuple(range(8)))
    e = cost.estimate_candidate(c2)
    # activations of 4096·2/2 = 4096 tokens per GPU: 34·s·b·h per layer at t = 1 (Korthikanti), 32 layers
    assert e.memory["activations"] == 32 * 34 * 4096 * 4096
    assert e.memory["logits"] == 4 * 4096 * (4096 + 128256)
    # ZeRO-3 shards over all 8 GPUs (dp 4 x cp 2)
    assert e.memory["optimizer"] == pytest.approx(params_rank(M8, 1, 1) * 12 / 8)
    # Ulysses all-to-all: per layer and pass (q,k,v,out) 4096 tok · (2·4096 + 2·1024) · 2 B, (u-1)/u over NVLink
    links = LinkModel(job.cluster, cost.eff)
    x = 4096 * (2 * 4096 + 2 * 1024) * 2
    bw = H100.scaleup_bandwidth * cost.eff.get("allgather@nvlink", H100)
    per = H100.scaleup_latency * 1 + 0.5 * x / bw
    got = seq_split_comm(links, M8, 4096, 1, 32, 2, 2)
    assert got["allgather@nvlink"] == pytest.approx(per * 2 * 32)
    with pytest.raises(ValueError, match="cp=2"):
        Candidate("actor.generate", 1, 1, 4, cp=2)
    assert ms.name == "actor.train"
