"""Per-GPU default efficiencies, attention's sequence-length curve, the memory-bound kernels and FP8
GEMMs of the cost model (issue 13 item 7). Expected values are computed here from the documented
formulas and the cited figures, not taken from the program."""

import dataclasses

import pytest

from nereus.cost import latency as lat
from nereus.cost.efficiency import ATTN_SEQ_HALF, EfficiencyTable, attention_seq_factor, default_efficiency
from nereus.spec.hardware import ClusterSpec, GPUSpec, get_gpu
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

M8 = get_model("llama-3.1-8b")
H100, A100, MI250X = get_gpu("h100"), get_gpu("a100"), get_gpu("mi250x")


def test_gpu_defaults_are_the_cited_figures():
    # GEMM: 0.75 x MAMF / peak (ml-engineering MAMF table); FP8: 0.75 x 1453.4 / 1979
    assert H100.efficiency_default("gemm") == round(0.75 * 792.1 / 989.4, 3) == 0.6
    assert A100.efficiency_default("gemm") == round(0.75 * 267.9 / 312, 3) == 0.644
    assert MI250X.efficiency_default("gemm") == round(0.75 * 147.0 / 191.5, 3) == 0.576
    assert H100.efficiency_default("gemm_fp8") == round(0.75 * 1453.4 / 1979, 3) == 0.551
    # attention: FA2 on H100 335 / 322 TFLOP/s of 989 (FA3 paper Fig. 5-6); A100 low end of 50-73%
    assert H100.efficiency_default("attention") == 0.33
    assert A100.efficiency_default("attention") == 0.55
    assert get_gpu("h200").default_efficiency == H100.default_efficiency
    assert H100.peak_flops_fp8 == 1979e12 and A100.peak_flops_fp8 == 0


def test_table_lookup_order():
    t = EfficiencyTable()
    assert t.get("attention", H100) == 0.33
    assert t.get("attention", A100) == 0.55
    assert t.get("attention", MI250X) == 0.45  # no figure for MI250X: the GPU-independent default
    assert t.get("attention") == 0.45
    assert t.get("allreduce@nvlink", H100) == 0.6 and t.get("p2p@ib", H100) == 0.75
    assert default_efficiency("gemm_fp8") == 0.5
    t.set("attention", 0.2)  # a calibrated value replaces every GPU's default
    assert t.get("attention", H100) == t.get("attention", A100) == 0.2


def test_calibration_starts_from_the_default_the_prediction_used():
    t = EfficiencyTable()
    assert t.get("attention", H100) == 0.33  # what the cost model read
    # measured twice the predicted time: target 0.33 / 2; EMA with alpha 0.5
    assert t.update("attention", 2.0, 1.0, gpu=H100) == pytest.approx(0.5 * 0.33 + 0.5 * 0.165)
    u = EfficiencyTable()
    assert u.update("attention", 2.0, 1.0, gpu=A100) == pytest.approx(0.5 * 0.55 + 0.5 * 0.275)
    assert EfficiencyTable().update("attention", 2.0, 1.0) == pytest.approx(0.5 * 0.45 + 0.5 * 0.225)


def test_attention_seq_factor():
    assert ATTN_SEQ_HALF == 256
    assert attention_seq_factor(256) == pytest.approx(0.5)
    assert attention_seq_factor(2048) == pytest.approx(2048 / 2304)
    assert attention_seq_factor(0) == 1.0


def _cluster(gpu=H100):
    return ClusterSpec(gpu, 1, 8)


def test_forward_pass_by_hand():
    """One inference micro-batch of Llama-3.1-8B, TP1 PP1: attention, memory-bound kernels and GEMM."""
    wl = WorkloadSpec(prompt_len=1024, response_len=1024)
    s, h, f, L, V = 2048, 4096, 14336, 32, 128256
    mid, last = lat.microbatch_stage_times("infer", M8, wl, _cluster(), EfficiencyTable(), 1, 1, 1)
    # causal attention 2·a·d·s FLOPs per token per layer, at 0.33 x s/(s+256) of 989.4 TFLOP/s
    attn = 2 * 4096 * s * s * L / (989.4e12 * 0.33 * s / (s + 256))
    assert mid["attention"] == pytest.approx(attn, rel=1e-12)
    # memory-bound kernels: (10h + 3F) bf16 elements per token and layer, at 0.7 of 3.35 TB/s
    ew = (10 * h + 3 * f) * 2 * s * L / (3.35e12 * 0.7)
    assert mid["memory_bound"] == pytest.approx(ew, rel=1e-12)
    # the head adds its fused cross-entropy forward: one read of 2-byte logits per token
    assert last["memory_bound"] == pytest.approx(ew + 2 * V * s / (3.35e12 * 0.7), rel=1e-12)
    # GEMM: 2·N_gemm per token at 0.6 x the size curve (7 calls per layer)
    n_gemm = 2 * h * 4096 + 2 * h * 1024 + 3 * h * f
    flops = 2 * n_gemm * s * L
    size = flops / (7 * L)
    assert mid["gemm"] == pytest.approx(flops / (989.4e12 * 0.6 * size / (size + 1e9)), rel=1e-12)


def test_training_memory_bound_and_sequence_parallel():
    h, f = 4096, 14336
    fwd, bwd = lat.elementwise_bytes_per_token(M8, 1)
    assert (fwd, bwd) == (pytest.approx((10 * h + 3 * f) * 2), pytest.approx((12 * h + 5 * f) * 2))
    fwd4, bwd4 = lat.elementwise_bytes_per_token(M8, 4)  # norms and adds replicated on each TP rank
    assert fwd4 == pytest.approx((10 * h + 3 * f / 4) * 2)
    fwd4s, bwd4s = lat.elementwise_bytes_per_token(M8, 4, sp=True)  # SP splits them too
    assert (fwd4s, bwd4s) == (pytest.approx(fwd / 4), pytest.approx(bwd / 4))
    wl = WorkloadSpec(prompt_len=512, response_len=512)
    s, L = 1024, 32
    for rc, n_fwd in (("none", 1), ("full", 2)):  # full recompute runs the forward kernels twice
        mid, _ = lat.microbatch_stage_times("train", M8, wl, _cluster(), EfficiencyTable(), 1, 1, 1, rc)
        assert mid["memory_bound"] == pytest.approx((n_fwd * fwd + bwd) * s * L / (3.35e12 * 0.7), rel=1e-12)


def test_fp8_gemms():
    bf = WorkloadSpec(prompt_len=1024, response_len=1024)
    f8 = dataclasses.replace(bf, gemm_precision="fp8")
    a, _ = lat.microbatch_stage_times("train", M8, bf, _cluster(), EfficiencyTable(), 1, 1, 2)
    b, _ = lat.microbatch_stage_times("train", M8, f8, _cluster(), EfficiencyTable(), 1, 1, 2)
    assert "gemm" not in b and "gemm_fp8" in b
    # same FLOPs and size curve: the ratio of (peak x efficiency), FP8 1979 x 0.551 vs bf16 989.4 x 0.6
    assert b["gemm_fp8"] == pytest.approx(a["gemm"] * (989.4e12 * 0.6) / (1979e12 * 0.551), rel=1e-12)
    assert b["attention"] == pytest.approx(a["attention"], rel=1e-12)  # attention stays bf16
    with pytest.raises(ValueError, match="gemm_precision"):
        lat.microbatch_stage_times("train", M8, f8, _cluster(A100), EfficiencyTable(), 1, 1, 2)
    with pytest.raises(ValueError, match="gemm_precision"):
        WorkloadSpec(gemm_precision="fp4")
    assert "gemm_precision" not in bf.to_dict() and f8.to_dict()["gemm_precision"] == "fp8"


def test_custom_gpu_default_efficiency():
    d = dict(name="x", peak_flops=1e15, memory_bytes=80 * 2**30, hbm_bandwidth=3e12, scaleup_bandwidth=4e11,
             scaleout_bandwidth=5e10, default_efficiency={"gemm": 0.7, "attention": 0.4})
    g = GPUSpec.from_dict(d)
    assert g.efficiency_default("gemm") == 0.7 and g.efficiency_default("memory_bound") is None
    assert EfficiencyTable().get("memory_bound", g) == 0.7  # GPU-independent HBM default
    assert GPUSpec.from_dict(g.to_dict()) == g and hash(g) == hash(GPUSpec.from_dict(g.to_dict()))
    with pytest.raises(ValueError, match="default_efficiency"):
        GPUSpec.from_dict(d | {"default_efficiency": {"gemm": 2.0}})
    with pytest.raises(ValueError, match="default_efficiency"):
        GPUSpec.from_dict(d | {"default_efficiency": 0.5})
    with pytest.raises(ValueError, match="peak_flops_fp8"):
        GPUSpec.from_dict(d | {"peak_flops_fp8": -1})


def test_attention_head_dim_factor():
    from nereus.cost.efficiency import attention_head_factor

    # FA3 paper Fig. 5: FA2 on H100, forward, 16k tokens: 324 TFLOP/s at head dim 64, 370 at 128
    assert attention_head_factor(64) == pytest.approx(324 / 370)
    assert attention_head_factor(96) == pytest.approx(324 / 370 + (1 - 324 / 370) / 2)
    assert attention_head_factor(128) == attention_head_factor(256) == 1.0
    q = get_model("qwen2.5-0.5b")  # head dim 64, 14 heads
    assert q.head_dim == 64
    wl = WorkloadSpec(prompt_len=512, response_len=512)
    s = 1024
    mid, _ = lat.microbatch_stage_times("infer", q, wl, _cluster(), EfficiencyTable(), 1, 1, 1)
    attn = 2 * q.q_dim * s * s * q.num_layers / (989.4e12 * 0.33 * s / (s + 256) * 324 / 370)
    assert mid["attention"] == pytest.approx(attn, rel=1e-12)
