"""What a byte costs to copy: strided (column-slice) copies and freshly mapped buffers.

Source: ours (issue 26: the copy term priced every byte alike, and a TP re-cut's copies, measured
on the runtime's CPU workers, ran about 1.4x slower per byte than a PP or DP move's, a 57 MB send
buffer's packing about 2x slower than a 28 MB one's). Two physical effects, each a per-byte
surcharge on the copy term ``K / C`` of :func:`nereus.transition.cost.duration`:

* **strided copies.** Megatron-style tensor parallelism (Shoeybi et al., *Megatron-LM*, 2019,
  §3; ``runtime/model/sharding.py``) cuts the attention output projection ``o_proj [h, a·d]`` and
  the MLP's ``down_proj [h, F]`` along their input dimension (*row parallel*): a rank holds a block
  of columns. Whenever a primitive changes the TP degree, those tensors are read or written as
  column slices (rows of ``n / tp`` elements at a stride of ``n``) instead of one contiguous run:
  packing them from a wider shard, re-slicing a kept shard, or writing received columns into a
  wider target. :func:`row_parallel_fraction` is their share of the model's parameters (the same
  share of every state kind, Adam being elementwise): ``L·h·(a·d + F) / N``. On the copy path of a
  primitive that changes TP, :func:`strided_bytes` counts that share of the largest new-shard bytes
  of one GPU and, when a sender holds wider shards than its receivers (``tp`` grows), of the
  largest send buffers of one GPU; a primitive that keeps TP (PP, DP, ZeRO re-cuts, Extend) copies
  whole tensors or row ranges, contiguous runs, and counts 0.
* **freshly mapped buffers.** The executor packs every receiver's bytes into one buffer
  (``runtime/transit/packing.py``). A CPU allocation of at least glibc's largest mmap threshold
  (:data:`FRESH_BUFFER_BYTES`, 32 MiB: ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit, mallopt(3)) is a
  fresh ``mmap`` each time; the kernel faults in and zeroes every page on first write, so packing
  into it writes each byte about twice (measured on this machine: 2.5 GB/s into a fresh 57 MB
  buffer against 7.5 GB/s into reused memory). :func:`fresh_bytes` is the send-buffer bytes of the
  busiest sender in buffers at least that large, :func:`fresh_recv_bytes` (``R_r``) the same of
  the busiest receiver's receive buffers, faulted in while the bytes arrive (on the wire's path:
  measured here, a 57 MB Extend's wire took 35-39 ms where two 28 MB transfers' took 2·10.5). GPUs (PyTorch's caching allocator) reuse memory:
  ``CostParams.fresh_buffer_bytes`` is infinite by default; so it stays for the runtime, whose CPU
  workers now keep their transit buffers between exchanges (``runtime/transit/buffer_pool.py``);
  ``TransitionCalibration(fresh_buffer_bytes=FRESH_BUFFER_BYTES)`` for an executor that does not.

The copy term becomes ``(K + σ·S + φ·(R + R_r)) / C`` (:func:`effective_copy_bytes`), ``S`` the strided
and ``R`` the fresh bytes, ``σ = CostParams.strided_copy_factor`` and ``φ =
CostParams.fresh_copy_factor`` the extra seconds of such a byte in units of a contiguous one (0 by
default; fitted by ``transition/calibrate.py`` from the executor's measured packing and assembly,
``φ`` together with each CPU worker's direct first-touch measurement, ``runtime/transit/fault_probe.py``).

Pure: no runtime import.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.spec.model import ModelSpec
from nereus.transition.emu import EMU
from nereus.transition.primitives import Primitive

__all__ = ["FRESH_BUFFER_BYTES", "FAULT_PROBE_BYTES", "row_parallel_fraction", "strided_bytes", "with_strided", "send_buffers",
           "fresh_bytes", "recv_buffers", "fresh_recv_bytes", "copy_workers", "crowd",
           "effective_copy_bytes"]

#: glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit (``4·1024·1024·sizeof(long)``, mallopt(3)): a
#: CPU allocation at least this large is always a fresh mmap (faulted in and zeroed on first write)
FRESH_BUFFER_BYTES = 32 * 1024 * 1024
#: bytes of the buffer each CPU worker first-touches once to measure the fresh-mapping cost directly
#: (``runtime/transit/fault_probe.py``): twice :data:`FRESH_BUFFER_BYTES`, so that glibc maps it fresh
#: whatever it has raised its dynamic mmap threshold to; also the weight of one such measurement
#: among the primitives' samples of ``φ`` (``calibrate.fit_copy``)
FAULT_PROBE_BYTES = 2 * FRESH_BUFFER_BYTES


def row_parallel_fraction(model: ModelSpec) -> float:
    """Share of ``model``'s parameters in row-parallel tensors (``o_proj``, ``down_proj``), in [0, 1).

    ``L·h·(a·d + F) / N`` with ``L`` layers, hidden size ``h``, query width ``a·d``, MLP width
    ``F`` and ``N = model.num_params`` (module docstring). The ``small`` preset (``L = 8, h = 256,
    a·d = 256, F = 512``): ``8·256·768 / 4 755 712 = 0.3307``.
    """
    h = model.hidden_size
    return model.num_layers * h * (model.q_dim + model.intermediate_size) / model.num_params


def _tps(uids, emus: dict[str, EMU]) -> set[int]:
    return {emus[u].tp for u in uids if u in emus}


def strided_bytes(p: Primitive, emus: dict[str, EMU], model: ModelSpec) -> tuple[int, int]:
    """Bytes copied as column slices on ``p``'s copy path: ``(of its packing, of its assembly)``.

    Args:
        p: a primitive with ``sent``/``alloc`` (``transition/buffers.py``); others count ``(0, 0)``.
        emus: uid → EMU for the units ``p`` consumes or reads.
        model: the model-stage's shapes.

    Returns:
        ``(0, 0)`` unless ``p`` is a Split or Merge whose produced EMUs' TP degree differs from its
        sources'; then the assembly part is ``f·max_g alloc[g]`` and the packing part
        ``f·max_g sent[g]`` when some source has a smaller TP degree than some target (its senders
        cut columns out of wider tensors), else 0; ``f =`` :func:`row_parallel_fraction`, rounded
        down to whole bytes. ``S = sum`` of the two (module docstring).
    """
    if p.kind not in ("split", "merge") or not (p.sent or p.alloc):
        return 0, 0
    src = _tps(p.consumes + p.reads, emus)
    dst = {e.tp for e in p.produces}
    if not src or not dst or src == dst == {next(iter(src))}:
        return 0, 0
    f = row_parallel_fraction(model)
    sent = int(f * max(p.sent.values(), default=0)) if min(src) < max(dst) else 0
    return sent, int(f * max(p.alloc.values(), default=0))


def with_strided(nodes, initial, model: ModelSpec) -> tuple[Primitive, ...]:
    """``nodes`` (one model-stage's primitives) with ``strided_sent`` and ``strided_alloc`` set
    (:func:`strided_bytes`); the units they read are looked up among ``initial`` (its current EMUs)
    and every node's products."""
    emus = {e.uid: e for e in initial}
    for n in nodes:
        emus.update({e.uid: e for e in n.produces})
    out = []
    for n in nodes:
        s, a = strided_bytes(n, emus, model)
        out.append(replace(n, strided_sent=s, strided_alloc=a) if (s, a) != (n.strided_sent, n.strided_alloc) else n)
    return tuple(out)


def send_buffers(p: Primitive) -> dict[int, list[float]]:
    """Sending GPU → its send buffers' bytes, one per receiver.

    An Extend (or weight sync) sends one buffer per pair; a Split or Merge GPU sends ``sent[g]``
    split evenly over the other members of its groups that receive (a bound: the executor's
    buffers carry exactly the pieces each receiver lacks).
    """
    if p.pairs and not p.groups:
        out: dict[int, list[float]] = {}
        for s, _, b in p.pairs:
            if b > 0:
                out.setdefault(s, []).append(float(b))
        return out
    out = {}
    for g, b in p.sent.items():
        if b <= 0:
            continue
        peers = {x for gpus, _ in p.groups if g in gpus for x in gpus if x != g and p.recv.get(x, 0) > 0}
        n = max(1, len(peers))
        out[g] = [b / n] * n
    return out


def recv_buffers(p: Primitive) -> dict[int, list[float]]:
    """Receiving GPU → its receive buffers' bytes, one per sender (the mirror of
    :func:`send_buffers`: ``recv[g]`` split evenly over the members of its groups that send)."""
    if p.pairs and not p.groups:
        out: dict[int, list[float]] = {}
        for _, d, b in p.pairs:
            if b > 0:
                out.setdefault(d, []).append(float(b))
        return out
    out = {}
    for g, b in p.recv.items():
        if b <= 0:
            continue
        peers = {x for gpus, _ in p.groups if g in gpus for x in gpus if x != g and p.sent.get(x, 0) > 0}
        n = max(1, len(peers))
        out[g] = [b / n] * n
    return out


def fresh_recv_bytes(p: Primitive, threshold: float = FRESH_BUFFER_BYTES) -> int:
    """Receive-buffer bytes of the busiest receiver in buffers of at least ``threshold`` bytes: the
    kernel faults those pages in while the bytes arrive, on the wire's path (``R_r``, module
    docstring).

    Raises:
        ValueError: ``threshold`` not > 0.
    """
    if not threshold > 0:
        raise ValueError(f"fresh_recv_bytes: threshold must be > 0 bytes, got {threshold!r}")
    return int(max((sum(b for b in bufs if b >= threshold) for bufs in recv_buffers(p).values()), default=0))


def fresh_bytes(p: Primitive, threshold: float = FRESH_BUFFER_BYTES) -> int:
    """Send-buffer bytes of the busiest sender that land in buffers of at least ``threshold`` bytes
    (``R`` of the module docstring); 0 when ``threshold`` is infinite (GPUs) or nothing is sent.

    Raises:
        ValueError: ``threshold`` not > 0.
    """
    if not threshold > 0:
        raise ValueError(f"fresh_bytes: threshold must be > 0 bytes, got {threshold!r}")
    return int(max((sum(b for b in bufs if b >= threshold) for bufs in send_buffers(p).values()), default=0))


def copy_workers(p: Primitive) -> tuple[int, int]:
    """``(n_p, n_a)``: how many GPUs pack (``sent > 0``) and how many assemble (``alloc > 0``) in
    ``p``; each phase runs on its GPUs at the same time (module docstring)."""
    return (sum(1 for b in p.sent.values() if b > 0), sum(1 for b in p.alloc.values() if b > 0))


def crowd(n: int, cores: float) -> float:
    """How many times one GPU's seconds a copy phase on ``n`` GPUs at once takes when they share
    ``cores`` cores: ``max(1, n / cores) / max(1, 1 / cores)`` (relative to one GPU alone, which
    the copy rate ``C`` is measured on; 1 for ``n <= 1``).

    Raises:
        ValueError: ``cores`` not > 0.
    """
    if not cores > 0:
        raise ValueError(f"crowd: cores must be > 0, got {cores!r}")
    return max(1.0, n / cores) / max(1.0, 1.0 / cores) if n > 1 else 1.0


def effective_copy_bytes(p: Primitive, copy: float, params) -> float:
    """The copy bytes ``p``'s copy term prices (module docstring), ``params`` a ``CostParams``.

    With ``sent``/``alloc``: ``(P + σ·S_p + φ·R)·crowd(n_p, c) + (A + σ·S_a)·crowd(n_a, c) + φ·R_r``,
    ``R_r = fresh_recv_bytes(p, ...)`` (the receive buffers' page faults, on the wire's path),
    ``P = max_g sent[g]`` and ``A = max_g alloc[g]`` (``cost.copy_bytes = P + A``), ``S_p, S_a =
    p.strided_sent, p.strided_alloc``, ``R = fresh_bytes(p, params.fresh_buffer_bytes)``, ``n_p, n_a``
    from :func:`copy_workers` and ``c = params.copy_cores``. Without them, ``copy`` (the
    primitive's ``K``) unchanged.
    """
    if not (p.sent or p.alloc):
        return float(copy)
    sig, c = params.strided_copy_factor, params.copy_cores
    pack = max(p.sent.values(), default=0) + sig * p.strided_sent
    if params.fresh_copy_factor and params.fresh_buffer_bytes != float("inf"):
        pack += params.fresh_copy_factor * fresh_bytes(p, params.fresh_buffer_bytes)
    asm = max(p.alloc.values(), default=0) + sig * p.strided_alloc
    n_p, n_a = copy_workers(p)
    wire = 0.0
    if params.fresh_copy_factor and params.fresh_buffer_bytes != float("inf"):
        wire = params.fresh_copy_factor * fresh_recv_bytes(p, params.fresh_buffer_bytes)
    return pack * crowd(n_p, c) + asm * crowd(n_a, c) + wire
