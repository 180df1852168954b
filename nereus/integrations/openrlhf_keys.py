"""Every option of OpenRLHF 0.11's ``train_ppo_ray`` parser, classified like verl's keys
(:mod:`nereus.integrations.verl_keys`): an option the importer reads is expressed; the others are
in :data:`NO_EFFECT` (no effect on memory or time as the cost model defines them), :data:`NOTED` (an
effect the cost model bounds or leaves out: named in the notes when set away from the parser's
default) or :data:`REFUSED` (outside the plan space: named as not expressible).
``tests/test_integrations_keys.py`` walks the parser and checks every option is read or classified.
"""

from __future__ import annotations

import re

from nereus.integrations.common import Unexpressible

__all__ = ["NO_EFFECT", "NOTED", "REFUSED", "classify", "classify_args"]

NO_EFFECT = [
    (r"^(actor|critic)\.(adam\..*|lr_scheduler|lr_warmup_ratio|max_norm|min_lr_ratio|muon\..*)$",
     "optimizer hyperparameters"),
    (r"^actor\.(aux_loss_coef|dual_clip|entropy_coef|eps_clip|eps_clip_low_high|loss_agg_mode|policy_loss_type"
     r"|freeze_visual_encoder)$|^critic\.(value_clip|freezing_steps|save_value_network)$", "loss coefficients"),
    (r"^algo\.(advantage\..*|kl\.(estimator|horizon|target|unbiased_gradient|use_loss))$",
     "advantage and KL coefficients (the reference model is there whenever --algo.kl.init_coef is set)"),
    (r"^(ckpt|data|eval|logger)\.|^(help|local_rank|use_ms)$", "checkpoints, data, evaluation and logging"),
    (r"^reward\.(clip_range|normalize_enable|overlong_buffer_len|overlong_penalty_factor|stop_properly_penalty_coef)$",
     "reward shaping on the driver"),
    (r"^rollout\.(temperature|top_p)$|^train\.(num_episodes|seed|ema_beta)$|^ds\.(value_head_prefix|use_universal_ckpt)$",
     "sampling parameters and run bookkeeping"),
]

NOTED = [
    (r"^ds\.(attn_implementation|packing_samples|use_liger_kernel|ring_attn_head_stride|deepcompile|experts_implementation"
     r"|param_dtype)$|^actor\.gradient_checkpointing_reentrant$|^train\.(full_determinism_enable|async_queue_size)$",
     "DeepSpeed implementation details the cost model's efficiencies stand for (packing: memory is sized at the "
     "maximum lengths, an upper bound)"),
    (r"^vllm\.(enforce_eager|enable_prefix_caching|sync_backend|sync_with_ray)$|^rollout\.vllm_generate_batch_size$",
     "vLLM options: the time model is vLLM's with CUDA graphs"),
    (r"^ds\.lora\.(alpha|dropout)$", "LoRA details (the rank and target modules are read)"),
]

REFUSED = [
    (r"^(actor|critic)\.optim$", "another optimizer than Adam changes the optimizer bytes (Nereus models fp32 Adam)"),
    (r"^ds\.load_in_4bit$", "4-bit base weights (QLoRA) are not in the cost model"),
    (r"^algo\.dynamic_filtering_enable$|^algo\.dynamic_filtering_range$",
     "dynamic filtering generates more batches than one per step"),
    (r"^train\.partial_rollout_enable$", "partial rollouts carry sequences across steps"),
    (r"^train\.enable_ema$", "an EMA copy of the actor's weights is not in the memory model"),
]

_COMPILED = {k: [(re.compile(p), why) for p, why in t] for k, t in
             (("refused", REFUSED), ("noted", NOTED), ("none", NO_EFFECT))}


def classify(option: str) -> tuple[str, str] | None:
    """``(kind, why)`` of an option name without ``--``: ``refused``, ``noted`` or ``none``; None when no
    table names it."""
    for kind in ("refused", "noted", "none"):
        for rx, why in _COMPILED[kind]:
            if rx.search(option):
                return kind, why
    return None


def classify_args(values: dict, defaults: dict, read: dict, un: list, notes: list) -> None:
    """Name every option set away from the parser's default that the import did not read."""
    for key, value in values.items():
        if key in read or key not in defaults or value == defaults[key]:
            continue
        c = classify(key)
        if c is None:
            notes.append(f"--{key} {value!r}: not an option Nereus reads; ignored")
        elif c[0] == "refused":
            un.append(Unexpressible(f"--{key}", value, c[1]))
        elif c[0] == "noted":
            notes.append(f"--{key} {value!r}: {c[1]}")
