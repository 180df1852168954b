"""Re-layout on the same GPUs at the minimum bytes: a Split whose units only feed one Merge onto the
Split's own GPUs is fused into that Merge.

Source: paper §5.2 (Split, Merge), §6.1 (the local DAG Split → Merge through ``T_sub``); issue 26
(the same-GPU re-layout TP 2 → PP 2 moved 2x the minimum: the Split all-gathers every GPU up to
the ``T_sub`` replica, 57.0 MB for the ``small`` preset's actor, and the Merge then keeps half).

When both layouts of a change share their GPU set and ``T_sub`` is coarser than both (TP 2 → PP 2:
``T_sub = (1, 1)``), :func:`~nereus.transition.local_dag.build_local_dag` splits every GPU up to a
``T_sub`` unit and then merges. :func:`fuse_relayout` replaces the pair by one
:func:`~nereus.transition.primitives.merge` of the current EMU itself into the target: every GPU
receives only the part of its target shard it does not hold (what
:func:`~nereus.transition.cost.min_bytes` counts), from the GPUs that hold it (the executor's piece
plan, ``runtime/transit/plans.py``, covers a region from the local unit first, then any holder).

Memory: the executor allocates the new shard while the old one is alive and holds the send and
receive buffers meanwhile (:mod:`nereus.transition.buffers`), so the fused Merge's ``mem_hi`` under
:func:`~nereus.transition.buffers.with_buffers` is ``new + received + sent`` per GPU. For TP 2 → PP 2
that is below the unfused Split's (``T_sub replica + sent + received``). ``estimate.plan_dag`` still
falls back to the unfused pair for a model-stage whose fused Merge a memory block names.

Fused: a Split of one current EMU (``z == 1``) whose produced units are consumed by one Merge and
used by nothing else, that Merge consuming exactly those units into one unsharded target on the
same GPU set. Edges into the Split or out of the Merge touch the fused Merge (pid unchanged).
"""

from __future__ import annotations

from dataclasses import replace

from nereus.spec.model import ModelSpec
from nereus.transition.emu import EMU
from nereus.transition.local_dag import LocalDAG
from nereus.transition.primitives import merge

__all__ = ["fuse_relayout"]


def fuse_relayout(ld: LocalDAG, current: tuple[EMU, ...], model: ModelSpec,
                  bytes_per_param) -> tuple[LocalDAG, frozenset[str]]:
    """``ld`` with every same-GPU Split → Merge fused (module docstring), and the fused pids.

    Args:
        current: the model-stage's current EMUs (the Splits' sources).
        model, bytes_per_param: as for :func:`~nereus.transition.primitives.merge`.
    """
    by_uid = {e.uid: e for e in current}
    node = {n.pid: n for n in ld.nodes}
    users: dict[str, set[str]] = {}
    for n in ld.nodes:
        for u in n.reads + n.consumes:
            users.setdefault(u, set()).add(n.pid)
    fused: dict[str, str] = {}  # split pid → merge pid
    new: dict[str, object] = {}  # merge pid → fused Merge
    for s in ld.nodes:
        if s.kind != "split" or len(s.consumes) != 1 or s.consumes[0] not in by_uid:
            continue
        e = by_uid[s.consumes[0]]
        outs = {u.uid for u in s.produces}
        us = set().union(*(users.get(u, set()) for u in outs)) if outs else set()
        if len(us) != 1:
            continue
        m = node[next(iter(us))]
        if m.kind != "merge" or len(m.produces) != 1 or set(m.consumes) != outs or m.pid in new:
            continue
        t = m.produces[0]
        if set(t.gpus) != set(e.gpus) or t.z != 1 or e.z != 1:
            continue
        fused[s.pid] = m.pid
        new[m.pid] = merge([e], t, model, bytes_per_param)
    if not fused:
        return ld, frozenset()
    nodes = tuple(new.get(n.pid, n) for n in ld.nodes if n.pid not in fused)
    edges = []
    for a, b in ld.edges:
        a, b = fused.get(a, a), fused.get(b, b)
        if a != b:
            edges.append((a, b))
    return replace(ld, nodes=nodes, edges=tuple(dict.fromkeys(edges))), frozenset(new)
