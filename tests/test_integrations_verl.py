"""verl import/export: jobs in the style of verl's example scripts (Qwen2.5-0.5B/7B, GRPO and PPO,
FSDP and Megatron), exported overrides composed by Hydra over verl's own config in struct mode,
round trip, and the predicted time of the exported layout recomputed by hand."""

import json

import pytest

from nereus.cost.model import CostModel
from nereus.integrations.common import evaluate_layout, layout_key
from nereus.integrations.verl import export_verl, import_verl, load_verl_config, verl_config_dir
from nereus.planner.search import plan_job

pytestmark = pytest.mark.skipif(verl_config_dir() is None, reason="verl not installed (pip install -e '.[test]')")

QWEN = {  # Hugging Face config.json fields of Qwen2.5-0.5B-Instruct and Qwen2.5-7B-Instruct
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
           "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"},
}


@pytest.fixture
def qwen(tmp_path):
    out = {}
    for k, cfg in QWEN.items():
        d = tmp_path / f"Qwen2.5-{k}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        out[k] = str(d)
    return out


def grpo_megatron_7b(path):
    # examples/grpo_trainer/run_qwen2_5-7b_math_megatron style (2 nodes x 8 GPUs)
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=1024",
            "data.max_response_length=1024", f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8", "trainer.nnodes=2"]


def test_import_grpo_megatron_qwen7b(qwen):
    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    w = imp.job.workload
    # hand-checked: 1024 prompts x 5; mini-batch 256 prompts x 5 = 1280 sequences; 16 GPUs
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("grpo", 1024, 5, 1280)
    assert (w.prompt_len, w.response_len, w.reward_model, imp.job.cluster.num_gpus) == (1024, 1024, False, 16)
    assert imp.job.actor.hidden_size == 3584 and imp.job.actor.num_layers == 28
    by = {c.model_stage: c for c in imp.layout}
    # actor: tp2 pp2 -> dp 16/4 = 4; micro-batch 4 -> grad accumulation 1280 / (4*4) = 80
    assert (by["actor.train"].tp, by["actor.train"].pp, by["actor.train"].dp) == (2, 2, 4)
    assert (by["actor.train"].micro_batch, by["actor.train"].grad_accum) == (4, 80)
    assert (by["actor.infer"].tp, by["actor.infer"].pp, by["actor.infer"].micro_batch) == (2, 2, 16)
    # the reference follows the actor's Megatron degrees (verl's interpolation)
    assert (by["reference.infer"].tp, by["reference.infer"].pp) == (2, 2)
    assert (by["actor.generate"].tp, by["actor.generate"].dp) == (2, 8)
    assert all(c.gpus == tuple(range(16)) for c in imp.layout)
    keys = [u.key for u in imp.unexpressible]
    assert keys == ["trainer.n_gpus_per_node", "actor_rollout_ref.actor.megatron.use_distributed_optimizer"]
    assert "actor.infer, reference.infer" in str(imp.unexpressible[0])


def test_import_ppo_fsdp_qwen05b(qwen):
    # examples/ppo_trainer/run_qwen2.5-0.5b style (FSDP, 1 node x 8 GPUs)
    ov = ["algorithm.adv_estimator=gae", "data.train_batch_size=256", "data.max_prompt_length=512",
          "data.max_response_length=512", f"actor_rollout_ref.model.path={qwen['0.5b']}",
          "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", f"critic.model.path={qwen['0.5b']}",
          "critic.ppo_micro_batch_size_per_gpu=8", "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]
    imp = import_verl(load_verl_config("ppo_trainer", ov))
    w = imp.job.workload
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("ppo", 256, 1, 64)
    by = {c.model_stage: c for c in imp.layout}
    # FSDP: DP over all 8 GPUs; mini-batch 64 / (8 x 4) = 2 accumulation steps
    assert (by["actor.train"].tp, by["actor.train"].dp, by["actor.train"].grad_accum) == (1, 8, 2)
    assert (by["critic.train"].micro_batch, by["critic.train"].grad_accum) == (8, 1)
    assert by["actor.train"].recompute == "full"  # enable_gradient_checkpointing defaults to true
    keys = [u.key for u in imp.unexpressible]
    assert "actor_rollout_ref.actor.strategy" in keys and "critic.strategy" in keys
    assert "critic.infer, reference.infer" in str(imp.unexpressible[0])  # PPO: three infer stages share GPUs


def test_errors_name_key_value_and_valid(qwen):
    with pytest.raises(ValueError, match="bogus"):
        load_verl_config("ppo_megatron_trainer", ["actor_rollout_ref.actor.bogus=1"])
    cfg = load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"]) + ["algorithm.adv_estimator=rloo"])
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='rloo'.*gae \(PPO\)"):
        import_verl(cfg)
    cfg = load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"]) +
                           ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu=3"):
        import_verl(cfg)
    cfg = load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"]) +
                           ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"])
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        import_verl(cfg)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_export_composes_in_struct_mode_and_round_trips(qwen, algo):
    from omegaconf import OmegaConf

    ov = grpo_megatron_7b(qwen["7b"]) + ([f"critic.model.path={qwen['7b']}", "critic.ppo_micro_batch_size_per_gpu=4",
                                          "algorithm.adv_estimator=gae"] if algo == "ppo" else [])
    imp = import_verl(load_verl_config("ppo_megatron_trainer", ov))
    best = plan_job(imp.job)
    ex = export_verl(imp.job, best, model_path=qwen["7b"])
    # Hydra composes verl's own trainer config with every exported override (struct: unknown keys fail)
    cfg = load_verl_config("ppo_megatron_trainer", ex["overrides"])
    # and OmegaConf in struct mode over verl's generated full config
    full = OmegaConf.load(verl_config_dir() / "_generated_ppo_megatron_trainer.yaml")
    OmegaConf.set_struct(full, True)
    for o in ex["overrides"]:
        k, _, v = o.partition("=")
        OmegaConf.update(full, k, v)  # raises on a key verl does not define
    for o in ex["overrides"]:
        k, _, v = o.partition("=")
        node = cfg
        for part in k.split("."):
            node = node[part]
        assert str(node).lower() in (v.lower(), "none" if v == "null" else v.lower()), o
    back = import_verl(cfg)
    assert layout_key(back.layout) == layout_key(ex["layout"])  # round trip
    assert back.job.workload == imp.job.workload
    assert [u.key for u in back.unexpressible] == ["trainer.n_gpus_per_node"]  # only the colocation remains


def test_export_time_is_the_serial_sum_on_shared_gpus(qwen):
    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    ex = export_verl(imp.job, plan_job(imp.job))
    cost = CostModel(imp.job)
    t = {c.model_stage: cost.estimate_candidate(c, True).time for c in ex["layout"]}
    # every model-stage runs on all 16 GPUs: each stage takes the sum of its model-stages' times
    want = t["actor.generate"] + (t["actor.infer"] + t["reference.infer"]) + t["actor.train"]
    assert ex["l_step"] == pytest.approx(want, rel=1e-9)
    assert ex["evaluation"].fits
    ev = evaluate_layout(imp.job, ex["layout"])
    assert ev.shared == ["infer"]
