"""ZeRO slices across a TP/PP change in one primitive: gathered into whole shards of any layout, or cut locally.

Source: DESIGN.md §4.8; paper §6.3 (Split is a position-wise all-gather into coarser ``T_sub`` shards,
Merge a local re-cut); ``transit/flat.py`` (what a ZeRO rank holds: spans of its position's flat
vector). Called by :func:`~nereus.runtime.transit.plans.plan_moves`.

A primitive whose units are all of one ``(tp, pp)`` moves a sliced kind as flat ranges
(``plans._plan_flat``). When its units have several layouts, a kind some unit slices goes one of
two ways (:func:`kind_mode`):

* **gather** (a whole target, e.g. the replicas a Split of a ZeRO group into ``T_sub`` yields, a
  Restore of host slices into another layout, or an inference copy a Load fills from a ZeRO-3
  group): for each parameter name, the target's region is covered by the regions of the sliced
  sources' ``(p, t)`` positions (the worker's own position first), each contributing the rows (or
  columns) it holds that no earlier one did. A position's shard of a name is a contiguous range of
  its flat vector (:func:`~nereus.runtime.transit.flat.name_span`); rows of it are one sub-range,
  part of the columns of a row-split matrix one sub-range per row. Those ranges are fetched as flat
  pieces from whichever DP ranks hold them (:class:`Part`) and written into the target's region, so
  exactly the needed elements move;
* **recut** (a sliced target whose holders of that kind are all whole, e.g. a Merge of ``T_sub``
  replicas into a ZeRO group of another TP/PP): the kind is planned per name like the weights (a
  local cut where the replica holds the target's regions, the planner's free Merge) and the whole
  target shard is cut into the target's slots (``flat.cut_slots``, ``packing.assemble``).

A sliced target fed by slices of another layout is refused (``ValueError``): no primitive of the
transition planner does that (it splits a group into replicas of its own layout first).
"""

from __future__ import annotations

from typing import NamedTuple

from nereus.runtime.transit.flat import is_sliced, name_span, spans
from nereus.runtime.transit.index import Region, shapes

__all__ = ["Part", "kind_mode", "plan_gather"]


class Part(NamedTuple):
    """Rows/columns ``[lo, hi)`` (full-tensor coordinates) along ``dim`` (None: the whole tensor) of a
    name, gathered for a target from one source position: ``shape`` of the piece, ``ranges`` the flat
    ranges ``(a, b, offset in the piece)`` of that position's vector it is made of (one for rows, one
    per row for a part of the columns), and the segments ``(sender or None, uid, a, b)`` covering them."""

    dim: int | None
    lo: int
    hi: int
    shape: tuple
    ranges: tuple
    segs: tuple


def kind_mode(pid: str, dst, kind: str, units) -> str:
    """How ``kind`` reaches ``dst`` in a primitive reading ``units`` (module docstring): ``"flat"``
    (every unit read is of ``dst``'s layout), ``"gather"``, ``"recut"`` or ``"name"`` (no unit slices
    it).

    Raises:
        ValueError: a sliced ``dst`` and sliced holders of another layout.
    """
    lay = (dst.tp, dst.pp)
    if all((u.tp, u.pp) == lay for u in units):
        return "flat"
    sliced = [u for u in units if is_sliced(u, kind)]
    if is_sliced(dst, kind):
        if sliced:
            raise ValueError(f"{pid}: {kind} slices of {dst.uid} (tp={dst.tp}, pp={dst.pp}) from slices of "
                             f"{sorted({(u.tp, u.pp) for u in sliced})}: not a primitive the executor runs")
        return "recut"
    return "gather" if sliced else "name"


def subtract(need: list[tuple[int, int]], lo: int, hi: int) -> tuple[list, list]:
    """Cover ``[lo, hi)`` against the uncovered intervals ``need``: (taken parts, still uncovered)."""
    taken, rest = [], []
    for a, b in need:
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            rest.append((a, b))
            continue
        taken.append((x, y))
        rest += [iv for iv in ((a, x), (y, b)) if iv[1] > iv[0]]
    return taken, rest


def _cover(spec, u, pos: tuple[int, int], kind: str, lo: int, hi: int, w: int) -> list:
    """Segments of ``[lo, hi)`` of ``u``'s position-``pos`` flat vector from its DP ranks there (``w``
    itself first: ``None`` as sender)."""
    p, t = pos
    at = [u.gpus[(r * u.pp + p) * u.tp + t] for r in range(u.z)]
    at = sorted(at, key=lambda x: x != w)
    need, segs = [(lo, hi)], []
    for x in at:
        for s in spans(spec, u, x, kind):
            taken, need = subtract(need, s.lo, s.hi)
            segs += [(None if x == w else x, u.uid, a, b) for a, b in taken]
    if need:
        raise ValueError(f"{u.uid}: flat {kind} elements {need} of position {pos} are held by none of its ranks")
    return segs


def _ranges(r: Region, full: tuple, off: int, lo: int, hi: int) -> tuple[tuple, tuple]:
    """``(piece shape, ((a, b, offset in piece), ...))``: the flat ranges of a source position's vector
    (its shard of the name starting at ``off``, region ``r``) that hold rows/columns ``[lo, hi)``."""
    if r.dim is None:
        n = 1
        for x in full:
            n *= x
        return tuple(full), ((off, off + n, 0),)
    shape = list(full)
    shape[r.dim] = hi - lo
    if r.dim == 0:
        row = 1
        for x in full[1:]:
            row *= x
        return tuple(shape), ((off + (lo - r.lo) * row, off + (hi - r.lo) * row, 0),)
    if len(full) != 2 or r.dim != 1:
        raise ValueError(f"a region along dim {r.dim} of a {len(full)}-d tensor is not a TP rule")
    rows, width = full[0], r.length
    if hi - lo == width:  # every column of the shard: one range
        return tuple(shape), ((off, off + rows * width, 0),)
    k = hi - lo
    return tuple(shape), tuple((off + i * width + lo - r.lo, off + i * width + hi - r.lo, i * k) for i in range(rows))


def plan_gather(spec, pid: str, dst, w: int, name: str, want: Region, kind: str, holders: list) -> list[Part]:
    """The parts of ``kind`` of ``name`` that worker ``w`` of ``dst`` gathers from the sliced holders
    (``plans._holders`` order: the worker's own position first; module docstring): each source
    position contributes the rows/columns of the target's region it holds and no earlier one did.

    Raises:
        ValueError: rows left uncovered.
    """
    full = shapes(spec)[name][0]
    need = [(want.lo, want.hi)] if want.dim is not None else [(0, 1)]
    parts, seen = [], set()
    for src_w, u, h in holders:
        if not need:
            break
        if not is_sliced(u, kind):
            continue
        at = w if src_w is None else src_w
        pos = u.position(at)
        r = h.get(name)
        if r is None or (u.uid, pos) in seen:
            continue
        seen.add((u.uid, pos))
        lo, hi = (r.lo, r.hi) if r.dim is not None and want.dim is not None else (0, 1)
        taken, need = subtract(need, lo, hi)
        off, _n = name_span(spec, u.tp, u.pp, *pos, name)
        for a, b in taken:
            shape, ranges = _ranges(r if want.dim is not None else Region(None), full, off, a, b)
            segs = [seg for x, y, _o in ranges for seg in _cover(spec, u, pos, kind, x, y, w)]
            parts.append(Part(r.dim if want.dim is not None else None, a, b, shape, ranges, tuple(segs)))
    if need:
        raise ValueError(f"{pid}: no ZeRO holder of {kind} of {name} rows {need} for worker {w} of {dst.uid}")
    return parts
