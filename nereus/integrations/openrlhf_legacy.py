"""OpenRLHF's flat option names (0.2 to 0.10: ``--pretrain``, ``--zero_stage``, ``--vllm_num_engines``...)
translated to the dotted names of 0.11 (``--actor.model_name_or_path``, ``--ds.zero_stage``...), so
the command lines in users' reports and older examples import as written.

Sources: the names are paired by their help text in the diff of commit ``ed62d0e2`` ("dotted config
hierarchy", OpenRLHF/OpenRLHF, 2026-04-19) of ``openrlhf/cli/train_ppo_ray.py``, and by hand for
the options whose help changed there (:data:`RENAMED` lists both). Older names still: ``--prompt_max_len``
and ``--generate_max_len`` (until ``d0e088b6``, 2026-03-24) become ``--data.max_len`` (their sum) and
``--rollout.max_new_tokens``; ``--bf16`` is ``--ds.param_dtype bf16``; ``--ref_reward_offload`` is
``--ref.offload --reward.offload``; ``--use_kl_estimator_k3`` (0.5-0.6) is ``--algo.kl.estimator k3``;
``examples/train_ppo_ray.py`` (0.2-0.3) is the entry point.

Defaults: a flat-name line that leaves an option out ran with that release's default, not 0.11's.
Where they differ and the cost model reads the option, the flat-name default is filled in
(:data:`LEGACY_DEFAULTS`, OpenRLHF v0.8.0's ``train_ppo_ray.py``): ``--micro_train_batch_size`` 4,
``--micro_rollout_batch_size`` 8, ``--prompt_max_len`` 1024, ``--generate_max_len`` 1024 (0.11: 1, 1,
no prompt length, no response length). A line that also uses 0.11's dotted names ran 0.11's parser,
so it takes 0.11.2's micro-batch defaults (1 and 1) and its flat names are translated with a note
(0.11.2's parser itself would reject them). ``--vllm_gpu_memory_utilization`` defaults to 0.95 from v0.6.4
(OpenRLHF/OpenRLHF@v0.6.4 ``openrlhf/cli/train_ppo_ray.py``); v0.5.8 to v0.6.3 default it to 0.9 and
earlier releases pass none, so vLLM's own 0.9 applies: with the line's OpenRLHF version given
(``version``) and older than v0.6.4, 0.9 is filled in, else 0.95; said in the notes.
"""

from __future__ import annotations

from nereus.integrations.framework_versions import version_key

__all__ = ["RENAMED", "DROPPED", "REFUSED", "LEGACY_DEFAULTS", "is_legacy", "translate_legacy"]

#: flat name -> dotted name (OpenRLHF 0.11)
RENAMED = {
    "--ref_num_nodes": "--ref.num_nodes", "--ref_num_gpus_per_node": "--ref.num_gpus_per_node",
    "--reward_num_nodes": "--reward.num_nodes", "--reward_num_gpus_per_node": "--reward.num_gpus_per_node",
    "--actor_num_nodes": "--actor.num_nodes", "--actor_num_gpus_per_node": "--actor.num_gpus_per_node",
    "--critic_num_nodes": "--critic.num_nodes", "--critic_num_gpus_per_node": "--critic.num_gpus_per_node",
    "--colocate_actor_ref": "--train.colocate_actor_ref", "--colocate_critic_reward": "--train.colocate_critic_reward",
    "--colocate_all_models": "--train.colocate_all", "--vllm_num_engines": "--vllm.num_engines",
    "--vllm_tensor_parallel_size": "--vllm.tensor_parallel_size", "--vllm_sync_backend": "--vllm.sync_backend",
    "--enforce_eager": "--vllm.enforce_eager", "--vllm_enable_sleep": "--vllm.enable_sleep",
    "--vllm_gpu_memory_utilization": "--vllm.gpu_memory_utilization", "--vllm_sync_with_ray": "--vllm.sync_with_ray",
    "--enable_prefix_caching": "--vllm.enable_prefix_caching", "--async_train": "--train.async_enable",
    "--async_queue_size": "--train.async_queue_size", "--zero_stage": "--ds.zero_stage",
    "--param_dtype": "--ds.param_dtype", "--enable_ema": "--train.enable_ema", "--ema_beta": "--train.ema_beta",
    "--zpg": "--ds.zpg", "--adam_offload": "--ds.adam_offload", "--attn_implementation": "--ds.attn_implementation",
    "--use_liger_kernel": "--ds.use_liger_kernel", "--grad_accum_dtype": "--ds.grad_accum_dtype",
    "--deepspeed_enable_sleep": "--ds.enable_sleep", "--ds_tensor_parallel_size": "--ds.tensor_parallel_size",
    "--rollout_batch_size": "--rollout.batch_size", "--max_len": "--data.max_len",
    "--max_new_tokens": "--rollout.max_new_tokens", "--max_samples": "--data.max_samples",
    "--eps_clip": "--actor.eps_clip", "--value_clip": "--critic.value_clip", "--lambd": "--algo.advantage.lambd",
    "--gamma": "--algo.advantage.gamma", "--micro_train_batch_size": "--train.micro_batch_size",
    "--train_batch_size": "--train.batch_size", "--normalize_reward": "--reward.normalize_enable",
    "--n_samples_per_prompt": "--rollout.n_samples_per_prompt", "--init_kl_coef": "--algo.kl.init_coef",
    "--kl_estimator": "--algo.kl.estimator", "--advantage_estimator": "--algo.advantage.estimator",
    "--use_kl_loss": "--algo.kl.use_loss", "--ring_attn_size": "--ds.ring_attn_size",
    "--ring_head_stride": "--ds.ring_attn_head_stride", "--remote_rm_url": "--reward.remote_url",
    "--agent_func_path": "--train.agent_func_path", "--prompt_data": "--data.prompt_dataset",
    "--prompt_data_probs": "--data.prompt_probs", "--apply_chat_template": "--data.apply_chat_template",
    "--eval_steps": "--eval.steps", "--save_steps": "--ckpt.save_steps", "--logging_steps": "--logger.logging_steps",
    "--ckpt_path": "--ckpt.path", "--save_hf_ckpt": "--ckpt.save_hf", "--disable_ds_ckpt": "--ckpt.disable_ds",
    "--max_ckpt_num": "--ckpt.max_num", "--max_ckpt_mem": "--ckpt.max_mem", "--load_checkpoint": "--ckpt.load_enable",
    "--gradient_checkpointing": "--actor.gradient_checkpointing_enable", "--deepcompile": "--ds.deepcompile",
    "--overlap_comm": "--ds.overlap_comm",
    "--gradient_checkpointing_use_reentrant": "--actor.gradient_checkpointing_reentrant",
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer", "--packing_samples": "--ds.packing_samples",
    "--use_dynamic_batch": "--train.dynamic_batch_enable", "--rollout_max_tokens_per_gpu": "--rollout.max_tokens_per_gpu",
    "--train_max_tokens_per_gpu": "--train.max_tokens_per_gpu", "--load_in_4bit": "--ds.load_in_4bit",
    "--lora_rank": "--ds.lora.rank", "--lora_alpha": "--ds.lora.alpha", "--target_modules": "--ds.lora.target_modules",
    "--lora_dropout": "--ds.lora.dropout", "--save_path": "--ckpt.output_dir", "--num_episodes": "--train.num_episodes",
    "--micro_rollout_batch_size": "--rollout.micro_batch_size", "--max_epochs": "--train.max_epochs",
    "--top_p": "--rollout.top_p", "--temperature": "--rollout.temperature", "--seed": "--train.seed",
    "--actor_learning_rate": "--actor.adam.lr", "--critic_learning_rate": "--critic.adam.lr",
    "--kl_target": "--algo.kl.target", "--kl_horizon": "--algo.kl.horizon", "--policy_loss_type": "--actor.policy_loss_type",
    "--pretrain": "--actor.model_name_or_path", "--reward_pretrain": "--reward.model_name_or_path",
    "--critic_pretrain": "--critic.model_name_or_path", "--value_head_prefix": "--ds.value_head_prefix",
    "--prompt_split": "--data.prompt_split", "--eval_dataset": "--eval.dataset", "--eval_split": "--eval.split",
    "--input_key": "--data.input_key", "--label_key": "--data.label_key", "--input_template": "--data.input_template",
    "--use_wandb": "--logger.wandb.key", "--wandb_org": "--logger.wandb.org", "--wandb_group": "--logger.wandb.group",
    "--wandb_project": "--logger.wandb.project", "--use_tensorboard": "--logger.tensorboard_dir",
}
#: flat options with no 0.11 counterpart that change neither memory nor step time as the cost model
#: sees them (optimizer hyper-parameters, init placement, the attention kernel 0.11 always uses)
DROPPED = ("--flash_attn", "--actor_init_on_gpu", "--max_norm", "--l2", "--lr_warmup_ratio", "--lr_scheduler",
           "--adam_betas", "--perf", "--wandb_run_name", "--freezing_actor_steps", "--torch_compile")
#: flat options that change memory or time in a way the cost model does not express, with why
REFUSED = {
    "--pretrain_data": "PPO-ptx (a pre-training loss on --pretrain_data in each actor update: another forward and "
                       "backward per micro-batch) is not in the cost model",
    "--ptx_coef": "PPO-ptx (see --pretrain_data) is not in the cost model",
}
#: OpenRLHF v0.8.0 defaults of the options the cost model reads, where 0.11's differ
LEGACY_DEFAULTS = {"--micro_train_batch_size": "4", "--micro_rollout_batch_size": "8",
                   "--prompt_max_len": "1024", "--generate_max_len": "1024"}
_MICRO = ("--micro_train_batch_size", "--micro_rollout_batch_size")
#: OpenRLHF 0.11.2's defaults of :data:`_MICRO` (openrlhf/cli/train_ppo_ray.py: --train.micro_batch_size and
#: --rollout.micro_batch_size, default=1)
_V011 = {"--micro_train_batch_size": 1, "--micro_rollout_batch_size": 1}
_SPECIAL = ("--prompt_max_len", "--generate_max_len", "--bf16", "--ref_reward_offload", "--use_kl_estimator_k3")
_ENTRIES = ("openrlhf.cli.train_ppo_ray", "examples/train_ppo_ray.py", "train_ppo_ray.py",
            "openrlhf/cli/train_ppo_ray.py")


def _groups(toks):
    out = []
    for t in toks:
        if t.startswith("--") or not out:
            out.append([t])
        else:
            out[-1].append(t)
    return out


def _entry_cut(toks: list[str]) -> list[str]:
    for i, t in enumerate(toks):
        if any(t == e or t.endswith("/" + e) for e in _ENTRIES):
            return toks[i + 1:]
    return toks


def is_legacy(toks) -> bool:
    """Whether option tokens use OpenRLHF's flat (pre-0.11) names."""
    names = {g[0].split("=", 1)[0] for g in _groups(_entry_cut(list(toks)))}
    return bool(names & (set(RENAMED) | set(DROPPED) | set(REFUSED) | set(_SPECIAL)))


def translate_legacy(toks, version: str | None = None) -> tuple[list[str], list[str], list[tuple[str, object, str]]]:
    """Flat-name option tokens as OpenRLHF 0.11 tokens: ``(tokens, notes, refused)``; ``refused`` holds
    ``(option, value, why)`` for :data:`REFUSED` options (to be named, never dropped). ``version``: the
    OpenRLHF release the line ran (None: not known), for ``--vllm_gpu_memory_utilization``'s default.

    Raises:
        ValueError: an option that is neither a flat nor a dotted OpenRLHF name is left to OpenRLHF's
            own parser, which names it; ``--prompt_max_len``/``--generate_max_len`` that are not integers.
    """
    groups = _groups([t for t in _entry_cut(list(toks)) if t != "\\"])
    given = {g[0] for g in groups}
    out: list[str] = []
    refused: list[tuple[str, object, str]] = []
    dropped: list[str] = []
    lens = {}
    for g in groups:
        k, vals = g[0], g[1:]
        if k in ("--prompt_max_len", "--generate_max_len"):
            if len(vals) != 1 or not vals[0].isdigit():
                raise ValueError(f"OpenRLHF argument {k} {' '.join(vals)!r}: must be one integer (tokens)")
            lens[k] = int(vals[0])
        elif k == "--bf16":
            out += ["--ds.param_dtype", "bf16"]
        elif k == "--ref_reward_offload":
            out += ["--ref.offload", "--reward.offload"]
        elif k == "--use_kl_estimator_k3":  # v0.5-0.6; --kl_estimator k3 from v0.7
            out += ["--algo.kl.estimator", "k3"]
        elif k in DROPPED:
            dropped.append(k)
        elif k in REFUSED:
            refused.append((k, " ".join(vals) or True, REFUSED[k]))
        else:
            out += [RENAMED.get(k, k)] + vals
    dotted = {"--prompt_max_len": "--data.max_len", "--generate_max_len": "--rollout.max_new_tokens"}
    # a line with 0.11's dotted names ran 0.11.2's parser: its defaults for what it leaves out
    new = sorted(k for k in given if "." in k.split("=", 1)[0])
    filled = [k for k in LEGACY_DEFAULTS if k not in given and RENAMED.get(k, dotted.get(k)) not in given
              and not (new and k in _MICRO)]
    for k in _MICRO:
        if k in filled:
            out += [RENAMED[k], LEGACY_DEFAULTS[k]]
    if not given & {"--max_len", "--max_new_tokens", "--data.max_len", "--rollout.max_new_tokens"}:
        p = lens.get("--prompt_max_len", int(LEGACY_DEFAULTS["--prompt_max_len"]))
        r = lens.get("--generate_max_len", int(LEGACY_DEFAULTS["--generate_max_len"]))
        out += ["--data.max_len", str(p + r), "--rollout.max_new_tokens", str(r)]
    notes = ["OpenRLHF flat (pre-0.11) option names translated to 0.11's (--pretrain -> --actor.model_name_or_path, "
             "--prompt_max_len + --generate_max_len -> --data.max_len, ...)"]
    if new:
        flat = sorted(given & (set(RENAMED) | set(DROPPED) | set(REFUSED) | set(_SPECIAL)))
        notes.append(f"the line mixes OpenRLHF 0.11 option names ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}) "
                     f"with flat ones ({', '.join(flat)}): the flat ones are translated, though OpenRLHF 0.11.2's "
                     "own parser rejects them (unrecognized arguments); options left out take 0.11.2's defaults "
                     f"({', '.join(f'{RENAMED[k]} {_V011[k]}' for k in _MICRO if k not in given and RENAMED[k] not in given)})")
    if filled:
        notes.append("flat-name defaults of OpenRLHF v0.8.0 filled in: " + ", ".join(f"{k} {LEGACY_DEFAULTS[k]}"
                                                                               for k in filled))
    if "--vllm_gpu_memory_utilization" not in given and "--vllm.gpu_memory_utilization" not in given:
        if version is not None and version_key(version) < version_key("0.6.4"):
            out += ["--vllm.gpu_memory_utilization", "0.9"]
            notes.append(f"--vllm_gpu_memory_utilization not given: 0.9 (OpenRLHF {version}: before v0.6.4 the "
                         "default, or vLLM's own, is 0.9)")
        else:
            notes.append("--vllm_gpu_memory_utilization not given: 0.95 (OpenRLHF >= 0.6.4; 0.9 before)")
    if dropped:
        notes.append(f"no 0.11 counterpart, no effect on the cost model: {', '.join(dropped)}")
    return out, notes, refused
