"""verl override keys of older releases (0.1-0.8) read under the installed verl's names.

verl renamed, merged and removed trainer-config keys between releases; a launch line written for an
older verl is refused by the installed verl's Hydra ("Could not override ..."). :func:`translate`
rewrites each legacy key of a user's overrides before they are composed
(:func:`nereus.integrations.verl_config.load_verl_config`):

* ``renamed``: the value is set under the new key(s) (``read as``); when the line also sets the new
  key, equal values are read once and different ones are refused, naming both;
* ``dropped``: verl removed the key and it changes neither memory nor time as the cost model
  defines them (logging, checkpoints, profiling, sampling, or a key verl never acted on);
* ``refused``: verl removed the key and it changes memory or time that the installed verl's keys do
  not say; refused by name, with what to write instead (an ``inert`` value, e.g. null, is dropped).

A rule may be ``gated`` by another key of the same line: the old verl read it only when the gate is
true (recompute kwargs under ``enable_gradient_checkpointing``, the reward-model worker's settings
under ``reward_model.enable``); with the gate false or unset it is dropped with a note.

A rule applies only to a key the installed verl's config lacks, and a rename only where the
installed config has the new key (``plus`` rules target verl's free-form dicts, written ``++``), so
keys the installed verl still has are never touched. Each rule cites the verl commit (on
``verl-project/verl``, formerly ``volcengine/verl``; first release tag in brackets) that
renamed or removed the key, found by walking the flattened ``ppo_trainer.yaml`` /
``ppo_megatron_trainer.yaml`` (``_generated_*.yaml`` from v0.5.0) at every commit that touched them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

__all__ = ["Legacy", "LEGACY", "Rewrite", "LegacyConfig", "translate"]

_ACT = r"actor_rollout_ref\.(actor|ref)"


@dataclass(frozen=True)
class Legacy:
    """One legacy key (or family of keys) and what it became.

    Attributes:
        pattern: regular expression matched against the whole dotted key (groups feed ``to``).
        kind: ``renamed``, ``dropped`` or ``refused``.
        source: the verl commit (and PR, first release) that renamed or removed it.
        why: what verl did, shown in the import's notes or in the refusal.
        to: for ``renamed``, the new key templates (``\\1`` = the pattern's first group).
        plus: the new key lies in a free-form dict of the installed config (written ``++key=value``).
        gate: a key template (``\\1`` allowed) the old verl required true to read this key.
        inert: values of a ``refused`` key that change nothing (dropped instead).
    """

    pattern: str
    kind: str
    source: str
    why: str
    to: tuple[str, ...] = ()
    plus: bool = False
    gate: str | None = None
    inert: tuple = ()


_REWARD_WORKER = ("4ef45d093 (#5194, v0.7.1) removed the FSDP/Megatron reward-model worker these keys "
                  "configure (micro-batches, sharding, offload of its forward pass); verl serves the reward model "
                  "with an inference engine since: give reward.reward_model.rollout.* instead")
_PROFILE = ("545f89984 (#2894, v0.6.0) replaced it with global_profiler.* and <role>.profiler.* "
            "(reward_model.profiler.* went with the reward-model worker, 4ef45d093); profiling options are outside "
            "the cost model (as the installed names are)")

#: every legacy key walked (verl 0.1-0.8 trainer configs against the installed 0.9.1), in config order
LEGACY: tuple[Legacy, ...] = (
    # --- offload ---------------------------------------------------------------------------------
    Legacy(r"(actor_rollout_ref\.actor\.fsdp_config|critic\.model\.fsdp_config)\.grad_offload", "dropped",
           "9db52329f (#284, v0.3.0.post0)",
           "verl <= 0.2 moved param.grad to the host with the parameters, but its dp_actor.update_policy and "
           "dp_critic.update_critic end with optimizer.zero_grad() (set_to_none, torch 2.4 under vllm<=0.6.3): no "
           "gradient is held between phases, so the key moved nothing"),
    Legacy(r"(actor_rollout_ref\.(actor|ref)|critic|reward_model)\.megatron\.grad_offload", "dropped",
           "#7544 (0.9.1; the key came with cc8fca504, #1162)",
           "verl assigned it to _is_offload_grad and never read it (megatron_workers.py v0.4.0-v0.7.1, "
           "engine/megatron/transformer_impl.py v0.6.0 to 1dda039b9); Megatron's gradient buffer is released "
           "with megatron.param_offload (offload_megatron_model_to_cpu), which Nereus reads"),
    Legacy(r"actor_rollout_ref\.ref\.param_offload", "renamed", "cc8fca504 (#1162, v0.4.0)",
           "the Megatron reference's parameter offload (load/offload around compute_ref_log_prob)",
           to=("actor_rollout_ref.ref.megatron.param_offload",)),
    Legacy(r"critic\.model\.fsdp_config\.(.+)", "renamed", "16253911d (#5870, v0.8.0)",
           "the FSDP critic's engine section moved from critic.model.fsdp_config to critic.fsdp",
           to=(r"critic.fsdp.\1",)),
    # --- parallelism and recompute -------------------------------------------------------------------
    Legacy(r"(actor_rollout_ref\.(actor|ref)|critic|reward_model)\.megatron\.num_layers_per_virtual_pipeline_stage",
           "refused", "35555d8ae (v0.3.0.post0)",
           "layers per virtual pipeline stage became virtual_pipeline_model_parallel_size (virtual stages per "
           "rank = num_hidden_layers / (pipeline_model_parallel_size x this value)): give that key instead",
           inert=(None,)),
    Legacy(r"actor_rollout_ref\.model\.gradient_checkpointing_kwargs\.activations_checkpoint_"
           r"(granularity|method|num_layers)", "renamed", "c5b189a1a (#2651, v0.5.0)",
           "Megatron recompute moved to override_transformer_config",
           to=(r"actor_rollout_ref.actor.megatron.override_transformer_config.recompute_\1",),
           gate="actor_rollout_ref.model.enable_gradient_checkpointing"),
    Legacy(r"critic\.model\.gradient_checkpointing_kwargs\.activations_checkpoint_(granularity|method|num_layers)",
           "renamed", "c5b189a1a (#2651, v0.5.0)", "Megatron recompute moved to override_transformer_config",
           to=(r"critic.megatron.override_transformer_config.recompute_\1",),
           gate="critic.model.enable_gradient_checkpointing"),
    # --- rollout ---------------------------------------------------------------------------------------
    Legacy(r"actor_rollout_ref\.rollout\.engine_kwargs\.(swap_space)", "renamed", "c803b1f76 (#1634, v0.4.0)",
           "vLLM engine arguments moved under engine_kwargs.vllm (a free-form dict since bd756c15c, #3037)",
           to=(r"actor_rollout_ref.rollout.engine_kwargs.vllm.\1",), plus=True),
    Legacy(r"actor_rollout_ref\.rollout\.engine_kwargs\.(attention_backend)", "renamed", "c803b1f76 (#1634, v0.4.0)",
           "SGLang engine arguments moved under engine_kwargs.sglang (a free-form dict since bd756c15c, #3037)",
           to=(r"actor_rollout_ref.rollout.engine_kwargs.sglang.\1",), plus=True),
    Legacy(r"actor_rollout_ref\.rollout\.engine_kwargs\.((vllm|sglang)\..+)", "renamed", "bd756c15c (#3037, v0.6.0)",
           "engine_kwargs.vllm / .sglang became free-form dicts of engine arguments (added with ++)",
           to=(r"actor_rollout_ref.rollout.engine_kwargs.\1",), plus=True),
    Legacy(r"actor_rollout_ref\.rollout\.update_weights_bucket_megabytes", "renamed", "ef6eaa05d (#5031, v0.7.1)",
           "the weight-sync bucket moved to the checkpoint engine",
           to=("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",)),
    Legacy(r"actor_rollout_ref\.rollout\.multi_turn\.max_turns", "renamed", "c7aa5e845 (#1630, v0.4.1)",
           "multi-turn limits split into assistant and user turns",
           to=("actor_rollout_ref.rollout.multi_turn.max_assistant_turns",)),
    Legacy(r"actor_rollout_ref\.rollout\.multi_turn\.(completion_callback|interaction_config_path"
           r"|enable_tokenization_sanity_check)", "dropped", "f10780083 (#2725), 63dc08501 (#6074), 644aaa76b (#2014)",
           "options of multi-turn rollouts (multi_turn.enable, still read, is refused when on)"),
    Legacy(r"actor_rollout_ref\.rollout\.chat_scheduler", "dropped", "457f4d2a2 (#1831, v0.4.1)",
           "the async chat-completion scheduler class of multi-turn rollouts (removed with the chat scheduler, "
           "f10780083)"),
    Legacy(r"actor_rollout_ref\.rollout\.use_fire_sampling", "dropped", "52065c640 (#2257, v0.5.0)",
           "FIRE sampling (a first-token temperature): a sampling parameter"),
    Legacy(r"actor_rollout_ref\.rollout\.layer_name_map\..+", "dropped", "2edc06a4e (#5848, v0.8.0)",
           "Megatron-to-vLLM weight-name mapping"),
    # --- reward model ------------------------------------------------------------------------------------
    Legacy(r"reward_model\.sandbox_fusion\.(.+)", "renamed", "67dc84b96 (#5255, v0.8.0)",
           "the reward configuration moved to reward.*", to=(r"reward.sandbox_fusion.\1",)),
    Legacy(r"reward_model\.launch_reward_fn_async", "dropped", "3df21a68e (#5237, v0.7.1)",
           "asynchronous rule-based reward on the CPU"),
    Legacy(r"reward_model\.(micro_batch_size|micro_batch_size_per_gpu|strategy|use_dynamic_bsz"
           r"|forward_max_token_len_per_gpu|max_length|ulysses_sequence_parallel_size|param_offload|nccl_timeout"
           r"|model\.(input_tokenizer|use_remove_padding|use_fused_kernels|use_shm|override_config|fsdp_config)(\..+)?"
           r"|megatron\..+)", "refused", "4ef45d093 (#5194, v0.7.1)", _REWARD_WORKER, gate="reward_model.enable"),
    # --- bookkeeping: optimizer schedule, checkpoints, logging, profiling, data --------------------------
    Legacy(r"(actor_rollout_ref\.actor|critic)\.optim\.(warmup_style|min_lr_ratio)", "dropped",
           "01ae0198f (#1701, v0.4.1)",
           "the Megatron learning-rate schedule became lr_decay_style / min_lr (an optimizer hyperparameter)"),
    Legacy(r"critic\.kl_ctrl\..+", "dropped", "332c7d53c (#2582, v0.5.0)",
           "an unread copy of algorithm.kl_ctrl in the Megatron config"),
    Legacy(r"(actor_rollout_ref\.(actor|ref)|critic|reward_model)\.load_weight", "dropped", "22b04f949 (v0.9.0)",
           "whether the Megatron engine loads the checkpoint's weights"),
    Legacy(r"(actor_rollout_ref\.actor|critic)\.checkpoint\.contents", "renamed", "a1a152ee4 (#1350, v0.4.1)",
           "checkpoint contents split into what is saved and what is loaded",
           to=(r"\1.checkpoint.save_contents", r"\1.checkpoint.load_contents")),
    Legacy(r"trainer\.remove_previous_ckpt_in_save", "dropped", "afb9f9f66 (#724, v0.3.0.post0)",
           "checkpoint retention (trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep since)"),
    Legacy(r"trainer\.val_generations_to_log_to_wandb", "renamed", "7fbf60919 (#822, v0.4.0)",
           "validation logging", to=("trainer.log_val_generations",)),
    Legacy(r"ray_init\.num_cpus", "renamed", "2bbd09245 (#3049, v0.6.0)", "Ray init options",
           to=("ray_kwargs.ray_init.num_cpus",)),
    Legacy(r"ray_init\.timeline_json_file", "renamed", "2bbd09245 (#3049, v0.6.0)", "Ray timeline",
           to=("ray_kwargs.timeline_json_file",)),
    Legacy(_ACT + r"\.profile\..+|(actor_rollout_ref\.(actor|ref|rollout)|critic|reward_model)\.profiler\.discrete"
           r"|(actor_rollout_ref|reward_model)\.profiler\..+|trainer\.(profile_steps|controller_nsight_options\..+"
           r"|worker_nsight_options\..+|npu_profile\..+)", "dropped", "545f89984 (#2894, v0.6.0)", _PROFILE),
    Legacy(r"actor_rollout_ref\.actor\.tis_imp_ratio_cap", "dropped", "21271aabb (v0.6.0)",
           "a truncated importance-sampling cap of the loss (algorithm.rollout_correction.* since)"),
    Legacy(r"data\.(datagen|sampler)\..+", "dropped", "5a506cc58 (v0.8.0)", "the curriculum sampler's data classes"),
    Legacy(r"trainer\.use_legacy_worker_impl", "dropped", "044bbba27 (#6067, v0.8.0)",
           "the choice between verl's legacy workers and its engine workers (the installed verl has the engines "
           "only; the cost model does not tell the two apart)"),
)

_COMPILED = tuple((re.compile(r.pattern), r) for r in LEGACY)


@dataclass(frozen=True)
class Rewrite:
    """What :func:`translate` did with one legacy override: ``new`` empty when dropped."""

    old: str
    value: object
    new: tuple[str, ...]
    rule: Legacy

    def note(self) -> str:
        if self.new:
            return (f"legacy key {self.old}={self.value!r} read as {' and '.join(self.new)} "
                    f"(verl {self.rule.source}: {self.rule.why})")
        return f"legacy key {self.old}={self.value!r} dropped (verl {self.rule.source}: {self.rule.why})"


class LegacyConfig(dict):
    """A composed verl config (a dict) with the legacy rewrites that produced it (``legacy``); give
    OmegaConf ``dict(cfg)``, as ``OmegaConf.create`` refuses dict subclasses."""

    legacy: tuple[Rewrite, ...] = ()
    overrides: tuple[str, ...] = ()  # the overrides as composed (legacy keys under the installed names)
    unknown: tuple = ()  # (key, closest installed key) of +key=value adding a key verl does not have


def _split(ov: str) -> tuple[str, str, str]:
    """``(plus prefix, key, raw value)`` of ``[+|++|~]key=value``."""
    key, _, raw = ov.partition("=")
    plus = key[: len(key) - len(key.lstrip("+~"))]
    return plus, key[len(plus):], raw


def _value(raw: str):
    try:
        return yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        return raw


def _has(installed, key: str, plus: bool) -> bool:
    if installed is None:
        return True
    if key in installed:
        return True
    if plus:  # a key in a free-form dict: its parent is a leaf (an empty dict) of the installed config
        parts = key.split(".")
        return any(".".join(parts[:i]) in installed for i in range(1, len(parts)))
    return False


def translate(overrides, installed=None) -> tuple[list[str], list[Rewrite]]:
    """Rewrite the legacy keys of Hydra ``key=value`` overrides to the installed verl's names.

    Args:
        overrides: the user's overrides (``key=value``, ``+key=value``, ``++key=value``).
        installed: the dotted leaf keys of the installed verl's composed config (None: apply every rule
            without checking the installed config).

    Returns:
        ``(overrides, rewrites)``: the overrides with each legacy key rewritten or removed (order kept),
        and one :class:`Rewrite` per legacy key, for the import's notes.

    Raises:
        ValueError: a ``refused`` legacy key (named, with its value, the verl commit and what to give), or
            a legacy key and its new name set to different values (both named).
    """
    given: dict[str, tuple[str, object]] = {}
    for ov in overrides:
        _, key, raw = _split(str(ov))
        given.setdefault(key, (str(ov), _value(raw)))
    out: list[str] = []
    done: list[Rewrite] = []
    emitted: dict[str, tuple[str, object]] = {}
    for ov in map(str, overrides):
        plus, key, raw = _split(ov)
        rule, m = _match(key, installed)
        if rule is None or plus.startswith("~") or "=" not in ov:
            out.append(ov)
            continue
        val = _value(raw)
        kind = rule.kind
        if rule.gate is not None:
            gate = m.expand(rule.gate)
            if given.get(gate, (None, None))[1] is not True:
                why = f"{rule.why}; the old verl read it only with {gate}=True, not set here"
                done.append(Rewrite(key, val, (), Legacy(rule.pattern, "dropped", rule.source, why)))
                continue
        if kind == "refused" and val in rule.inert:
            kind = "dropped"
        if kind == "refused":
            raise ValueError(f"verl override {key}={val!r}: a key of an older verl that changes memory or time and "
                             f"that the installed verl does not have (verl {rule.source}: {rule.why})")
        if kind == "dropped":
            done.append(Rewrite(key, val, (), rule))
            continue
        targets = tuple(m.expand(t) for t in rule.to)
        if not all(_has(installed, t, rule.plus) for t in targets):
            out.append(ov)  # the installed verl lacks the new name too: Hydra names the key
            continue
        for t in targets:
            also = {} if t == key else given  # the line's own override is not another setting of t
            for src, oval in (also.get(t, (None, _MISS)), emitted.get(t, (None, _MISS))):
                if oval is not _MISS and oval != val:
                    raise ValueError(f"verl overrides {key}={val!r} (a legacy name, read as {t}) and {src} disagree: "
                                     f"give one of them (verl {rule.source})")
            if t in also or t in emitted:
                continue
            emitted[t] = (ov, val)
            out.append(f"{'++' if rule.plus else plus}{t}={raw}")
        done.append(Rewrite(key, val, targets, rule))
    return out, done


_MISS = object()


def _match(key: str, installed):
    if installed is not None and key in installed:
        return None, None
    for rx, rule in _COMPILED:
        m = rx.fullmatch(key)
        if m is not None:
            return rule, m
    return None, None
