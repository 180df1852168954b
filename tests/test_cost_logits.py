"""The logits kernels (nereus/cost/logits.py): bytes by hand for Llama-3.1-8B's head (h 4,096, V 128,256),
their use by stage_memory, and verl's selection of the kernel (nereus/integrations/verl_features.py)."""

from dataclasses import replace

import pytest

from nereus.cost.logits import infer_logits_bytes, train_logits_bytes
from nereus.cost.memory import stage_memory
from nereus.integrations.verl_features import verl_logits_kernel
from nereus.spec.model import value_head_variant
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

M = get_model("llama-3.1-8b")
T = 40 * 2048  # a micro-batch of 40 sequences of 2,048 tokens


def test_bytes_by_hand():
    assert (M.hidden_size, M.vocab_size) == (4096, 128256)
    # fp32 accounting: forward-only bf16 logits + fp32 log-softmax, 6 B per logit; training 4·T·(h + V)
    assert infer_logits_bytes(M, T, 1) == 6 * 81920 * 128256 == 63_040_389_120
    assert train_logits_bytes(M, T, 1) == 4 * 81920 * (4096 + 128256) == 43_369_103_360
    # flash_ce: only the bf16 logits (2 B) forward-only; logits and the head's bf16 input in training
    assert infer_logits_bytes(M, T, 1, "flash_ce") == 2 * 81920 * 128256 == 21_013_463_040
    assert train_logits_bytes(M, T, 1, "flash_ce") == 2 * 81920 * (4096 + 128256) == 21_684_551_680
    # flash_ce_entropy: two more bf16 gradient buffers in training, forward-only unchanged
    assert train_logits_bytes(M, T, 1, "flash_ce_entropy") == 81920 * (6 * 128256 + 2 * 4096) == 63_711_477_760
    assert infer_logits_bytes(M, T, 1, "flash_ce_entropy") == 21_013_463_040
    # the vocabulary split by TP
    assert infer_logits_bytes(M, T, 4, "flash_ce") == 21_013_463_040 / 4
    # a value head is the same whatever the kernel
    v = value_head_variant(M)
    for k in (None, "flash_ce", "flash_ce_entropy"):
        assert train_logits_bytes(v, T, 2, k) == 4 * 81920 * 4096 / 2
        assert infer_logits_bytes(v, T, 2, k) == 4 * 81920


def test_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="logits kernel must be one of .*flash_ce.*got 'bf16'"):
        train_logits_bytes(M, T, 1, "bf16")
    with pytest.raises(ValueError, match="workload field 'logits_kernel' must be one of .*got 'bf16'"):
        WorkloadSpec(logits_kernel="bf16")
    w = WorkloadSpec(logits_kernel="flash_ce")
    assert WorkloadSpec.from_dict(w.to_dict()) == w and "logits_kernel" not in WorkloadSpec().to_dict()


def test_stage_memory_takes_the_workloads_kernel():
    w = WorkloadSpec(prompt_len=1024, response_len=1024)
    f = replace(w, logits_kernel="flash_ce")
    t = 8 * 2048
    assert stage_memory("infer", M, w, 1, 1, micro_batch=8)["logits"] == 6 * t * 128256
    assert stage_memory("infer", M, f, 1, 1, micro_batch=8)["logits"] == 2 * t * 128256
    assert stage_memory("train", M, f, 1, 1, micro_batch=8)["logits"] == 2 * t * (4096 + 128256)
    # the rest of the terms do not move
    a, b = stage_memory("train", M, w, 1, 1, micro_batch=8), stage_memory("train", M, f, 1, 1, micro_batch=8)
    assert a["activations"] == b["activations"] and a["weights"] == b["weights"]
    assert a["transient"] - b["transient"] == pytest.approx(2 * t * (4096 + 128256))


class _Cfg:
    def __init__(self, **kv):
        self.kv = {k.replace("__", "."): v for k, v in kv.items()}

    def get(self, key, default=None):
        return self.kv.get(key, default)


A = "actor_rollout_ref"


def test_verl_kernel_follows_the_engines_code_path():
    assert verl_logits_kernel(_Cfg(), "fsdp") == "flash_ce"  # verl 0.9.1 defaults: rmpad, compile, no entropy
    assert verl_logits_kernel(_Cfg(), "fsdp2") == "flash_ce"
    assert verl_logits_kernel(_Cfg(**{f"{A}.actor.entropy_coeff": 0.001}), "fsdp") == "flash_ce_entropy"
    assert verl_logits_kernel(_Cfg(**{f"{A}.actor.calculate_entropy": True}), "fsdp") == "flash_ce_entropy"
    # the padded path computes the entropy uncompiled; so does use_torch_compile=False
    assert verl_logits_kernel(_Cfg(**{f"{A}.model.use_remove_padding": False}), "fsdp") is None
    assert verl_logits_kernel(_Cfg(**{f"{A}.actor.use_torch_compile": False}), "fsdp") is None
    assert verl_logits_kernel(_Cfg(**{f"{A}.actor.fsdp_config.use_torch_compile": False}), "fsdp") is None
    # Megatron's vocab-parallel cross-entropy is fp32
    assert verl_logits_kernel(_Cfg(), "megatron") is None
