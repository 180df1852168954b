"""Logical parameters of a Llama decoder and how a (tp, pp) layout shards them (resharding.md §3).

Parameter names follow Hugging Face Llama. Each has a TP rule:

=========  =====================================================  ==============================
rule       parameters                                             shard of TP rank ``t``
=========  =====================================================  ==============================
``rep``    RMSNorm weights, value head, ``o_proj`` bias ``[h]``   the full tensor (replicated)
``col``    ``q_proj``, ``gate_proj``, ``up_proj`` ``[out, h]``;   chunk ``t`` of dim 0
           ``q_proj`` bias ``[a·d]``
``row``    ``o_proj``, ``down_proj`` ``[h, in]``                  chunk ``t`` of dim 1
``kv``     ``k_proj``, ``v_proj`` ``[g·d, h]`` and their biases    heads ``t·g/tp ..``; when
           ``[g·d]``
                                                                  ``tp > g`` KV head ``t // (tp/g)``
                                                                  replicated (vLLM)
``vocab``  ``embed_tokens``, ``lm_head`` ``[V, h]``               chunk ``t`` of the vocab padded
                                                                  to a multiple of ``tp``
=========  =====================================================  ==============================

PP rank ``p`` owns layers :func:`nereus.cost.shapes.layers_of_rank` (the cost model's split), the
embedding on ``p == 0``, the final norm and head on ``p == pp-1``. With tied word embeddings and
``pp > 1`` the last rank also holds ``model.embed_tokens.weight`` as its output layer (Megatron's
layout); the engine sums the two copies' gradients, so they stay equal. Adam state follows the same rules
(it is elementwise), so :func:`shard` and :func:`unshard` serve parameters, gradients and moments.
"""

from __future__ import annotations

import torch

from nereus.cost.shapes import layers_of_rank, valid_tp
from nereus.spec.model import ModelSpec

__all__ = ["validate_layout", "tied_copy", "param_shapes", "rule_of", "names_of_stage", "shard", "unshard",
           "init_full_params", "padded_vocab"]


def validate_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """Check that ``(tp, pp)`` can shard ``spec``.

    Raises:
        ValueError: TP not dividing the query heads / MLP width / vocab, TP neither dividing nor a
            multiple of the KV heads, PP outside ``1..num_layers``.
    """
    for f, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"layout field {f!r} must be a positive integer, got {v!r}")
    why = valid_tp(spec, tp)
    if why:
        raise ValueError(f"layout tp={tp} is invalid for model {spec.name!r}: {why}")
    if pp > spec.num_layers:
        raise ValueError(f"layout pp={pp} is invalid for model {spec.name!r}: pp must be in "
                         f"1..num_hidden_layers={spec.num_layers}")


def padded_vocab(spec: ModelSpec, tp: int) -> int:
    return -(-spec.vocab_size // tp) * tp


def _layer_params(spec: ModelSpec, i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    h, d = spec.hidden_size, spec.head_dim
    p = f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": ((h,), "rep"),
        p + "self_attn.q_proj.weight": ((spec.q_dim, h), "col"),
        p + "self_attn.k_proj.weight": ((spec.kv_dim, h), "kv"),
        p + "self_attn.v_proj.weight": ((spec.kv_dim, h), "kv"),
        p + "self_attn.o_proj.weight": ((h, spec.q_dim), "row"),
        p + "post_attention_layernorm.weight": ((h,), "rep"),
        p + "mlp.gate_proj.weight": ((spec.intermediate_size, h), "col"),
        p + "mlp.up_proj.weight": ((spec.intermediate_size, h), "col"),
        p + "mlp.down_proj.weight": ((h, spec.intermediate_size), "row"),
    }
    if spec.qk_norm:
        out[p + "self_attn.q_norm.weight"] = ((d,), "rep")
        out[p + "self_attn.k_norm.weight"] = ((d,), "rep")
    if spec.qkv_bias:
        out[p + "self_attn.q_proj.bias"] = ((spec.q_dim,), "col")
        out[p + "self_attn.k_proj.bias"] = ((spec.kv_dim,), "kv")
        out[p + "self_attn.v_proj.bias"] = ((spec.kv_dim,), "kv")
    if spec.o_bias:
        out[p + "self_attn.o_proj.bias"] = ((h,), "rep")
    return out


def param_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every logical parameter: ``name -> (full shape, TP rule)``, in a fixed order."""
    h = spec.hidden_size
    out = {"model.embed_tokens.weight": ((spec.vocab_size, h), "vocab")}
    for i in range(spec.num_layers):
        out.update(_layer_params(spec, i))
    out["model.norm.weight"] = ((h,), "rep")
    if spec.head == "value":
        out["score.weight"] = ((1, h), "rep")
        out["score.bias"] = ((1,), "rep")
    elif not spec.tie_word_embeddings:
        out["lm_head.weight"] = ((spec.vocab_size, h), "vocab")
    return out


def rule_of(name: str, spec: ModelSpec) -> str:
    return param_shapes(spec)[name][1]


def names_of_stage(spec: ModelSpec, pp: int, p: int) -> list[str]:
    """Logical parameter names PP rank ``p`` of ``pp`` holds, in :func:`param_shapes` order."""
    layers = set(layers_of_rank(spec.num_layers, pp, p))
    names = []
    for n in param_shapes(spec):
        if n.startswith("model.layers."):
            if int(n.split(".")[2]) in layers:
                names.append(n)
        elif n == "model.embed_tokens.weight":
            if p == 0 or (p == pp - 1 and tied_copy(spec, pp)):
                names.append(n)
        elif p == pp - 1:
            names.append(n)
    return names


def tied_copy(spec: ModelSpec, pp: int) -> bool:
    """Whether the last PP rank holds its own copy of the tied embedding as output layer."""
    return spec.tie_word_embeddings and spec.head == "lm" and pp > 1


def shard(full: torch.Tensor, rule: str, spec: ModelSpec, tp: int, t: int) -> torch.Tensor:
    """TP rank ``t``'s shard of a full tensor (a contiguous copy)."""
    if rule == "rep" or tp == 1 and rule != "vocab":
        return full.clone()
    if rule == "col":
        return full.chunk(tp, 0)[t].clone()
    if rule == "row":
        return full.chunk(tp, 1)[t].contiguous()
    if rule == "kv":
        g, d = spec.num_kv_heads, spec.head_dim
        if tp <= g:
            return full.chunk(tp, 0)[t].clone()
        j = t // (tp // g)
        return full[j * d:(j + 1) * d].clone()
    if rule == "vocab":
        vp = padded_vocab(spec, tp)
        padded = torch.zeros((vp,) + tuple(full.shape[1:]), dtype=full.dtype)
        padded[:full.shape[0]] = full
        return padded.chunk(tp, 0)[t].clone()
    raise ValueError(f"unknown TP rule {rule!r}")


def unshard(shards: list[torch.Tensor], rule: str, spec: ModelSpec) -> torch.Tensor:
    """The full tensor from the shards of TP ranks ``0..tp-1`` (inverse of :func:`shard`)."""
    tp = len(shards)
    if rule == "rep" or tp == 1 and rule != "vocab":
        return shards[0].clone()
    if rule == "col":
        return torch.cat(shards, 0)
    if rule == "row":
        return torch.cat(shards, 1)
    if rule == "kv":
        g = spec.num_kv_heads
        if tp <= g:
            return torch.cat(shards, 0)
        return torch.cat([shards[j * (tp // g)] for j in range(g)], 0)
    if rule == "vocab":
        return torch.cat(shards, 0)[:spec.vocab_size].clone()
    raise ValueError(f"unknown TP rule {rule!r}")


def init_full_params(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic full (unsharded) initial parameters: N(0, 0.02) matrices, unit norms, zero bias.

    Every rank draws the same full tensors from ``seed`` and keeps its shard, so any layout starts
    from the same logical state (fine for the small models the runtime tests on).
    """
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, (shape, _rule) in param_shapes(spec).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        elif name == "score.bias":
            out[name] = torch.zeros(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    return out
