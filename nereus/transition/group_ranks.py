"""The DP rank order of a target ZeRO group: which target rank each staying DP block takes.

Ours (issue 13; DESIGN.md §4.6). A ZeRO-sharded DP group is one EMU (:func:`~nereus.transition.emu.phi`)
whose DP rank ``r`` of ``z`` holds slice ``[r/z, (r+1)/z)`` of the sharded state (ZeRO,
Rajbhandari et al. SC'20). The ranks are interchangeable at a step boundary, so before the local
DAGs are built (``estimate.plan_dag``) :func:`align_group` orders the target group's ranks so that
a DP block that stays keeps the most of its old slice, and the local DAG
(:mod:`nereus.transition.local_dag`) moves only what the new slices lack.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.transition.emu import EMU

__all__ = ["align_group"]


def align_group(current: tuple[EMU, ...], target: tuple[EMU, ...]) -> tuple[EMU, ...]:
    """``target`` with its ZeRO group's DP ranks ordered to keep the most state in place (ours).

    The DP ranks of a ZeRO group are interchangeable at a step boundary (which rank owns which slice
    and which micro-batches is a convention), so the transition may choose the order; the DAG's
    target EMU records it. A target DP block that is a block of a current group of the same
    ``(tp, pp)`` (rank ``r`` of ``z``, slice ``[r/z, (r+1)/z)``) takes the free target rank whose
    slice overlaps its own most (ties: the lowest), in order of ``r``; the other blocks take the
    remaining ranks in plan order. Shrinking ``z = 4 → 2`` onto ranks 0 and 2 keeps them as target
    ranks 0 and 1 (a Split unit, nothing but the leaving ranks' slices moves); growing ``2 → 4``
    puts the old ranks at target ranks 0 and 2. ``n`` replicas growing into a larger group count as
    the group of degree ``n`` they first merge into (``local_dag._grow_from_replicas``). Replica targets
    and host copies are returned unchanged.
    """
    if len(target) != 1 or target[0].z == 1 or target[0].host:
        return target
    t = target[0]
    held = {}
    for e in current:
        if (e.tp, e.pp) == (t.tp, t.pp) and e.z > 1 and not e.host:
            for r in range(e.z):
                held[e.block(r)] = (r, e.z)
    blocks = [t.block(r) for r in range(t.z)]
    reps = [e for e in current if e.z == 1 and not e.host and (e.tp, e.pp) == (t.tp, t.pp)]
    if 1 < len(reps) == len(current) < t.z and all(e.gpus in blocks for e in reps):
        held = {e.gpus: (i, len(reps)) for i, e in enumerate(reps)}  # merged into a group first
    if not any(b in held for b in blocks):
        return target
    free = list(range(t.z))
    rank_of: dict[tuple[int, ...], int] = {}
    for blk in sorted((b for b in blocks if b in held), key=lambda b: held[b][0]):
        r, z = held[blk]

        def overlap(q: int, r: int = r, z: int = z) -> float:
            return max(0.0, min((r + 1) / z, (q + 1) / t.z) - max(r / z, q / t.z))
        q = max(free, key=lambda q: (overlap(q), -q))
        free.remove(q)
        rank_of[blk] = q
    for blk in blocks:
        if blk not in rank_of:
            rank_of[blk] = free.pop(0)
    order = sorted(blocks, key=rank_of.__getitem__)
    return (replace(t, gpus=tuple(g for b in order for g in b)),)
