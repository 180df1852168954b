"""Attention kernels other than FlashAttention-2 (``WorkloadSpec.attention_kernel``): FlashAttention in
Triton and unfused attention. Expected values are computed here from the documented formulas and
the cited figures (FlashAttention-2 paper §4.1; kernel-by-kernel HBM traffic), not taken from the
program."""

import dataclasses

import pytest

from nereus.cost import latency as lat
from nereus.cost.efficiency import TRITON_FA_SLOWDOWN, EfficiencyTable
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

M8 = get_model("llama-3.1-8b")  # q_dim 4096 = 32 heads x 128, 32 layers
H100, A100 = get_gpu("h100"), get_gpu("a100")
S, L, HEADS, D = 2048, 32, 32, 128
WL = WorkloadSpec(prompt_len=1024, response_len=1024)


def _train(kernel, gpu=H100, rc="none", eff=None):
    wl = dataclasses.replace(WL, attention_kernel=kernel)
    mid, _ = lat.microbatch_stage_times("train", M8, wl, ClusterSpec(gpu, 1, 8), eff or EfficiencyTable(), 1, 1, 1,
                                        rc)
    return mid


def test_workload_field_is_validated_and_optional():
    with pytest.raises(ValueError, match=r"attention_kernel.*flash_triton.*'sdpa'"):
        WorkloadSpec(attention_kernel="sdpa")
    assert "attention_kernel" not in WL.to_dict()
    w = dataclasses.replace(WL, attention_kernel="unfused")
    assert w.to_dict()["attention_kernel"] == "unfused" and WorkloadSpec.from_dict(w.to_dict()) == w
    # None and "flash" are the same kernel
    assert _train(None) == _train("flash")


def test_flash_triton_forward_and_backward_slowdowns_by_hand():
    # FlashAttention-2 paper §4.1: FA2 1.3-1.5x faster than Triton forward, about 2x backward
    assert TRITON_FA_SLOWDOWN == (1.4, 2.0)
    fwd_flops = 2 * 4096 * S * S * L  # causal: 2·q_dim·s per token and layer
    rate = 989.4e12 * 0.33 * S / (S + 256)  # H100 attention default x the sequence curve
    flash = _train("flash")
    assert flash["attention"] == pytest.approx(fwd_flops * (1 + 2.5) / rate, rel=1e-12)
    tri = _train("flash_triton")
    assert tri["attention"] == pytest.approx(fwd_flops * (1.4 + 2.5 * 2.0) / rate, rel=1e-12)
    # full recompute adds one forward at the forward slowdown
    tri_rc = _train("flash_triton", rc="full")
    assert tri_rc["attention"] == pytest.approx(fwd_flops * (2 * 1.4 + 2.5 * 2.0) / rate, rel=1e-12)
    assert tri["gemm"] == flash["gemm"] and tri["memory_bound"] == flash["memory_bound"]


def test_unfused_attention_by_hand_memory_bound_on_h100():
    e = S * S * HEADS * L  # score elements over the layers (one sequence, TP1)
    hbm = 3.35e12 * 0.7
    # each batched GEMM: 2·e·d FLOPs, reads or writes the e scores once (2 bytes each); on H100 the
    # traffic binds: 256 FLOP / (989.4 TFLOP/s x 0.6) = 0.43 ps < 2 B / 2.345 TB/s = 0.85 ps per score
    size = 2 * S * S * HEADS * D
    t_flops = 6 * 2 * e * D / (989.4e12 * 0.6 * size / (size + 1e9))
    t_io = 6 * 2 * e / hbm
    assert t_io > t_flops
    # softmax: forward read + write (4 B), backward read P and dP, write dS (6 B)
    flash, unf = _train("flash"), _train("unfused")
    assert "attention" not in unf
    assert unf["gemm"] == pytest.approx(flash["gemm"], rel=1e-12)
    assert unf["memory_bound"] - flash["memory_bound"] == pytest.approx(t_io + (4 + 6) * e / hbm, rel=1e-9)
    # dropout on the probabilities: forward read 2 + write 2 + mask 1, backward the same (5 B each way)
    drop = _train("unfused_dropout")
    assert drop["memory_bound"] - unf["memory_bound"] == pytest.approx((5 + 5) * e / hbm, rel=1e-9)


def test_unfused_attention_compute_bound_batched_gemms():
    # with a high HBM efficiency the batched GEMMs are compute-bound and land in the gemm class
    eff = EfficiencyTable()
    eff.set("memory_bound", 1.4)
    e = S * S * HEADS  # one layer, one forward and one backward pass
    out = lat.attention_times(M8, "unfused", 1, S, S, 1, 1, 1, A100, eff)
    size = 2 * S * S * HEADS * D
    t_flops = 6 * 2 * e * D / (312e12 * 0.644 * size / (size + 1e9))
    hbm = 2.039e12 * 1.4
    assert 6 * 2 * e / hbm < t_flops
    assert out["gemm"] == pytest.approx(t_flops, rel=1e-12)
    assert out["memory_bound"] == pytest.approx((4 + 6) * e / hbm, rel=1e-12)
    # forward only (prefill): QK^T and PV, the softmax forward
    fwd = lat.attention_times(M8, "unfused", 1, S, S, 1, 1, 0, A100, eff)
    assert fwd["gemm"] == pytest.approx(t_flops / 3, rel=1e-12)
    assert fwd["memory_bound"] == pytest.approx(4 * e / hbm, rel=1e-12)
    # TP splits the heads
    tp4 = lat.attention_times(M8, "unfused", 4, S, S, 1, 1, 1, A100, eff)
    assert tp4["memory_bound"] == pytest.approx(out["memory_bound"] / 4, rel=1e-12)
    with pytest.raises(ValueError, match="attention_kernel"):
        lat.attention_times(M8, "sdpa", 1, S, S, 1, 1, 1, A100, eff)


def test_selective_recompute_reruns_the_kernel_forward():
    e = S * S * HEADS * L
    hbm = 3.35e12 * 0.7
    none, sel = _train("unfused"), _train("unfused", rc="selective")
    # one more forward of unfused attention: 2 batched GEMMs' traffic (2 x 2 B) and the softmax (4 B)
    extra = sel["memory_bound"] - none["memory_bound"]
    assert extra == pytest.approx((2 * 2 + 4) * e / hbm, rel=1e-9)
    # Korthikanti et al. 2022 §5: only the core attention is re-run, not the QKV projection
    assert sel["gemm"] == pytest.approx(none["gemm"], rel=1e-12)


def test_selective_recompute_with_flash_reruns_the_attention_block():
    # the flash-era definition: the core attention forward and the QKV projection,
    # 2·h·(q_dim + 2·kv_dim) FLOPs per token and layer (Llama-3.1-8B: 4096 x (4096 + 2 x 1024))
    none, sel = _train("flash"), _train("flash", rc="selective")
    fwd_flops = 2 * 4096 * S * S * L
    rate = 989.4e12 * 0.33 * S / (S + 256)
    assert sel["attention"] - none["attention"] == pytest.approx(fwd_flops / rate, rel=1e-9)
    qkv = 2 * 4096 * (4096 + 2 * 1024) * S * L
    size = qkv / (3 * L)  # three projections per layer
    assert sel["gemm"] - none["gemm"] == pytest.approx(qkv / (989.4e12 * 0.6 * size / (size + 1e9)), rel=1e-9)


def test_unfused_attention_stores_the_score_matrix_korthikanti_5asb():
    # Korthikanti et al. 2022 Table 2: the attention block of one layer stores 5·a·s²·b/t bytes
    # for its scores (softmax output 2, dropout mask 1, dropout output 2); without dropout the
    # softmax output 2·a·s²·b/t. Llama-3.1-8B (a = 32), s = 4096, b = 1:
    from nereus.cost.memory import activation_bytes_per_layer, stage_memory
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    m8 = get_model("llama-3.1-8b")
    flash = activation_bytes_per_layer(m8, 4096, 1)
    assert flash == 34 * 4096 * 4096  # the 34·s·b·h of the reference (no score term)
    drop = activation_bytes_per_layer(m8, 4096, 1, seq=4096, kernel="unfused_dropout")
    assert drop - flash == 5 * 32 * 4096**2 == 2_684_354_560  # 2.5 GiB per layer
    assert activation_bytes_per_layer(m8, 4096, 2, seq=4096, kernel="unfused") - \
        activation_bytes_per_layer(m8, 4096, 2) == 2 * 32 * 4096**2 / 2  # heads split by TP
    # selective recompute with unfused attention (Korthikanti et al. §5) drops exactly the score term:
    # the 34·s·b·h that remain of their Table 2
    assert activation_bytes_per_layer(m8, 4096, 1, selective=True, seq=4096, kernel="unfused_dropout") == \
        34 * 4096 * 4096
    # with flash attention it re-runs the attention block and keeps its input: 6h + 6F per token
    assert activation_bytes_per_layer(m8, 4096, 1, selective=True) == 4096 * (6 * 4096 + 6 * 14336)
    # stage memory: training without recompute keeps all 32 layers' scores; inference holds two layers'
    wl = dict(prompt_len=1024, response_len=3072, micro_batch_size=1)
    a = stage_memory("train", m8, WorkloadSpec(**wl), 1, 1, micro_batch=1)
    b = stage_memory("train", m8, WorkloadSpec(**wl, attention_kernel="unfused_dropout"), 1, 1, micro_batch=1)
    assert b["activations"] - a["activations"] == 32 * 5 * 32 * 4096**2
    ai = stage_memory("infer", m8, WorkloadSpec(**wl), 1, 1, micro_batch=1)
    bi = stage_memory("infer", m8, WorkloadSpec(**wl, attention_kernel="unfused"), 1, 1, micro_batch=1)
    assert bi["activations"] - ai["activations"] == 2 * 2 * 32 * 4096**2
    # generation (vLLM) keeps its fused kernel: no change in time or memory
    ag = stage_memory("generate", m8, WorkloadSpec(**wl), 1, 1, concurrency=8)
    bg = stage_memory("generate", m8, WorkloadSpec(**wl, attention_kernel="unfused"), 1, 1, concurrency=8)
    assert ag == bg


def test_generation_time_ignores_the_training_engines_attention_kernel():
    from nereus.cost.model import CostModel
    from nereus.spec.hardware import ClusterSpec, get_gpu
    from nereus.spec.job import JobSpec
    from nereus.spec.plan import Candidate
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    def est(kernel):
        job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 1, 8),
                      WorkloadSpec(prompt_len=2048, response_len=1024, attention_kernel=kernel))
        cm = CostModel(job)
        return (cm.estimate_candidate(Candidate("actor.generate", 2, 1, 4, concurrency=64)),
                cm.estimate_candidate(Candidate("actor.infer", 2, 1, 4, micro_batch=4)))

    (g0, i0), (g1, i1) = est(None), est("unfused")
    assert g1 == g0  # vLLM's prefill and decode run their own fused attention
    assert i1.time > i0.time  # the training engine's forward pass does not
