"""Transient memory of a primitive that moves bytes: send and receive buffers, and new shards.

Source: the executor (``runtime/transit/worker_side.py``, ``runtime/transit/packing.py``; DESIGN.md
§4.8, paper §6.3 contiguous transfer buffers); issue 26 (the transient memory the planner's
memory check did not count). Pure: no runtime import; the rules below restate what the executor
does, so that ``mem_hi`` (``primitives``) is the most a primitive adds on a GPU while it runs.

On every worker of a Split, Merge, Extend or Load from a train EMU the executor

1. packs one contiguous send buffer per receiver (``pack``), all alive until every send ended;
2. allocates one receive buffer per sender (``recv_sizes``), all alive until assembly ended;
3. allocates the produced shards (``assemble``) while the consumed units are still alive (they are
   freed after the primitive, ``Transit.run``); a produced tensor that is exactly a local consumed
   one (same region, dtype and shape) *is* that tensor, no new bytes.

So on GPU ``g``: ``mem_hi[g] = alloc[g] + sent[g] + recv[g]`` with ``recv[g]`` the bytes that arrive
(the primitive's ``recv``), ``sent[g]`` the bytes it sends and ``alloc[g]`` the produced bytes that
are not aliases (:func:`alloc_bytes`). The 40-byte counters header per buffer is left out.

``sent[g]`` is not in a primitive's byte-level description (it comes from the executor's piece
plan), so :func:`sent_bound` bounds it: a GPU of a group sends each other member that receives at
most what it holds, and in all no more than those members receive. Exact for an Extend (one pair),
a Split between two ranks and a Merge where one holder serves each receiver; at most the bytes of
the replicated tensors (norms) too high elsewhere.

A ZeRO group's re-cut (``primitives.reshard``) runs through the same exchange, with the sliced
kinds moved as ranges of one flat vector per position (``runtime/transit/flat.py``):
:func:`recut_buffers` gives its ``sent`` (the bound above) and ``alloc``: on a target GPU its new
flat slice, ``ceil(shd / z*)``, is always new, and so is the replicated part (the weights of
ZeRO-1/2, ``rep``) unless the GPU held the same position of the group before (then the executor
reuses those tensors); on a GPU of a replica that becomes a group (``z = 1`` source) also the
flat copy of its sliced kinds, ``shd`` bytes (``flatten``'s ``torch.cat``, alive until the
primitive ends).
"""

from __future__ import annotations

from dataclasses import replace

from nereus.transition.emu import EMU

__all__ = ["sent_bound", "alloc_bytes", "with_buffers", "recut_buffers"]


def sent_bound(held: dict[int, int], recv: dict[int, int], groups) -> dict[int, int]:
    """GPU → an upper bound on the bytes it sends (module docstring), summed over ``groups``.

    Args:
        held: GPU → bytes of the primitive's source state on it (bytes).
        recv: GPU → bytes that arrive on it.
        groups: GPU tuples that exchange among themselves (a Split's blocks; one group otherwise).

    Raises:
        ValueError: a negative byte count.
    """
    bad = [(g, b) for d in (held, recv) for g, b in d.items() if b < 0]
    if bad:
        raise ValueError(f"sent_bound: GPU {bad[0][0]} has a negative byte count {bad[0][1]}; bytes are >= 0")
    out: dict[int, int] = {}
    for gpus in groups:
        for g in gpus:
            takers = [r for r in gpus if r != g and recv.get(r, 0) > 0]
            if held.get(g, 0) and takers:
                out[g] = out.get(g, 0) + min(held[g] * len(takers), sum(recv[r] for r in takers))
    return out


def with_buffers(p):
    """``p`` (a :class:`~nereus.transition.primitives.Primitive`) with ``mem_hi`` as the runtime's
    executor needs it: ``max(paper mem_hi, alloc + sent + recv)`` on every GPU (module docstring;
    a Load from a train EMU receives its pairs' bytes). A primitive without ``sent`` or ``alloc``
    (Destroy, Offload, Restore, a Load from storage, a ZeRO group's re-cut) is returned unchanged.
    """
    if not (p.sent or p.alloc) or (p.kind == "load" and not p.pairs):
        return p
    recv = dict(p.recv)
    if p.kind == "load":
        recv = {}
        for _, d, b in p.pairs:
            recv[d] = recv.get(d, 0) + b
    hi = dict(p.mem_hi)
    for g in set(hi) | set(p.sent) | set(recv) | set(p.alloc):
        hi[g] = max(hi.get(g, 0), p.alloc.get(g, 0) + p.sent.get(g, 0) + recv.get(g, 0))
    return replace(p, mem_hi=hi)


def alloc_bytes(src: EMU | None, g: int, dst: EMU, held: int) -> int:
    """Bytes of ``dst``'s new shard on GPU ``g`` that the executor allocates (module docstring, 3).

    A tensor is reused when the consumed unit ``src`` on ``g`` holds it with the same region: same
    TP position (``tp`` and rank) and both unsharded (``z == 1``); then the ``held`` bytes (what
    ``src`` holds of ``dst``'s shard there, :func:`~nereus.transition.held.held_bytes`) are aliases.
    Otherwise (another TP slicing, a ZeRO flat buffer, no local unit) the whole shard is new.
    """
    need = dst.bytes_on(g)
    if src is None or g not in src.gpus or src.z != 1 or dst.z != 1:
        return need
    (_, ts), (_, td) = src.position(g), dst.position(g)
    return max(0, need - held) if (src.tp, ts) == (dst.tp, td) else need


def _rep(e: EMU, p: int) -> int:
    """Replicated bytes per GPU of ``e`` at pipeline rank ``p`` (``emu.zero_shard_bytes``: a GPU of
    a group holds ``rep + ceil(shd / z)``)."""
    return e.shard_bytes[p] - (-(-e.sharded[p] // e.z) if e.sharded else 0)


def recut_buffers(src: EMU, dst: EMU, recv: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """``(sent, alloc)`` of a ZeRO re-cut ``src → dst`` (same ``tp, pp``; module docstring).

    Args:
        src, dst: the current group (or replica) and its target group (or replica).
        recv: GPU → bytes that arrive on it (``primitives.reshard``'s).

    Returns:
        GPU → bytes sent (a bound, :func:`sent_bound`), GPU → bytes the executor allocates there.
    """
    sent = sent_bound({g: src.bytes_on(g) for g in src.gpus}, recv, [tuple(src.gpus) + tuple(
        g for g in dst.gpus if g not in src.gpus)])
    shd = dst.sharded if dst.sharded else src.sharded
    alloc: dict[int, int] = {}
    for g in dst.gpus:
        p = dst.position(g)[0]
        keep = g in src.gpus and src.position(g) == dst.position(g)
        alloc[g] = dst.bytes_on(g) - (min(_rep(dst, p), _rep(src, p)) if keep else 0)
    if src.z == 1 and shd:  # a replica's sliced kinds flattened into one vector (flat.flatten)
        for g in src.gpus:
            alloc[g] = alloc.get(g, 0) + shd[src.position(g)[0]]
    return sent, alloc
