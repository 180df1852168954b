"""The runtime engine's training memory terms (``nereus.cost.runtime_memory``), by hand, in bytes.

The ``small`` preset (h 256, F 512, 8 layers, 8 query / 4 KV heads of 32, vocabulary 64), fp32
(w = 4), micro-batch b = 4 of s = 9 tokens (5 prompt + 4 response), mini-batch 16.
"""

from __future__ import annotations

import pytest

from nereus.cost.memory import stage_memory
from nereus.cost.runtime_memory import layer_bytes
from nereus.runtime.model.precision import workload_bytes
from nereus.spec.presets import MODEL_PRESETS
from nereus.spec.workload import WorkloadSpec

SMALL = MODEL_PRESETS["small"]
W = WorkloadSpec(prompt_len=5, response_len=4, micro_batch_size=4, mini_batch_size=16, prompts_per_step=16,
                 samples_per_prompt=1, **workload_bytes("fp32"), activation_model="runtime")
# per token of one layer: two norms (4h fp32 input + 2·4h + 4 rsqrt), q and the SDPA output (4·8·32 each),
# k and v repeated to 8 heads (4·8·32 each), the log-sum-exp (4·8), the SwiGLU's four F-wide tensors
PER_TOKEN = 2 * (4 * 256 + 2 * 4 * 256 + 4) + 2 * 4 * 256 + 2 * 4 * 256 + 4 * 8 + 4 * 4 * 512
assert PER_TOKEN == 18_472
LAYER = 36 * PER_TOKEN + 4 * 4 * 9 * 32 + 4 * 9 * 9  # + RoPE cos/sin of q and k, the fp32 mask [s, s]
EMBED = 36 * (8 + 4)  # int64 ids, fp32 mask
HEAD = 36 * (4 * 256 + 2 * 4 * 256 + 4)  # the final norm
N_PARAMS = 64 * 256 + 8 * (589_824 + 2 * 256) + (256 + 64 * 256)  # embed, 8 layers, norm + lm_head


def _loss(dp: int) -> int:
    # z and exp(z) [4, 4, 64] and 28 B per response token; two [n, 4] batch fields, n = 16 / dp
    return 16 * (8 * 64 + 28) + 2 * 4 * (16 // dp) * 4


def test_layer_bytes_by_hand():
    assert LAYER == 669_924
    assert layer_bytes(SMALL, 4, 9, 1, 4.0) == LAYER
    # selective: the SDPA under checkpointing keeps no log-sum-exp
    assert layer_bytes(SMALL, 4, 9, 1, 4.0, selective=True) == LAYER - 36 * 32


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_train_terms_by_hand(zero):
    m = stage_memory("train", SMALL, W, 1, 1, micro_batch=4, dp=2, zero=zero)
    acts = 8 * LAYER + EMBED + HEAD + _loss(2)
    assert m["activations"] == acts == 5_479_456
    assert m["weights"] == 4 * N_PARAMS and N_PARAMS == 4_755_712
    k = N_PARAMS // 2  # ceil(N / 2): N is even
    if zero == 0:  # one flat fp32 buffer
        assert m["gradients"] == 4 * N_PARAMS and m["optimizer"] == 8 * N_PARAMS
        assert m["transient"] == 4 * N_PARAMS + acts
    elif zero == 1:  # the buffer padded to dp·k; the reduce-scatter output 4k outlives the activations
        assert m["gradients"] == 4 * 2 * k and m["reduce"] == 4 * k and m["optimizer"] == 8 * k
        assert m["transient"] == 4 * 2 * k + max(acts, 4 * k) == 28_534_272
    else:  # slices per unit; one layer unit's pending grads, flat and padded copies and output
        ku = 8192 + 8 * 295_168 + 8320  # embed 16,384, layer 590,336, head 16,640 elements, halves
        assert m["gradients"] == 4 * ku == 9_511_424
        assert m["bucket"] == 4 * (2 * 590_336 + 2 * 295_168 + 295_168) == 8_264_704
        assert m["transient"] == 4 * ku + acts + 8_264_704


def test_zero3_full_recompute_by_hand():
    m = stage_memory("train", SMALL, W, 1, 1, micro_batch=4, dp=2, zero=3, recompute="full")
    # checkpointed parts' inputs: ids (8 B), 8 layer inputs and the head's input (4h each per token),
    # one layer recomputed in backward, the loss outside the checkpoints
    acts = 36 * 8 + 8 * 36 * 4 * 256 + 36 * 4 * 256 + LAYER + _loss(2)
    assert m["activations"] == acts == 1_010_884
    ku = 8192 + 8 * 295_168 + 8320
    # resident weight slices; while it runs one gathered layer unit, twice while the receive buffers
    # and the flat unit coexist
    assert m["weights"] == 4 * ku and m["resident"] == 4 * ku + 8 * ku
    assert m["gathered"] == 2 * 4 * 2 * 295_168 == 4_722_688
    assert m["gradients"] == 4 * ku
    assert m["transient"] == 4 * ku + acts + 4_722_688


def test_default_workload_keeps_korthikanti():
    w = WorkloadSpec(prompt_len=5, response_len=4, micro_batch_size=4, mini_batch_size=16, prompts_per_step=16,
                     samples_per_prompt=1, **workload_bytes("fp32"))
    m = stage_memory("train", SMALL, w, 1, 1, micro_batch=4)
    assert "reduce" not in m
    # Korthikanti's per-layer s·b·(8h + 4h + 4h·g/a + 6F) at t = 1, 8 layers
    assert m["activations"] == 8 * 36 * (8 * 256 + 4 * 256 + 4 * 256 * 4 / 8 + 6 * 512)


def test_unknown_activation_model_is_refused():
    with pytest.raises(ValueError, match="activation_model"):
        WorkloadSpec(activation_model="megatron")
