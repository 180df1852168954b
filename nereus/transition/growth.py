"""Growth at the minimum bytes: an Extend whose copy only feeds a Merge is fused into that Merge.

Source: paper §5.2 (Extend, Merge), §6.1 (the local DAG Split → Destroy → Extend → Merge); issue 26
(growth moved 2x the minimum bytes: TP/PP 1->2 Extend a whole replica onto the new GPUs and the Merge
then keeps half of it; a Merge that reads its missing parts from remote sources moved exactly the
minimum with bit-identical state).

:func:`~nereus.transition.local_dag.build_local_dag` fills a target slot that no current unit
covers with an Extend of a whole ``T_sub`` unit, then Merges the slots into the target EMU. When
such a copy is read by nothing else and consumed only by that Merge, :func:`fuse_growth` replaces
the pair by one *remote-source Merge* (:func:`remote_merge`):

* it consumes the Merge's other (local) units and *reads* the Extend's source;
* a GPU of a local unit receives what it lacks, as in the Merge (``recv`` unchanged);
* a GPU of the copied slot receives its target shard alone, ``target.bytes_on(g)``, from the
  source's GPUs (the executor's plan covers each target region from the rank-aligned holder
  first, ``runtime/transit/plans.py``), instead of the whole unit;
* memory: ``mem_hi = mem_net = target.bytes_on(g)`` on such a GPU (it is acquired, as by the
  Extend), the Merge's values elsewhere; the source's GPUs only send (0). ``sent`` (bounded over
  every GPU of it: the executor may take a piece from any holder) and ``alloc`` feed
  :func:`~nereus.transition.buffers.with_buffers`.

Its bytes on the new GPUs equal the target bytes they do not hold, which is what
:func:`~nereus.transition.cost.min_bytes` counts there, so the growth moves the minimum. Edges:
every edge into or out of the Extend or the Merge now touches the fused primitive (a Destroy of
the source still waits for it; the pid stays the Merge's).
"""

from __future__ import annotations

from dataclasses import replace

from nereus.transition.buffers import sent_bound
from nereus.transition.local_dag import LocalDAG
from nereus.transition.primitives import Primitive

__all__ = ["fuse_growth", "remote_merge"]


def remote_merge(m: Primitive, copies: list[Primitive]) -> Primitive:
    """Merge ``m`` with the Extends ``copies`` that produced some of its units fused in (module
    docstring).

    Raises:
        ValueError: a copy is not an Extend producing one unit that ``m`` consumes, or ``m`` is
            not a Merge with one target.
    """
    if m.kind != "merge" or len(m.produces) != 1:
        raise ValueError(f"{m.pid}: only a Merge into one target takes remote sources, got {m.kind}")
    target = m.produces[0]
    fused = {}
    for x in copies:
        if x.kind != "extend" or len(x.produces) != 1 or x.produces[0].uid not in m.consumes:
            raise ValueError(f"{x.pid}: not an Extend of a unit that {m.pid} consumes")
        fused[x.produces[0].uid] = x
    new_gpus = [g for x in fused.values() for g in x.produces[0].gpus]
    recv = {g: b for g, b in m.recv.items() if g not in new_gpus}
    hi = {g: b for g, b in m.mem_hi.items() if g not in new_gpus}
    net = {g: b for g, b in m.mem_net.items() if g not in new_gpus}
    for g in new_gpus:
        need = target.bytes_on(g)
        hi[g] = net[g] = need
        if need:
            recv[g] = need
    reads = tuple(dict.fromkeys(u for x in fused.values() for u in x.reads if u not in m.consumes))
    senders = [g for x in fused.values() for g in x.gpus if g not in target.gpus]
    gpus = tuple(dict.fromkeys(tuple(target.gpus) + tuple(senders)))
    for g in senders:
        hi.setdefault(g, 0)
        net.setdefault(g, 0)
    held = {g: target.bytes_on(g) - net[g] for g in m.mem_net if g not in new_gpus}  # the local units'
    for x in fused.values():
        for s, _, b in x.pairs:
            held[s] = max(held.get(s, 0), b)
    alloc = {**{g: b for g, b in m.alloc.items() if g not in new_gpus}, **{g: target.bytes_on(g) for g in new_gpus}}
    moved = sum(recv.values())
    groups = ((gpus, max(recv.values())),) if moved else ()
    acquires = tuple(dict.fromkeys(m.acquires + tuple(g for x in fused.values() for g in x.acquires)))
    return replace(m, reads=m.reads + reads, consumes=tuple(u for u in m.consumes if u not in fused),
                   gpus=gpus, acquires=acquires, mem_hi=hi, mem_net=net, groups=groups, bytes_moved=moved,
                   num_comms=1 + (1 if moved else 0), recv=recv, alloc=alloc,
                   sent=sent_bound(held, recv, [gpus]))  # any holder may serve a piece (transit/plans.py)


def fuse_growth(ld: LocalDAG) -> LocalDAG:
    """``ld`` with every Extend whose copy only feeds one Merge fused into that Merge
    (:func:`remote_merge`); ``ld`` itself when there is none.

    A copy is fused when the Merge consumes it, no other primitive reads or consumes it, and it is
    a plain replica copy (its source and the copy are unsharded, ``z == 1``: the executor covers a
    target region from any holder of the same parameters).
    """
    nodes = list(ld.nodes)
    by_out = {x.produces[0].uid: x for x in nodes if x.kind == "extend" and len(x.produces) == 1}
    users: dict[str, list[str]] = {}
    for n in nodes:
        for u in n.reads + n.consumes:
            users.setdefault(u, []).append(n.pid)
    fuse: dict[str, list[Primitive]] = {}
    for m in nodes:
        if m.kind != "merge" or len(m.produces) != 1 or m.produces[0].z != 1:
            continue
        xs = [by_out[u] for u in m.consumes if u in by_out and users.get(u) == [m.pid]
              and by_out[u].produces[0].z == 1]
        if xs:
            fuse[m.pid] = xs
    if not fuse:
        return ld
    gone = {x.pid: m for m, xs in fuse.items() for x in xs}  # extend pid → merge pid
    out = []
    for n in nodes:
        if n.pid in gone:
            continue
        out.append(remote_merge(n, fuse[n.pid]) if n.pid in fuse else n)
    edges = []
    for a, b in ld.edges:
        a, b = gone.get(a, a), gone.get(b, b)
        if a != b:
            edges.append((a, b))
    return replace(ld, nodes=tuple(out), edges=tuple(dict.fromkeys(edges)))
