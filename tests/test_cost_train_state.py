"""Training state a framework keeps resident (nereus/cost/train_state.py): Megatron-Core DDP's
gradient buffer and verl FSDP's fp32 parameters, hand-computed on a small model, and as the verl
importer applies them (the vLLM start-up bytes with the gradient buffer, by hand)."""

from dataclasses import replace

import pytest

from nereus.cost.memory import WORKSPACE_BYTES, stage_memory
from nereus.cost.model import CostModel
from nereus.cost.shapes import params_rank
from nereus.cost.train_state import engine_train_state
from nereus.cost.vllm_startup import startup_bytes
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config
from nereus.planner.whatif import evaluate_layout
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

# h = 64, F = 128, L = 4, a = g = 4 (d = 16), V = 256, untied head
TINY = ModelSpec(name="tiny", hidden_size=64, intermediate_size=128, num_layers=4, num_attention_heads=4,
                 num_kv_heads=4, head_dim=16, vocab_size=256, tie_word_embeddings=False)
# one layer at tp 1: q,o 2·64·64 + k,v 2·64·64 + MLP 3·64·128 + two norms 2·64 = 41,088
LAYER = 2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 128 + 2 * 64
# 4 layers + embedding 256·64 + final norm 64 + head 256·64
P = 4 * LAYER + 256 * 64 + 64 + 256 * 64
W = WorkloadSpec(prompts_per_step=8, samples_per_prompt=1, prompt_len=16, response_len=16, mini_batch_size=8,
                 micro_batch_size=1)
MEGATRON = replace(get_framework("megatron"), persistent_grads=True)
FSDP = replace(get_framework("fsdp"), fp32_train_params=True)


def _train(dp, zero, offload=0):
    return stage_memory("train", TINY, W, 1, 1, micro_batch=1, dp=dp, zero=zero, offload=offload)


def test_shapes_by_hand():
    assert LAYER == 41_088 and P == 197_184
    assert params_rank(TINY, 1, 1) == P


def test_megatron_grad_buffer_resident_by_hand():
    before = _train(dp=4, zero=1)
    # distributed optimizer over 4: bf16 weights 2P, Adam 12P/4 = 3P; the fp32 buffer 4P is whole
    assert (before["weights"], before["optimizer"], before["gradients"]) == (2 * P, 3 * P, 4 * P)
    after = engine_train_state(before, MEGATRON, TINY, W, 1, 1, 4, 1, 0)
    assert after["resident"] == pytest.approx(9 * P)  # 2P + 3P + 4P
    assert after["transient"] == pytest.approx(before["transient"] - 4 * P)
    # offloaded (verl param_offload: the grad buffer goes to the host with the parameters): all transient
    host = _train(dp=4, zero=1, offload=1)
    moved = engine_train_state(host, MEGATRON, TINY, W, 1, 1, 4, 1, 1)
    assert moved["resident"] == 0.0 and moved["transient"] == pytest.approx(host["transient"])
    # the engine's start-up bytes: weights + fp32 master (a third of Adam) + the grad buffer = 2P + P + 4P
    assert startup_bytes("train", after, after["resident"]) == pytest.approx(7 * P)


def test_fsdp_fp32_params_by_hand():
    two_layers = 2 * LAYER * 2  # two gathered bf16 layers
    z3 = _train(dp=4, zero=3)
    assert z3["weights"] == pytest.approx(2 * P / 4 + two_layers)
    a = engine_train_state(z3, FSDP, TINY, W, 1, 1, 4, 3, 0)
    # resident: the fp32 shard is Adam's master copy: 12P/4 in all; the bf16 layers in flight are transient
    assert a["weights"] == 0.0 and a["resident"] == pytest.approx(3 * P)
    assert a["transient"] == pytest.approx(z3["transient"] + two_layers)
    assert a["resident"] + a["transient"] == pytest.approx(z3["resident"] + z3["transient"] - 2 * P / 4)
    # one GPU: 12P resident (fp32 params + moments), gathered bf16 layers transient
    one = engine_train_state(_train(dp=1, zero=0), FSDP, TINY, W, 1, 1, 1, 0, 0)
    assert one["resident"] == pytest.approx(12 * P) and one["gathered"] == pytest.approx(two_layers)
    # ZeRO-2 (SHARD_GRAD_OP) over 4: the whole bf16 weights stay gathered through forward and backward
    z2 = engine_train_state(_train(dp=4, zero=2), FSDP, TINY, W, 1, 1, 4, 2, 0)
    assert z2["gathered"] == pytest.approx(2 * P) and z2["resident"] == pytest.approx(3 * P)
    # vLLM start-up: the fp32 parameters only (4 B) before Adam's moments exist
    assert startup_bytes("train", a, a["resident"]) == pytest.approx(P)


def test_flags_off_and_lora_leave_memory_alone():
    m = _train(dp=4, zero=3)
    assert engine_train_state(m, FrameworkSpec(), TINY, W, 1, 1, 4, 3, 0) is m
    lora = replace(W, lora_rank=8)
    assert engine_train_state(m, FSDP, TINY, lora, 1, 1, 4, 3, 0) is m


def test_flags_validated_and_serialized():
    with pytest.raises(ValueError, match="persistent_grads"):
        FrameworkSpec(persistent_grads="yes")
    assert "fp32_train_params" not in FrameworkSpec().to_dict()
    assert FrameworkSpec.from_dict(MEGATRON.to_dict()).persistent_grads is True


def _import(config, overrides):
    cfg = load_verl_config(config, ["data.train_batch_size=16", "data.max_prompt_length=64",
                                    "data.max_response_length=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", *overrides])
    return import_verl(cfg, model="qwen2.5-0.5b", gpu="h100")


def test_verl_megatron_critic_holds_its_grad_buffer():
    imp = _import("ppo_megatron_trainer", ["algorithm.adv_estimator=gae",
                                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                                           "critic.ppo_micro_batch_size_per_gpu=2",
                                           "actor_rollout_ref.rollout.gpu_memory_utilization=0.95"])
    assert imp.expressible and imp.job.framework.persistent_grads
    ev = evaluate_layout(imp.job, imp.layout, cost=CostModel(imp.job))
    c = ev.plan.estimates["critic.train"]
    critic = imp.job.model("critic")
    pc = params_rank(critic, 1, 1)  # verl's critic default: tp 1, pp 1, distributed optimizer over 8
    assert c.memory["gradients"] == pytest.approx(4 * pc) and c.memory["optimizer"] == pytest.approx(12 * pc / 8)
    assert c.resident == pytest.approx(2 * pc + 12 * pc / 8 + 4 * pc)
    # vLLM >= 0.9.1 at start-up: f·M must be free beside every co-located model's start-up bytes
    # (no reference model: no KL; actor.infer and critic.infer run on their training engines)
    assert set(ev.plan.estimates) == {"actor.generate", "actor.infer", "critic.infer", "actor.train", "critic.train"}
    starts = sum(startup_bytes("train", ev.plan.estimates[n].memory, ev.plan.estimates[n].resident)
                 for n in ("actor.train", "critic.train"))
    pa = params_rank(imp.job.model("actor"), 1, 1)
    # each: bf16 weights 2 + fp32 grad buffer 4 + fp32 master 12/8/3 bytes per parameter
    assert starts == pytest.approx(6.5 * pa + 6.5 * pc)
    m = imp.job.cluster.gpu.memory_bytes
    short = 0.95 * m - (m - WORKSPACE_BYTES - starts)
    assert short > 0  # vLLM refuses to start: "Free memory on device ... less than desired"
    gen = ev.plan.estimates["actor.generate"]
    assert gen.resident + gen.transient == pytest.approx(m + short)
    assert not ev.fits


def test_verl_fsdp_actor_weights_are_its_fp32_master():
    imp = _import("ppo_trainer", ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"])
    assert imp.job.framework.fp32_train_params
    ev = evaluate_layout(imp.job, imp.layout, cost=CostModel(imp.job))
    a = ev.plan.estimates["actor.train"]
    p = params_rank(imp.job.model("actor"), 1, 1)
    assert a.memory["weights"] == 0.0 and a.resident == pytest.approx(12 * p / 8)  # FULL_SHARD over 8
