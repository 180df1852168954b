"""verl's reference model by release (a KL term from 0.4.0, always before) and with LoRA (``ref_in_actor``:
the actor's engine with the adapters disabled, no weights of its own)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.cost.step import engine_owned
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir
from nereus.spec.plan import Plan

pytestmark = pytest.mark.skipif(verl_config_dir() is None, reason="verl not installed (pip install -e '.[test]')")

QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
            "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    return str(tmp_path)


def ppo_v02(path, extra=()):
    # verl v0.2 examples/ppo_trainer/run_qwen2-7b.sh style: a KL coefficient and no use_kl_loss key
    return ["data.train_batch_size=256", "data.max_prompt_length=512", "data.max_response_length=512",
            f"actor_rollout_ref.model.path={path}", f"critic.model.path={path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=8",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.n_gpus_per_node=8", "trainer.nnodes=1", *extra]


@pytest.mark.parametrize("version", ["0.1", "0.2", "0.3.0.post0", "0.3.0.post1"])
def test_before_0_4_every_job_has_a_reference(model, version):
    imp = import_verl(load_verl_config("ppo_trainer", ppo_v02(model)), version=version)
    stages = [c.model_stage for c in imp.layout]
    assert imp.job.workload.reference_model and "reference.infer" in stages
    ref = {c.model_stage: c for c in imp.layout}["reference.infer"]
    assert (ref.dp, ref.micro_batch) == (8, 16)  # the ref's own log-prob micro-batch
    assert any("072fc9fe" in n and f"verl {version} builds a reference model" in n for n in imp.notes)


def test_installed_and_0_4_build_no_reference_and_the_difference_is_named(model):
    cfg = load_verl_config("ppo_trainer", ppo_v02(model))
    inst = import_verl(cfg)
    assert not inst.job.workload.reference_model
    assert "reference.infer" not in [c.model_stage for c in inst.layout]
    assert any("verl before 0.4.0 always builds a reference model" in n for n in inst.notes)
    new = import_verl(cfg, version="0.4.0")
    assert "reference.infer" not in [c.model_stage for c in new.layout]
    assert not any("verl before 0.4.0" in n for n in new.notes)  # a version given: no guessing note
    # a line that sets the KL keys is a >= 0.4 line: no note
    kl = import_verl(load_verl_config("ppo_trainer", ppo_v02(model, ["actor_rollout_ref.actor.use_kl_loss=False"])))
    assert not any("verl before 0.4.0" in n for n in kl.notes)


def lora(path, extra=()):
    return ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.ref.fsdp_config.param_offload=False",
            *[o.replace("ref.log_prob_micro_batch_size_per_gpu=16", "ref.log_prob_micro_batch_size_per_gpu=4")
              for o in ppo_v02(path, extra)]]


def test_lora_reference_runs_on_the_actor_engine(model):
    imp = import_verl(load_verl_config("ppo_trainer", lora(model)))
    assert imp.expressible, imp.unexpressible
    assert imp.job.framework.ref_in_actor and imp.job.workload.lora_rank == 64
    by = {c.model_stage: c for c in imp.layout}
    a, r = by["actor.infer"], by["reference.infer"]
    # the actor's engine: its degrees, ZeRO-3 shards, offload and log-prob micro-batch (16), not ref.*
    assert (r.tp, r.pp, r.dp, r.zero, r.offload, r.micro_batch, r.gpus) == \
        (a.tp, a.pp, a.dp, a.zero, a.offload, a.micro_batch, a.gpus)
    assert any(n.startswith("LoRA read: rank 64, alpha 32, target modules all-linear") for n in imp.notes)
    cost = CostModel(imp.job)
    plan = cost.estimate(Plan(candidates=tuple(imp.layout)))
    owned = engine_owned(plan, imp.job.framework)
    assert {"actor.infer", "reference.infer"} <= owned
    e = plan.estimates
    assert e["reference.infer"].time > 0  # the pass still runs
    assert e["reference.infer"].resident > 0  # its own estimate holds the weight shard the actor owns
    # per GPU: workspace + residents of the model-stages that own weights + the largest transient
    want = WORKSPACE_BYTES + sum(v.resident for k, v in e.items() if k not in owned) + \
        max(v.transient for v in e.values())
    assert all(m == pytest.approx(want, rel=1e-9) for m in plan.gpu_memory.values())
    # a separate reference engine on the same GPUs would add its resident weights
    sep = CostModel(replace(imp.job, framework=replace(imp.job.framework, ref_in_actor=False)))
    p2 = sep.estimate(Plan(candidates=tuple(imp.layout)))
    assert p2.gpu_memory[0] - plan.gpu_memory[0] == pytest.approx(e["reference.infer"].resident, rel=1e-9)


def test_lora_before_0_4_keeps_a_reference_worker(model):
    imp = import_verl(load_verl_config("ppo_trainer", lora(model)), version="0.3.0.post1")
    assert not imp.job.framework.ref_in_actor
    assert {c.model_stage: c for c in imp.layout}["reference.infer"].micro_batch == 4  # the ref's own
