"""FP8 recipes of torchao (``WorkloadSpec.fp8_recipe``): the cast kernels' HBM traffic, by hand from
torchao's roofline byte counts (``torchao/testing/training/roofline_utils.py``)."""

import dataclasses

import pytest

from nereus.cost import latency as lat
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.fp8 import fp8_cast_bytes
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

M8 = get_model("llama-3.1-8b")  # h 4096, q 4096, kv 1024, F 14336, 32 layers
# the seven linears' (K, N): wq, wk, wv, wo, w1, w3, w2
SUM_K = 4096 + 4096 + 4096 + 4096 + 4096 + 4096 + 14336
SUM_N = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096
SUM_KN = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
assert SUM_KN == 218_103_808  # the layer's linear parameters


def test_cast_bytes_per_layer_by_hand():
    m = 8192
    # tensorwise: input and grad_output 4 B per element (bf16 read, two fp8 writes), weight 8 B
    assert fp8_cast_bytes(M8, "tensorwise", 1, m) == pytest.approx(4 * m * (SUM_K + SUM_N) + 8 * SUM_KN)
    # rowwise: 6 B and 10 B (the other-axis copy re-scaled from bf16)
    assert fp8_cast_bytes(M8, "rowwise", 1, m) == pytest.approx(6 * m * (SUM_K + SUM_N) + 10 * SUM_KN)
    # TP 2 halves every sharded dimension (8 KV heads: no replication at TP 2): wo's and w2's K,
    # the others' N
    k2 = 4096 + 4096 + 4096 + 2048 + 4096 + 4096 + 7168
    n2 = 2048 + 512 + 512 + 4096 + 7168 + 7168 + 4096
    assert fp8_cast_bytes(M8, "tensorwise", 2, m) == pytest.approx(4 * m * (k2 + n2) + 8 * SUM_KN / 2)
    with pytest.raises(ValueError, match="fp8_recipe"):
        fp8_cast_bytes(M8, "blockwise", 1, m)


def test_cast_traffic_in_a_training_pass_and_neutral_default():
    gpu = get_gpu("h100")
    wl = WorkloadSpec(prompt_len=4096, response_len=4096, gemm_precision="fp8")
    cl = ClusterSpec(gpu, 1, 8)

    def mid(w):
        return lat.microbatch_stage_times("train", M8, w, cl, EfficiencyTable(), 1, 1, 1)[0]

    te = mid(wl)  # fp8_recipe None (Transformer Engine): no cast charged, as before
    for recipe, (a, w) in (("tensorwise", (4, 8)), ("rowwise", (6, 10))):
        got = mid(dataclasses.replace(wl, fp8_recipe=recipe))
        extra = 32 * (a * 8192 * (SUM_K + SUM_N) + w * SUM_KN) / (3.35e12 * 0.7)  # 32 layers at HBM x 0.7
        assert got["memory_bound"] - te["memory_bound"] == pytest.approx(extra, rel=1e-9)
        assert got["gemm_fp8"] == te["gemm_fp8"]
    # bf16 GEMMs ignore the recipe
    bf = dataclasses.replace(wl, gemm_precision=None)
    assert mid(dataclasses.replace(bf, fp8_recipe="rowwise")) == mid(bf)
    assert "fp8_recipe" not in wl.to_dict()
    with pytest.raises(ValueError, match="fp8_recipe"):
        WorkloadSpec(fp8_recipe="delayed")
