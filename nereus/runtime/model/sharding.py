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

Random initial values (:func:`init_param`) are drawn in :data:`INIT_TILE` tiles, each from its own
generator, so a worker draws only the tiles of its shard (:func:`init_shard_params`) and every layout
starts from the same logical tensors (:func:`init_full_params`, the reference).
"""

from __future__ import annotations

import hashlib

import torch

from nereus.cost.shapes import layers_of_rank, valid_tp
from nereus.spec.model import ModelSpec

__all__ = ["validate_layout", "tied_copy", "param_shapes", "rule_of", "names_of_stage", "shard", "unshard",
           "init_full_params", "init_param", "init_shard_params", "shard_range", "padded_vocab", "INIT_TILE"]


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


#: rows × columns of one initialization tile (1-D tensors are read as ``[n, 1]``); part of the
#: definition of the initial values, so changing it changes every random-initialized model
INIT_TILE = (64, 64)
_M32 = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer: a bijection of ``0..2**32-1``."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _tiles(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(rows, cols, tile rows, tile cols)`` of a parameter's tiling (1-D read as ``[n, 1]``)."""
    r, c = (shape[0], 1) if len(shape) == 1 else shape
    return r, c, -(-r // INIT_TILE[0]), -(-c // INIT_TILE[1])


def _tile_offsets(spec: ModelSpec) -> dict[str, int]:
    """Index of each parameter's first tile when all tiles are counted in :func:`param_shapes` order."""
    out, k = {}, 0
    for name, (shape, _rule) in param_shapes(spec).items():
        out[name] = k
        _r, _c, nr, nc = _tiles(shape)
        k += nr * nc
    return out


def _random(name: str) -> bool:
    return not (name.endswith("norm.weight") or name == "score.bias")


def init_param(spec: ModelSpec, seed: int, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32,
               stats: dict | None = None, pad_rows: int = 0, _offsets: dict[str, int] | None = None) -> torch.Tensor:
    """Rows ``[rows)`` and columns ``[cols)`` of logical parameter ``name``'s initial value, computed
    without the rest of the tensor.

    Values: RMSNorm weights 1, the value head's bias 0, every other tensor ``N(0, 0.02)``. A random tensor
    is cut into :data:`INIT_TILE` tiles (edge tiles clipped to the tensor); tile ``k`` (counted over
    the whole model in :func:`param_shapes` order, row-major within a tensor) is
    ``0.02 * randn(tile shape)`` from a ``torch.Generator`` seeded with ``fmix32((h(seed) + k) mod 2**32)``,
    ``h`` a hash of ``seed``. The tile seeds of one model are distinct (``fmix32`` is a bijection), and a
    slice draws only the tiles it overlaps, so a value depends on ``(spec, seed, name, position)``
    alone: every layout sees the same logical model. Actor and critic variants of one spec share the
    backbone values (their extra tensors come last).

    Args:
        rows, cols: half-open ranges along dims 0 and 1 (None: all); ``cols`` only for 2-D tensors.
        dtype: of the result (drawn in fp32, then cast).
        stats: when given, ``stats["generated"]`` grows by the number of elements drawn.
        pad_rows: zero rows appended (vocab padding of a shard), allocated with the result.

    Returns:
        a tensor of shape ``[rows[1]-rows[0]+pad_rows, cols[1]-cols[0]]`` (``[rows[1]-rows[0]+pad_rows]``
        for 1-D).

    Raises:
        KeyError: ``name`` is not a parameter of ``spec``.
        ValueError: a range outside the tensor, ``cols`` for a 1-D tensor, or ``pad_rows < 0``.
    """
    shape = tuple(param_shapes(spec)[name][0])
    R, C, _nr, nc = _tiles(shape)
    if cols is not None and len(shape) == 1:
        raise ValueError(f"parameter {name!r} is 1-D: no column range")
    r0, r1 = rows if rows is not None else (0, R)
    c0, c1 = cols if cols is not None else (0, C)
    if not (0 <= r0 <= r1 <= R and 0 <= c0 <= c1 <= C):
        raise ValueError(f"range rows {r0}:{r1}, cols {c0}:{c1} outside parameter {name!r} of shape {shape}")
    if pad_rows < 0:
        raise ValueError(f"pad_rows must be >= 0, got {pad_rows}")
    n = r1 - r0 + int(pad_rows)
    out_shape = (n,) if len(shape) == 1 else (n, c1 - c0)
    out = torch.empty((n, c1 - c0), dtype=dtype)
    out[r1 - r0:] = 0
    if not _random(name):
        out[:r1 - r0] = 1.0 if name.endswith("norm.weight") else 0.0
        return out.view(out_shape)
    first = (_offsets or _tile_offsets(spec))[name]
    base = int.from_bytes(hashlib.blake2b(str(int(seed)).encode(), digest_size=4).digest(), "little")
    tr, tc = INIT_TILE
    for i in range(r0 // tr, -(-r1 // tr)):
        for j in range(c0 // tc, -(-c1 // tc)):
            g = torch.Generator().manual_seed(_fmix32((base + first + i * nc + j) & _M32))
            lo_r, lo_c = i * tr, j * tc
            tile = torch.randn((min(tr, R - lo_r), min(tc, C - lo_c)), generator=g).mul_(0.02)
            if stats is not None:
                stats["generated"] = stats.get("generated", 0) + tile.numel()
            a, b = max(r0, lo_r), min(r1, lo_r + tile.shape[0])
            c, d = max(c0, lo_c), min(c1, lo_c + tile.shape[1])
            out[a - r0:b - r0, c - c0:d - c0] = tile[a - lo_r:b - lo_r, c - lo_c:d - lo_c]
    return out.view(out_shape)


def shard_range(spec: ModelSpec, name: str, tp: int, t: int) -> tuple[int | None, int, int, int]:
    """``(dim, lo, hi, length)``: TP rank ``t``'s shard of ``name`` is elements ``[lo, hi)`` of ``dim``
    (None: the whole tensor) followed by ``length - (hi - lo)`` zero rows (vocab padding); the same
    cut as :func:`shard`."""
    shape, rule = param_shapes(spec)[name]
    if rule == "rep" or tp == 1 and rule != "vocab":
        return None, 0, 0, 0
    if rule == "vocab":
        c = padded_vocab(spec, tp) // tp
        return 0, min(t * c, shape[0]), min((t + 1) * c, shape[0]), c
    if rule == "kv" and tp > spec.num_kv_heads:
        j, d = t // (tp // spec.num_kv_heads), spec.head_dim
        return 0, j * d, (j + 1) * d, d
    dim = 1 if rule == "row" else 0
    c = shape[dim] // tp
    return dim, t * c, (t + 1) * c, c


def init_shard_params(spec: ModelSpec, seed: int, pp: int, p: int, tp: int, t: int,
                      dtype: torch.dtype = torch.float32, device: str = "cpu", names: list[str] | None = None,
                      stats: dict | None = None) -> dict[str, torch.Tensor]:
    """Initial shards of PP rank ``p``, TP rank ``t`` drawn directly (:func:`init_param`): equal to
    ``shard(init_full_params(spec, seed)[n], ...)`` while holding at most this rank's shards plus one
    :data:`INIT_TILE` tile (the full tensors are never built).

    Args:
        names: a subset of the rank's parameters (default: all of :func:`names_of_stage`).
        stats: ``stats["generated"]`` counts the random elements drawn.

    Returns:
        name → tensor of :func:`shard`'s shape on ``device`` in ``dtype`` (vocab padding rows are 0).
    """
    offsets = _tile_offsets(spec)
    out = {}
    for n in (names if names is not None else names_of_stage(spec, pp, p)):
        dim, lo, hi, length = shard_range(spec, n, tp, t)
        if dim is None:
            x = init_param(spec, seed, n, dtype=dtype, stats=stats, _offsets=offsets)
        elif dim == 0:
            x = init_param(spec, seed, n, rows=(lo, hi), dtype=dtype, stats=stats, pad_rows=length - (hi - lo),
                           _offsets=offsets)
        else:
            x = init_param(spec, seed, n, cols=(lo, hi), dtype=dtype, stats=stats, _offsets=offsets)
        out[n] = x.to(device)
    return out


def init_full_params(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic full (unsharded) initial parameters (:func:`init_param`: N(0, 0.02) matrices and
    q/k/v/o biases, unit norms, zero value-head bias): name → tensor of :func:`param_shapes`' shape.

    The reference for tests and tools; workers draw only their shards (:func:`init_shard_params`),
    which equal the slices of these tensors under every layout.
    """
    offsets = _tile_offsets(spec)
    return {n: init_param(spec, seed, n, dtype=dtype, _offsets=offsets) for n in param_shapes(spec)}
