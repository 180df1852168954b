"""Every key of verl's trainer config, classified: what the importer does with the keys it does not
read as layout (verl 0.9 names; ``_generated_ppo_trainer.yaml`` / ``_generated_ppo_megatron_trainer.yaml``).

A key the importer reads (:attr:`VerlConfig.read`) is expressed. Every other key falls in one of
three tables of regular expressions over the dotted key:

* :data:`NO_EFFECT`: no effect on memory or time as the cost model defines them (logging,
  checkpoints, data and reward paths, learning rates, loss coefficients, sampling parameters);
* :data:`NOTED`: an effect the cost model bounds or leaves out; set away from verl's default, the
  import names it in its notes and still evaluates (e.g. ``use_remove_padding``: memory is sized at
  the maximum lengths, an upper bound; ``enforce_eager``: vLLM decodes without CUDA graphs, slower
  than predicted);
* :data:`REFUSED`: an effect outside the plan space; set away from the default, the import names it
  as not expressible (:class:`~nereus.integrations.common.Unexpressible`) and does not evaluate.

:func:`classify_keys` applies them; ``tests/test_integrations_keys.py`` walks verl's full configs and
checks that every key is read or classified.
"""

from __future__ import annotations

import re
from functools import lru_cache

from nereus.integrations.common import Unexpressible

__all__ = ["EXPRESSED", "NO_EFFECT", "NOTED", "REFUSED", "classify", "classify_keys", "leaves"]

_R = r"(actor_rollout_ref\.(actor|ref|rollout)|critic|reward\.reward_model(\.rollout)?|reward_model(\.rollout)?)\."

#: keys the importer reads when their feature applies (token budgets with ``use_dynamic_bsz``, the
#: deprecated global micro-batches when the per-GPU ones are unset, LoRA targets with a rank...)
EXPRESSED = [
    (r"\.(ppo_max_token_len_per_gpu|log_prob_max_token_len_per_gpu|forward_max_token_len_per_gpu)$", "token budgets"),
    (r"\.(ppo_micro_batch_size|log_prob_micro_batch_size|forward_micro_batch_size)$", "deprecated global micro-batches"),
    (r"\.optim\.main_grads_dtype$|^algorithm\.use_kl_in_reward$|\.model\.(lora\.)?target_modules$"
     r"|\.model\.enable_gradient_checkpointing$|^critic\.(ppo_epochs|ppo_mini_batch_size)$", "read where they apply"),
]

NO_EFFECT = [
    (r"(^|\.)_target_$", "Hydra's dataclass target"),
    (r"(^|\.)seed$", "seeds"),
    (r"^actor_rollout_ref\.ref\.(megatron\.(optimizer_offload|use_distributed_optimizer|use_megatron_fsdp)"
     r"|fsdp_config\.offload_policy)$", "the reference has no optimizer; verl offloads a forward-only FSDP model anyway"),
    (r"(^|\.)profiler(\.|$)|^global_profiler\.|(^|\.)trace\.|(^|\.)prometheus\.|^ray_kwargs\.", "profiling, tracing and Ray options"),
    (r"^trainer\.(logger|project_name|experiment_name|save_freq|test_freq|total_epochs|total_training_steps|val_before_train"
     r"|val_only|default_hdfs_dir|default_local_dir|resume_mode|resume_from_path|del_local_ckpt_after_load|max_actor_ckpt_to_keep"
     r"|max_critic_ckpt_to_keep|log_val_generations|rollout_data_dir|validation_data_dir|checkpoint_callback_class"
     r"|ray_wait_register_center_timeout|esi_redundant_time|device|critic_warmup|balance_batch)$",
     "run bookkeeping (steps, logging, checkpoints, validation); balance_batch reorders sequences across DP ranks"),
    (r"^data\.(train_files|val_files|prompt_key|reward_fn_key|image_key|video_key|audio_key|image_patch_size|shuffle|seed"
     r"|validation_shuffle|dataloader_num_workers|filter_overlong_prompts|filter_overlong_prompts_workers|truncation"
     r"|tokenizer|use_shm|trust_remote_code|return_raw_input_ids|return_raw_chat|return_full_prompt|return_multi_modal_inputs"
     r"|custom_cls\..*|apply_chat_template_kwargs|mm_processor_kwargs|tool_config_path|function_tool_path|train_max_samples"
     r"|val_max_samples|val_batch_size)$", "data files, keys and loading (validation batches are outside the RL step)"),
    (r"(^|\.)optim\.(lr|lr_.*|betas|weight_decay|weight_decay_incr_style|warmup_style|min_lr|min_lr_ratio|num_cycles|clip_grad"
     r"|total_training_steps|zero_indexed_step|use_checkpoint_opt_param_scheduler|muon_.*)$",
     "optimizer hyperparameters (Adam's state and step cost do not depend on them)"),
    (_R + r"(clip_ratio.*|cliprange_value|entropy_coeff|kl_loss_coef|kl_loss_type|loss_agg_mode|loss_scale_factor|tau_pos|tau_neg"
     r"|grad_clip|shuffle|data_loader_seed|seed|policy_loss\..*|use_kl_loss|checkpoint\..*|nccl_timeout|rollout_n)$",
     "loss and optimisation coefficients, checkpoint contents, seeds"),
    (r"^algorithm\.(gamma|lam|kl_ctrl\..*|kl_penalty|norm_adv_by_std_in_grpo|pf_ppo\..*|use_pf_ppo|rollout_correction\..*)$",
     "advantage and KL coefficients (computed on the driver, negligible)"),
    (r"^actor_rollout_ref\.nccl_timeout$", "a timeout"),
    (_R + r"(temperature|top_k|top_p|do_sample|val_kwargs\..*|logprobs_mode|skip_tokenizer_init|disable_log_stats|load_format"
     r"|mode|scheduling_policy|router_config_path|prompt_length|response_length|n_gpus_per_node|calculate_log_probs"
     r"|moe_load_balance_metrics_interval|limit_images|ignore_eos|model_path)$",
     "sampling parameters and engine bookkeeping (ignore_eos: responses run to the maximum, which Nereus assumes)"),
    (r"^actor_rollout_ref\.model\.(custom_chat_template|external_lib|hf_config_path|tokenizer_path|trust_remote_code|use_shm"
     r"|lora_alpha|lora\.(alpha|dropout|dropout_position|lora_A_init_method|lora_B_init_method|freeze_vision_model"
     r"|freeze_vision_projection|freeze_language_model|a2a_experimental|type)|freeze_vision_tower)$|^critic\.model\."
     r"(custom_chat_template|external_lib|hf_config_path|tokenizer_path|trust_remote_code|use_shm|lora_alpha"
     r"|lora\.(alpha|dropout|dropout_position|lora_A_init_method|lora_B_init_method|freeze_vision_model"
     r"|freeze_vision_projection|freeze_language_model|a2a_experimental|type)|path)$|^" + _R + r"freeze_vision_tower$",
     "model loading, tokenizer and LoRA initialisation (the rank and targets are read)"),
    (r"^(reward\.(custom_reward_function|reward_manager|sandbox_fusion|num_workers)|custom_reward_function|sandbox_fusion)\b"
     r"|^reward_model\.(reward_manager|reward_loop_.*|num_workers|model\.(external_lib|trust_remote_code|path))$"
     r"|^reward\.reward_model\.(model\.(external_lib|trust_remote_code|path)|reward_loop_.*|num_workers)$",
     "rule-based reward functions run on the CPU; reward-model paths"),
    (r"^(skip|transfer_queue)\.", "debug dumps and the data transfer queue (host side)"),
    (r"^distillation\.|^algorithm\.filter_groups\.|(^|\.)multi_turn\.|(^|\.)(qat|mtp|disaggregation|router_replay"
     r"|turbo_config)(\.|$)|\.quantization_config_file$",
     "options of features that are off (their switch is refused when on)"),
]

NOTED = [
    (r"\.(use_remove_padding|pad_to_length|pad_to_length_bucket|pad_bshd_to_minibatch_max|max_seqlen_per_dp_cp_rank)$",
     "padding: Nereus sizes every micro-batch at the maximum lengths (an upper bound without padding)"),
    (r"\.(use_fused_kernels|use_liger|fused_kernel_options\..*|tiled_mlp\..*|entropy_from_logits_with_chunking"
     r"|entropy_from_logits_chunk_size|entropy_checkpointing|calculate_entropy|calculate_sum_pi_squared|use_prefix_grouper)$",
     "fused or chunked logits / MLP kernels: less memory than Nereus's logits term (an upper bound)"),
    (r"\.(use_torch_compile|forward_prefetch|use_orig_params|use_no_sync_for_gradient_accumulation|wrap_policy\..*|forward_only"
     r"|full_determinism|strategy|attention_backend|override_mcore_model_config|use_mbridge|vanilla_mbridge"
     r"|use_dist_checkpointing|dist_checkpointing_.*|dist_ckpt_optim_fully_reshardable|distrib_optim_fully_reshardable_mem_efficient"
     r"|recompute_method|recompute_num_layers|recompute_modules|override_ddp_config|override_transformer_config"
     r"|override_optimizer_config)$",
     "engine implementation details the cost model's efficiencies stand for"),
    (_R + r"(enforce_eager|cudagraph_capture_sizes|enable_chunked_prefill|enable_prefix_caching|max_num_batched_tokens"
     r"|max_model_len|engine_kwargs(\..*)?|multi_stage_wake_up|layered_summon|agent\..*|checkpoint_engine\..*"
     r"|enable_rollout_routing_replay|name|gpu_memory_utilization|free_cache_engine|max_num_seqs|tensor_model_parallel_size"
     r"|data_parallel_size|expert_parallel_size|nnodes|dtype)$",
     "vLLM engine options: the time model is vLLM's with CUDA graphs and chunked prefill of 8,192 tokens"),
    (r"^actor_rollout_ref\.model\.(lora_adapter_path|lora\.(adapter_path|merge|dtype|exclude_modules)|exclude_modules"
     r"|override_config)$|^critic\.model\.(lora_adapter_path|lora\.(adapter_path|merge|dtype|exclude_modules)"
     r"|exclude_modules|override_config|lora_rank|lora\.rank|target_modules|lora\.target_modules)$",
     "LoRA loading details and model-config overrides"),
    (r"^reward_model\.|^reward\.reward_model\.", "the legacy reward-model section and the reward engine's serving options"),
    (r"^trainer\.v1\.", "verl's v1 trainer options (its mode is read)"),
    (r"^data\.gen_batch_size$", "generation batch of dynamic sampling (DAPO)"),
]

REFUSED = [
    (r"(^|\.)optim\.(optimizer|optimizer_impl|exp_avg_dtype|exp_avg_sq_dtype|use_layer_wise_distributed_optimizer)$",
     "another optimizer or optimizer-state dtype changes the optimizer bytes (Nereus models fp32 Adam, 12 B/param)"),
    (r"\.(qat\.enable|quantization)$", "quantized training or rollout is not in the cost model"),
    (r"(^|\.)(mtp\.enable|mtp\.enable_train|mtp\.enable_rollout|disaggregation\.enabled|router_replay\.mode"
     r"|expert_tensor_parallel_size|turbo_config\.distributed\.(tensor_parallel_size|expert_parallel_size"
     r"|ulysses_parallel_size|fully_shard_parallel_size|expert_fully_shard_parallel_size))$",
     "multi-token prediction, disaggregated prefill/decode, MoE routing and FSDP-turbo layouts are not in the plan space"),
    (r"\.(fsdp|fsdp_config|megatron)\.(dtype|model_dtype)$", "another parameter dtype changes the weight bytes"),
    (r"(^|\.)multi_turn\.enable$", "multi-turn rollouts (tool calls) change the lengths the cost model assumes"),
    (r"^algorithm\.filter_groups\.enable$|\.over_sample_rate$", "dynamic sampling generates more batches than one per step"),
    (r"^distillation\.enabled$", "on-policy distillation runs a teacher model the workflow does not have"),
    (r"\.model\.enable_activation_offload$", "activation offload to host memory is not in the cost model"),
    (r"^critic\.enable$", "an explicit critic switch: Nereus runs a critic exactly for PPO (gae)"),
]

_TABLES = (("expressed", EXPRESSED), ("none", NO_EFFECT), ("noted", NOTED), ("refused", REFUSED))
_COMPILED = [(kind, [(re.compile(p), why) for p, why in table]) for kind, table in _TABLES]


def classify(key: str) -> tuple[str, str] | None:
    """``(kind, why)`` of a key not read as layout: kind ``expressed`` (read where it applies), then
    ``refused``, ``noted``, ``none``; None when no table names it."""
    for want in ("expressed", "refused", "noted", "none"):
        for kind, table in _COMPILED:
            if kind != want:
                continue
            for rx, why in table:
                if rx.search(key):
                    return kind, why
    return None


def leaves(d: dict, prefix: str = ""):
    """Dotted keys of the leaves of a nested dict (an empty dict is a leaf)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@lru_cache(maxsize=4)
def _defaults(name: str) -> dict:
    from nereus.integrations.verl_config import load_verl_config

    return dict(_flat(load_verl_config(name)))


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def classify_keys(cfg: dict, read: dict, un: list, notes: list, config_name: str = "ppo_trainer") -> None:
    """Name every key of ``cfg`` set away from verl's default that the import did not read: REFUSED
    ones in ``un``, NOTED ones in ``notes``; keys of no table and not in verl's config (a user's ``+key``)
    are noted as unread."""
    try:
        base = _defaults(config_name)
    except ValueError:  # verl absent: nothing to compare against
        return
    for key, value in _flat(cfg):
        if key in read or key not in base and key.endswith("_target_"):
            continue
        default = base.get(key, _UNSET)
        if default is not _UNSET and value == default:
            continue
        if key in _LIKE_ACTOR:  # the critic's copies default to the actor's (interpolated)
            mine = next((v for k, v in _flat(cfg) if k == _LIKE_ACTOR[key]), value)
            if value != mine:
                un.append(Unexpressible(key, value, f"differs from {_LIKE_ACTOR[key]}={mine!r}; the workload has one"))
            continue
        c = classify(key)
        if c is None or c[0] == "expressed" and key not in base:
            notes.append(f"{key}={value!r}: not a key Nereus reads; ignored")
        elif c[0] == "expressed":
            continue
        elif c[0] == "refused":
            un.append(Unexpressible(key, value, c[1]))
        elif c[0] == "noted":
            notes.append(f"{key}={value!r}: {c[1]}")


_UNSET = object()
_LIKE_ACTOR = {"critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
               "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size"}
