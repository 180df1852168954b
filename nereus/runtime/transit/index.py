"""A memoized index of one model's shards: shapes, stage names and TP regions, computed once.

Source: DESIGN.md §4.8 (transfer plans); issue 26 (bookkeeping at real model scale: per-piece region
lookups recomputed every parameter's shape, so planning a Llama-3.3-70B Extend grew with the
parameter count times the number of pieces).

Every function here is a pure function of a frozen :class:`~nereus.spec.model.ModelSpec` (hashable)
and small integers, cached with :func:`functools.lru_cache`; the results are read-only
(``MappingProxyType``, tuples), so callers share them. Worker-side and planning code call these
instead of :func:`~nereus.runtime.model.sharding.param_shapes` per piece: a lookup is a dict access,
and building the index of one ``(spec, tp, t)`` or ``(spec, pp, p)`` is one pass over the
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from nereus.cost.shapes import layers_of_rank
from nereus.runtime.model.sharding import padded_vocab, param_shapes, tied_copy
from nereus.spec.model import ModelSpec

__all__ = ["Region", "shapes", "stage_names", "tp_regions", "stage_regions", "row_numel", "full_numel", "cache_clear",
           "piece_numel"]

_CACHE = 256


@dataclass(frozen=True)
class Region:
    """Part of a full tensor a shard holds: rows/columns ``[lo, hi)`` of ``dim`` (None: all of it);
    ``length`` is the shard's extent along ``dim`` (``> hi - lo`` only for vocab padding)."""

    dim: int | None
    lo: int = 0
    hi: int = 0
    length: int = 0


@lru_cache(maxsize=_CACHE)
def shapes(spec: ModelSpec) -> MappingProxyType:
    """``name -> (full shape, TP rule)`` of every logical parameter (``sharding.param_shapes``),
    read-only and computed once per spec."""
    return MappingProxyType({n: (tuple(s), r) for n, (s, r) in param_shapes(spec).items()})


@lru_cache(maxsize=_CACHE)
def _stages(spec: ModelSpec, pp: int) -> tuple[tuple[str, ...], ...]:
    """The names of every PP rank of ``pp`` in one pass (the rules of ``sharding.names_of_stage``)."""
    owner = {layer: p for p in range(pp) for layer in layers_of_rank(spec.num_layers, pp, p)}
    out: list[list[str]] = [[] for _ in range(pp)]
    for n in shapes(spec):
        if n.startswith("model.layers."):
            out[owner[int(n.split(".", 3)[2])]].append(n)
        elif n == "model.embed_tokens.weight":
            out[0].append(n)
            if tied_copy(spec, pp):
                out[pp - 1].append(n)
        else:
            out[pp - 1].append(n)
    return tuple(tuple(x) for x in out)


def stage_names(spec: ModelSpec, pp: int, p: int) -> tuple[str, ...]:
    """Names PP rank ``p`` of ``pp`` holds (``sharding.names_of_stage``), in parameter order.

    Raises:
        ValueError: ``p`` outside ``0..pp-1``.
    """
    if not 0 <= p < pp:
        raise ValueError(f"PP rank p={p} outside 0..{pp - 1}")
    return _stages(spec, pp)[p]


def _region(spec: ModelSpec, shape: tuple[int, ...], rule: str, tp: int, t: int) -> Region:
    if rule == "rep":
        return Region(None)
    if rule == "vocab":
        c = padded_vocab(spec, tp) // tp
        v = shape[0]
        return Region(0, min(t * c, v), min((t + 1) * c, v), c)
    if rule == "kv" and tp > spec.num_kv_heads:
        j, d = t // (tp // spec.num_kv_heads), spec.head_dim
        return Region(0, j * d, (j + 1) * d, d)
    dim = 1 if rule == "row" else 0
    c = shape[dim] // tp
    return Region(dim, t * c, (t + 1) * c, c)


@lru_cache(maxsize=_CACHE)
def tp_regions(spec: ModelSpec, tp: int, t: int) -> MappingProxyType:
    """``name -> Region`` of every parameter on TP rank ``t`` of ``tp`` (``transit/plans.py``'s
    table).

    Raises:
        ValueError: ``t`` outside ``0..tp-1``.
    """
    if not 0 <= t < tp:
        raise ValueError(f"TP rank t={t} outside 0..{tp - 1}")
    return MappingProxyType({n: _region(spec, s, r, tp, t) for n, (s, r) in shapes(spec).items()})


@lru_cache(maxsize=_CACHE)
def stage_regions(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> MappingProxyType:
    """``name -> Region`` of the parameters the worker at ``(p, t)`` of a ``(tp, pp)`` shard holds."""
    regs = tp_regions(spec, tp, t)
    return MappingProxyType({n: regs[n] for n in stage_names(spec, pp, p)})


def full_numel(shape) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def row_numel(shape, dim: int) -> int:
    """Elements of one row (``dim == 0``) or column (``dim == 1``) of a tensor of ``shape``."""
    return full_numel(shape) // shape[dim]


def piece_numel(spec: ModelSpec, name: str, dim: int | None, lo: int, hi: int) -> int:
    """Elements of rows/columns ``[lo, hi)`` of ``dim`` of ``name`` (all of it when ``dim`` is None)."""
    shape = shapes(spec)[name][0]
    return full_numel(shape) if dim is None else (hi - lo) * row_numel(shape, dim)


def cache_clear() -> None:
    """Forget every memoized index (benchmarks time cold bookkeeping with it)."""
    for f in (shapes, _stages, tp_regions, stage_regions):
        f.cache_clear()
