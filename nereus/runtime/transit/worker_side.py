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
   or receive build one gloo communicator among exactly themselves, post every send (one contiguous
   ``uint8`` buffer per receiver: the pieces, then a 40-byte header of the counters), receive from
   each sender in worker order, assemble the produced shards (local pieces copied, padding zero),
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

import time
from dataclasses import dataclass

import torch

from nereus.runtime.comm.groups import new_group
from nereus.runtime.model.sharding import init_shard_params, param_shapes
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, held, kind_dtype, plan_moves

__all__ = ["Unit", "Transit", "COUNTERS"]

#: the counters every unit carries, in header order (int64 each)
COUNTERS = ("step", "update_count", "version", "policy_version", "position")


@dataclass
class Unit:
    """One worker's shard of one EMU: ``tensors[kind][name]`` and the counters."""

    meta: UnitMeta
    tensors: dict
    counters: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())


def _piece(t: torch.Tensor, dim: int | None, lo: int, hi: int, off: int) -> torch.Tensor:
    """Rows/columns ``[lo, hi)`` (full-tensor coordinates) of a shard whose region starts at ``off``."""
    return t if dim is None else t.narrow(dim, lo - off, hi - lo)


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
            if (m.model_stage, m.tp, m.pp, m.gpus, m.host) == (model_stage, tp, pp, tuple(gpus), False):
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
            ``{"pid", "worker", "seconds", "setup_s", "transfer_s", "sent", "recv", "header_bytes",
            "host_bytes", "storage_bytes"}`` (bytes; ``recv`` counts state bytes that arrived).

        Raises:
            ValueError: a unit it reads or consumes is not here.
        """
        t0, wall = time.perf_counter(), time.time()
        out = {"pid": move.pid, "worker": self.id, "t_start": wall, "setup_s": 0.0, "transfer_s": 0.0, "sent": 0, "recv": 0,
               "header_bytes": 0, "host_bytes": 0, "storage_bytes": 0}
        if move.kind == "destroy":
            for uid in move.consumes:
                self.units.pop(uid, None)
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
        out["seconds"] = time.perf_counter() - t0
        out["t_end"] = wall + out["seconds"]
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
            cache: communicators kept by name across calls (the per-step weight sync reuses its
                own); None builds one for this call only.

        Returns:
            produced uid → :class:`Unit` (counters from a local source, else from a sender's header).
        """
        plan = plan_moves(spec, move)
        me = self.id
        comm = plan.comm_workers

        def source(uid: str) -> Unit:
            if uid not in units:
                raise ValueError(f"worker {me}: {move.pid} reads unit {uid}, which is not here "
                                 f"(it holds {sorted(units)})")
            return units[uid]

        group = None
        if me in comm and len(comm) > 1:
            group = (cache or {}).get(group_name)
            if group is None:
                t0 = time.perf_counter()
                group = new_group(self.store, group_name, comm, me, self.meter, self.timeout_s, device)
                out["setup_s"] = time.perf_counter() - t0
                if cache is not None:
                    cache[group_name] = group
        t1 = time.perf_counter()
        handles, outgoing = [], {}
        # sends: one contiguous buffer per receiver (pieces, then the counters header)
        for (s, d), pieces in sorted(plan.pairs.items()):
            if s != me:
                continue
            parts, counters = [], None
            for pc in pieces:
                u = source(pc.uid)
                r = _region_of(spec, u.meta, me, pc.name)
                t = u.tensors[pc.kind][pc.name]
                parts.append(_piece(t, pc.dim, pc.lo, pc.hi, r.lo).to(kind_dtype(pc.kind, dtype)).contiguous()
                             .reshape(-1).view(torch.uint8))
                counters = u.counters
            header = torch.tensor([counters.get(k, 0) for k in COUNTERS], dtype=torch.int64).view(torch.uint8)
            buf = torch.cat([header.to(parts[0].device)] + parts)  # header first: every piece stays aligned
            out["sent"] += buf.numel() - header.numel()
            out["header_bytes"] += header.numel()
            if group.direct:  # NCCL: sent below, pair by pair in one global order
                outgoing[d] = buf
            else:
                handles.append(group.isend(buf, comm.index(d)))
        # receives, in sender order
        recv: dict[int, tuple[torch.Tensor, dict]] = {}
        h = 8 * len(COUNTERS)
        incoming: dict[int, torch.Tensor] = {}
        for (s, d), pieces in sorted(plan.pairs.items()):
            if d != me:
                continue
            n = sum(_numel(spec, pc) * _itemsize(kind_dtype(pc.kind, dtype)) for pc in pieces)
            incoming[s] = torch.empty(h + n, dtype=torch.uint8, device=group.device)
            if not group.direct:
                group.recv(incoming[s], comm.index(s))
            out["recv"] += n
        if group is not None and group.direct:
            # NCCL shares one stream per pair: every worker visits the pairs in the same global order
            # and exchanges both directions of a pair with the lower rank sending first
            for a, b in sorted({tuple(sorted(p)) for p in plan.pairs if me in p}):
                peer = b if a == me else a
                group.sendrecv(outgoing.get(peer), incoming.get(peer), comm.index(peer))
        for s, buf in incoming.items():
            recv[s] = (buf[h:], dict(zip(COUNTERS, buf[:h].view(torch.int64).tolist())))
        for hd in handles:
            group.wait(hd)
        out["transfer_s"] = time.perf_counter() - t1
        # assemble every produced shard on this worker
        shapes = param_shapes(spec)
        cursor = dict.fromkeys(recv, 0)
        made = {}
        for dst in move.produces:
            if me not in dst.gpus:
                continue
            tensors: dict = {}
            counters = None
            for kind, name, want, segs in plan.assembly[(me, dst.uid)]:
                shape = list(shapes[name][0])
                if want.dim is not None:
                    shape[want.dim] = want.length
                kdt = kind_dtype(kind, dtype)
                t = torch.zeros(shape, dtype=kdt, device=device)
                for src_w, uid, a, b in segs:
                    if src_w is None:
                        u = source(uid)
                        r = _region_of(spec, u.meta, me, name)
                        piece = _piece(u.tensors[kind][name], want.dim, a, b, r.lo)
                        counters = counters or u.counters
                    else:
                        raw, hdr = recv[src_w]
                        k = (b - a) * _row_numel(shapes[name][0], want.dim) if want.dim is not None else \
                            _full_numel(shapes[name][0])
                        nb = k * _itemsize(kdt)
                        piece = raw[cursor[src_w]:cursor[src_w] + nb]
                        if piece.storage_offset() % _itemsize(kdt):  # bf16 pieces before fp32 ones
                            piece = piece.clone()
                        piece = piece.view(kdt)
                        piece = piece.view(_piece_shape(shapes[name][0], want.dim, b - a))
                        cursor[src_w] += nb
                        counters = counters or hdr
                    _piece(t, want.dim, a, b, want.lo).copy_(piece)
                tensors.setdefault(kind, {})[name] = t
            made[dst.uid] = Unit(dst, tensors, dict(counters))
        return made


def _region_of(spec, meta: UnitMeta, worker: int, name: str):
    return held(spec, meta, worker).get(name)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _full_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row_numel(shape, dim: int) -> int:
    return _full_numel(shape) // shape[dim]


def _piece_shape(shape, dim: int | None, rows: int) -> list[int]:
    out = list(shape)
    if dim is not None:
        out[dim] = rows
    return out


def _numel(spec, pc) -> int:
    shape = param_shapes(spec)[pc.name][0]
    return _full_numel(shape) if pc.dim is None else (pc.hi - pc.lo) * _row_numel(shape, pc.dim)
