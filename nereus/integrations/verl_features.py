"""verl settings the importer expresses beyond degrees: LoRA, sequence splitting (Ulysses, context
parallelism), token-budget micro-batches and the legacy global micro-batch keys (verl 0.9 names).

* LoRA: ``actor_rollout_ref.model.lora_rank`` (FSDP, PEFT ``target_modules: all-linear``) or
  ``actor_rollout_ref.model.lora.rank`` (Megatron, ``linear_qkv/linear_proj/linear_fc1/linear_fc2``: the
  same linear layers); a critic with another rank, or other target modules, is named in the refusal.
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

__all__ = ["verl_lora_rank", "seq_split_degree", "budget_micro_batch", "legacy_micro_batch", "verl_logits_kernel"]


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


def verl_lora_rank(c, algo: str, un: list) -> int | None:
    """The LoRA rank of the actor (None: full fine-tuning); the settings LoRA cannot express are named
    in ``un``."""
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
