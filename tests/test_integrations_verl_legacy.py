"""verl override keys of older releases read under the installed verl's names
(nereus/integrations/verl_legacy.py): every rule exercised with the installed verl's config (old key in,
the new key's value out, or dropped / refused by name), a conflict between a legacy key and its new
name refused naming both, unknown keys still refused by Hydra."""

import pytest

from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir
from nereus.integrations.verl_legacy import LEGACY, translate

needs_verl = pytest.mark.skipif(verl_config_dir() is None, reason="verl not installed")

FSDP, MEG = "ppo_trainer", "ppo_megatron_trainer"
_BASE = ["data.train_batch_size=8", "actor_rollout_ref.model.path=x"]

#: (config, overrides, the legacy key, expected): expected is {new key: value} for a rename (the value
#: as written on the line, hence as Hydra composes it), "dropped", or a regex of the refusal
CASES = [
    (FSDP, ["actor_rollout_ref.actor.fsdp_config.grad_offload=True"], "actor_rollout_ref.actor.fsdp_config.grad_offload",
     "dropped"),
    (FSDP, ["critic.model.fsdp_config.grad_offload=True"], "critic.model.fsdp_config.grad_offload", "dropped"),
    (MEG, ["actor_rollout_ref.actor.megatron.grad_offload=True"], "actor_rollout_ref.actor.megatron.grad_offload",
     "dropped"),
    (MEG, ["actor_rollout_ref.ref.param_offload=True"], "actor_rollout_ref.ref.param_offload",
     {"actor_rollout_ref.ref.megatron.param_offload": True}),
    (FSDP, ["critic.model.fsdp_config.param_offload=True"], "critic.model.fsdp_config.param_offload",
     {"critic.fsdp.param_offload": True}),
    (FSDP, ["critic.model.fsdp_config.fsdp_size=4"], "critic.model.fsdp_config.fsdp_size", {"critic.fsdp.fsdp_size": 4}),
    (MEG, ["actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=2"],
     "actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage",
     r"num_layers_per_virtual_pipeline_stage=2.*35555d8ae.*virtual_pipeline_model_parallel_size"),
    (MEG, ["critic.megatron.num_layers_per_virtual_pipeline_stage=null"],
     "critic.megatron.num_layers_per_virtual_pipeline_stage", "dropped"),
    (MEG, ["actor_rollout_ref.model.enable_gradient_checkpointing=True",
           "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_granularity=full"],
     "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_granularity",
     {"actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity": "full"}),
    (MEG, ["critic.model.enable_gradient_checkpointing=True",
           "critic.model.gradient_checkpointing_kwargs.activations_checkpoint_num_layers=2"],
     "critic.model.gradient_checkpointing_kwargs.activations_checkpoint_num_layers",
     {"critic.megatron.override_transformer_config.recompute_num_layers": 2}),
    (FSDP, ["actor_rollout_ref.rollout.engine_kwargs.swap_space=8"], "actor_rollout_ref.rollout.engine_kwargs.swap_space",
     {"actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space": 8}),
    (FSDP, ["actor_rollout_ref.rollout.engine_kwargs.attention_backend=triton"],
     "actor_rollout_ref.rollout.engine_kwargs.attention_backend",
     {"actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend": "triton"}),
    (MEG, ["actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"],
     "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",
     {"actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache": True}),
    (FSDP, ["actor_rollout_ref.rollout.update_weights_bucket_megabytes=1024"],
     "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
     {"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 1024}),
    (FSDP, ["actor_rollout_ref.rollout.multi_turn.max_turns=5"], "actor_rollout_ref.rollout.multi_turn.max_turns",
     {"actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 5}),
    (FSDP, ["actor_rollout_ref.rollout.multi_turn.completion_callback=my.Callback"],
     "actor_rollout_ref.rollout.multi_turn.completion_callback", "dropped"),
    (FSDP, ["actor_rollout_ref.rollout.chat_scheduler=my.Scheduler"], "actor_rollout_ref.rollout.chat_scheduler",
     "dropped"),
    (FSDP, ["actor_rollout_ref.rollout.use_fire_sampling=True"], "actor_rollout_ref.rollout.use_fire_sampling",
     "dropped"),
    (MEG, ["actor_rollout_ref.rollout.layer_name_map.qkv_layer_name=qkv"],
     "actor_rollout_ref.rollout.layer_name_map.qkv_layer_name", "dropped"),
    (FSDP, ["reward_model.sandbox_fusion.url=http://sandbox"], "reward_model.sandbox_fusion.url",
     {"reward.sandbox_fusion.url": "http://sandbox"}),
    (FSDP, ["reward_model.launch_reward_fn_async=True"], "reward_model.launch_reward_fn_async", "dropped"),
    (FSDP, ["reward_model.enable=True", "reward_model.micro_batch_size_per_gpu=8"], "reward_model.micro_batch_size_per_gpu",
     r"reward_model.micro_batch_size_per_gpu=8.*4ef45d093.*reward.reward_model.rollout"),
    (FSDP, ["reward_model.model.fsdp_config.param_offload=True"], "reward_model.model.fsdp_config.param_offload",
     "dropped"),
    (MEG, ["actor_rollout_ref.actor.optim.warmup_style=cosine"], "actor_rollout_ref.actor.optim.warmup_style", "dropped"),
    (MEG, ["critic.kl_ctrl.kl_coef=0.01"], "critic.kl_ctrl.kl_coef", "dropped"),
    (MEG, ["actor_rollout_ref.actor.load_weight=True"], "actor_rollout_ref.actor.load_weight", "dropped"),
    (FSDP, ["actor_rollout_ref.actor.checkpoint.contents=[model]"], "actor_rollout_ref.actor.checkpoint.contents",
     {"actor_rollout_ref.actor.checkpoint.save_contents": ["model"],
      "actor_rollout_ref.actor.checkpoint.load_contents": ["model"]}),
    (FSDP, ["trainer.remove_previous_ckpt_in_save=True"], "trainer.remove_previous_ckpt_in_save", "dropped"),
    (FSDP, ["trainer.val_generations_to_log_to_wandb=10"], "trainer.val_generations_to_log_to_wandb",
     {"trainer.log_val_generations": 10}),
    (FSDP, ["ray_init.num_cpus=16"], "ray_init.num_cpus", {"ray_kwargs.ray_init.num_cpus": 16}),
    (FSDP, ["ray_init.timeline_json_file=/tmp/t.json"], "ray_init.timeline_json_file",
     {"ray_kwargs.timeline_json_file": "/tmp/t.json"}),
    (FSDP, ["trainer.profile_steps=[1,2]"], "trainer.profile_steps", "dropped"),
    (FSDP, ["reward_model.profiler.all_ranks=True"], "reward_model.profiler.all_ranks", "dropped"),
    (FSDP, ["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"], "actor_rollout_ref.actor.tis_imp_ratio_cap", "dropped"),
    (FSDP, ["data.sampler.class_path=my.sampler"], "data.sampler.class_path", "dropped"),
    (FSDP, ["trainer.use_legacy_worker_impl=auto"], "trainer.use_legacy_worker_impl", "dropped"),
]


def _at(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _rule(key: str):
    return next(r for r in LEGACY if __import__("re").fullmatch(r.pattern, key))


def test_every_rule_has_a_case_and_cites_a_commit():
    covered = {id(_rule(key)) for _, _, key, _ in CASES}
    assert [r.pattern for r in LEGACY if id(r) not in covered] == []
    for r in LEGACY:
        assert r.kind in ("renamed", "dropped", "refused") and r.source and r.why
        assert bool(r.to) == (r.kind == "renamed")


@needs_verl
@pytest.mark.parametrize("config,ovs,key,want", CASES, ids=[c[2] for c in CASES])
def test_each_legacy_key_is_read_under_the_installed_name(config, ovs, key, want):
    if isinstance(want, str) and want != "dropped":
        with pytest.raises(ValueError, match=want):
            load_verl_config(config, _BASE + ovs)
        return
    cfg = load_verl_config(config, _BASE + ovs)
    notes = [r.note() for r in cfg.legacy]
    assert [r.old for r in cfg.legacy] == [key]
    if want == "dropped":
        assert cfg.legacy[0].new == () and f"legacy key {key}=" in notes[0] and "dropped" in notes[0]
        return
    assert {k: _at(cfg, k) for k in want} == want
    assert f"legacy key {key}=" in notes[0] and f"read as {' and '.join(want)}" in notes[0]


@needs_verl
def test_gated_keys_are_dropped_without_their_gate():
    # verl <= 0.4 applied the Megatron recompute kwargs only under enable_gradient_checkpointing=True
    # (volcengine/verl@v0.4.1 verl/single_controller/base/megatron/worker.py), and the reward-model worker's
    # settings only with reward_model.enable
    k = "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_granularity"
    cfg = load_verl_config(MEG, _BASE + [f"{k}=full"])
    assert cfg.legacy[0].new == () and "only with actor_rollout_ref.model.enable_gradient_checkpointing=True" in \
        cfg.legacy[0].note()
    assert _at(cfg, "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity") is None
    cfg = load_verl_config(FSDP, _BASE + ["reward_model.micro_batch_size_per_gpu=8"])
    assert cfg.legacy[0].new == () and "reward_model.enable=True" in cfg.legacy[0].note()


@needs_verl
def test_a_legacy_key_and_its_new_name_disagreeing_are_refused_naming_both():
    old, new = "critic.model.fsdp_config.param_offload", "critic.fsdp.param_offload"
    with pytest.raises(ValueError, match=rf"{old}=True .*read as {new}.* and {new}=False disagree"):
        load_verl_config(FSDP, _BASE + [f"{old}=True", f"{new}=False"])
    with pytest.raises(ValueError, match=rf"{new}=False disagree"):  # in either order
        load_verl_config(FSDP, _BASE + [f"{new}=False", f"{old}=True"])
    cfg = load_verl_config(FSDP, _BASE + [f"{old}=True", f"{new}=True"])  # agreeing: read once
    assert cfg["critic"]["fsdp"]["param_offload"] is True and [r.new for r in cfg.legacy] == [(new,)]


@needs_verl
def test_unknown_keys_are_still_refused_by_hydra_and_installed_keys_untouched():
    for ov in ("trainer.no_such_key=1", "critic.model.fsdp_config.no_such_key=1"):  # critic.fsdp lacks it too
        with pytest.raises(ValueError, match=ov.partition("=")[0].replace(".", r"\.")):
            load_verl_config(FSDP, _BASE + [ov])
    # the FSDP config still has optim.warmup_style (only the Megatron one renamed it): kept as written
    cfg = load_verl_config(FSDP, _BASE + ["actor_rollout_ref.actor.optim.warmup_style=cosine"])
    assert cfg.legacy == () and cfg["actor_rollout_ref"]["actor"]["optim"]["warmup_style"] == "cosine"


def test_translate_by_hand_without_verl():
    ovs = ["+critic.model.fsdp_config.param_offload=True", "trainer.nnodes=1", "~trainer.logger",
           "actor_rollout_ref.actor.megatron.grad_offload=False"]
    out, rw = translate(ovs, installed={"critic.fsdp.param_offload", "trainer.nnodes", "trainer.logger"})
    # the user's + is kept on the renamed key; a deletion and installed keys pass through; grad_offload dropped
    assert out == ["+critic.fsdp.param_offload=True", "trainer.nnodes=1", "~trainer.logger"]
    assert [(r.old, r.value, r.new) for r in rw] == [
        ("critic.model.fsdp_config.param_offload", True, ("critic.fsdp.param_offload",)),
        ("actor_rollout_ref.actor.megatron.grad_offload", False, ())]
    # the installed config lacking the new name: left for Hydra to name
    assert translate(["critic.model.fsdp_config.param_offload=True"], installed=set())[0] == \
        ["critic.model.fsdp_config.param_offload=True"]


@needs_verl
def test_megatron_grad_offload_imports_as_param_offload_alone():
    # verl never read grad_offload (assigned to _is_offload_grad, unused); the gradient buffer follows
    # param_offload, which the import expresses: the same layout with and without the legacy key
    meg = _BASE[:1] + ["data.max_prompt_length=512", "data.max_response_length=512", "trainer.n_gpus_per_node=8",
                       "trainer.nnodes=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                       "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                       "actor_rollout_ref.actor.megatron.param_offload=True",
                       "actor_rollout_ref.actor.megatron.optimizer_offload=True"]
    a = import_verl(load_verl_config(MEG, meg), model="qwen2.5-0.5b")
    b = import_verl(load_verl_config(MEG, meg + ["actor_rollout_ref.actor.megatron.grad_offload=True"]),
                    model="qwen2.5-0.5b")
    assert a.layout == b.layout and a.job == b.job
    train = next(c for c in b.layout if c.model_stage == "actor.train")
    assert train.offload == "host" and train.tp == 2
    assert any(n.startswith("legacy key actor_rollout_ref.actor.megatron.grad_offload=True dropped") and "#7544" in n
               for n in b.notes)


@needs_verl
def test_cli_export_of_a_legacy_line_keeps_the_settings_under_the_installed_names(tmp_path, capsys):
    import json

    from nereus.cli import main

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}))
    line = ["algorithm.adv_estimator=grpo", "data.train_batch_size=64", "data.max_prompt_length=256",
            "data.max_response_length=256", f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.n_gpus_per_node=8",
            "trainer.nnodes=1", "actor_rollout_ref.actor.fsdp_config.grad_offload=False",
            "critic.model.fsdp_config.param_offload=False", "trainer.val_generations_to_log_to_wandb=5"]
    rc = main(["plan", "--export", "verl", "--json", "--from-verl", "python3", "-m", "verl.trainer.main_ppo", *line])
    out = capsys.readouterr()
    assert rc == 0, out.err
    ov = json.loads(out.out)["overrides"]
    assert "trainer.log_val_generations=5" in ov and "critic.fsdp.param_offload=False" in ov
    assert not any(o.startswith(("trainer.val_generations", "critic.model.fsdp_config", "actor_rollout_ref.actor."
                                 "fsdp_config.grad_offload")) for o in ov)
    assert load_verl_config("ppo_trainer", ov).legacy == ()  # the export composes with no legacy key left
