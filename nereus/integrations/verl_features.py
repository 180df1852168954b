"""verl settings the importer expresses beyond degrees: LoRA, sequence splitting (Ulysses, context
parallelism), token-budget micro-batches and the legacy global micro-batch keys (verl 0.9 names).

* LoRA: ``actor_rollout_ref.model.lora_rank`` (FSDP, PEFT ``target_modules: all-linear``) or
  ``actor_rollout_ref.model.lora.rank`` (Megatron, ``linear_qkv/linear_proj/linear_fc1/linear_fc2``: the
  same linear layers); a critic with another rank, or other target modules, is named in the refusal.
* reference model (:func:`verl_uses_reference`): verl >= 0.4.0 builds one only for a KL term
  (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``; volcengine/verl@072fc9fe, #644 "support no
  reference model"); before it (v0.1 - v0.3.0.post1) ``main_ppo.py`` always maps ``Role.RefPolicy`` and
  ``ray_trainer.py`` applies ``algorithm.kl_ctrl.kl_coef`` in the reward, so every job has one.
* reference in the actor (:func:`verl_ref_in_actor`): with LoRA verl computes the reference log-probs
  on the actor's engine with the adapters disabled (``ref_in_actor``; volcengine/verl@16f6c1ee6, #1127,
  first in v0.4.0: ``lora_rank > 0``; verl 0.9.1 ``verl/trainer/ppo/ray_trainer.py`` ~l.360 also
  Megatron's ``model.lora.rank`` (e69998c71, #4673) and ``model.lora_adapter_path`` (5b364659c, v0.6.1)):
  no reference worker, no second copy of the base weights; ``init_workers`` builds the ref worker only
  ``if self.use_reference_policy and not self.ref_in_actor``.
* sequence split: FSDP ``<role>.ulysses_sequence_parallel_size`` (or its ``fsdp_config`` copy) is
  Ulysses; Megatron ``<role>.megatron.context_parallel_size`` is ring context parallelism. verl's data
  parallelism is then ``N / (tp·pp·sp)`` (``fsdp_workers.py``: ``dp = world_size // sp``).
* token-budget micro-batches (``use_dynamic_bsz``): verl packs sequences (padding removed) into
  micro-batches of at most ``max_token_len_per_gpu · sp`` tokens per sequence-split group
  (``seqlen_balancing.rearrange_micro_batches``); Nereus takes the largest fixed micro-batch ``b``
  that divides the replica's sequences and whose ``b · (prompt + response_max)`` tokens fit that
  budget, so memory is sized for full-length sequences filling the budget (an upper bound when
  responses are shorter) and time is at the mean as always.
* logits kernel (:mod:`nereus.cost.logits`): an FSDP actor with padding removal
  (``actor_rollout_ref.model.use_remove_padding``, default true) and ``use_torch_compile`` (default
  true) holds bf16 logits read by flash-attn's cross-entropy (``flash_ce``; ``flash_ce_entropy``
  when ``actor.entropy_coeff != 0`` or ``actor.calculate_entropy``): verl@b178a3cd5
  ``verl/workers/actor/dp_actor.py`` and verl 0.9.1 ``verl/workers/engine/fsdp/transformer_impl.py``;
  the padded path computes the entropy uncompiled and Megatron's vocab-parallel cross-entropy is fp32
  (None, the default accounting).
"""

from __future__ import annotations

from nereus.integrations.common import Unexpressible
from nereus.integrations.framework_versions import version_key

#: the first verl release whose reference model depends on a KL term (volcengine/verl@072fc9fe, #644)
CONDITIONAL_REFERENCE = "0.4.0"
_KL_KEYS = ("actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward")


def verl_uses_reference(c, cfg, version: str | None, notes: list) -> bool:
    """Whether verl builds a reference model (module docstring): a KL term, or any job of a verl
    release before :data:`CONDITIONAL_REFERENCE`. With no ``version`` (the installed verl) a line that
    sets neither KL key but uses older verl's keys (legacy names, ``algorithm.kl_ctrl.kl_coef``) gets a
    note naming the difference."""
    if any([c.get(k, False) for k in _KL_KEYS]):  # both read
        return True
    coef = c.get("algorithm.kl_ctrl.kl_coef", None)
    if version is not None and version_key(version) < version_key(CONDITIONAL_REFERENCE):
        notes.append(f"verl {version} builds a reference model whatever {_KL_KEYS[0]} says (before verl "
                     f"{CONDITIONAL_REFERENCE}, volcengine/verl@072fc9fe: main_ppo.py always maps Role.RefPolicy and "
                     f"ray_trainer.py applies algorithm.kl_ctrl.kl_coef={coef} in the reward): the job has "
                     "reference.infer")
        return True
    given = {o.split("=", 1)[0].lstrip("+~") for o in getattr(cfg, "overrides", ()) if isinstance(o, str)}
    if version is None and not given & set(_KL_KEYS) and (getattr(cfg, "legacy", ()) or
                                                          "algorithm.kl_ctrl.kl_coef" in given):
        notes.append(f"this configuration sets neither {_KL_KEYS[0]} nor {_KL_KEYS[1]} (keys of verl >= "
                     f"{CONDITIONAL_REFERENCE}); verl before {CONDITIONAL_REFERENCE} always builds a reference model "
                     f"and applies algorithm.kl_ctrl.kl_coef={coef} in the reward (volcengine/verl@072fc9fe). The "
                     "installed verl's behaviour is used: no reference model; pass --framework-version "
                     "verl==VERSION for the release the job runs")
    notes.append(f"{_KL_KEYS[0]} and {_KL_KEYS[1]} are false: verl builds no reference model, so the job has no "
                 "reference.infer (its ref.* settings are read and unused)")
    return False


def verl_ref_in_actor(version: str | None, uses_ref: bool, lora_rank: int | None, notes: list) -> bool:
    """verl's ``ref_in_actor`` (module docstring): a reference model with LoRA on the actor, verl >=
    0.4.0 (None: the installed verl); said in ``notes``."""
    if not uses_ref or not lora_rank or (version is not None and
                                         version_key(version) < version_key(CONDITIONAL_REFERENCE)):
        return False
    notes.append("LoRA: verl computes the reference log-probs on the actor's engine with the adapters disabled "
                 "(ref_in_actor, verl/trainer/ppo/ray_trainer.py): reference.infer has the actor's degrees, "
                 "log-prob micro-batch and GPUs and no weights of its own; the ref.* settings are unused")
    return True

__all__ = ["verl_lora_rank", "verl_uses_reference", "verl_ref_in_actor", "CONDITIONAL_REFERENCE", "seq_split_degree", "budget_micro_batch", "legacy_micro_batch", "verl_logits_kernel"]


def verl_logits_kernel(c, strategy: str) -> str | None:
    """The workload's ``logits_kernel`` for verl's actor engine of ``strategy`` (module docstring):
    ``flash_ce`` / ``flash_ce_entropy`` for FSDP with padding removal and ``use_torch_compile``,
    else None (fp32 accounting)."""
    arr = "actor_rollout_ref"
    if strategy not in ("fsdp", "fsdp2") or not c.get(f"{arr}.model.use_remove_padding", True):
        return None
    if not (c.get(f"{arr}.actor.use_torch_compile", True) and c.get(f"{arr}.actor.fsdp_config.use_torch_compile", True)):
        return None
    coeff = c.get(f"{arr}.actor.entropy_coeff", 0) or 0
    entropy = bool(c.get(f"{arr}.actor.calculate_entropy", False)) or float(coeff) != 0.0
    return "flash_ce_entropy" if entropy else "flash_ce"


def verl_lora_rank(c, algo: str, un: list, notes: list | None = None) -> int | None:
    """The LoRA rank of the actor (None: full fine-tuning); the settings LoRA cannot express are named
    in ``un``; what was read (rank, alpha, target modules) is a line of ``notes``."""
    arr = "actor_rollout_ref"
    r = c.get(f"{arr}.model.lora_rank", 0) or c.get(f"{arr}.model.lora.rank", 0) or 0
    if not r:
        return None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"verl key {arr}.model.lora_rank={r!r}: must be an integer >= 0")
    tm = c.get(f"{arr}.model.target_modules", "all-linear")
    if c.get(f"{arr}.model.lora_rank", 0) and tm not in ("all-linear", None):
        un.append(Unexpressible(f"{arr}.model.target_modules", tm, "the cost model puts adapters on every linear "
                                "layer (all-linear); other target modules change the adapters' size"))
    if notes is not None:
        mega = not c.get(f"{arr}.model.lora_rank", 0)
        alpha = c.get(f"{arr}.model.lora.alpha" if mega else f"{arr}.model.lora_alpha", None)
        mods = c.get(f"{arr}.model.lora.target_modules", None) if mega else tm
        notes.append(f"LoRA read: rank {r}, alpha {alpha}, target modules {mods} (frozen base weights; gradients, "
                     "optimizer state and the weight sync for the adapters only)")
    if algo == "ppo":
        cr = c.get("critic.model.lora_rank", 0) or c.get("critic.model.lora.rank", 0) or 0
        if cr != r:
            un.append(Unexpressible("critic.model.lora_rank", cr, f"the cost model has one LoRA rank per job; the "
                                    f"actor's is {r}"))
    return int(r)


def seq_split_degree(c, prefix: str, sec: str | None, strategy: str, model) -> tuple[int, str]:
    """``(degree, key)`` of a role's sequence split (1 when none).

    Raises:
        ValueError: a degree that does not divide the attention heads (verl asserts it).
    """
    if strategy == "megatron":
        key = f"{prefix}.megatron.context_parallel_size"
        v = c.get(key, 1) or 1
    else:
        key = f"{prefix}.ulysses_sequence_parallel_size"
        v = c.get(key, 1) or 1
        if v == 1 and sec is not None:
            key2 = f"{sec}.ulysses_sequence_parallel_size"
            if (c.get(key2, 1) or 1) > 1:
                key, v = key2, c.get(key2)
        if v > 1 and model.num_attention_heads % v:
            raise ValueError(f"verl key {key}={v}: Ulysses splits the {model.num_attention_heads} attention heads; "
                             "it must divide them")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"verl key {key}={v!r}: must be an integer >= 1")
    return int(v), key


def budget_micro_batch(budget: int, key: str, per_replica: int, seq_len: int, sp: int) -> int:
    """The fixed micro-batch standing for a token budget (module docstring).

    Raises:
        ValueError: a budget smaller than one sequence (verl refuses it: a sequence is never split
            across micro-batches).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"verl key {key}={budget!r}: must be an integer >= 1 (tokens per GPU)")
    fit = budget * sp // seq_len
    if fit < 1:
        raise ValueError(f"verl key {key}={budget}: a micro-batch of {budget} x {sp} tokens cannot hold one "
                         f"sequence of prompt + response = {seq_len} tokens (verl needs max_token_len >= the longest "
                         "sequence)")
    return max(b for b in range(1, min(fit, per_replica) + 1) if per_replica % b == 0)


def legacy_micro_batch(c, per_gpu_key: str, dp: int):
    """The per-GPU micro-batch from ``*_per_gpu``, else from verl's deprecated global key (``//= dp``,
    as verl normalises it), else None."""
    v = c.get(per_gpu_key, None)
    if v is not None:
        return v
    g = c.get(per_gpu_key[: -len("_per_gpu")], None)
    if g is None:
        return None
    if isinstance(g, bool) or not isinstance(g, int) or g < dp:
        raise ValueError(f"verl key {per_gpu_key[: -len('_per_gpu')]}={g!r}: the global micro-batch must be an "
                         f"integer >= the data-parallel size {dp}")
    return g // dp


_BOTH = ("Nereus's idle-state offload moves a model-stage's weights and optimizer state together "
         "(offload='host'); set param_offload and optimizer_offload both true or both false")


def _train_offload(po: bool, oo: bool, sec: str, out: list) -> str:
    if po and oo:
        return "host"
    if po or oo:
        key = f"{sec}.param_offload" if po else f"{sec}.optimizer_offload"
        out.append(Unexpressible(key, True, _BOTH))
        return "host"
    return "none"


def _recompute(c, prefix: str, strategy: str, model_prefix: str) -> str:
    if strategy == "megatron":
        g = c.get(f"{prefix}.megatron.override_transformer_config.recompute_granularity", None)
        if g in (None, "null", "none"):
            return "none"
        if g not in ("full", "selective"):
            raise ValueError(f"verl key {prefix}.megatron.override_transformer_config.recompute_granularity={g!r}: "
                             "valid null, selective, full")
        return g
    return "full" if c.get(f"{model_prefix}.enable_gradient_checkpointing", False) else "none"
