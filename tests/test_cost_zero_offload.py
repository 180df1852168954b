"""DeepSpeed ZeRO-1/2 ZeRO-Offload GPU buffers (nereus/cost/zero_offload.py; microsoft/DeepSpeed@v0.15.0
``deepspeed/runtime/zero/stage_1_and_2.py``), hand-computed on a small model, and as the OpenRLHF
``train_ppo`` import applies them (Llama-3.1-8B shapes, the buffers by hand)."""

from dataclasses import replace

import pytest

from nereus.cost.memory import stage_memory
from nereus.cost.model import CostModel
from nereus.cost.shapes import params_rank
from nereus.cost.train_state import engine_train_state
from nereus.cost.zero_offload import largest_param_numel, zero_offload_state
from nereus.integrations.openrlhf import import_openrlhf, openrlhf_source
from nereus.planner.whatif import evaluate_layout
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.model import ModelSpec, value_head_variant
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

# h = 64, F = 128, L = 4, a = g = 4 (d = 16), V = 256, untied head
TINY = ModelSpec(name="tiny", hidden_size=64, intermediate_size=128, num_layers=4, num_attention_heads=4,
                 num_kv_heads=4, head_dim=16, vocab_size=256, tie_word_embeddings=False)
LAYER = 2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 128 + 2 * 64
P = 4 * LAYER + 256 * 64 + 64 + 256 * 64  # 197,184
W = WorkloadSpec(prompts_per_step=8, samples_per_prompt=1, prompt_len=16, response_len=16, mini_batch_size=8,
                 micro_batch_size=1)
DS = replace(get_framework("deepspeed"), overlap_grad_reduce=False)  # DeepSpeed's own overlap_comm default
CPU_ADAM = 3
BUCKET = 10_000  # a reduce bucket smaller than the 256 x 64 = 16,384-element embedding and head


def _train(zero, dp=4, model=TINY):
    return stage_memory("train", model, W, 1, 1, micro_batch=1, dp=dp, zero=zero, offload=CPU_ADAM)


def test_largest_parameter_by_hand():
    assert largest_param_numel(TINY, None, 1) == 256 * 64  # embedding / untied head V x h
    assert largest_param_numel(TINY, None, 1, lm_head_first=True) == 256 * 64  # the head's grad comes first
    critic = value_head_variant(TINY)
    assert largest_param_numel(critic, None, 1) == 256 * 64  # the embedding
    assert largest_param_numel(critic, None, 1, lm_head_first=True) == 64 * 128  # a layer's h x F (gate/up/down)
    tied = replace(TINY, tie_word_embeddings=True)
    assert largest_param_numel(tied, None, 1, lm_head_first=True) == 64 * 128  # the tied weight's grad ends last
    assert largest_param_numel(TINY, 8, 1) == 8 * 128  # LoRA: the widest adapter r x max(h, F)


def test_zero2_offload_buffers_by_hand():
    assert W.memory_seq_len == 32 and params_rank(TINY, 1, 1) == P
    mem = _train(zero=2)
    act = 32 * (8 * 64 + 4 * 64 + 4 * 64 + 6 * 128) * 4  # 32 tokens x 1,792 B x 4 layers (no recompute)
    logits = 4 * 32 * (64 + 256)
    assert (mem["activations"], mem["logits"], mem["gradients"]) == (act, logits, 2 * P)  # bucket = whole grads
    out = zero_offload_state(mem, DS, TINY, W, 1, 1, 4, 2, CPU_ADAM, bucket_elems=BUCKET)
    n, part = 256 * 64, P / 4
    # resident: temp_grad_buffer_for_gpu_offload, the largest parameter in bf16
    assert out["offload_buffer"] == 2 * n and out["resident"] == 2 * P + 2 * n
    # backward: one ipg bucket (2 B x 10,000); reducing the head (larger than the bucket: its own grad
    # 2n) at the boundary takes an fp64 copy of its slice, 8 x min(n, P/4)
    ipg = 2 * BUCKET
    reduce_a = 8 * min(n, part) + 2 * n
    assert out["gradients"] == ipg and out["reduce_copies"] == reduce_a
    assert out["step_copy"] == 4 * part  # fp32_partition.to(GPU) in the step
    assert out["transient"] == pytest.approx(ipg + max(act + logits, act + max(2 * BUCKET, reduce_a), 4 * part))
    assert out["transient"] == pytest.approx(20_000 + act + 163_840)
    # overlap_comm: two ipg buffers
    two = zero_offload_state(mem, replace(DS, overlap_grad_reduce=True), TINY, W, 1, 1, 4, 2, CPU_ADAM,
                             bucket_elems=BUCKET)
    assert two["transient"] - out["transient"] == pytest.approx(2 * BUCKET)
    # DP 1: the whole model is the partition; the step copies 4P back
    one = zero_offload_state(_train(zero=2, dp=1), DS, TINY, W, 1, 1, 1, 2, CPU_ADAM, bucket_elems=BUCKET)
    assert one["step_copy"] == 4 * P and one["transient"] == pytest.approx(max(ipg + act + reduce_a, 4 * P))


def test_critic_embedding_reduced_after_the_activations_by_hand():
    critic = value_head_variant(TINY)
    pc = params_rank(critic, 1, 1)
    mem = _train(zero=2, model=critic)
    out = zero_offload_state(mem, DS, critic, W, 1, 1, 4, 2, CPU_ADAM, bucket_elems=BUCKET)
    act, vh = mem["activations"], mem["logits"]  # the value head's 4·T·h
    ipg, part = 2 * BUCKET, pc / 4
    during = max(act + vh, act + max(2 * BUCKET, 8 * 64 * 128))  # widest layer matrix, inside the bucket
    end = 8 * min(256 * 64, part) + 2 * 256 * 64  # the embedding, at the backward's end
    assert out["transient"] == pytest.approx(max(ipg + during, ipg + end, 4 * part))


def test_zero1_keeps_its_gradients_and_only_the_end_copies():
    mem = _train(zero=1)
    held = mem["gradients"]
    assert held == P * W.grad_bytes  # ZeRO-1: gradients not partitioned
    out = zero_offload_state(mem, DS, TINY, W, 1, 1, 4, 1, CPU_ADAM, bucket_elems=BUCKET)
    end = 8 * min(256 * 64, P / 4) + 2 * 256 * 64
    assert out["gradients"] == held + 2 * BUCKET
    assert out["transient"] == pytest.approx(max(held + 2 * BUCKET + mem["activations"] + mem["logits"],
                                                 held + 2 * BUCKET + end, P))


def test_other_rows_and_frameworks_unchanged():
    mem = _train(zero=2)
    assert zero_offload_state(mem, replace(DS, zero_offload_buffers=False), TINY, W, 1, 1, 4, 2, CPU_ADAM) is mem
    for zero, off in ((3, CPU_ADAM), (2, 0)):  # the terms are 0, the rest as it was
        got = zero_offload_state(mem, DS, TINY, W, 1, 1, 4, zero, off)
        assert got == dict(mem, offload_buffer=0.0, reduce_copies=0.0, step_copy=0.0)
    assert zero_offload_state(mem, DS, TINY, replace(W, activation_model="runtime"), 1, 1, 4, 2, CPU_ADAM) is mem
    # engine_train_state applies it last (no Megatron / FSDP flag here)
    assert engine_train_state(mem, DS, TINY, W, 1, 1, 4, 2, CPU_ADAM)["offload_buffer"] == 2 * 256 * 64
    # the preset sets it, the flag validates and round-trips
    assert get_framework("deepspeed").zero_offload_buffers and not get_framework("fsdp").zero_offload_buffers
    assert FrameworkSpec.from_dict(DS.to_dict()).zero_offload_buffers is True
    assert "zero_offload_buffers" not in get_framework("megatron").to_dict()
    with pytest.raises(ValueError, match="zero_offload_buffers"):
        FrameworkSpec(zero_offload_buffers="yes")


ROW42 = ("/env/bin/python -u -m openrlhf.cli.train_ppo --local_rank=7 --pretrain m --reward_pretrain rm "
         "--micro_train_batch_size 2 --train_batch_size 128 --micro_rollout_batch_size 4 --rollout_batch_size 1024 "
         "--prompt_max_len 1024 --generate_max_len 1024 --zero_stage 2 --bf16 --init_kl_coef 0.01 --adam_offload "
         "--flash_attn --gradient_checkpointing")


@pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed (its parser checks names)")
def test_train_ppo_adam_offload_by_hand():
    m = get_model("llama-3.1-8b")
    imp = import_openrlhf(ROW42, model=m, gpu="h100", gpus_per_node=8)
    assert imp.expressible and imp.job.framework.zero_offload_buffers and not imp.job.framework.overlap_grad_reduce
    ev = evaluate_layout(imp.job, imp.layout, cost=CostModel(imp.job))
    est = ev.plan.estimates
    vh = 128256 * 4096  # the embedding / LM head: 525,336,576 elements, > the 5e8 bucket
    for name in ("actor.train", "critic.train"):
        e = est[name].memory
        assert e["offload_buffer"] == 2 * vh  # 0.98 GiB each, resident
        part = params_rank(get_model("llama-3.1-8b") if name == "actor.train" else value_head_variant(m), 1, 1) / 8
        assert e["step_copy"] == pytest.approx(4 * part)
        assert e["reduce_copies"] == pytest.approx(8 * vh + 2 * vh)  # head (actor) / embedding (critic) slice
    off = replace(imp.job, framework=replace(imp.job.framework, zero_offload_buffers=False))
    before = evaluate_layout(off, imp.layout, cost=CostModel(off))
    # the two resident buffers add to every GPU; the largest transient (the log-prob pass) is unchanged
    assert max(ev.plan.gpu_memory.values()) - max(before.plan.gpu_memory.values()) == pytest.approx(2 * 2 * vh)
