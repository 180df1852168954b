"""Durations of primitives, the links they hold, and the byte counts of a transition.

Source: paper §6.3 (transport: NVLink inside a node, GPU-direct RDMA across nodes, rank pairs
transfer concurrently subject to shared link bandwidth), §7.4 (setup counted in transition cost);
DESIGN.md §4.6.

Time of one primitive, seconds::

    Split   setup + max over all-gather groups  (recv_bytes / B + (k-1)·α) + K / C   ring all-gather
    Merge   setup + (recv_bytes / B + α + K / C  if any shard must move)
    Extend  setup + max over rank pairs        (bytes / B + α) + K / C
    Destroy teardown + teardown_tensor · the tensors its busiest GPU frees (transition/teardown.py)
    Load    from storage:   load_setup + max over nodes (bytes landing on the node / storage_bandwidth)
            from a train EMU: setup + max over source GPUs (bytes it sends / B + α)   weight sync;
            a destination GPU that holds the train EMU copies its shard locally: 2·bytes / HBM
            (device-to-device copy reads and writes every byte; no link, no setup when all local);
            from a train EMU in host memory (``offload="host"``): as a Restore, below
    Offload host_setup + max over the staged replica's GPUs (bytes / H)      device → host
    Restore max over target GPUs (bytes / H_g)                               host → device
            H = ``host_bandwidth`` (PCIe); H_g = min(H, scale-out bandwidth) for a target GPU on a
            node whose host holds none of the staged copy

``B`` and ``α`` are the scale-up (NVLink) bandwidth and latency when every GPU involved sits on one
node, else the scale-out (NIC) ones (``GPUSpec``: bytes/s per GPU per direction). ``K`` is the bytes
the busiest GPU copies (:func:`copy_bytes`: what it packs into its send buffers plus the new shard
bytes it writes, local re-slicing included; the busiest receiver's bytes for a primitive that does
not record them) and ``C`` the *copy* rate
(``runtime/transit/packing.py``: one write per byte at the sender, one at the receiver), bytes/s:
``CostParams.copy_bandwidth`` (default infinite: on GPUs the copies run at HBM speed, two orders
above the links, so an uncalibrated estimate ignores them; 0 derives ``hbm_bandwidth / 4``, each
byte read and written twice). Bytes copied as column slices (a TP re-cut) and bytes packed into
freshly mapped send buffers cost more than contiguous ones: ``K`` is replaced by ``K + σ·S + φ·R``
(:mod:`nereus.transition.copy_cost`; ``σ``, ``φ`` 0 until calibrated). So a primitive's seconds are three terms, *setup* (communicators; whatever per-primitive
fixed cost the calibration finds), *copy* and *wire*, each calibrated apart from the executor's
records (``transition/calibrate.py``). Communicators of
one primitive are created in parallel, so setup is paid once per primitive: ``comm_setup_intra_s``
inside a node, ``comm_setup_inter_s`` across nodes.

Shared-link contention is modeled by *ports*: each primitive holds the send and receive side of the
NVLink or NIC port of every GPU it moves data on, and two primitives holding one port never overlap
in a schedule (serializing two transfers on one link takes as long as sharing its bandwidth). A
Load from storage holds one ``(node, "storage", "rx")`` port per node it reads into, so Loads on one
node share its storage bandwidth the same way. An Offload holds ``(gpu, "host", "tx")`` on the GPUs
it copies out and a Restore ``(gpu, "host", "rx")`` on those it writes (each GPU's own PCIe link).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from nereus.spec.hardware import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.transition.copy_cost import effective_copy_bytes
from nereus.transition.emu import EMU
from nereus.transition.held import held_bytes
from nereus.transition.primitives import STORAGE, Primitive
from nereus.transition.staging import HOST_ID

__all__ = ["CostParams", "duration", "ports", "min_bytes", "copy_bytes"]


@dataclass(frozen=True)
class CostParams:
    """Constants of the transition cost model.

    Attributes:
        comm_setup_intra_s: seconds to create the communicators of one primitive inside one node;
            calibrated, the fixed seconds per primitive (setup, call round trips, dispatch:
            ``TransitionCalibration.setup_s``).
        comm_setup_inter_s: the same across nodes (bootstrap over the network).
        teardown_s: fixed seconds of a Destroy (free buffers, close communicators).
        teardown_tensor_s: seconds per tensor a Destroy frees on its busiest GPU
            (``Primitive.freed_tensors``; ``transition/teardown.py``), 0 unless calibrated.
        storage_bandwidth: bytes/s per node read from shared storage by a Load. 2 GB/s, the same
            assumption as the simulator's checkpoint/restart model (``nereus/sim/restart.py``,
            ``STORAGE_BW``: typical NFS/Lustre client throughput, not a measurement).
        load_setup_s: fixed seconds of a Load from storage: open the model files, parse the
            safetensors headers, allocate the shards (an assumption of the right order for an
            8B-class model in a running worker; the process, CUDA context and engine warm-up are
            not included, the controller adds the rollout-engine start separately).

        host_bandwidth: bytes/s per GPU per direction between a GPU and pinned host memory (a
            Offload or Restore). 25 GB/s: what a PCIe Gen4 x16 link (32 GB/s theoretical) sustains for pinned
            copies; Gen5 (H100 SXM hosts, 64 GB/s theoretical) reaches about twice that, so the
            default is conservative there. An assumption, not a measurement.
        host_setup_s: fixed seconds of an Offload: allocate and pin host buffers for the shards.
        copy_bandwidth: bytes/s at which a primitive's busiest receiver's bytes are packed at their
            senders and assembled at it (module docstring, ``C``); infinite (the default) leaves the
            copy term out until calibrated, 0 derives it from the device, ``hbm_bandwidth / 4``.
        transit_buffers: count the transient memory of the runtime's executor in the memory
            check (its send and receive buffers, new shards allocated beside the old:
            :func:`~nereus.transition.buffers.with_buffers`); False (the default) keeps the paper's
            in-place rule. :class:`~nereus.transition.calibrate.TransitionCalibration` sets it, as
            its constants are the runtime's.
        serial_workers: a GPU runs one primitive at a time (each holds a ``(gpu, "worker", "run")``
            port on every GPU it touches, :func:`ports`): the runtime's executor submits a
            primitive to each of its workers as one call of a single-threaded actor, and an actor
            runs its calls one after another, so two primitives with disjoint links on one worker
            do not overlap there (on GPUs with separate copy engines and streams they could).
            False (the default) lets them overlap (paper §6.3). Set by the calibration.
        worker_cores: CPU cores the workers' local work shares (the runtime's CPU workers: the
            cores of the pool's CPU budget, ``os.sched_getaffinity``); primitives running at once
            progress together at ``min(1, worker_cores / busy workers)`` of their own speed
            (:mod:`nereus.transition.sharing`). Infinite (the default): every device has its own
            engines (GPUs), no sharing. Set by the calibration.
        strided_copy_factor: ``σ``, extra seconds of a byte copied as a column slice (a TP
            re-cut's row-parallel tensors, ``Primitive.strided``) in units of a contiguous byte's
            (:mod:`nereus.transition.copy_cost`); 0 (the default) prices them alike. Calibrated.
        fresh_copy_factor: ``φ``, extra seconds of a byte packed into a freshly mapped send buffer
            (:func:`~nereus.transition.copy_cost.fresh_bytes`) in the same units; 0 by default.
            Calibrated.
        fresh_buffer_bytes: send buffers at least this large are freshly mapped on every use
            (``copy_cost.FRESH_BUFFER_BYTES`` for an executor that allocates each CPU buffer anew,
            ``TransitionCalibration.fresh_buffer_bytes``); infinite (the default) for GPUs, whose
            caching allocator reuses memory, and for the runtime's CPU workers, which pool their
            transit buffers (``runtime/transit/buffer_pool.py``).
        copy_cores: cores the copy phases of one primitive that run at once share (its ``n``
            packing GPUs, then its assembling GPUs: each phase takes ``max(1, n / copy_cores)``
            times one GPU's, :func:`~nereus.transition.copy_cost.effective_copy_bytes`); infinite
            (the default: every GPU copies with its own engines). Calibrated on CPU workers, where
            the cores and memory bandwidth the workers get on a shared machine are fewer than
            ``worker_cores``.
        dispatch_s: seconds from a primitive's end to the start of one that depends on it (the
            runtime's executor: Ray dispatches a dependent call once its arguments are known;
            :func:`~nereus.transition.sharing.shared_schedule`); 0 by default. Calibrated.

    The defaults are assumptions of the right order (NCCL communicator creation takes tens to
    hundreds of milliseconds); calibrate them from measured transitions.

    Raises:
        ValueError: a negative value.
    """

    comm_setup_intra_s: float = 0.05
    comm_setup_inter_s: float = 0.2
    teardown_s: float = 0.01
    teardown_tensor_s: float = 0.0
    storage_bandwidth: float = 2e9
    load_setup_s: float = 2.0
    host_bandwidth: float = 25e9
    host_setup_s: float = 0.5
    copy_bandwidth: float = math.inf
    transit_buffers: bool = False
    serial_workers: bool = False
    worker_cores: float = math.inf
    strided_copy_factor: float = 0.0
    fresh_copy_factor: float = 0.0
    fresh_buffer_bytes: float = math.inf
    copy_cores: float = math.inf
    dispatch_s: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"cost parameter {k!r} must be a number >= 0, got {v!r}")
        if not self.worker_cores > 0:
            raise ValueError(f"cost parameter 'worker_cores' must be > 0 cores, got {self.worker_cores!r}")
        if not self.copy_cores > 0:
            raise ValueError(f"cost parameter 'copy_cores' must be > 0 cores, got {self.copy_cores!r}")
        if self.storage_bandwidth <= 0:
            raise ValueError(f"cost parameter 'storage_bandwidth' must be > 0 B/s, got {self.storage_bandwidth!r}")


def _link(cluster: ClusterSpec, gpus) -> tuple[float, float, str]:
    return cluster.link_of(gpus)


def _copy_bw(cluster: ClusterSpec, params: CostParams) -> float:
    """``C`` of the module docstring, bytes/s."""
    return params.copy_bandwidth or cluster.gpu.hbm_bandwidth / 4


def _setup(cluster: ClusterSpec, gpus, params: CostParams) -> float:
    return params.comm_setup_inter_s if cluster.spans_nodes(gpus) else params.comm_setup_intra_s


def copy_bytes(p: Primitive) -> int:
    """Bytes copied in memory on ``p``'s critical path, the copy term's ``K`` (module docstring).

    The runtime's executor packs every byte a GPU sends into a send buffer and writes every byte of
    a new shard once, local parts included (a shard re-sliced in place, as on the GPU that keeps
    half of a replica under TP 1 -> 2, costs as much copying as one received). Every sender packs
    before it sends and a receiver assembles after its last buffer arrived, so the packing of the
    slowest sender and the assembly of the slowest receiver follow each other:
    ``max_g sent[g] + max_g alloc[g]`` (:mod:`nereus.transition.buffers`; an Extend of ``b`` bytes
    copies ``2·b`` on its path, ``b`` packed at the source and ``b`` written at the destination; a
    symmetric Split packs and writes on every GPU, the same as ``max_g (sent[g] + alloc[g])``).
    The calibration measures it as the slowest worker's packing plus the slowest worker's assembly
    (``transition/calibrate.py``). A primitive that does not record them (a ZeRO group's re-cut)
    falls back to its busiest receiver's bytes.
    """
    if p.sent or p.alloc:
        return max(p.sent.values(), default=0) + max(p.alloc.values(), default=0)
    return int(max([b for _, b in p.groups] + [b for _, _, b in p.pairs] + [0]))


def duration(p: Primitive, cluster: ClusterSpec, params: CostParams = CostParams()) -> float:
    """Predicted seconds of one primitive (formulas in the module docstring)."""
    if p.kind == "destroy":
        return params.teardown_s + params.teardown_tensor_s * p.freed_tensors
    if p.kind == "load" and p.source == STORAGE:
        per_node: dict[int, int] = {}
        for g, b in p.mem_net.items():
            per_node[cluster.node_of(g)] = per_node.get(cluster.node_of(g), 0) + b
        return params.load_setup_s + max(per_node.values(), default=0) / params.storage_bandwidth
    if p.kind == "load" and not p.home:  # weight sync from a train EMU: a source GPU sends its pairs one after another
        sent: dict[int, float] = {}
        for s, d, b in p.pairs:
            bw, lat, _ = _link(cluster, (s, d))
            sent[s] = sent.get(s, 0.0) + b / bw + lat
        received: dict[int, int] = {}
        for _, d, b in p.pairs:
            received[d] = received.get(d, 0) + b
        for g, b in p.mem_net.items():  # local copies of what the train shard on g already holds
            local = b - received.get(g, 0)
            if local > 0:
                sent[g] = sent.get(g, 0.0) + 2.0 * local / cluster.gpu.hbm_bandwidth
        return (_setup(cluster, p.gpus, params) if p.pairs else 0.0) + max(sent.values(), default=0.0)
    if p.kind == "offload":
        return params.host_setup_s + max((b / params.host_bandwidth for _, _, b in p.pairs), default=0.0)
    if p.kind == "restore" or (p.kind == "load" and p.home):  # a Load from a host-resident train copy
        home = {cluster.node_of(g) for g in p.home}
        return max((b / (params.host_bandwidth if cluster.node_of(d) in home
                         else min(params.host_bandwidth, cluster.gpu.scaleout_bandwidth))
                    for _, d, b in p.pairs), default=0.0)
    copy = effective_copy_bytes(p, copy_bytes(p), params) / _copy_bw(cluster, params)
    if p.kind == "extend":
        t = 0.0
        for s, d, b in p.pairs:
            bw, lat, _ = _link(cluster, (s, d))
            t = max(t, b / bw + lat)
        return _setup(cluster, p.gpus, params) + t + copy
    t = 0.0
    for gpus, recv in p.groups:
        bw, lat, _ = _link(cluster, gpus)
        steps = len(gpus) - 1 if p.kind == "split" else 1
        t = max(t, recv / bw + steps * lat)
    return _setup(cluster, p.gpus, params) + t + copy


def ports(p: Primitive, cluster: ClusterSpec, params: CostParams | None = None) -> frozenset[tuple[int, str, str]]:
    """``(gpu, link, "tx" | "rx")`` ports a primitive holds while it runs; with
    ``params.serial_workers`` also ``(gpu, "worker", "run")`` on every GPU it touches."""
    out = _link_ports(p, cluster)
    if params is not None and params.serial_workers:
        out |= {(g, "worker", "run") for g in p.gpus if g != HOST_ID}
    return frozenset(out)


def _link_ports(p: Primitive, cluster: ClusterSpec) -> set:
    out = set()
    if p.kind == "load" and p.source == STORAGE:
        return {(cluster.node_of(g), "storage", "rx") for g in p.gpus}
    if p.kind in ("offload", "restore") or (p.kind == "load" and p.home):
        return {(s, "host", "tx") if d == HOST_ID else (d, "host", "rx") for s, d, b in p.pairs if b > 0}
    for s, d, b in p.pairs:
        if b > 0:
            link = _link(cluster, (s, d))[2]
            out.add((s, link, "tx"))
            out.add((d, link, "rx"))
    for gpus, recv in p.groups:
        if recv > 0:
            link = _link(cluster, gpus)[2]
            for g in gpus:
                out.add((g, link, "tx"))
                out.add((g, link, "rx"))
    return out


def min_bytes(initial: tuple[EMU, ...], target: tuple[EMU, ...], models: dict[str, tuple[ModelSpec, int]]) -> int:
    """Bytes any transition from ``initial`` to ``target`` must move, a lower bound.

    Every target shard must end on its GPU; whatever part of it is not already there (in the current
    EMU of the same model-stage on that GPU, :func:`~nereus.transition.held.held_bytes`, ZeRO slices
    included; a slice of another TP/PP layout counts as much of it as could lie in the target shard,
    so the bound holds whatever the flat-buffer order) has to arrive over a link at least once. A
    frozen or derived model-stage with no current EMU at all is re-created by a Load, whose weight
    sync copies locally what its ``*.train`` EMU on the GPU holds: that part counts as there too. Host copies (``Candidate.offload == "host"``)
    need and hold no GPU bytes and count 0 here.

    Args:
        models: model-stage → (model shapes, state bytes per parameter: an int or
            ``(weights, optimizer)``, :func:`~nereus.transition.emu.state_parts`).
    """
    here: dict[tuple[str, int], EMU] = {(e.model_stage, g): e for e in initial if not e.host for g in e.gpus}
    own = {e.model_stage for e in initial}
    total = 0
    for e in target:
        model, bpp = models[e.model_stage]
        for g in e.gpus:
            need = e.bytes_on(g)
            if not need:
                continue
            src = here.get((e.model_stage, g))
            if src is None and e.model_stage not in own and not e.model_stage.endswith(".train"):
                # re-created by a Load (no replica of its own left): a weight sync copies what the
                # model's *.train EMU holds on this GPU locally (primitives.load)
                src = here.get((e.model_stage.partition(".")[0] + ".train", g))
            res = 0 if src is None else held_bytes(model, bpp, src, g, e, g, optimistic=True)
            total += max(0, need - res)
    return total
