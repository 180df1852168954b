"""Which piece of which tensor a primitive moves, from which worker to which (DESIGN.md §4.8).

Pure functions of shapes and EMU metadata, shared by the sender and the receiver of every transfer
so both compute the same plan without talking: no tensor here, only index ranges.

**Regions.** Under TP rank ``t`` of ``tp`` a logical parameter (``runtime/model/sharding.py`` rules) is held
as a *region* of the full tensor:

======  ==================================================================================
rule    region
======  ==================================================================================
rep     the whole tensor (``dim`` None)
col     rows ``[t·n/tp, (t+1)·n/tp)`` of dim 0
row     columns ``[t·n/tp, (t+1)·n/tp)`` of dim 1
kv      rows of dim 0: chunk ``t`` when ``tp <= g``; KV head ``t // (tp/g)`` when ``tp > g``
vocab   rows ``[t·c, (t+1)·c) ∩ [0, V)`` of dim 0, ``c = ceil(V/tp)``; the shard has ``c`` rows, the
        ones past ``V`` are zero padding (never moved)
======  ==================================================================================

Adam moments and the fp32 master weights of a bf16 run share their parameter's region (Adam is
elementwise). PP rank ``p`` holds the names
:func:`~nereus.runtime.model.sharding.names_of_stage` gives.

**Transfers.** For every produced EMU and every worker of it, in a fixed order (produced EMUs, their
workers, parameter names, state kinds), the needed region is covered first by what the worker
already holds in the primitive's *local* units (Split and Merge: the consumed units; Load: the
train EMU when it shares the worker), then by remote *source* units, preferring the rank-aligned
holder (same ``(p, t)`` in a source of the same layout: Extend sends each shard from its aligned
rank), then the source units' workers in order. Every (sender, receiver) pair exchanges one
contiguous buffer holding its pieces in that order. Split is thus an all-gather-v inside each
``a × b`` block (each member receives only what its finer ``T_sub`` shard lacks), Merge moves only
the non-resident parts, Extend copies each shard once from its aligned rank.

**ZeRO slices.** A kind a ZeRO group of the primitive slices (``transit/flat.py``: the moments and
bf16 master; ZeRO-3 also the weights) is planned per target worker before the names: as flat ranges
of its position's flat vector when every unit read is of the target's ``(tp, pp)``
(:func:`_plan_flat`, pieces named ``"flat"``), else gathered from the sliced sources' positions or
cut from whole units (``transit/regroup.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from nereus.runtime.model.precision import TRAIN_KINDS, WEIGHT_KINDS, train_kinds
from nereus.runtime.transit.flat import FLAT, is_sliced, spans
from nereus.runtime.transit.index import Region, stage_regions, tp_regions
from nereus.runtime.transit.index import cache_clear as index_cache_clear
from nereus.runtime.transit.regroup import kind_mode, plan_gather, subtract
from nereus.spec.model import ModelSpec

__all__ = ["Region", "UnitMeta", "MoveSpec", "Piece", "MovePlan", "region", "held", "plan_moves",
           "kinds_for", "kind_dtype", "cache_clear"]

def kinds_for(kinds: tuple[str, ...], precision: str) -> tuple[str, ...]:
    """``kinds`` (a :class:`MoveSpec`'s) restricted to what a run of ``precision`` holds: the
    executor names every kind of :data:`TRAIN_KINDS`; an fp32 run has no separate ``master``."""
    held_kinds = train_kinds(precision)
    return tuple(k for k in kinds if k in held_kinds or k not in TRAIN_KINDS)


def kind_dtype(kind: str, params_dtype):
    """The dtype a unit holds ``kind`` in: the engine's parameter dtype for ``params``; fp32 for the
    master weights and Adam moments (whatever the parameter dtype)."""
    return params_dtype if kind == "params" else torch.float32


def region(spec: ModelSpec, name: str, tp: int, t: int) -> Region:
    """The region of parameter ``name`` on TP rank ``t`` of ``tp`` (table in the module docstring;
    memoized per ``(spec, tp, t)`` in :func:`~nereus.runtime.transit.index.tp_regions`).

    Raises:
        KeyError: ``name`` is not a parameter of ``spec``.
    """
    return tp_regions(spec, tp, t)[name]


@dataclass(frozen=True)
class UnitMeta:
    """An EMU as the executor sees it: ``gpus`` are worker ids, ``gpus[(r*pp + p)*tp + t]``; ``host``:
    staged in the host memory of those workers (an Offload's output, or idle state offloaded);
    ``z``, ``zero``: a ZeRO group of ``z`` DP ranks (``transit/flat.py``), 1 and 0 for a replica."""

    uid: str
    model_stage: str
    tp: int
    pp: int
    gpus: tuple[int, ...]
    host: bool = False
    z: int = 1
    zero: int = 0

    def position(self, worker: int) -> tuple[int, int]:
        return divmod(self.gpus.index(worker) % (self.tp * self.pp), self.tp)

    def rank(self, worker: int) -> int:
        """DP (sharding) rank of ``worker`` in a ZeRO group (0 in a replica)."""
        return self.gpus.index(worker) // (self.tp * self.pp)

    @classmethod
    def of(cls, emu) -> UnitMeta:
        """From a ``nereus.transition.emu.EMU``."""
        return cls(emu.uid, emu.model_stage, emu.tp, emu.pp, tuple(emu.gpus), bool(emu.host),
                   int(getattr(emu, "z", 1)), int(getattr(emu, "zero", 0)))


def held(spec: ModelSpec, unit: UnitMeta, worker: int) -> Mapping[str, Region]:
    """Parameter name → region held by ``worker`` in ``unit`` (empty when not a member); read-only,
    memoized per layout position (:func:`~nereus.runtime.transit.index.stage_regions`)."""
    if worker not in unit.gpus:
        return {}
    p, t = unit.position(worker)
    return stage_regions(spec, unit.tp, unit.pp, p, t)


@dataclass(frozen=True)
class MoveSpec:
    """One primitive as the workers execute it (built by the driver from the DAG; metadata only).

    Attributes:
        pid, kind, model_stage: from the primitive.
        consumes: uids removed when it ends.
        produces: units created (for an Offload, the host-staged unit).
        sources: units whose pieces may be sent to other workers.
        local: units whose pieces count as already present on their own workers.
        kinds: state kinds moved (:data:`TRAIN_KINDS` or :data:`WEIGHT_KINDS`; a worker drops the
            kinds its run's precision does not hold, :func:`kinds_for`, before planning).
        storage_seed: a Load from storage re-creates frozen weights from this seed (-1: not one).
        workers: every worker that runs it (sends, receives, frees or produces).
    """

    pid: str
    kind: str
    model_stage: str
    consumes: tuple[str, ...] = ()
    produces: tuple[UnitMeta, ...] = ()
    sources: tuple[UnitMeta, ...] = ()
    local: tuple[UnitMeta, ...] = ()
    kinds: tuple[str, ...] = WEIGHT_KINDS
    storage_seed: int = -1
    workers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Piece:
    """``kind`` of ``name`` from the sender's unit ``uid``: rows/columns ``[lo, hi)`` of ``dim`` (all of
    it when ``dim`` is None)."""

    uid: str
    kind: str
    name: str
    dim: int | None
    lo: int
    hi: int


@dataclass
class MovePlan:
    """Transfers of one primitive.

    Attributes:
        pairs: ``(sender, receiver)`` → pieces, in buffer order.
        assembly: ``(receiver, produced uid)`` → ``[(kind, name, target region, segments)]`` where a
            segment is ``(source, source uid, lo, hi)``; ``source`` is the sending worker, or None
            when the piece is local (read from ``source uid`` on the receiver); a gathered item's
            segments are :class:`~nereus.runtime.transit.regroup.Part` s instead (``transit/regroup.py``).
        recut: ``(receiver, produced uid)`` → kinds planned per name and then cut into the target's
            ZeRO slots (``transit/regroup.py``).
    """

    pairs: dict = field(default_factory=dict)
    assembly: dict = field(default_factory=dict)
    members: tuple[int, ...] | None = None
    recut: dict = field(default_factory=dict)

    @property
    def comm_workers(self) -> tuple[int, ...]:
        """Workers that send or receive anywhere in the primitive (they build its communicator),
        also when the plan was restricted to one worker's pairs (``members``)."""
        if self.members is not None:
            return self.members
        return tuple(sorted({w for pair in self.pairs for w in pair}))


def _source_items(spec: ModelSpec, move: MoveSpec) -> list[tuple[int, UnitMeta, tuple, Mapping]]:
    """Every source worker once: ``(worker, unit, (tp, pp, p, t), held regions)``, in order."""
    out = []
    for u in move.sources:
        for w in u.gpus:
            up, ut = u.position(w)
            out.append((w, u, (u.tp, u.pp, up, ut), stage_regions(spec, u.tp, u.pp, up, ut)))
    return out


def _holders(spec: ModelSpec, move: MoveSpec, dst: UnitMeta, worker: int,
             sources: list) -> list[tuple[int | None, UnitMeta, Mapping]]:
    """Candidate holders of pieces for ``worker`` of ``dst``, in preference order: ``(sender or None
    when on ``worker`` itself, unit, held regions)``. Local units first (and a source unit's shard on
    ``worker``, e.g. its own host copy in a Restore), then the rank-aligned source worker, then
    every source worker in order (``sources``: :func:`_source_items`)."""
    p, t = dst.position(worker)
    key = (dst.tp, dst.pp, p, t)
    local = [(None, u, held(spec, u, worker)) for u in move.local if worker in u.gpus]
    aligned, rest = [], []
    for w, u, pos, regs in sources:
        if w == worker:
            local.append((None, u, regs))
        elif pos == key:
            aligned.append((w, u, regs))
        else:
            rest.append((w, u, regs))
    return local + aligned + rest


def plan_moves(spec: ModelSpec, move: MoveSpec, worker: int | None = None) -> MovePlan:
    """The transfers of ``move`` (see the module docstring); a Load from storage and Offload,
    Destroy plan none.

    Memoized per ``(spec, move, worker)`` (both frozen): a weight sync that runs every step plans
    once. Cost: one pass over the produced shards' parameter names per produced worker, with
    regions from :mod:`~nereus.runtime.transit.index` (issue 26: the per-piece recomputation of every
    parameter's shape made a Llama-3.3-70B TP4 PP16 Extend take 21 s per worker).

    Args:
        worker: keep only the pairs this worker sends or receives and its own assembly (what a
            worker executes); ``comm_workers`` still names every worker that sends or receives.
            None: the whole plan.

    Returns:
        the :class:`MovePlan`; shared between callers, so read-only.

    Raises:
        ValueError: a needed piece has no holder among the local and source units.
    """
    return _plan(spec, move, worker)


@lru_cache(maxsize=128)
def _plan(spec: ModelSpec, move: MoveSpec, worker: int | None) -> MovePlan:
    plan = MovePlan()
    if move.kind in ("destroy", "offload") or move.storage_seed >= 0:
        return plan
    everyone: set[int] = set()
    sources = _source_items(spec, move)
    units = move.sources + move.local
    sliced = tuple(k for k in move.kinds if any(is_sliced(u, k) for u in units + move.produces))
    for dst in move.produces:
        modes = {k: kind_mode(move.pid, dst, k, units) if k in sliced else "name" for k in move.kinds}
        flat_kinds = tuple(k for k in move.kinds if modes[k] == "flat")
        gather_kinds = tuple(k for k in move.kinds if modes[k] == "gather")
        name_kinds = tuple(k for k in move.kinds if modes[k] in ("name", "recut"))
        recut = tuple(k for k in move.kinds if modes[k] == "recut")
        for w in dst.gpus:
            mine = worker is None or w == worker
            holders = _holders(spec, move, dst, w, sources)
            p, t = dst.position(w)
            items = []
            for kind in flat_kinds:
                items += _plan_flat(spec, move, plan, dst, w, holders, kind, everyone, mine, worker)
            if recut and mine:
                plan.recut[(w, dst.uid)] = recut
            want_regions = stage_regions(spec, dst.tp, dst.pp, p, t)
            for name, want in want_regions.items():
                for kind in gather_kinds:  # buffer order: gathered kinds first, then name, kind, segment
                    parts = plan_gather(spec, move.pid, dst, w, name, want, kind, holders)
                    for part in parts:
                        for src_w, uid, a, b in part.segs:
                            if src_w is not None:
                                everyone.update((src_w, w))
                                if mine or src_w == worker:
                                    plan.pairs.setdefault((src_w, w), []).append(Piece(uid, kind, FLAT, 0, a, b))
                    if mine:
                        items.append((kind, name, want, tuple(parts)))
                if not name_kinds:
                    continue
                need = [(want.lo, want.hi)] if want.dim is not None else [(0, 1)]
                segs = []
                for src_w, u, h in holders:
                    if not need:
                        break
                    r = h.get(name)
                    if r is None:
                        continue
                    lo, hi = (r.lo, r.hi) if r.dim is not None and want.dim is not None else (0, 1)
                    taken, need = subtract(need, lo, hi)
                    segs += [(src_w, u.uid, a, b) for a, b in taken]
                if need and want.dim is not None and any(b > a for a, b in need):
                    raise ValueError(f"{move.pid}: no holder of {name} rows {need} for worker {w} of {dst.uid}")
                if want.dim is None and need:
                    raise ValueError(f"{move.pid}: no holder of {name} for worker {w} of {dst.uid}")
                dim = want.dim
                remote = [(src_w, uid, a if dim is not None else 0, b if dim is not None else 0)
                          for src_w, uid, a, b in segs if src_w is not None]
                for src_w, _uid, _a, _b in remote:
                    everyone.update((src_w, w))
                remote = [x for x in remote if mine or x[0] == worker]
                for kind in name_kinds:  # buffer order: name, kind, segment (the assembly's order)
                    for src_w, uid, a, b in remote:
                        plan.pairs.setdefault((src_w, w), []).append(Piece(uid, kind, name, dim, a, b))
                if mine:
                    items += [(kind, name, want, segs) for kind in name_kinds]
            if mine:
                plan.assembly[(w, dst.uid)] = items
    if worker is not None:
        plan.members = tuple(sorted(everyone))
    return plan


def _plan_flat(spec: ModelSpec, move: MoveSpec, plan: MovePlan, dst: UnitMeta, w: int, holders: list,
               kind: str, everyone: set, mine: bool, worker: int | None) -> list:
    """The flat pieces of ``kind`` for worker ``w`` of ``dst`` (``transit/flat.py``): its spans of its
    position's flat vector, covered by the holders' spans at the same ``(tp, pp, p, t)`` in order (local
    first); adds the pairs, returns the assembly item ``(kind, FLAT, None, segments)``."""
    pos = dst.position(w)
    need = [(s.lo, s.hi) for s in spans(spec, dst, w, kind)]
    segs: list = []
    for src_w, u, _h in holders:
        if not need:
            break
        at = w if src_w is None else src_w
        if (u.tp, u.pp) != (dst.tp, dst.pp) or u.position(at) != pos:
            continue
        for s in spans(spec, u, at, kind):
            taken, need = subtract(need, s.lo, s.hi)
            segs += [(src_w, u.uid, x, y) for x, y in taken]
            if not need:
                break
    if need:
        raise ValueError(f"{move.pid}: no holder of flat {kind} elements {need} for worker {w} of {dst.uid}")
    for src_w, uid, a, b in segs:
        if src_w is not None:
            everyone.update((src_w, w))
            if mine or src_w == worker:
                plan.pairs.setdefault((src_w, w), []).append(Piece(uid, kind, FLAT, 0, a, b))
    return [(kind, FLAT, None, segs)] if mine else []


def cache_clear() -> None:
    """Forget every memoized plan and layout index (benchmarks time cold bookkeeping with it)."""
    _plan.cache_clear()
    index_cache_clear()
