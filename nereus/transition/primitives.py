"""The transition primitives as specs: what they read, consume and create, and their resources.

Source: paper §5.2 (Split, Merge, Extend, Destroy), §6.2-§6.3 (buffers, lifetimes, transport);
DESIGN.md §4.8, §4.9. Two more primitives are ours (not in the paper): ``Load`` re-creates a
replica of a model-stage that holds no unique state after every replica of it was lost or was
dropped to make room (see :func:`load`), and ``Offload``/``Restore`` move a model-stage to its
target layout through host memory when no GPU-resident path fits; those are built in
:mod:`nereus.transition.staging` (:func:`~nereus.transition.staging.stage`,
:func:`~nereus.transition.staging.unstage`), as :class:`Primitive` values of this module.

A :class:`Primitive` is pure data. Its memory effect is given per GPU by two numbers, both bytes:

* ``mem_hi[g]`` >= 0: the most it adds on ``g`` over the usage before it starts, at any moment from
  its start on (Split keeps source buffers until its all-gather ends; Merge receives the missing
  parts of its target shards before dropping the rest);
* ``mem_net[g]``: the change once it ended (negative for Destroy).

Pre-conditions: every EMU in ``reads`` and ``consumes`` exists; a primitive's ``acquires`` GPUs
(Extend, Load and Restore destinations) are not owned by another model-stage of the same stage. Post-conditions: ``consumes`` are gone and
``produces`` exist. :func:`apply` checks and applies both on a :class:`TransitionState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.spec.model import ModelSpec
from nereus.transition.buffers import alloc_bytes, recut_buffers, sent_bound
from nereus.transition.emu import EMU, HOST_ID, STAGE_ORDER, sub_units
from nereus.transition.held import held_bytes

__all__ = ["Primitive", "split", "merge", "extend", "destroy", "load", "reshard", "TransitionState", "apply",
           "KINDS", "priority", "STORAGE"]

KINDS = ("split", "destroy", "extend", "load", "merge", "offload", "restore")

#: ``Load`` source of frozen weights: the model files the job started from (shared storage).
STORAGE = "storage"


@dataclass(frozen=True)
class Primitive:
    """One primitive of a transition DAG.

    Attributes:
        pid: unique id, ``f"{kind}:{uid}"``.
        kind: ``split``, ``merge``, ``extend``, ``destroy``, ``load``, ``offload`` or ``restore``.
        model_stage: whose state it changes.
        reads: uids that must exist and stay alive while it runs (Extend's source).
        consumes: uids removed when it ends.
        produces: EMUs created when it ends.
        gpus: every GPU it touches (its own and its sources').
        acquires: GPUs the model-stage newly occupies (Extend, Load and Restore destinations).
        mem_hi: GPU → bytes, see the module docstring.
        mem_net: GPU → bytes, see the module docstring.
        groups: collective groups ``(gpus, recv_bytes_per_gpu)``: Split all-gathers, Merge reshards.
        pairs: point-to-point copies ``(src_gpu, dst_gpu, bytes)``: Extend broadcasts; the copies
            of an Offload, a Restore and a host-sourced Load use :data:`~nereus.transition.emu.HOST_ID`.
        home: a Restore's staged copy (or a Load's host train EMU) is in these GPUs' nodes' host memory.
        bytes_moved: bytes received over links, summed over GPUs.
        num_comms: communicators it creates (cost of setup).
        source: a Load's source, :data:`STORAGE` or the uid of the train EMU it syncs from;
            :data:`~nereus.transition.staging.HOST` for an Offload or Restore ("" else).
        recv: GPU → bytes of the produced shards that arrive on it over links (Split, Merge,
            Extend; empty for the others), what ``verify`` checks the produced state against.
        sent, alloc: GPU → bytes it sends (a bound) and bytes of new shards the runtime's executor
            allocates there; what :func:`~nereus.transition.buffers.with_buffers` counts.
        strided_sent, strided_alloc: of the largest ``sent`` and the largest ``alloc`` of one GPU,
            the bytes copied as column slices (a TP re-cut's row-parallel tensors), set by
            :func:`~nereus.transition.copy_cost.with_strided`; 0 when unset.
        freed_tensors: a Destroy's most tensors one GPU frees (``transition/teardown.py``); 0 unset.
    """

    pid: str
    kind: str
    model_stage: str
    reads: tuple[str, ...] = ()
    consumes: tuple[str, ...] = ()
    produces: tuple[EMU, ...] = ()
    gpus: tuple[int, ...] = ()
    acquires: tuple[int, ...] = ()
    mem_hi: dict = field(default_factory=dict)
    mem_net: dict = field(default_factory=dict)
    groups: tuple = ()
    pairs: tuple = ()
    bytes_moved: int = 0
    num_comms: int = 0
    source: str = ""
    home: tuple[int, ...] = ()
    recv: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    alloc: dict = field(default_factory=dict)
    strided_sent: int = 0
    strided_alloc: int = 0
    freed_tensors: int = 0

    @property
    def stage(self) -> str:
        return self.model_stage.partition(".")[2]

    def to_dict(self) -> dict:
        return {"pid": self.pid, "kind": self.kind, "model_stage": self.model_stage,
                "reads": list(self.reads), "consumes": list(self.consumes),
                "produces": [e.to_dict() for e in self.produces], "gpus": list(self.gpus),
                "acquires": list(self.acquires),
                "mem_hi": {str(g): v for g, v in self.mem_hi.items()},
                "mem_net": {str(g): v for g, v in self.mem_net.items()},
                "groups": [[list(g), b] for g, b in self.groups],
                "pairs": [list(p) for p in self.pairs], "bytes_moved": self.bytes_moved,
                "num_comms": self.num_comms, **({"source": self.source} if self.kind in ("load", "offload", "restore") else {})}


def priority(p: Primitive) -> tuple:
    """Paper order (§6.1): Destroy first (release-before-acquire), then generation → inference →
    training, then Split, Extend, Merge."""
    return (0 if p.kind == "destroy" else 1, STAGE_ORDER[p.stage], KINDS.index(p.kind), p.pid)


def split(emu: EMU, sub: tuple[int, ...], model: ModelSpec, bytes_per_param,
          keep: frozenset[str] | set[str] | None = None) -> Primitive:
    """``Split(EMU, T_sub) → {EMU_1..EMU_k}`` on the same GPUs (paper §5.2a).

    Each GPU goes from ``1/(tp*pp)`` of the state to ``1/(tp'*pp')`` by a position-wise all-gather
    inside its ``a x b`` block (``a = tp/tp'``, ``b = pp/pp'``) and keeps its source shard until the
    all-gather ends, so ``mem_hi = new shard`` and ``mem_net = new - old``. Along the sharding
    dimension of a ZeRO group (``c = z/z'``, ours) the block also spans ``c`` consecutive sharding
    ranks, whose slices together form the new ``1/z'`` slice (``z' = 1``: every unit a replica).

    With ``keep`` (uids of the units to produce), only those units are materialized: a GPU of a unit
    that would be destroyed right after only sends its shard to its block and then frees it
    (``mem_hi = 0``, ``mem_net = -old``, nothing received), so a Split that shrinks a layout onto
    fewer GPUs moves only what the kept units lack (ours; the paper splits into every unit and
    destroys the extra ones).

    Raises:
        ValueError: ``sub`` does not divide the layout or equals it, or ``keep`` names no unit.
    """
    if tuple(sub) == emu.layout:
        raise ValueError(f"Split of {emu.uid}: T_sub={sub} equals its layout; nothing to split")
    units = sub_units(emu, sub, model, bytes_per_param)
    if keep is not None:
        units = tuple(u for u in units if u.uid in keep)
        if not units:
            raise ValueError(f"Split of {emu.uid}: keep={sorted(keep)} names none of its units")
    unit_of = {g: u for u in units for g in u.gpus}
    a, b = emu.tp // sub[0], emu.pp // sub[1]
    c = emu.z // (sub[2] if len(sub) > 2 else 1)
    hi, net, groups, moved, recv = {}, {}, [], 0, {}
    for g in emu.gpus:
        if g in unit_of:
            new = unit_of[g].bytes_on(g)
            hi[g] = new
            net[g] = new - emu.bytes_on(g)
            moved += net[g]
            if net[g] > 0:
                recv[g] = net[g]
        else:
            hi[g] = 0
            net[g] = -emu.bytes_on(g)
    zs = emu.z // c
    for rq in range(zs):
        for pq in range(sub[1]):
            for tq in range(sub[0]):
                block = tuple(emu.gpu_at(pq * b + j, tq * a + i, rq * c + m)
                              for m in range(c) for j in range(b) for i in range(a))
                groups.append((block, max(max(net[g], 0) for g in block)))
    sent = sent_bound({g: emu.bytes_on(g) for g in emu.gpus}, recv, [blk for blk, _ in groups])
    alloc = {g: alloc_bytes(emu, g, u, emu.bytes_on(g)) for g, u in unit_of.items()}
    return Primitive(pid=f"split:{emu.uid}", kind="split", model_stage=emu.model_stage,
                     consumes=(emu.uid,), produces=units, gpus=emu.gpus, mem_hi=hi, mem_net=net,
                     groups=tuple(groups), bytes_moved=moved,
                     num_comms=len(groups) + len(units), recv=recv, sent=sent, alloc=alloc)


def reshard(emu: EMU, target: EMU, model: ModelSpec, bytes_per_param) -> Primitive:
    """One ZeRO group (or replica) re-cut into ``target`` along the sharding dimension (ours).

    For a model-stage whose current and target EMU have the same ``(tp, pp)`` and share DP blocks
    (a ZeRO group growing or shrinking ``z``, changing stage, e.g. ZeRO-1 → ZeRO-3, or a replica
    becoming a group): every target GPU receives the part of its new shard it does not hold
    (:func:`~nereus.transition.held.held_bytes`) from the ranks that hold it, and GPUs that leave send
    their slices and free them. Two of the paper's primitives along the sharding dimension:

    * ``kind="split"`` when the target's GPUs are a strict subset (``z → z* < z``: fewer holders,
      each gathers more, as a Split that keeps one unit, ``split(keep=...)``); ``mem_hi = new`` on a
      kept GPU (its old slice is kept until the exchange ends), ``mem_net = new - old``;
    * ``kind="merge"`` otherwise: the same GPUs (a one-unit Merge that re-cuts slices, paper §6.3)
      or new ones too (``z → z* > z``): the Merge of the group with the copies an Extend would put on
      the new DP blocks, fused so that a new rank receives only its own slice and the replicated
      part (weights for ZeRO-1/2), not a whole copy that the Merge would then cut; it acquires the
      new GPUs (``mem_hi = mem_net = new`` there) and a staying GPU has ``mem_hi =
      max(received, new - old, 0)``, ``mem_net = new - old``.

    Leaving GPUs: ``mem_hi = 0``, ``mem_net = -old``. Cost: one all-to-all group of every GPU
    involved, receiving the largest per-GPU amount (``cost.duration``).

    Raises:
        ValueError: different model-stage or ``(tp, pp)``, or no DP block in common.
    """
    if emu.model_stage != target.model_stage or (emu.tp, emu.pp) != (target.tp, target.pp):
        raise ValueError(f"reshard {emu.uid} → {target.uid}: needs one model-stage and one (tp, pp)")
    mine = {emu.block(r) for r in range(emu.z)}
    if not any(target.block(r) in mine for r in range(target.z)):
        raise ValueError(f"reshard {emu.uid} → {target.uid}: no DP block in common (use Extend)")
    tg, cg = set(target.gpus), set(emu.gpus)
    shrink = tg < cg
    hi, net, recv, moved = {}, {}, {}, 0
    for g in emu.gpus + tuple(g for g in target.gpus if g not in cg):
        old = emu.bytes_on(g)
        if g in tg:
            new = target.bytes_on(g)
            miss = max(0, new - held_bytes(model, bytes_per_param, emu, g, target, g)) if g in cg else new
            hi[g] = new if shrink or g not in cg else max(miss, new - old, 0)
            net[g] = new - old
            if miss:
                recv[g] = miss
                moved += miss
        else:
            hi[g], net[g] = 0, -old
    kind = "split" if shrink else "merge"
    gpus = tuple(hi)
    groups = ((gpus, max(recv.values())),) if moved else ()
    pid = f"split:{emu.uid}" if kind == "split" else f"merge:{target.uid}"
    sent, alloc = recut_buffers(emu, target, recv)  # the executor's buffers (buffers.py)
    return Primitive(pid=pid, kind=kind, model_stage=emu.model_stage, consumes=(emu.uid,), produces=(target,),
                     gpus=gpus, acquires=tuple(g for g in target.gpus if g not in cg), mem_hi=hi, mem_net=net,
                     groups=groups, bytes_moved=moved, num_comms=1 + (1 if moved else 0), recv=recv,
                     sent=sent, alloc=alloc)


def merge(units: list[EMU] | tuple[EMU, ...], target: EMU, model: ModelSpec,
          bytes_per_param) -> Primitive:
    """``Merge({EMU_1..EMU_k}, T) → EMU'`` on the union of the units' GPUs (paper §5.2b).

    Every target GPU receives the part of its target shard it does not already hold
    (:func:`~nereus.transition.held.held_bytes`); with units placed by :func:`aligned_gpus` nothing
    moves. Into a ZeRO group (ours): units of its ``(tp, pp)`` and a smaller ``z'``, or unsharded
    units of any layout; each GPU keeps its slice and drops the rest. A single unit
    (``k = 1``) on the target GPUs in another rank order is a Merge that only permutes shards.

    Raises:
        ValueError: units of different model-stages or layouts, or whose GPUs do not partition the
            target's.
    """
    if not units:
        raise ValueError(f"Merge into {target.uid}: no units")
    if any(u.model_stage != target.model_stage for u in units):
        raise ValueError(f"Merge into {target.uid}: units of other model-stages "
                         f"{sorted({u.model_stage for u in units})}")
    if len({u.layout for u in units}) != 1:
        raise ValueError(f"Merge into {target.uid}: units have different layouts {[u.layout for u in units]}")
    owner = {}
    for u in units:
        for g in u.gpus:
            if g in owner:
                raise ValueError(f"Merge into {target.uid}: GPU {g} is in two units")
            owner[g] = u
    if set(owner) != set(target.gpus):
        raise ValueError(f"Merge into {target.uid}: units cover GPUs {sorted(owner)}, target needs "
                         f"{sorted(target.gpus)}")
    hi, net, moved = {}, {}, 0
    recv, alloc = {}, {}
    for g in target.gpus:
        u = owner[g]
        res = held_bytes(model, bytes_per_param, u, g, target, g)
        need = target.bytes_on(g)
        missing = max(0, need - res)
        recv[g] = missing
        alloc[g] = alloc_bytes(u, g, target, res)
        hi[g] = max(missing, need - u.bytes_on(g), 0)
        net[g] = need - u.bytes_on(g)
        moved += missing
    groups = ((target.gpus, max(recv.values())),) if moved else ()
    return Primitive(pid=f"merge:{target.uid}", kind="merge", model_stage=target.model_stage,
                     consumes=tuple(u.uid for u in units), produces=(target,), gpus=target.gpus,
                     mem_hi=hi, mem_net=net, groups=groups, bytes_moved=moved,
                     num_comms=1 + (1 if moved else 0), recv={g: b for g, b in recv.items() if b},
                     sent=sent_bound({g: owner[g].bytes_on(g) for g in target.gpus}, recv, [target.gpus]),
                     alloc=alloc)


def extend(src: EMU, dst: EMU) -> Primitive:
    """``Extend(EMU, R') → {EMU, EMU'}``: copy ``src`` onto the disjoint GPUs of ``dst`` (paper §5.2c).

    Rank-aligned broadcast: the shard at ``(p, t)`` goes once, as one contiguous buffer, from
    ``src.gpu_at(p, t)`` to ``dst.gpu_at(p, t)``, one communicator per pair (paper §6.3).

    Raises:
        ValueError: different model-stage or layout, or overlapping GPU sets.
    """
    if src.model_stage != dst.model_stage or src.layout != dst.layout:
        raise ValueError(f"Extend {src.uid} → {dst.uid}: needs the same model-stage and layout, got "
                         f"{src.model_stage}{src.layout} and {dst.model_stage}{dst.layout}")
    common = set(src.gpus) & set(dst.gpus)
    if common:
        raise ValueError(f"Extend {src.uid} → {dst.uid}: destination GPUs must be disjoint from the "
                         f"source, both hold {sorted(common)}")
    pairs = tuple((s, d, src.bytes_on(s)) for s, d in zip(src.gpus, dst.gpus))
    mem = {d: b for _, d, b in pairs}
    return Primitive(pid=f"extend:{dst.uid}", kind="extend", model_stage=src.model_stage,
                     reads=(src.uid,), produces=(dst,), gpus=src.gpus + dst.gpus, acquires=dst.gpus,
                     mem_hi=dict(mem), mem_net=dict(mem), pairs=pairs,
                     bytes_moved=sum(b for _, _, b in pairs), num_comms=len(pairs) + 1,
                     recv={d: b for _, d, b in pairs if b}, sent={s: b for s, _, b in pairs if b}, alloc=dict(mem))


def destroy(emu: EMU) -> Primitive:
    """``Destroy(EMU) → ∅``: local teardown and memory release, no collective (paper §5.2d)."""
    return Primitive(pid=f"destroy:{emu.uid}", kind="destroy", model_stage=emu.model_stage,
                     consumes=(emu.uid,), gpus=emu.gpus, mem_net={g: -emu.bytes_on(g) for g in emu.gpus})


def load(dst: EMU, source: EMU | str, read: bool = True, model: ModelSpec | None = None,
         bytes_per_param=0) -> Primitive:
    """``Load(EMU, source) → EMU``: re-create a replica whose model-stage lost every replica, or
    whose copies were dropped to make room (``estimate.plan_dag``; ours).

    Only model-stages without unique state may be re-created (DESIGN.md §4.9: state survives as
    long as one copy does): frozen weights (``reference.infer``, ``reward.infer``) are read from
    ``source = STORAGE`` (the model files the job started from), and the weight copies of a trained
    model (``actor.generate``, ``actor.infer``, ``critic.infer``) from a live EMU of its
    ``<model>.train`` model-stage, as the per-step weight sync does. ``*.train`` holds the unique
    logical state (θ, ω, counters) and is never loaded: losing all of it means a checkpoint restore.

    * storage: every destination GPU reads its shard; no GPU-to-GPU traffic (``pairs`` empty);
    * train EMU: weight-sync broadcast, destination GPU ``i`` receives its shard (weights only,
      ``dst.shard_bytes``) from train GPU ``src.gpus[i % len(src.gpus)]`` (a destination GPU that
      also holds the train EMU copies what it already holds locally, without a link, and receives
      the rest when ``model`` and ``bytes_per_param`` (of ``dst``) say how much of its shard the
      train shard on it covers, :func:`~nereus.transition.held.resident_bytes`; without them it is
      counted in full); the source EMU is read (it must stay alive until the Load ends);
    * host train EMU (``offload="host"``; ours): pairs ``(HOST_ID, d, bytes)``, ``home = source.gpus``,
      no communicator, timed as a Restore (verl also loads offloaded weights first, reference/rl-frameworks.md).
    With ``read=False`` the source is a *target* EMU of the train model-stage: the Load reads no uid,
    ``source`` is the train model-stage's name, and the global DAG orders it after every primitive
    of that model-stage (sync from its final layout).

    ``mem_hi = mem_net = dst.bytes_on(g)`` on the destination GPUs; ``bytes_moved`` counts the
    bytes received (from storage or over links).

    Raises:
        ValueError: a ``*.train`` destination, or a source that is neither storage nor an EMU of
            the destination model's ``*.train``.
    """
    mname, _, stage = dst.model_stage.partition(".")
    if stage == "train":
        raise ValueError(f"Load {dst.uid}: {dst.model_stage} holds unique training state and cannot be "
                         "reloaded; restore it from a checkpoint")
    mem = {g: dst.bytes_on(g) for g in dst.gpus}
    common = dict(pid=f"load:{dst.uid}", kind="load", model_stage=dst.model_stage, produces=(dst,),
                  acquires=dst.gpus, mem_hi=dict(mem), mem_net=dict(mem), bytes_moved=sum(mem.values()))
    if isinstance(source, str):
        if source != STORAGE:
            raise ValueError(f"Load {dst.uid}: source must be {STORAGE!r} or a {mname}.train EMU, got {source!r}")
        return Primitive(gpus=dst.gpus, source=STORAGE, **common)
    if source.model_stage != f"{mname}.train":
        raise ValueError(f"Load {dst.uid}: weights of {dst.model_stage} derive from {mname}.train, not "
                         f"{source.model_stage} ({source.uid})")
    if source.host:  # host → device from the offloaded train state; no send buffers, priced as a Restore
        gpus = source.gpus + tuple(g for g in dst.gpus if g not in source.gpus)
        return Primitive(reads=(source.uid,) if read else (), gpus=gpus, pairs=tuple((HOST_ID, d, mem[d]) for d in dst.gpus),
                         home=source.gpus, source=source.uid if read else source.model_stage, **common)
    pairs, moved = [], 0
    n = len(source.gpus)
    for i, d in enumerate(dst.gpus):
        if d not in source.gpus:
            pairs.append((source.gpus[i % n], d, mem[d]))
            moved += mem[d]
        elif model is not None and bytes_per_param:  # receives what the train shard here lacks
            miss = max(0, mem[d] - held_bytes(model, bytes_per_param, source, d, dst, d))
            if miss:
                j = source.gpus.index(d)
                pairs.append((source.gpus[(j + 1) % n], d, miss))
                moved += miss
        else:
            moved += mem[d]
    common["bytes_moved"] = moved
    sent: dict[int, int] = {}
    for s_, _, b in pairs:
        sent[s_] = sent.get(s_, 0) + b
    common.update(sent=sent, alloc=dict(mem))
    gpus = source.gpus + tuple(g for g in dst.gpus if g not in source.gpus)
    return Primitive(reads=(source.uid,) if read else (), gpus=gpus, pairs=tuple(pairs), num_comms=len(pairs) + 1,
                     source=source.uid if read else source.model_stage, **common)



@dataclass
class TransitionState:
    """The EMUs alive and the bytes per GPU at one point of a transition (mutable; for checking).

    Attributes:
        emus: uid → EMU.
        used: GPU → bytes held (state plus running primitives' buffers).
    """

    emus: dict
    used: dict

    @classmethod
    def of(cls, emus) -> TransitionState:
        used: dict[int, int] = {}
        for e in emus:
            for g in e.gpus:
                used[g] = used.get(g, 0) + e.bytes_on(g)
        return cls({e.uid: e for e in emus}, used)

    def owners(self, gpu: int) -> set[str]:
        """Model-stages with an EMU on ``gpu`` (a copy staged in host memory owns none)."""
        return {e.model_stage for e in self.emus.values() if gpu in e.gpus and not e.host}

    def copies(self, model_stage: str) -> int:
        return sum(1 for e in self.emus.values() if e.model_stage == model_stage)


def check_pre(state: TransitionState, prim: Primitive, exclusive: bool = True,
              shared: frozenset = frozenset()) -> str | None:
    """Why ``prim`` cannot start in ``state`` (ignoring memory), or None.

    ``exclusive=False`` (a job whose framework colocates model-stages of one stage) lets an
    acquisition share a GPU with a concurrent model-stage; ``shared`` names model-stages that may
    share GPUs with each other during this transition (``GlobalDAG.shared``).
    """
    for uid in prim.reads + prim.consumes:
        if uid not in state.emus:
            return f"{prim.pid}: EMU {uid} does not exist"
    for g in prim.acquires if exclusive else ():
        for other in state.owners(g):
            if other != prim.model_stage and other.partition(".")[2] == prim.stage and not (
                    other in shared and prim.model_stage in shared):
                return f"{prim.pid}: GPU {g} is owned by concurrent model-stage {other}"
    return None


def apply(state: TransitionState, prim: Primitive) -> None:
    """Run ``prim`` to completion on ``state`` (checks pre-conditions).

    Raises:
        ValueError: a pre-condition does not hold.
    """
    why = check_pre(state, prim)
    if why:
        raise ValueError(why)
    for uid in prim.consumes:
        del state.emus[uid]
    for e in prim.produces:
        state.emus[e.uid] = e
    for g, d in prim.mem_net.items():
        state.used[g] = state.used.get(g, 0) + d
