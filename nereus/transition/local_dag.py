"""The local DAG of one model-stage: ``Δ_M = (E_M → E*_M)`` as Split → Destroy → Extend → Merge.

Source: paper §6.1 and DESIGN.md §4.6.

1. ``T_sub`` = the largest layout both the current and the target layout split into. When no
   replica is disjoint from a slot that needs an Extend (a shifted GPU set), smaller divisors of
   ``T_sub`` are tried: smaller units overlap less.
2. Each target EMU is cut into ``T_sub`` *slots* (:func:`~nereus.transition.emu.sub_units`). A
   current EMU is split when one of its ``T_sub`` units sits exactly on a slot's GPU set (it is kept
   in place), or when no unit is kept anywhere and a source of the target layout is needed.
3. Units that fill no slot are destroyed; empty slots are filled by Extend from a unit on disjoint
   GPUs (same node first, then the least used source). A split unit that fills no slot and feeds no
   Extend is not materialized at all (``split(keep=...)``): its GPUs only send their shards to their
   blocks and free them, so shrinking a layout moves only what the kept units lack.
4. Each target EMU is formed by Merge of its slots' units (skipped when one unit already is it).
5. With ``relocate``, a replica that would be split in place is first extended onto free slots
   (arranged by :func:`~nereus.transition.emu.aligned_gpus`) and split there.

When every current replica was lost (``current`` empty) and the model-stage holds no unique state,
the caller passes ``reload_from`` (storage, or a live EMU of the model's ``*.train``): the first
target EMU is created by :func:`~nereus.transition.primitives.load` and the others by Extend from
the copies already made, as a binary tree (each copy feeds at most two more), so storage is read
once per model-stage. A ``*.train`` model-stage with no current replica stays infeasible.
A model-stage whose Split fits neither in place nor relocated, or that is on a circular wait or
memory block no drop can clear, is *staged*: ``Offload`` copies a replica to host memory and frees the GPUs, then
``Restore`` writes the target shards back (training state included; its logical state is kept in
host memory in between, and other model-stages may use the freed GPUs meanwhile).
The same shape serves *drop and reload*: a frozen or derived model-stage whose current EMUs block
another model-stage (their memory, or a circular wait) is rebuilt as Destroy of every current EMU
(no edges: its state survives in storage or the train model-stage) plus the Load and Extends.

ZeRO groups (ours, issue 13): a training model-stage with ``zero >= 1`` is one EMU of layout
``(tp, pp, z, zero)`` (:func:`~nereus.transition.emu.phi`). ``T_sub`` keeps a sharding degree
``gcd(z, z*)`` only between groups of one ``(tp, pp)`` and stage; otherwise the common layout is
unsharded, so a group changing TP/PP is split into replicas (its ranks all-gather their slices) and
the target group is merged from replicas (each rank keeps its slice). A group that keeps its
``(tp, pp)`` and some DP blocks (``z`` grows or shrinks, the stage changes) is re-cut by one
:func:`~nereus.transition.primitives.reshard` instead; the caller first orders the target's DP
ranks so that staying ranks keep the most of their slices (:mod:`nereus.transition.group_ranks`).
Idle state (``Candidate.offload``): host copies move by ``Offload``/``Restore``
(:func:`~nereus.transition.staging.unstage`), a dropped target is Destroyed (:func:`_idle_dag`).

Edges are state dependencies only: a primitive follows the primitives that produce what it reads or
consumes; a Destroy or Merge follows every Extend reading the unit (buffer lifetime) and, when the model-stage
keeps no unit in place (so the unit may be its last replica), the first Extend, so a full copy always
exists. Resource ordering between model-stages is added by the global DAG.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.spec.hardware import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.transition.emu import EMU, aligned_gpus, sub_units, t_sub, zero_shard_bytes
from nereus.transition.primitives import (
    Primitive,
    destroy,
    extend,
    load,
    merge,
    reshard,
    split,
)
from nereus.transition.staging import stage, unstage

__all__ = ["LocalDAG", "build_local_dag", "Infeasible"]


class Infeasible(Exception):
    """The target cannot be reached under the primitives' rules; ``str(e)`` says why.

    Attributes:
        blocked: pids of the primitives that could not start (empty when not a resource block),
            or of the primitives on a circular wait (``cycle``).
        cycle: the DAG has a circular wait (``blocked`` lists it).
    """

    def __init__(self, message: str, blocked: tuple[str, ...] = (), cycle: bool = False) -> None:
        super().__init__(message)
        self.blocked = tuple(blocked)
        self.cycle = cycle


@dataclass(frozen=True)
class LocalDAG:
    """Primitives of one model-stage and their state dependencies.

    Attributes:
        model_stage: the model-stage.
        t_sub: the largest common layout used (``(tp, pp)``, or ``(tp, pp, z, zero)`` along a ZeRO
            group's sharding dimension).
        nodes: primitives in the default order Split → Destroy → Extend → Merge.
        edges: ``(pid_before, pid_after)`` pairs.
        kept: uids of units kept in place (not moved).
    """

    model_stage: str
    t_sub: tuple[int, int]
    nodes: tuple[Primitive, ...]
    edges: tuple[tuple[str, str], ...]
    kept: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"model_stage": self.model_stage, "t_sub": list(self.t_sub),
                "nodes": [n.pid for n in self.nodes], "edges": [list(e) for e in self.edges],
                "kept": list(self.kept)}


def _pick_source(slot: EMU, units: list[EMU], uses: dict, cluster: ClusterSpec | None) -> EMU | None:
    best, best_key = None, None
    for u in units:
        if set(u.gpus) & set(slot.gpus):
            continue
        same_node = 0
        if cluster is not None:
            same_node = sum(cluster.node_of(s) == cluster.node_of(d) for s, d in zip(u.gpus, slot.gpus))
        key = (-same_node, uses[u.uid], u.uid)
        if best_key is None or key < best_key:
            best, best_key = u, key
    return best


def _sub_layouts(common: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Divisors of a common layout, largest first (ties: larger TP): along TP/PP as in the paper,
    and along the sharding dimension only at the full ``(tp, pp)`` (:func:`~nereus.transition.emu.t_sub`)."""
    subs: list[tuple[int, ...]] = [(t, p) for t in _divisors(common[0]) for p in _divisors(common[1])]
    if len(common) > 2:
        subs += [(common[0], common[1], z, common[3]) for z in _divisors(common[2]) if z > 1]

    def size(s: tuple[int, ...]) -> int:
        return s[0] * s[1] * (s[2] if len(s) > 2 else 1)
    return sorted(subs, key=lambda s: (-size(s), -s[0]))


def _idle_dag(model_stage: str, current: tuple[EMU, ...], target: tuple[EMU, ...]) -> LocalDAG | None:
    """The local DAG when the state is or goes idle off the GPUs (``Candidate.offload``), else None.

    * target empty (``drop``): Destroy every current EMU (frozen or derived state only);
    * current in host memory: nothing when the target is the same host copy, else one Restore
      (:func:`~nereus.transition.staging.unstage`) onto the target GPUs or into the target's host
      layout;
    * current on GPUs, target in host memory: Offload (:func:`~nereus.transition.staging.stage`)
      then the Restore into the target's host layout.
    """
    if not target:
        if model_stage.endswith(".train"):
            raise ValueError(f"{model_stage}: training state cannot be dropped (offload='drop')")
        nodes = tuple(destroy(e) for e in current)
        return LocalDAG(model_stage, current[0].layout if current else (), nodes, (), ())
    cur_host = bool(current) and all(e.host for e in current)
    tgt_host = all(e.host for e in target)
    if cur_host:
        if tgt_host and sorted(e.signature() for e in current) == sorted(e.signature() for e in target):
            return LocalDAG(model_stage, target[0].layout, (), (), tuple(e.uid for e in current))
        r = unstage(current, target)
        return LocalDAG(model_stage, target[0].layout, (r,), (), ())
    if current and tgt_host:
        off, _ = stage(current, target)
        r = unstage(off.produces, target)
        return LocalDAG(model_stage, target[0].layout, (off, r), ((off.pid, r.pid),), ())
    return None


def _direct(model_stage: str, current: tuple[EMU, ...], target: tuple[EMU, ...], model: ModelSpec,
            bytes_per_param) -> LocalDAG | None:
    """One :func:`~nereus.transition.primitives.reshard` when one current EMU and one target EMU, a
    ZeRO group on at least one side, share ``(tp, pp)`` and some DP block (the group shrinks, grows,
    changes stage or moves part of its ranks), else None."""
    if len(target) == 1 and len(current) > 1 and target[0].z > 1 and isinstance(bytes_per_param, tuple):
        return _grow_from_replicas(model_stage, current, target[0], model, bytes_per_param)
    if len(current) != 1 or len(target) != 1:
        return None
    c, t = current[0], target[0]
    if max(c.z, t.z) == 1 or (c.tp, c.pp) != (t.tp, t.pp) or c.signature() == t.signature():
        return None
    mine = {c.block(r) for r in range(c.z)}
    if not any(t.block(r) in mine for r in range(t.z)):
        return None
    r = reshard(c, t, model, bytes_per_param)
    return LocalDAG(model_stage, t.layout, (r,), (), ())


def _grow_from_replicas(model_stage: str, current: tuple[EMU, ...], t: EMU, model: ModelSpec,
                        bytes_per_param: tuple[int, int]) -> LocalDAG | None:
    """``n > 1`` replicas of ``t``'s ``(tp, pp)`` whose blocks are all DP blocks of the larger ZeRO
    group ``t``: Merge them into a group of degree ``n`` on their own GPUs (each keeps its slice,
    nothing moves), then grow it with :func:`~nereus.transition.primitives.reshard` (new ranks
    receive the replicated part and their slice only). None when that shape does not apply."""
    blocks = {t.block(r) for r in range(t.z)}
    if any(e.z != 1 or (e.tp, e.pp) != (t.tp, t.pp) or e.gpus not in blocks for e in current) \
            or len(current) >= t.z:
        return None
    pb, ob = bytes_per_param
    per, shd = zero_shard_bytes(model, t.tp, t.pp, pb, ob, t.zero, len(current))
    mid = EMU(f"{model_stage}#z", model_stage, t.tp, t.pp, tuple(g for e in current for g in e.gpus), per,
              z=len(current), zero=t.zero, sharded=shd)
    m = merge(current, mid, model, bytes_per_param)
    r = reshard(mid, t, model, bytes_per_param)
    return LocalDAG(model_stage, mid.layout, (m, r), ((m.pid, r.pid),), ())


def build_local_dag(model_stage: str, current: tuple[EMU, ...], target: tuple[EMU, ...], model: ModelSpec,
                    bytes_per_param, cluster: ClusterSpec | None = None,
                    relocate: bool = False, reload_from: EMU | str | None = None,
                    staged: bool = False) -> LocalDAG:
    """The local DAG of ``model_stage`` from its current to its target EMUs.

    Args:
        current, target: EMUs of this model-stage (one layout each, ``Φ(π)`` and ``Φ(π*)``).
        model, bytes_per_param: shapes and state bytes per parameter of the model-stage, an int or
            ``(weights, optimizer)`` (:func:`~nereus.transition.emu.state_parts`; needed for ZeRO
            groups).
        cluster: used to prefer same-node Extend sources; optional.
        relocate: instead of splitting a replica in place (which needs room for the larger shards
            on its own GPUs), Extend it onto free target slots arranged by ``aligned_gpus`` and
            split the copy there; used when an in-place Split does not fit.
        reload_from: where a Load reads the state: ``"storage"`` or an EMU of the model's
            ``*.train`` (module docstring). With ``current`` empty (every replica lost) it rebuilds
            the model-stage; otherwise every current EMU is destroyed first (drop and reload).
        staged: move the model-stage through host memory, :func:`~nereus.transition.staging.stage`'s
            Offload then Restore (used when no GPU-resident path fits; training state included).

    Idle state (``Candidate.offload``, ours): an empty ``target`` (``drop``) destroys every current
    EMU; host-memory EMUs on either side are moved by Offload/Restore (:func:`_idle_dag`). A ZeRO
    group that keeps its ``(tp, pp)`` and some of its DP blocks is re-cut by one
    :func:`~nereus.transition.primitives.reshard` (:func:`_direct`).

    Raises:
        ValueError: empty EMU lists (``current`` may be empty only with ``reload_from``), mixed
            layouts, EMUs of another model-stage, or a ``*.train`` target that drops its state.
        Infeasible: no current unit is disjoint from a slot that must be filled by Extend; or no
            current unit of a ``*.train`` model-stage (its unique state is lost).
    """
    for e in current + target:
        if e.model_stage != model_stage:
            raise ValueError(f"{model_stage}: EMU {e.uid} belongs to {e.model_stage}")
    if not current and not target:
        return LocalDAG(model_stage, (), (), (), ())
    reload = reload_from is not None and target and not all(e.host for e in target)
    idle = None if reload else _idle_dag(model_stage, current, target)
    if idle is not None:
        return idle
    if target and reload_from is not None:
        return _build_reload(model_stage, target, reload_from, current, model, bytes_per_param)
    if staged and current and target:
        off, back = stage(current, target)
        return LocalDAG(model_stage, target[0].layout, (off, back), ((off.pid, back.pid),), ())
    if not current and target and model_stage.endswith(".train"):
        raise Infeasible(f"{model_stage}: every replica lost; its training state is unique; restore from a checkpoint")
    if not current or not target:
        raise ValueError(f"{model_stage}: needs current and target EMUs, got {len(current)} and {len(target)}")
    if len({e.layout for e in current}) != 1 or len({e.layout for e in target}) != 1:
        raise ValueError(f"{model_stage}: EMUs of one model-stage share one layout")
    direct = _direct(model_stage, current, target, model, bytes_per_param)
    if direct is not None:
        return direct
    subs = _sub_layouts(t_sub(current[0].layout, target[0].layout))
    for i, sub in enumerate(subs):
        try:
            return _build(model_stage, current, target, sub, model, bytes_per_param, cluster, relocate)
        except Infeasible:
            # no replica disjoint from a slot: smaller units overlap less (e.g. a shifted GPU set)
            if i == len(subs) - 1:
                raise
    raise AssertionError("unreachable")


def _build_reload(model_stage: str, target: tuple[EMU, ...], source: EMU | str,
                  current: tuple[EMU, ...] = (), model: ModelSpec | None = None,
                  bytes_per_param=0) -> LocalDAG:
    """Destroy ``current``, Load the first target EMU, then Extend copies in a binary tree (see the
    module docstring). A train EMU source that is a target EMU (uid with ``*``) is synced from after
    the train model-stage's transition (``load(..., read=False)``)."""
    if model_stage.endswith(".train"):
        raise ValueError(f"{model_stage}: training state is unique; it cannot be dropped and reloaded")
    for e in current + target:
        if e.model_stage != model_stage:
            raise ValueError(f"{model_stage}: EMU {e.uid} belongs to {e.model_stage}")
    if len({e.layout for e in target}) != 1:
        raise ValueError(f"{model_stage}: EMUs of one model-stage share one layout")
    first = load(target[0], source, read=isinstance(source, str) or "*" not in source.uid, model=model,
                 bytes_per_param=bytes_per_param)
    nodes, edges = [destroy(e) for e in current], []
    nodes.append(first)
    made = [first.pid]
    for i, e in enumerate(target[1:], start=1):
        parent = (i - 1) // 2
        x = extend(target[parent], e)
        nodes.append(x)
        edges.append((made[parent], x.pid))
        made.append(x.pid)
    return LocalDAG(model_stage, target[0].layout, tuple(nodes), tuple(edges), ())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _build(model_stage: str, current: tuple[EMU, ...], target: tuple[EMU, ...], sub: tuple[int, ...],
           model: ModelSpec, bytes_per_param, cluster: ClusterSpec | None,
           relocate: bool = False) -> LocalDAG:
    slots = {e.uid: (sub_units(e, sub, model, bytes_per_param, prefix="/") if e.layout != sub else (e,))
             for e in target}
    slot_sets = {frozenset(s.gpus) for ss in slots.values() for s in ss}
    # which current EMUs to split: those with a unit sitting on a slot
    pieces = {e.uid: (sub_units(e, sub, model, bytes_per_param) if e.layout != sub else (e,)) for e in current}
    to_split = [e for e in current if e.layout != sub
                and any(frozenset(u.gpus) in slot_sets for u in pieces[e.uid])]
    has_keep = any(frozenset(u.gpus) in slot_sets for e in current for u in pieces[e.uid])
    if not has_keep and current[0].layout != sub:
        # one replica becomes the Extend source: the one disjoint from the most slots
        free = [sum(not (set(e.gpus) & s) for s in slot_sets) for e in current]
        to_split = [current[free.index(max(free))]]
    nodes: list[Primitive] = []
    edges: list[tuple[str, str]] = []
    producer: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    units: list[EMU] = []
    moved: dict[str, EMU] = {}  # current uid → its copy on free slots (relocate)
    if relocate:
        occupied = {g for e in current for g in e.gpus}
        free = [s for ss in slots.values() for s in ss if not set(s.gpus) & occupied]
        for e in to_split:
            k = len(pieces[e.uid])
            if any(frozenset(u.gpus) in slot_sets for u in pieces[e.uid]) or len(free) < k:
                continue  # keeps a unit in place, or no room: split in place
            chosen, free = free[:k], free[k:]
            copy = replace(e, uid=f"{e.uid}>", gpus=aligned_gpus(chosen, e.layout))
            x = extend(e, copy)
            nodes.append(x)
            readers.setdefault(e.uid, []).append(x.pid)
            producer[copy.uid] = x.pid
            moved[e.uid] = copy
    for e in current:
        if e in to_split:
            src = moved.get(e.uid, e)
            s = split(src, sub, model, bytes_per_param)
            nodes.append(s)
            if src.uid in producer:
                edges.append((producer[src.uid], s.pid))
            for u in s.produces:
                producer[u.uid] = s.pid
                units.append(u)
        elif e.layout == sub:
            units.append(e)
    whole = [e for e in current if e.layout != sub and (e not in to_split or e.uid in moved)]  # destroyed unsplit
    by_set = {frozenset(u.gpus): u for u in units}
    filled: dict[str, EMU] = {}
    kept: set[str] = set()
    for ss in slots.values():
        for s in ss:
            u = by_set.get(frozenset(s.gpus))
            if u is not None and u.uid not in kept:
                filled[s.uid] = u
                kept.add(u.uid)
    uses = {u.uid: 0 for u in units}
    extends: list[Primitive] = []
    for u in units:
        readers.setdefault(u.uid, [])
    for ss in slots.values():
        for s in ss:
            if s.uid in filled:
                continue
            src = _pick_source(s, units, uses, cluster)
            if src is None:
                raise Infeasible(f"{model_stage}: no replica on GPUs disjoint from {list(s.gpus)} to "
                                 f"Extend from (current units on {[list(u.gpus) for u in units]})")
            uses[src.uid] += 1
            x = extend(src, s)
            extends.append(x)
            readers[src.uid].append(x.pid)
            if src.uid in producer:
                edges.append((producer[src.uid], x.pid))
            producer[s.uid] = x.pid
            filled[s.uid] = s
    # a split unit neither kept in place nor an Extend source would be destroyed at once: the Split
    # does not materialize it (its GPUs only send), so no Destroy and no bytes for it
    dropped: set[str] = set()
    for i, n in enumerate(nodes):
        if n.kind != "split":
            continue
        keep = {u.uid for u in n.produces if u.uid in kept or uses.get(u.uid, 0) > 0}
        if keep and len(keep) < len(n.produces):
            emu = next((x for x in list(current) + list(moved.values()) if x.uid == n.consumes[0]), None)
            nodes[i] = split(emu, sub, model, bytes_per_param, keep=keep)
            dropped |= {u.uid for u in n.produces} - keep
    destroys = []
    for u in [u for u in units if u.uid not in kept and u.uid not in dropped] + whole:
        d = destroy(u)
        destroys.append(d)
        if u.uid in producer:
            edges.append((producer[u.uid], d.pid))
        for r in readers.get(u.uid, ()):
            edges.append((r, d.pid))
        if not kept and extends and extends[0].pid not in readers.get(u.uid, ()):
            edges.append((extends[0].pid, d.pid))
    merges = []
    for e in target:
        parts = [filled[s.uid] for s in slots[e.uid]]
        if len(parts) == 1 and parts[0].gpus == e.gpus:
            continue
        m = merge(parts, e, model, bytes_per_param)
        merges.append(m)
        for u in parts:
            if u.uid in producer:
                edges.append((producer[u.uid], m.pid))
            for r in readers.get(u.uid, ()):  # a kept unit may be an Extend source: copy first
                edges.append((r, m.pid))
    ordered = nodes + destroys + extends + merges
    return LocalDAG(model_stage, sub, tuple(ordered), tuple(dict.fromkeys(edges)), tuple(sorted(kept)))
