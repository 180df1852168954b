"""ZeRO slices in a live transition: the flat buffer of one ``(p, t)`` shard and who holds which part.

Source: DESIGN.md §4.8; Rajbhandari et al., "ZeRO" (SC'20) stages 1-3 (``P_os``, ``P_os+g``,
``P_os+g+p``); ``worker/zero.py`` and ``worker/zero3.py`` (the runtime's layouts of them); the
transition planner's ZeRO EMUs (``nereus/transition/emu.py``: rank ``r`` of ``z`` holds ``[r/z,
(r+1)/z)`` of the sharded part).

Every engine at TP/PP position ``(p, t)`` has one *flat vector* per state kind: its parameter shards
in the order :func:`~nereus.runtime.transit.index.stage_names` gives (the engine's own order,
``model/llama.py``), flattened and concatenated, ``N`` elements (vocab padding rows included: they are
part of the shard). A unit holds parts of it as *spans* (:class:`Span`, :func:`spans`): a global range
``[lo, hi)`` stored at ``tensors[kind][key][off : off + hi - lo]``:

* a replica (``z = 1``), and a group's *whole* kinds (not in :func:`sliced_kinds` of its stage: the
  weights of ZeRO-1/2), hold ``[0, N)`` as per-name tensors (key None: :func:`flatten` concatenates
  them, :func:`unflatten` cuts a received vector back);
* ZeRO-1 (``worker/zero.py``): ``k = ceil(N / z)``, rank ``r`` holds ``[r·k, min((r+1)·k, N))`` in one
  slot :data:`FLAT` of ``k`` elements (zero padding past ``N``, never moved);
* ZeRO-2 and ZeRO-3 (``worker/zero3.py``): the shard is cut into units ``embed``, ``layer<i>``,
  ``head`` (:func:`zero_units`: contiguous in the flat vector, unit ``u`` at offset ``o_u`` with
  ``N_u`` elements), each padded to ``z·k_u`` with ``k_u = ceil(N_u / z)``; rank ``r`` holds ``[o_u +
  r·k_u, o_u + min((r+1)·k_u, N_u))`` of every unit, in slot ``u`` of ``k_u`` elements: one span per
  unit. The sliced kinds are the moments and bf16 master; ZeRO-3 also the weights (in their dtype).

A primitive moves a kind that some ZeRO group in it slices as element ranges of the flat vector
(named :data:`FLAT` in a piece, ``transit/plans.py``): every target span is covered by the spans of
holders at the same ``(p, t)`` of the same ``(tp, pp)`` (local first), so only the ranges a target
lacks travel. Slices only move between units of one ``(tp, pp)``; the transition planner splits a
group that changes TP/PP into replicas first (``local_dag.py``), which :func:`check_flat` enforces.
With ``z | N`` (ZeRO-1) or ``z | N_u`` for every unit (ZeRO-2/3) a rank holds exactly ``N/z``
elements of a sliced kind, the planner's ``ceil(N·ob/z)`` bytes; with padding, up to ``z-1`` (per
unit) fewer. ZeRO-1 and ZeRO-2/3 ranks of one degree hold different element sets (one range against
one range per unit), which the planner does not model (``transit/sharded.py`` refuses such a move).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from nereus.runtime.transit.index import full_numel, row_numel, shapes, stage_names, stage_regions
from nereus.spec.model import ModelSpec

__all__ = ["FLAT", "Span", "sliced_kinds", "is_sliced", "flat_numel", "zero_units", "spans", "slot_lengths",
           "name_span", "cut_slots", "flatten", "unflatten"]

#: the slot a ZeRO-1 slice goes under in a unit's ``tensors[kind]`` (``worker/zero.py``: ``"flat"``),
#: and the name of every flat piece (``transit/plans.py``)
FLAT = "flat"

_OPT = ("master", "exp_avg", "exp_avg_sq")


class Span(NamedTuple):
    """Elements ``[lo, hi)`` of a position's flat vector, held at ``tensors[kind][key][off:off + hi - lo]``
    (``key`` None: the per-name tensors, concatenated by :func:`flatten`)."""

    lo: int
    hi: int
    key: str | None
    off: int = 0


def sliced_kinds(zero: int) -> tuple[str, ...]:
    """State kinds a ZeRO group of stage ``zero`` holds as slices (module docstring): the Adam
    moments and bf16 master for stages 1 and 2, and the weights too for stage 3.

    Raises:
        ValueError: ``zero`` outside 0-3.
    """
    if zero == 0:
        return ()
    if zero in (1, 2):
        return _OPT
    if zero == 3:
        return ("params",) + _OPT
    raise ValueError(f"zero={zero!r}: not a ZeRO stage; valid: 0, 1, 2, 3")


def is_sliced(unit, kind: str) -> bool:
    """Whether ``unit`` (a :class:`~nereus.runtime.transit.plans.UnitMeta`) holds ``kind`` as slices."""
    return unit.z > 1 and kind in sliced_kinds(unit.zero)


@lru_cache(maxsize=256)
def flat_numel(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> int:
    """``N``: elements of the ``(p, t)`` shard of a ``(tp, pp)`` layout (vocab padding included)."""
    return sum(_name_numel(spec, tp, pp, p, t).values())


@lru_cache(maxsize=256)
def _name_numel(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> dict[str, int]:
    shp, out = shapes(spec), {}
    for name, r in stage_regions(spec, tp, pp, p, t).items():
        full = shp[name][0]
        out[name] = full_numel(full) if r.dim is None else r.length * row_numel(full, r.dim)
    return out


def _unit_names(names) -> list[tuple[str, list[str]]]:
    """``[(unit, names)]`` as ``worker/zero3.py: unit_names`` groups a shard's ordered names (not
    imported: the worker engine imports this package's modules; ``tests/test_transit_zero3_slices.py``
    checks the two agree)."""
    layers: dict[int, list[str]] = {}
    embed, head = [], []
    for n in names:
        if n.startswith("model.layers."):
            layers.setdefault(int(n.split(".")[2]), []).append(n)
        elif n == "model.embed_tokens.weight":
            embed.append(n)
        else:
            head.append(n)
    out = [("embed", embed)] if embed else []
    out += [(f"layer{i}", layers[i]) for i in sorted(layers)]
    return out + ([("head", head)] if head else [])


@lru_cache(maxsize=256)
def zero_units(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> tuple[tuple[str, int, int], ...]:
    """``((unit, o_u, N_u), ...)``: the ZeRO-2/3 units of the ``(p, t)`` shard (grouped as
    ``worker/zero3.py: unit_names`` groups them) with their offsets in the flat vector and their elements.

    Raises:
        ValueError: a unit whose names are not contiguous, in order, in the flat vector (the
            engine's layout changed without this module).
    """
    names = stage_names(spec, pp, p)
    numel = _name_numel(spec, tp, pp, p, t)
    at, off = {}, 0
    for n in names:
        at[n] = off
        off += numel[n]
    out = []
    for u, ns in _unit_names(names):
        o = at[ns[0]]
        size = sum(numel[n] for n in ns)
        if [at[n] for n in ns] != [o + sum(numel[m] for m in ns[:i]) for i in range(len(ns))]:
            raise ValueError(f"ZeRO unit {u} of shard (p={p}, t={t}) is not contiguous in the flat vector")
        out.append((u, o, size))
    return tuple(out)


@lru_cache(maxsize=4096)
def _spans(spec: ModelSpec, tp: int, pp: int, p: int, t: int, z: int, zero: int, r: int,
           sliced: bool) -> tuple[Span, ...]:
    n = flat_numel(spec, tp, pp, p, t)
    if not sliced:
        return (Span(0, n, None),)
    if zero == 1:
        k = -(-n // z)
        return (Span(min(r * k, n), min((r + 1) * k, n), FLAT),)
    out = []
    for u, o, size in zero_units(spec, tp, pp, p, t):
        k = -(-size // z)
        lo, hi = min(r * k, size), min((r + 1) * k, size)
        if hi > lo:
            out.append(Span(o + lo, o + hi, u))
    return tuple(out)


def spans(spec: ModelSpec, unit, worker: int, kind: str) -> tuple[Span, ...]:
    """The spans of its position's flat vector of ``kind`` that ``worker`` holds in ``unit`` (a
    :class:`~nereus.runtime.transit.plans.UnitMeta`; module docstring), in increasing order; empty
    ranges left out. Memoized."""
    p, t = unit.position(worker)
    return _spans(spec, unit.tp, unit.pp, p, t, unit.z, unit.zero, unit.rank(worker), is_sliced(unit, kind))


def slot_lengths(spec: ModelSpec, unit, worker: int, kind: str) -> dict[str | None, int]:
    """Slot key → elements of every tensor ``worker`` holds of ``kind`` in ``unit``, padding included:
    ``{None: N}`` (whole), ``{FLAT: k}`` (ZeRO-1) or ``{u: k_u}`` for every unit (ZeRO-2/3)."""
    p, t = unit.position(worker)
    n = flat_numel(spec, unit.tp, unit.pp, p, t)
    if not is_sliced(unit, kind):
        return {None: n}
    if unit.zero == 1:
        return {FLAT: -(-n // unit.z)}
    return {u: -(-size // unit.z) for u, _o, size in zero_units(spec, unit.tp, unit.pp, p, t)}


def name_span(spec: ModelSpec, tp: int, pp: int, p: int, t: int, name: str) -> tuple[int, int]:
    """``(offset, elements)`` of parameter ``name``'s shard in the ``(p, t)`` flat vector of a ``(tp, pp)``
    layout (vocab padding rows included).

    Raises:
        KeyError: ``name`` is not on PP rank ``p``.
    """
    return _offsets(spec, tp, pp, p, t)[name]


@lru_cache(maxsize=256)
def _offsets(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> dict[str, tuple[int, int]]:
    out, off = {}, 0
    for n, k in _name_numel(spec, tp, pp, p, t).items():
        out[n] = (off, k)
        off += k
    return out


def cut_slots(spec: ModelSpec, unit, worker: int, kind: str, flat: torch.Tensor) -> dict:
    """The slots (:func:`slot_lengths`) ``worker`` holds of ``kind`` in ``unit``, cut from its position's
    whole flat vector ``[N]`` (fresh tensors, padding zero)."""
    out = {key: torch.zeros(n, dtype=flat.dtype, device=flat.device)
           for key, n in slot_lengths(spec, unit, worker, kind).items()}
    for s in spans(spec, unit, worker, kind):
        out[s.key][s.off:s.off + s.hi - s.lo].copy_(flat[s.lo:s.hi])
    return out


def flatten(spec: ModelSpec, unit, worker: int, tensors: dict) -> torch.Tensor:
    """The flat vector a unit holds for one kind: its ``FLAT`` slice as is, or its per-name shards
    concatenated in :func:`~nereus.runtime.transit.index.stage_names` order (a replica)."""
    if FLAT in tensors:
        return tensors[FLAT]
    p, t = unit.position(worker)
    names = stage_regions(spec, unit.tp, unit.pp, p, t)
    return torch.cat([tensors[n].reshape(-1) for n in names])


def unflatten(spec: ModelSpec, unit, worker: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """name → shard (a fresh tensor each) of a replica's flat vector ``[N]``: the inverse of
    :func:`flatten`."""
    p, t = unit.position(worker)
    shp = shapes(spec)
    out, off = {}, 0
    for name, r in stage_regions(spec, unit.tp, unit.pp, p, t).items():
        full = shp[name][0]
        shape = list(full)
        if r.dim is not None:
            shape[r.dim] = r.length
        k = full_numel(shape)
        out[name] = flat[off:off + k].reshape(shape).clone()
        off += k
    return out
