"""Send buffers and shard assembly of one primitive on one worker, with one copy per byte.

Source: DESIGN.md §4.8; paper §6.3 (contiguous transfer buffers); issue 26 (the redundant copies:
``torch.cat`` of the pieces, zero-filled targets).

* :func:`pack`: one contiguous ``uint8`` buffer per receiver, allocated once (a 40-byte counters
  header, then the pieces in plan order); each piece is written into its slice by one ``copy_``
  that also casts and gathers a strided (column) piece. Before: every piece was made contiguous
  (a copy for columns or a cast) and then concatenated (a second copy of every byte).
* :func:`recv_sizes`: the bytes each sender's buffer carries, from the plan alone.
* :func:`assemble`: the produced shards. A target is allocated uninitialised (``torch.empty``) and
  every element is written by exactly one segment; only vocab padding rows (which no segment
  covers) are zeroed. A target covered whole by one local tensor of a consumed unit, in the same
  dtype and shape, *is* that tensor (no copy).

Shapes and regions come from :mod:`~nereus.runtime.transit.index` (memoized per layout); the
functions also run on ``meta`` tensors (no data), which is how
``benchmarks/bench_transition_bookkeeping.py`` times the bookkeeping of real model sizes.
"""

from __future__ import annotations

import torch

from nereus.runtime.transit.flat import FLAT, cut_slots, flatten, is_sliced, slot_lengths, spans, unflatten
from nereus.runtime.transit.index import full_numel, piece_numel, row_numel, shapes
from nereus.runtime.transit.plans import MovePlan, MoveSpec, held, kind_dtype
from nereus.runtime.transit.regroup import Part

__all__ = ["COUNTERS", "HEADER_BYTES", "pack", "recv_sizes", "assemble", "itemsize"]

#: the counters every unit carries, in header order (int64 each)
COUNTERS = ("step", "update_count", "version", "policy_version", "position")
HEADER_BYTES = 8 * len(COUNTERS)

_ITEMSIZE: dict = {}


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def _narrow(t: torch.Tensor, dim: int | None, lo: int, hi: int, off: int) -> torch.Tensor:
    """Rows/columns ``[lo, hi)`` (full-tensor coordinates) of a shard whose region starts at ``off``."""
    return t if dim is None else t.narrow(dim, lo - off, hi - lo)


def _numel(spec, name: str, dim: int | None, lo: int, hi: int) -> int:
    """Elements of a piece: a flat ZeRO range (``transit/flat.py``) or rows/columns of a parameter."""
    return hi - lo if name == FLAT else piece_numel(spec, name, dim, lo, hi)


def _span_at(spec, unit, me: int, kind: str, a: int, b: int):
    """The span of ``unit`` on ``me`` that holds flat elements ``[a, b)`` of ``kind`` (a plan's segments
    never cross spans: each is an intersection of one source span with one target span)."""
    for s in spans(spec, unit, me, kind):
        if s.lo <= a and b <= s.hi:
            return s
    raise ValueError(f"worker {me}: {unit.uid} holds no span of {kind} covering flat [{a}, {b})")


def _flat_piece(spec, u, me: int, kind: str, a: int, b: int, memo: dict) -> torch.Tensor:
    """Flat elements ``[a, b)`` of ``kind`` that unit ``u`` holds on ``me`` (a view): from its slot, or
    from its per-name tensors concatenated once (memoized per unit and kind)."""
    s = _span_at(spec, u.meta, me, kind, a, b)
    if s.key is None:
        key = (id(u), kind)
        if key not in memo:
            memo[key] = flatten(spec, u.meta, me, u.tensors[kind])
        return memo[key].narrow(0, a, b - a)
    return u.tensors[kind][s.key].reshape(-1).narrow(0, s.off + a - s.lo, b - a)


def _piece_shape(shape, dim: int | None, rows: int) -> list[int]:
    out = list(shape)
    if dim is not None:
        out[dim] = rows
    return out


def _typed(raw: torch.Tensor, off: int, nbytes: int, dtype: torch.dtype, shape) -> tuple[torch.Tensor, bool]:
    """``raw[off:off+nbytes]`` as a ``dtype`` tensor of ``shape``: a view when aligned (``True``),
    else a fresh aligned tensor the caller copies through (``False``; bf16 pieces before fp32 ones)."""
    part = raw[off:off + nbytes]
    if (raw.storage_offset() + off) % itemsize(dtype) == 0:
        return part.view(dtype).view(shape), True
    return torch.empty(shape, dtype=dtype, device=raw.device), False


def pack(spec, plan: MovePlan, me: int, source, dtype: torch.dtype, device, alloc=None) -> dict:
    """The send buffers of worker ``me``: receiver → (buffer, state bytes in it).

    Args:
        plan: the primitive's plan (``plans.plan_moves``).
        source: uid → ``Unit`` this worker reads (a callable raising ``ValueError`` when absent).
        dtype: the ``params`` dtype pieces travel in (other kinds fp32, ``plans.kind_dtype``).
        device: where the buffers live: the group's device (``cpu`` for gloo, so a device tensor
            is copied to host once, straight into its slice), ``meta`` to time bookkeeping alone.
        alloc: ``(nbytes, device) -> uint8 tensor`` for the buffers (``BufferPool.take``); None:
            ``torch.empty``. Every byte of a buffer is written here.

    Returns:
        ``{receiver: (uint8 tensor of HEADER_BYTES + n, n)}``; the header holds the counters of
        the unit the last piece came from.
    """
    shp = shapes(spec)
    out, memo = {}, {}
    for (s, d), pieces in sorted(plan.pairs.items()):
        if s != me:
            continue
        sizes = [_numel(spec, pc.name, pc.dim, pc.lo, pc.hi) * itemsize(kind_dtype(pc.kind, dtype))
                 for pc in pieces]
        n = sum(sizes)
        buf = alloc(HEADER_BYTES + n, device) if alloc is not None else \
            torch.empty(HEADER_BYTES + n, dtype=torch.uint8, device=device)
        off, counters = HEADER_BYTES, {}
        for pc, nb in zip(pieces, sizes):
            u = source(pc.uid)
            if pc.name == FLAT:
                src, pshape = _flat_piece(spec, u, me, pc.kind, pc.lo, pc.hi, memo), [pc.hi - pc.lo]
            else:
                r = held(spec, u.meta, me)[pc.name]
                src = _narrow(u.tensors[pc.kind][pc.name], pc.dim, pc.lo, pc.hi, r.lo)
                pshape = _piece_shape(shp[pc.name][0], pc.dim, pc.hi - pc.lo)
            kdt = kind_dtype(pc.kind, dtype)
            view, aligned = _typed(buf, off, nb, kdt, pshape)
            view.copy_(src)
            if not aligned:
                buf[off:off + nb].copy_(view.reshape(-1).view(torch.uint8))
            off += nb
            counters = u.counters
        if buf.device.type != "meta":
            buf[:HEADER_BYTES].copy_(torch.tensor([counters.get(k, 0) for k in COUNTERS], dtype=torch.int64)
                                     .view(torch.uint8))
        out[d] = (buf, n)
    return out


def recv_sizes(spec, plan: MovePlan, me: int, dtype: torch.dtype) -> dict[int, int]:
    """sender → state bytes of its buffer to ``me`` (header excluded), in sender order."""
    return {s: sum(_numel(spec, pc.name, pc.dim, pc.lo, pc.hi) * itemsize(kind_dtype(pc.kind, dtype))
                   for pc in pieces)
            for (s, d), pieces in sorted(plan.pairs.items()) if d == me}


def assemble(spec, plan: MovePlan, move: MoveSpec, me: int, recv: dict, source, dtype: torch.dtype,
             device) -> dict:
    """The produced shards of ``move`` on ``me``: produced uid → ``(tensors, counters)``.

    Args:
        recv: sender → (received payload without header, its header counters).
        source: as for :func:`pack`.

    Every element of a target is written by exactly one segment (the plan covers each target
    region once); vocab padding rows are zeroed; a whole target held by a consumed local unit in
    the target's dtype and shape is taken as is (no copy).
    """
    shp = shapes(spec)
    memo: dict = {}
    consumed = set(move.consumes)
    cursor = dict.fromkeys(recv, 0)
    taken: set[int] = set()  # tensors handed over as is (never twice)
    made = {}
    for dst in move.produces:
        if me not in dst.gpus:
            continue
        tensors: dict = {}
        counters = None
        for kind, name, want, segs in plan.assembly[(me, dst.uid)]:
            if name == FLAT:  # ZeRO slots, or a whole flat vector cut per name (transit/flat.py)
                slots = _assemble_flat(spec, me, dst, kind, segs, recv, cursor, source, kind_dtype(kind, dtype),
                                       device, memo)
                if is_sliced(dst, kind):
                    tensors.setdefault(kind, {}).update(slots)
                else:
                    tensors.setdefault(kind, {}).update(unflatten(spec, dst, me, slots[None]))
                counters = counters or next((source(u).counters for w, u, _a, _b in segs if w is None), None) or \
                    next((recv[w][1] for w, *_ in segs if w is not None), None)
                continue
            full = shp[name][0]
            shape = _piece_shape(full, want.dim, want.length) if want.dim is not None else list(full)
            kdt = kind_dtype(kind, dtype)
            if segs and isinstance(segs[0], Part):  # regions gathered from ZeRO slices (transit/regroup.py)
                t, hdr = _assemble_gathered(spec, me, kind, want, shape, segs, recv, cursor, source, kdt, device, memo)
                counters = counters or hdr
                tensors.setdefault(kind, {})[name] = t
                continue
            t = _whole_local(spec, segs, consumed, source, me, kind, name, shape, kdt, taken, device)
            if t is not None:
                counters = counters or source(segs[0][1]).counters
                tensors.setdefault(kind, {})[name] = t
                continue
            t = torch.empty(shape, dtype=kdt, device=device)
            if want.dim is not None and want.hi - want.lo < want.length:  # vocab padding: no segment
                t.narrow(0, want.hi - want.lo, want.length - (want.hi - want.lo)).zero_()
            for src_w, uid, a, b in segs:
                if src_w is None:
                    u = source(uid)
                    r = held(spec, u.meta, me)[name]
                    piece = _narrow(u.tensors[kind][name], want.dim, a, b, r.lo)
                    counters = counters or u.counters
                else:
                    raw, hdr = recv[src_w]
                    k = (b - a) * row_numel(full, want.dim) if want.dim is not None else full_numel(full)
                    nb = k * itemsize(kdt)
                    piece, aligned = _typed(raw, cursor[src_w], nb, kdt, _piece_shape(full, want.dim, b - a))
                    if not aligned:
                        piece.reshape(-1).view(torch.uint8).copy_(raw[cursor[src_w]:cursor[src_w] + nb])
                    cursor[src_w] += nb
                    counters = counters or hdr
                _narrow(t, want.dim, a, b, want.lo).copy_(piece)
            tensors.setdefault(kind, {})[name] = t
        for kind in plan.recut.get((me, dst.uid), ()):  # whole shards of a sliced kind: cut into the slots
            tensors[kind] = cut_slots(spec, dst, me, kind, flatten(spec, dst, me, tensors[kind]))
        made[dst.uid] = (tensors, dict(counters or {}))
    return made


def _assemble_flat(spec, me, dst, kind, segs, recv, cursor, source, kdt, device, memo) -> dict:
    """The slots of ``kind`` that ``dst`` holds on ``me`` (:func:`~nereus.runtime.transit.flat.slot_lengths`),
    each element of its spans written by one segment (local ones read from the source unit), padding
    zero."""
    lengths = slot_lengths(spec, dst, me, kind)
    covered = dict.fromkeys(lengths, 0)
    for s in spans(spec, dst, me, kind):
        covered[s.key] += s.hi - s.lo
    out = {key: (torch.empty if covered[key] == n else torch.zeros)(n, dtype=kdt, device=device)
           for key, n in lengths.items()}
    for src_w, uid, a, b in segs:
        s = _span_at(spec, dst, me, kind, a, b)
        target = out[s.key].narrow(0, s.off + a - s.lo, b - a)
        if src_w is None:
            target.copy_(_flat_piece(spec, source(uid), me, kind, a, b, memo))
        else:
            target.copy_(_next_piece(recv[src_w][0], cursor, src_w, b - a, kdt))
    return out


def _next_piece(raw, cursor: dict, src_w, n: int, kdt) -> torch.Tensor:
    """The next ``n`` elements of dtype ``kdt`` in worker ``src_w``'s receive buffer ``raw`` (a copy
    when the offset is not aligned for the dtype), advancing ``cursor[src_w]``."""
    nb = n * itemsize(kdt)
    piece, aligned = _typed(raw, cursor[src_w], nb, kdt, [n])
    if not aligned:
        piece.reshape(-1).view(torch.uint8).copy_(raw[cursor[src_w]:cursor[src_w] + nb])
    cursor[src_w] += nb
    return piece


def _assemble_gathered(spec, me, kind, want, shape, parts, recv, cursor, source, kdt, device, memo):
    """One target shard ``shape`` of a name from gathered :class:`~nereus.runtime.transit.regroup.Part` s:
    each part's flat ranges filled from its segments, viewed as the rows/columns it is and written into
    the target's region (vocab padding rows of the target zero). Returns ``(tensor, counters or None)``."""
    t = torch.empty(shape, dtype=kdt, device=device)
    if want.dim is not None and want.hi - want.lo < want.length:
        t.narrow(0, want.hi - want.lo, want.length - (want.hi - want.lo)).zero_()
    counters = None
    for part in parts:
        n = 1
        for x in part.shape:
            n *= x
        tmp = torch.empty(n, dtype=kdt, device=device)
        for src_w, uid, a, b in part.segs:
            x, _y, o = next(rg for rg in part.ranges if rg[0] <= a and b <= rg[1])
            target = tmp.narrow(0, o + a - x, b - a)
            if src_w is None:
                u = source(uid)
                target.copy_(_flat_piece(spec, u, me, kind, a, b, memo))
                counters = counters or u.counters
                continue
            raw, hdr = recv[src_w]
            target.copy_(_next_piece(raw, cursor, src_w, b - a, kdt))
            counters = counters or hdr
        got = tmp.view(part.shape)
        if part.dim is None:
            t.copy_(got)
        else:
            _narrow(t, part.dim, part.lo, part.hi, want.lo).copy_(got)
    return t, counters


def _whole_local(spec, segs, consumed, source, me, kind, name, shape, kdt, taken, device):
    """The consumed local tensor that is exactly the target (one local segment covering it, same
    dtype and shape), or None."""
    if len(segs) != 1 or segs[0][0] is not None or segs[0][1] not in consumed:
        return None
    u = source(segs[0][1])
    t = u.tensors[kind][name]
    if t.dtype != kdt or list(t.shape) != list(shape) or id(t) in taken or t.device != torch.device(device):
        return None
    r = held(spec, u.meta, me)[name]
    a, b = segs[0][2], segs[0][3]
    if r.dim is not None and (a, b) != (r.lo, r.hi):
        return None
    taken.add(id(t))
    return t
