"""verl import/export: jobs in the style of verl's example scripts (Qwen2.5-0.5B/7B, GRPO and PPO,
FSDP and Megatron, hybrid engine, offload, distributed optimizer, interleaving), exported overrides
composed by Hydra over verl's own configs in struct mode, round trips, settings still refused named
by key, and predicted step times recomputed by hand from the cost model's per-candidate estimates."""

import json
from dataclasses import replace

import pytest

from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.integrations.common import compare, layout_key
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir
from nereus.integrations.verl_export import export_verl, verl_job
from nereus.planner.search import plan_job
from nereus.planner.whatif import evaluate_layout

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


def fsdp_offload_05b(path, extra=()):
    # examples/grpo_trainer/run_qwen2_5-0.5b style with the actor's FSDP state offloaded (1 node x 8 GPUs)
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
            "data.max_response_length=1024", f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.use_kl_loss=True",  # the example's KL loss: verl builds the reference
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8",
            "trainer.nnodes=1", *extra]


def test_import_fsdp_offload_hybrid_engine_by_hand(qwen):
    imp = import_verl(load_verl_config("ppo_trainer", fsdp_offload_05b(qwen["0.5b"])))
    assert imp.expressible, imp.unexpressible
    fw = imp.job.framework
    # FSDP: ZeRO-2/3 only, no TP/PP for training, fp32 reduce (verl's default mixed precision), hybrid engine
    assert (fw.name, fw.zero_stages, fw.model_parallel_train, fw.grad_reduce_bytes, fw.colocate) == \
        ("verl-fsdp", (2, 3), False, 4, "always")
    by = {c.model_stage: c for c in imp.layout}
    a = by["actor.train"]
    # mini-batch 64 prompts x 4 = 256 sequences over DP 8 with micro-batch 8: 4 accumulation steps;
    # reshard_after_forward (default true) = FULL_SHARD = ZeRO-3; param + optimizer offload = host
    assert (a.tp, a.pp, a.dp, a.micro_batch, a.grad_accum, a.zero, a.offload) == (1, 1, 8, 8, 4, 3, "host")
    assert (by["actor.infer"].offload, by["reference.infer"].offload) == ("host", "host")
    # FULL_SHARD engines run the log-prob passes on their shards: ZeRO-3 inference
    assert (by["actor.infer"].zero, by["reference.infer"].zero) == (3, 3)
    g = by["actor.generate"]  # free_cache_engine (default true): vLLM sleeps, weights dropped and re-synced
    assert (g.tp, g.dp, g.offload, g.concurrency) == (1, 8, "drop", 128)  # 256 x 4 rollouts / 8 engines
    assert all(c.gpus == tuple(range(8)) for c in imp.layout)  # hybrid engine: one pool, overlapping sets
    cost = CostModel(imp.job)
    est = {c.model_stage: cost.estimate_candidate(c, False) for c in imp.layout}
    # every model-stage shares the 8 GPUs, so each stage is the sum of its model-stages' times
    want = est["actor.generate"].time + est["actor.infer"].time + est["reference.infer"].time + est["actor.train"].time
    ev = compare(imp)["user"]["evaluation"]
    assert ev["l_step"] == pytest.approx(want, rel=1e-9)
    assert ev["stage_times"]["infer"] == pytest.approx(est["actor.infer"].time + est["reference.infer"].time)
    # offloaded state is transient: nothing stays resident, the GPU peak is the largest model-stage's own
    assert all(e.resident == 0 for k, e in est.items()), {k: e.resident for k, e in est.items()}
    peak = WORKSPACE_BYTES + max(e.transient for e in est.values())
    assert ev["model_stages"]["actor.train"]["peak_gib"] * 2**30 == pytest.approx(peak, rel=1e-9)
    # ZeRO-2 when the parameters stay gathered after forward (SHARD_GRAD_OP)
    imp2 = import_verl(load_verl_config("ppo_trainer", fsdp_offload_05b(
        qwen["0.5b"], ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False"])))
    by2 = {c.model_stage: c for c in imp2.layout}
    assert (by2["actor.train"].zero, by2["actor.infer"].zero, by2["reference.infer"].zero) == (2, 0, 3)


def test_import_ppo_fsdp_qwen05b(qwen):
    # examples/ppo_trainer/run_qwen2.5-0.5b style (FSDP, 1 node x 8 GPUs), critic state offloaded
    ov = ["algorithm.adv_estimator=gae", "data.train_batch_size=256", "data.max_prompt_length=512",
          "data.max_response_length=512", f"actor_rollout_ref.model.path={qwen['0.5b']}",
          "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", f"critic.model.path={qwen['0.5b']}",
          "critic.ppo_micro_batch_size_per_gpu=8", "critic.fsdp.param_offload=True", "critic.fsdp.optimizer_offload=True",
          "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]
    imp = import_verl(load_verl_config("ppo_trainer", ov))
    w = imp.job.workload
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("ppo", 256, 1, 64)
    by = {c.model_stage: c for c in imp.layout}
    # FSDP: DP over all 8 GPUs; mini-batch 64 / (8 x 4) = 2 accumulation steps; ZeRO-3 (FULL_SHARD)
    assert (by["actor.train"].tp, by["actor.train"].dp, by["actor.train"].grad_accum, by["actor.train"].zero) == \
        (1, 8, 2, 3)
    assert (by["critic.train"].micro_batch, by["critic.train"].grad_accum, by["critic.train"].zero) == (8, 1, 3)
    assert by["actor.train"].recompute == "full"  # enable_gradient_checkpointing defaults to true
    # the critic's engine offloads (critic.fsdp.*), the actor's does not
    assert [by[k].offload for k in ("critic.train", "critic.infer", "actor.train", "actor.infer")] \
        == ["host", "host", "none", "none"]
    # no use_kl_loss / use_kl_in_reward: verl builds no reference model (need_reference_policy)
    assert "reference.infer" not in by and imp.job.workload.reference_model is False
    assert imp.expressible, imp.unexpressible
    cost = CostModel(imp.job)
    t = {c.model_stage: cost.estimate_candidate(c, False).time for c in imp.layout}
    ev = compare(imp)["user"]["evaluation"]
    # PPO on one pool: three infer model-stages and two train model-stages each add up
    assert ev["stage_times"]["infer"] == pytest.approx(t["actor.infer"] + t["critic.infer"])
    assert ev["l_step"] == pytest.approx(sum(t.values()), rel=1e-9)


def test_import_grpo_megatron_qwen7b(qwen):
    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    w = imp.job.workload
    # hand-checked: 1024 prompts x 5; mini-batch 256 prompts x 5 = 1280 sequences; 16 GPUs
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("grpo", 1024, 5, 1280)
    assert (w.prompt_len, w.response_len, w.reward_model, imp.job.cluster.num_gpus) == (1024, 1024, False, 16)
    assert imp.job.actor.hidden_size == 3584 and imp.job.actor.num_layers == 28
    by = {c.model_stage: c for c in imp.layout}
    # actor: tp2 pp2 -> dp 16/4 = 4; micro-batch 4 -> grad accumulation 1280 / (4*4) = 80;
    # verl's default use_distributed_optimizer=True is ZeRO-1
    assert (by["actor.train"].tp, by["actor.train"].pp, by["actor.train"].dp) == (2, 2, 4)
    assert (by["actor.train"].micro_batch, by["actor.train"].grad_accum, by["actor.train"].zero) == (4, 80, 1)
    assert (by["actor.infer"].tp, by["actor.infer"].pp, by["actor.infer"].micro_batch) == (2, 2, 16)
    # the reference follows the actor's Megatron degrees (verl's interpolation)
    assert (by["reference.infer"].tp, by["reference.infer"].pp) == (2, 2)
    assert (by["actor.generate"].tp, by["actor.generate"].dp, by["actor.generate"].offload) == (2, 8, "drop")
    assert all(c.gpus == tuple(range(16)) for c in imp.layout)
    assert all(c.offload == "none" for c in imp.layout if c.model_stage != "actor.generate")
    fw = imp.job.framework  # verl's Megatron defaults: SP on, no DDP overlap, fp32 gradient reduce
    assert (fw.name, fw.sequence_parallel, fw.overlap_grad_reduce, fw.grad_reduce_bytes) == \
        ("verl-megatron", True, False, 4)
    assert imp.expressible
    # actor.infer runs on actor.train's engine: one copy of the weights on the shared GPUs
    assert fw.shared_engine
    ev = evaluate_layout(imp.job, imp.layout)
    est = ev.plan.estimates
    peak = WORKSPACE_BYTES + sum(e.resident for k, e in est.items() if k != "actor.infer") + \
        max(e.transient for e in est.values())
    assert est["actor.infer"].resident > 0 and max(ev.plan.gpu_memory.values()) == pytest.approx(peak, rel=1e-9)


def test_import_megatron_offload_interleaving_and_flags(qwen):
    ov = grpo_megatron_7b(qwen["7b"]) + [
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.megatron.optimizer_offload=True",
        "actor_rollout_ref.actor.megatron.sequence_parallel=False", "actor_rollout_ref.ref.megatron.sequence_parallel=False",
        "+actor_rollout_ref.actor.megatron.override_ddp_config.overlap_grad_reduce=True",
        "actor_rollout_ref.rollout.free_cache_engine=False"]
    imp = import_verl(load_verl_config("ppo_megatron_trainer", ov))
    assert imp.expressible, imp.unexpressible
    by = {c.model_stage: c for c in imp.layout}
    a = by["actor.train"]
    assert (a.vpp, a.zero, a.offload) == (2, 1, "host")
    assert not any(c.zero for c in imp.layout if not c.model_stage.endswith(".train"))  # Megatron: unsharded
    # the ref's param_offload interpolates the actor's; interleaving is a training schedule
    assert (by["reference.infer"].offload, by["reference.infer"].vpp, by["actor.infer"].offload) == ("host", 1, "host")
    assert by["actor.generate"].offload == "none"
    fw = imp.job.framework
    assert (fw.sequence_parallel, fw.overlap_grad_reduce) == (False, True)
    # 28 layers over pp 2 x vpp 3 do not split: named with the key
    bad = ov[:-7] + ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=3"]
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=3"):
        import_verl(load_verl_config("ppo_megatron_trainer", bad))


@pytest.mark.parametrize("config,extra,key", [
    ("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.param_offload=True"],
     "actor_rollout_ref.actor.megatron.param_offload"),
    ("ppo_megatron_trainer", ["actor_rollout_ref.rollout.data_parallel_size=2"],
     "actor_rollout_ref.rollout.data_parallel_size"),
    ("ppo_trainer", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=4"], "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
    ("ppo_trainer", ["actor_rollout_ref.actor.fsdp_config.offload_policy=True"],
     "actor_rollout_ref.actor.fsdp_config.offload_policy"),
    ("ppo_trainer", ["actor_rollout_ref.actor.fsdp_config.param_offload=False"],
     "actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
])
def test_settings_still_refused_are_named(qwen, config, extra, key):
    base = grpo_megatron_7b(qwen["7b"]) if config == "ppo_megatron_trainer" else fsdp_offload_05b(qwen["0.5b"])
    imp = import_verl(load_verl_config(config, base + extra))
    assert key in [u.key for u in imp.unexpressible]
    rep = compare(imp)
    assert rep["user"]["expressible"] is False and "evaluation" not in rep["user"]
    assert key in [u["key"] for u in rep["user"]["not_expressible"]]


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


def _check_keys(config: str, overrides: list[str]) -> None:
    """Every override is a key of verl's generated full config (OmegaConf struct mode; ``+`` adds one
    inside a free-form section) and Hydra composes the config with it."""
    from omegaconf import OmegaConf, open_dict

    full = OmegaConf.load(verl_config_dir() / f"_generated_{config}.yaml")
    OmegaConf.set_struct(full, True)
    for o in overrides:
        k, _, v = o.partition("=")
        if k.startswith("+"):
            parent = OmegaConf.select(full, k[1:].rsplit(".", 1)[0])
            assert parent is not None, o  # the section exists; the key is new inside it
            with open_dict(full):
                OmegaConf.update(full, k[1:], v, force_add=True)
        else:
            OmegaConf.update(full, k, v)  # raises on a key verl does not define


@pytest.mark.parametrize("algo,backend", [("grpo", "megatron"), ("ppo", "megatron"), ("grpo", "fsdp"), ("ppo", "fsdp")])
def test_export_composes_in_struct_mode_and_round_trips(qwen, algo, backend):
    ov = grpo_megatron_7b(qwen["7b"]) + ([f"critic.model.path={qwen['7b']}", "critic.ppo_micro_batch_size_per_gpu=4",
                                          "algorithm.adv_estimator=gae"] if algo == "ppo" else [])
    imp = import_verl(load_verl_config("ppo_megatron_trainer", ov))
    best = plan_job(imp.job)
    ex = export_verl(imp.job, best, model_path=qwen["7b"], backends=(backend,))
    assert ex["config_name"] == {"megatron": "ppo_megatron_trainer", "fsdp": "ppo_trainer"}[backend]
    _check_keys(ex["config_name"], ex["overrides"])
    # Hydra composes verl's own trainer config with every exported override, and each value lands
    cfg = load_verl_config(ex["config_name"], ex["overrides"])
    for o in ex["overrides"]:
        k, _, v = o.partition("=")
        node = cfg
        for part in k.lstrip("+").split("."):
            node = node[part]
        assert str(node).lower() in (v.lower(), "none" if v == "null" else v.lower()), o
    back = import_verl(cfg)
    assert back.expressible, back.unexpressible
    assert layout_key(back.layout) == layout_key(ex["layout"])  # round trip, zero/offload/vpp included
    # everything but vLLM's fraction, which the export sets to what the planned concurrency needs
    frac = float(next(o for o in ex["overrides"] if ".rollout.gpu_memory_utilization=" in o).split("=")[1])
    # and the backend's logits kernel (verl's FSDP engine: bf16 logits, flash-attn's cross-entropy)
    kernel = {"megatron": None, "fsdp": "flash_ce"}[backend]
    assert back.job.workload == replace(imp.job.workload, rollout_memory_fraction=frac, logits_kernel=kernel)
    assert back.job.framework.to_dict() == ex["framework_spec"]
    ev = compare(back)["user"]["evaluation"]
    assert ev["l_step"] == pytest.approx(ex["l_step"], rel=1e-9) and ev["fits"]


def test_export_picks_the_faster_backend_and_time_is_the_serial_sum(qwen):
    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    ex = export_verl(imp.job, plan_job(imp.job), backends=("megatron", "fsdp"))
    per = {b: export_verl(imp.job, plan_job(imp.job), backends=(b,))["l_step"] for b in ("megatron", "fsdp")}
    assert ex["l_step"] == pytest.approx(min(per.values())) and ex["backend"] == min(per, key=per.get)
    cost = CostModel(verl_job(imp.job, ex["backend"]))
    t = {c.model_stage: cost.estimate_candidate(c, True).time for c in ex["layout"]}
    # every model-stage runs on all 16 GPUs: each stage takes the sum of its model-stages' times
    want = t["actor.generate"] + (t["actor.infer"] + t["reference.infer"]) + t["actor.train"]
    assert ex["l_step"] == pytest.approx(want, rel=1e-9)
    assert ex["evaluation"].fits
    ev = evaluate_layout(verl_job(imp.job, ex["backend"]), ex["layout"])
    assert ev.shared == ["infer"]


def test_verl_expressible_names_what_verl_cannot_run(qwen):
    from dataclasses import replace

    from nereus.integrations.verl_export import verl_expressible

    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    assert verl_expressible(imp.job, imp.layout, "megatron") is None  # the user's own layout
    by = {c.model_stage: c for c in imp.layout}
    bad = [replace(c, tp=1, pp=1, dp=16) if c.model_stage == "actor.infer" else c for c in imp.layout]
    assert "actor.infer does not run on actor.train's engine" in verl_expressible(imp.job, bad, "megatron")
    bad = [replace(c, offload="drop") if c.model_stage == "reference.infer" else c for c in imp.layout]
    assert "reference.infer has offload 'drop'" in verl_expressible(imp.job, bad, "megatron")
    bad = [replace(c, dp=2, gpus=tuple(range(8))) if c.model_stage == "reference.infer" else c for c in imp.layout]
    assert "not on all 16 GPUs" in verl_expressible(imp.job, bad, "megatron")
    assert "FSDP engines are data-parallel" in verl_expressible(imp.job, imp.layout, "fsdp")
    assert by["actor.train"].zero == 1


def test_export_takes_the_planners_plan_when_verl_runs_it_and_it_is_faster(qwen, monkeypatch):
    from dataclasses import replace

    import nereus.integrations.verl_export as v
    from nereus.spec.plan import Plan

    imp = import_verl(load_verl_config("ppo_megatron_trainer", grpo_megatron_7b(qwen["7b"])))
    user = Plan(candidates=imp.layout, l_step=1.0)
    real = v.closest_verl_layout

    def slower(job, headroom=None, backends=("megatron",)):  # the grid's layout made slow on purpose
        b, j, cands = real(job, headroom, backends)
        return b, j, tuple(replace(c, concurrency=1) if c.model_stage == "actor.generate" else c for c in cands)

    monkeypatch.setattr(v, "closest_verl_layout", slower)
    ex = v.export_verl(imp.job, user, model_path=qwen["7b"])
    assert layout_key(ex["layout"]) == layout_key(imp.layout) and ex["changes"] == []
    back = import_verl(load_verl_config(ex["config_name"], ex["overrides"]))
    assert layout_key(back.layout) == layout_key(imp.layout)


def test_ulysses_lora_dynamic_bsz_are_expressed(qwen):
    # Ulysses sp 2 on 8 GPUs: verl's DP is 8/2 = 4; mini-batch 64 x 4 = 256 sequences -> 64 per DP rank,
    # micro-batch 8 -> 8 accumulation steps; the 7B's 28 heads split over 2
    base = fsdp_offload_05b(qwen["7b"], ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                          "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                                          "actor_rollout_ref.model.lora_rank=32"])
    imp = import_verl(load_verl_config("ppo_trainer", base))
    assert imp.expressible, imp.unexpressible
    by = {c.model_stage: c for c in imp.layout}
    a = by["actor.train"]
    assert (a.dp, a.cp, a.micro_batch, a.grad_accum, a.num_gpus) == (4, 2, 8, 8, 8)
    assert (by["actor.infer"].dp, by["actor.infer"].cp, by["reference.infer"].cp) == (4, 2, 2)
    assert imp.job.workload.lora_rank == 32
    assert imp.job.workload.rollout_memory_fraction == 0.5
    # token budget 16384 per GPU x sp 2 over prompt 512 + response 1024 = 1536 tokens: 21 sequences fit,
    # the largest divisor of the 64 sequences per DP rank that is <= 21 is 16
    dyn = import_verl(load_verl_config("ppo_trainer", base + ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                                                              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"]))
    d = {c.model_stage: c for c in dyn.layout}["actor.train"]
    assert (d.micro_batch, d.grad_accum) == (16, 4)
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=512"):
        import_verl(load_verl_config("ppo_trainer", base + ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                                                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"]))


def test_single_gpu_fsdp_is_not_zero3(qwen):
    imp = import_verl(load_verl_config("ppo_trainer", fsdp_offload_05b(qwen["0.5b"], [
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])))
    by = {c.model_stage: c for c in imp.layout}
    assert (by["actor.train"].dp, by["actor.train"].zero, by["actor.infer"].zero) == (1, 0, 0)
