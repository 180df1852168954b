"""The worker side of a live transition: EMU shards held between engines, and primitives run on them.

Source: DESIGN.md §4.8; paper §5.2 (primitives), §6.3 (buffers and transport).

A transition on one worker goes through three calls, all sent by the driver's
:class:`~nereus.runtime.transit.driver_side.TransitionExecutor` (it never receives a state tensor):

1. :meth:`Transit.adopt`: the engine of every model-stage that changes becomes a *unit*: its
   parameter shards, Adam moments and, in a bf16 run, fp32 master weights (``Engine.state_tensors``:
   the same tensors, no copy), its counters ``(step,
   update_count, version, policy_version, position)`` and its EMU metadata, under the EMU's uid
   (``"actor.train#1"``); the engine and its communicators are dropped.
2. :meth:`Transit.run`: one primitive (a :class:`~nereus.runtime.transit.plans.MoveSpec`). Both ends of
   every transfer compute the same :func:`~nereus.runtime.transit.plans.plan_moves`; the workers that send
   or receive share one communicator among exactly themselves (kept by member set across
   transitions and weight syncs: ``comm/cache.py``), post every send (one contiguous ``uint8``
   buffer per receiver: a 40-byte header of the counters, then the pieces; ``transit/packing.py``),
   receive from each sender in worker order, assemble the produced shards (each element written
   once; padding zero),
   and only then free the consumed units (source buffers live until the transfers end). Destroy
   frees; Offload moves a replica's shards to host memory (``.cpu()``; on a CPU worker host and
   device memory are one, so this only re-labels); Load from storage re-creates frozen weights from
   the model's initial weights (the seed the run started from).
3. :meth:`Transit.engine_from_unit`: the unit matching a target EMU becomes the engine of the new
   layout (new communicators, the moved tensors as its parameters and moments, counters restored).

Dtypes: ``params`` travel and are assembled in the engine's parameter dtype (bf16 in a bf16 run, so
the weight sync sends bf16 weights), ``master`` and the moments always in fp32
(``shards.kind_dtype``); a piece is cast only when source and target dtypes differ (an fp32 train
engine feeding a bf16 inference copy on CUDA under ``dtype="auto"``).

Each :meth:`run` returns metadata only: seconds (total, communicator setup, transfer), bytes sent
and received (state pieces, headers, host copies).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from nereus.runtime.comm.cache import GroupCache
from nereus.runtime.model.sharding import init_shard_params
from nereus.runtime.transit.buffer_pool import BufferPool
from nereus.runtime.transit.packing import COUNTERS, HEADER_BYTES, assemble, pack, recv_sizes
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, plan_moves

__all__ = ["Unit", "Transit"]


@dataclass
class Unit:
    """One worker's shard of one EMU: ``tensors[kind][name]`` and the counters."""

    meta: UnitMeta
    tensors: dict
    counters: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())


class Transit:
    """Units held by one worker during transitions (see the module docstring).

    Args:
        worker_id: this worker.
        store: the job's TCPStore client (communicators rendezvous through it).
        meter: where collective seconds and bytes go.
        timeout_s: timeout of every communicator.
    """

    def __init__(self, worker_id: int, store, meter, timeout_s: float) -> None:
        self.id, self.store, self.meter, self.timeout_s = worker_id, store, meter, timeout_s
        self.units: dict[str, Unit] = {}
        self.comms = GroupCache(store, worker_id, meter, timeout_s)
        #: send and receive buffers kept across exchanges (``transit/buffer_pool.py``)
        self.buffers = BufferPool()
        #: this process's fresh-buffer first-touch cost (``fault_probe.measure``), once measured
        self.fault: dict | None = None

    def fault_probe(self, device: str, measure: bool = True) -> dict | None:
        """The first-touch cost of a fresh CPU buffer in this process (``transit/fault_probe.py``),
        measured on the first call with ``measure`` and kept; ``{"s_per_byte": None}`` on a non-CPU
        device (nothing fresh to pay); None while not measured and ``measure`` is False."""
        if self.fault is None and measure:
            if str(device) == "cpu":
                from nereus.runtime.transit.fault_probe import measure as probe

                self.fault = probe()
            else:
                self.fault = {"s_per_byte": None}
        return self.fault

    # ------------------------------------------------------------------ engines <-> units
    def adopt(self, engine, meta: UnitMeta) -> None:
        """Take ``engine``'s state as the unit ``meta`` (no copy): every kind it holds
        (``Engine.state_tensors``)."""
        tensors = {k: dict(d) for k, d in engine.state_tensors().items()}
        self.units[meta.uid] = Unit(meta, tensors, {k: int(getattr(engine, k)) for k in COUNTERS})

    def take(self, model_stage: str, tp: int, pp: int, gpus: tuple[int, ...]) -> Unit:
        """Remove and return the unit of ``model_stage`` laid out as ``(tp, pp)`` on ``gpus``.

        Raises:
            ValueError: no such unit on this worker (the transition did not end in the target).
        """
        for uid, u in self.units.items():
            m = u.meta
            if (m.model_stage, m.tp, m.pp, m.gpus) == (model_stage, tp, pp, tuple(gpus)):
                return self.units.pop(uid)
        raise ValueError(f"worker {self.id}: no unit of {model_stage} with layout tp={tp} pp={pp} on "
                         f"workers {list(gpus)}; it holds {sorted(self.units)}")

    # ------------------------------------------------------------------ primitives
    def run(self, spec, move: MoveSpec, group_name: str, dtype: torch.dtype, device: str,
            readable: dict | None = None) -> dict:
        """Run this worker's part of ``move`` (module docstring, step 2).

        Args:
            spec: the model-stage's model shapes.
            group_name: unique prefix of this primitive's communicator.
            dtype, device: of the produced shards' ``params`` (other kinds are fp32, ``kind_dtype``).
            readable: more units it may read pieces from (engines that are not changing).

        Returns:
            ``{"pid", "worker", "seconds", "setup_s", "pack_s", "transfer_s", "assemble_s", "sent", "recv",
            "header_bytes", "host_bytes", "storage_bytes"}`` (seconds: communicator setup, 0 when
            reused; packing the send buffers; sends and receives; assembling the produced shards;
            bytes; ``recv`` counts state bytes that arrived); a Destroy adds ``"freed_tensors"``,
            the tensors it dropped; ``"fault_s_per_byte"`` once :meth:`fault_probe` has measured; a
            transfer adds ``"pack_faults"`` and ``"transfer_faults"``, the minor page faults of its
            packing and of its sends and receives (``getrusage``: a fresh buffer's first touch).

        Raises:
            ValueError: a unit it reads or consumes is not here.
        """
        t0, wall = time.perf_counter(), time.time()
        out = {"pid": move.pid, "worker": self.id, "t_start": wall, "setup_s": 0.0, "transfer_s": 0.0, "pack_s": 0.0,
               "assemble_s": 0.0, "sent": 0, "recv": 0,
               "header_bytes": 0, "host_bytes": 0, "storage_bytes": 0}
        if move.kind == "destroy":  # one free per tensor (transition/teardown.py prices it so)
            gone = [self.units.pop(uid, None) for uid in move.consumes]
            out["freed_tensors"] = sum(len(d) for u in gone if u is not None for d in u.tensors.values())
            del gone
        elif move.kind == "offload":
            self._offload(move, out)
        elif move.storage_seed >= 0:
            self._load_storage(spec, move, dtype, device, out)
        else:
            made = self.exchange(spec, move, {**(readable or {}), **self.units}, group_name, dtype, device, out)
            for uid in move.consumes:  # source buffers lived until every transfer ended
                self.units.pop(uid, None)
            self.units.update(made)
            if move.kind == "restore":  # every produced byte came from host memory
                out["host_bytes"] = sum(u.nbytes for u in made.values())
                for u in made.values():  # re-cut in host memory: the target is a host copy too
                    if u.meta.host:
                        u.tensors = {k: {n: t.cpu() for n, t in d.items()} for k, d in u.tensors.items()}
        out["seconds"] = time.perf_counter() - t0
        out["t_end"] = wall + out["seconds"]
        if self.fault is not None:  # measured once, outside every primitive (driver_side._fault_probes); None: GPU
            out["fault_s_per_byte"] = self.fault["s_per_byte"]
        return out

    def _offload(self, move: MoveSpec, out: dict) -> None:
        staged = move.produces[0]
        for uid in move.consumes:
            u = self.units.pop(uid, None)
            if u is not None and self.id in staged.gpus and u.meta.gpus == staged.gpus:
                host = {k: {n: t.cpu() for n, t in d.items()} for k, d in u.tensors.items()}
                out["host_bytes"] += u.nbytes
                self.units[staged.uid] = Unit(staged, host, u.counters)

    def _load_storage(self, spec, move: MoveSpec, dtype, device, out: dict) -> None:
        # a Hugging Face checkpoint is read shard by shard (hf.read_shards); a random model is re-drawn
        for dst in move.produces:
            if self.id not in dst.gpus:
                continue
            p, t = dst.position(self.id)
            if spec.checkpoint:
                from nereus.runtime.model.hf import read_shards

                params = read_shards(spec, dst.pp, p, dst.tp, t, dtype, device, move.storage_seed)
            else:  # only this worker's shards are drawn (layout.init_shard_params)
                params = init_shard_params(spec, move.storage_seed, dst.pp, p, dst.tp, t, dtype, device)
            out["storage_bytes"] += sum(x.numel() * x.element_size() for x in params.values())
            self.units[dst.uid] = Unit(dst, {"params": params}, dict.fromkeys(COUNTERS, 0))

    def exchange(self, spec, move: MoveSpec, units: dict, group_name: str, dtype, device, out: dict,
                 cache: dict | None = None) -> dict:
        """Send and receive the pieces of ``move`` and assemble the produced units on this worker.

        Args:
            units: uid → :class:`Unit` this worker reads pieces from.
            group_name: a name unique to this call; the communicator among the workers that send or
                receive is taken from :attr:`comms` (kept by member set across transitions and weight
                syncs, ``comm/cache.py``) and built under this name only when none is held.
            cache: ignored (communicators are kept in :attr:`comms`); kept for callers.

        Returns:
            produced uid → :class:`Unit` (counters from a local source, else from a sender's header).
        """
        del cache
        plan = plan_moves(spec, move, self.id)
        me = self.id
        comm = plan.comm_workers

        def source(uid: str) -> Unit:
            if uid not in units:
                raise ValueError(f"worker {me}: {move.pid} reads unit {uid}, which is not here "
                                 f"(it holds {sorted(units)})")
            return units[uid]

        group = None
        if me in comm and len(comm) > 1:
            group, out["setup_s"] = self.comms.get(comm, group_name, device)
        t1, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            made = self._transfer_and_assemble(spec, move, plan, source, group, dtype, device, out, t1, f0)
        except BaseException:
            self.buffers.discard()  # a failed transfer may still write them: never handed out again
            raise
        self.buffers.release()  # the views of its blocks died with the call that took them
        return made

    def _transfer_and_assemble(self, spec, move, plan, source, group, dtype, device, out, t1, f0) -> dict:
        """:meth:`exchange` from the packing on, its buffers taken from :attr:`buffers` (released by the
        caller once this returns: no view of them outlives it)."""
        me, comm = self.id, plan.comm_workers
        handles, outgoing, incoming = [], {}, {}
        if group is not None:
            # sends: one contiguous buffer per receiver (the counters header, then the pieces)
            bufs = pack(spec, plan, me, source, dtype, group.device, self.buffers.take)
            out["pack_s"] = time.perf_counter() - t1
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # page faults: fresh buffers (fault_probe.py)
            out["pack_faults"], f0 = f1 - f0, f1
            t1 = time.perf_counter()
            for d, (buf, n) in bufs.items():
                out["sent"] += n
                out["header_bytes"] += HEADER_BYTES
                if group.direct:  # NCCL: sent below, pair by pair in one global order
                    outgoing[d] = buf
                else:
                    handles.append(group.isend(buf, comm.index(d)))
            # receives, in sender order
            for s, n in recv_sizes(spec, plan, me, dtype).items():
                incoming[s] = self.buffers.take(HEADER_BYTES + n, group.device)
                if not group.direct:
                    group.recv(incoming[s], comm.index(s))
                out["recv"] += n
            if group.direct:
                # NCCL shares one stream per pair: every worker visits the pairs in the same global order
                # and exchanges both directions of a pair with the lower rank sending first
                for a, b in sorted({tuple(sorted(p)) for p in plan.pairs if me in p}):
                    peer = b if a == me else a
                    group.sendrecv(outgoing.get(peer), incoming.get(peer), comm.index(peer))
            for hd in handles:
                group.wait(hd)
        recv = {s: (buf[HEADER_BYTES:], dict(zip(COUNTERS, buf[:HEADER_BYTES].view(torch.int64).tolist())))
                for s, buf in incoming.items()}
        out["transfer_s"] = time.perf_counter() - t1
        out["transfer_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        t2 = time.perf_counter()
        made = {uid: Unit(next(m for m in move.produces if m.uid == uid), tensors, counters)
                for uid, (tensors, counters) in assemble(spec, plan, move, me, recv, source, dtype, device).items()}
        out["assemble_s"] = time.perf_counter() - t2
        return made
