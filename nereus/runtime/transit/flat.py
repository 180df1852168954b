"""ZeRO slices in a live transition: the flat buffer of one ``(p, t)`` shard and who holds which part.

Source: DESIGN.md §4.8; Rajbhandari et al., "ZeRO" (SC'20) stage 1 ``P_os`` (the partitioning);
``worker/zero.py`` (the runtime's layout of it); the transition planner's ZeRO EMUs
(``nereus/transition/emu.py``: rank ``r`` of ``z`` holds ``[r/z, (r+1)/z)`` of the sharded part).

A ZeRO-1/2 engine at TP/PP position ``(p, t)`` flattens its parameter shards, in the order
:func:`~nereus.runtime.transit.index.stage_names` gives (the engine's own order, ``model/llama.py``),
into one vector of ``N`` elements (vocab padding rows included: they are part of the shard), pads
it to ``z·k`` with ``k = ceil(N / z)`` and gives DP rank ``r`` the slice ``[r·k, (r+1)·k)`` of every
*sliced kind* (:func:`sliced_kinds`: the Adam moments and, in a bf16 run, the fp32 master). The
replicated kinds (the weights, in ZeRO-1/2) stay per parameter name.

In a transition whose units include a ZeRO group (:func:`flat_mode`) a sliced kind is moved as
element ranges of that flat vector, named :data:`FLAT`:

* a replica (``z = 1``) holds ``[0, N)`` (its per-name tensors, concatenated in order);
* rank ``r`` of a group of degree ``z`` holds ``[r·k, min((r+1)·k, N))`` (:func:`flat_range`);
  its padding ``[N, z·k)`` is zero and never moved.

A piece is a range ``[lo, hi)`` of one position's flat vector, so slices only move between units of
the same ``(tp, pp)`` at the same ``(p, t)``; the transition planner splits a group that changes
TP/PP into replicas first (``local_dag.py``), which the executor's check (:func:`check_flat`) enforces.
With ``z | N`` a rank's slice is exactly ``N/z`` elements, the planner's ``ceil(N·ob/z)`` bytes; with
padding the last rank holds up to ``z-1`` elements fewer than the planner counts for it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from nereus.runtime.transit.index import full_numel, row_numel, shapes, stage_regions
from nereus.spec.model import ModelSpec

__all__ = ["FLAT", "sliced_kinds", "flat_numel", "flat_range", "flat_mode", "check_flat", "flatten",
           "unflatten"]

#: the name a flat ZeRO buffer goes under in a unit's ``tensors[kind]`` (``worker/zero.py``: ``"flat"``)
FLAT = "flat"


def sliced_kinds(zero: int) -> tuple[str, ...]:
    """State kinds a ZeRO group of stage ``zero`` holds as flat slices (``worker/zero.py``).

    Raises:
        ValueError: a stage the runtime's transitions do not move (2, 3: ``worker/zero3.py``'s
            engines, whose layout the executor does not read).
    """
    if zero == 1:
        return ("master", "exp_avg", "exp_avg_sq")
    if zero == 0:
        return ()
    raise ValueError(f"zero={zero}: live transitions move ZeRO-1 slices (worker/zero.py); ZeRO-2/3 engines "
                     "(worker/zero3.py) hold their state otherwise; valid: 0, 1")


@lru_cache(maxsize=256)
def flat_numel(spec: ModelSpec, tp: int, pp: int, p: int, t: int) -> int:
    """``N``: elements of the ``(p, t)`` shard of a ``(tp, pp)`` layout (vocab padding included)."""
    n = 0
    shp = shapes(spec)
    for name, r in stage_regions(spec, tp, pp, p, t).items():
        full = shp[name][0]
        n += full_numel(full) if r.dim is None else r.length * row_numel(full, r.dim)
    return n


def flat_range(spec: ModelSpec, unit, worker: int) -> tuple[int, int]:
    """``[lo, hi)`` of its position's flat vector that ``worker`` holds in ``unit`` (a
    :class:`~nereus.runtime.transit.plans.UnitMeta`): everything for a replica, rank ``r``'s slice
    for a ZeRO group (module docstring)."""
    p, t = unit.position(worker)
    n = flat_numel(spec, unit.tp, unit.pp, p, t)
    if unit.z == 1:
        return 0, n
    k = -(-n // unit.z)
    r = unit.rank(worker)
    return min(r * k, n), min((r + 1) * k, n)


def flat_mode(units) -> int:
    """The ZeRO stage whose sliced kinds move flat in a primitive over ``units`` (0: none is a group).

    Raises:
        ValueError: groups of different stages among them.
    """
    stages = {u.zero for u in units if u.z > 1}
    if len(stages) > 1:
        raise ValueError(f"units of ZeRO stages {sorted(stages)} in one primitive")
    return stages.pop() if stages else 0


def check_flat(move_pid: str, units) -> None:
    """Raise ValueError unless every unit of a flat-mode primitive has one ``(tp, pp)`` (slices of
    different layouts are not nested, module docstring)."""
    lays = {(u.tp, u.pp) for u in units}
    if len(lays) > 1:
        raise ValueError(f"{move_pid}: ZeRO slices move only between units of one (tp, pp); got {sorted(lays)}")


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
