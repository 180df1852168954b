"""Subset communicators and instrumented collectives (DESIGN.md §4.7).

A :class:`Group` is a gloo (CPU) or NCCL (CUDA) process group among any subset of workers, built on demand from a shared
``TCPStore`` under a unique ``PrefixStore`` prefix, without a world-wide ``init_process_group``:
``torch.distributed.ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)``. On CUDA workers the same mechanism builds
``torch.distributed.ProcessGroupNCCL(PrefixStore(prefix, store), rank, size, opts)`` with
``opts._timeout`` (:func:`backend_for` picks the backend from the worker's device). Only the
members build it, so workers can join and leave a running job. Every group carries a timeout, so a
collective whose peer died raises instead of hanging. On a worker (whose :class:`Meter` has an
``abort`` event) the rendezvous is a presence barrier the driver can release when a member is lost,
and so is the gloo group's own build after it (``comm/rendezvous.py``), instead of a wait for the
group timeout.

Collectives call the process group's own methods and record, in the worker's :class:`Meter`, the
seconds spent under op class ``"<collective>@<backend>"`` (``@gloo`` or ``@nccl``) and the bytes this rank sent (payload model:
all-reduce ``2·(n-1)/n·B`` (ring), reduce-scatter ``(n-1)/n·B_in``, all-gather ``(n-1)/n·B_out``, broadcast ``B`` at the root, p2p ``B``).

Gloo caveats (resharding.md §2.2): receive into contiguous buffers, then copy into views; all-gather
inputs must have equal sizes. Gloo runs on host memory, so a CUDA tensor given to a gloo group is
staged through a CPU copy; an NCCL group takes CUDA tensors directly (no host copy) and refuses CPU
tensors. NCCL point-to-point between two ranks shares one stream per pair, so two ranks that both
send before receiving can deadlock: :meth:`Group.sendrecv` orders the pair (lower rank sends first).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.rendezvous import RendezvousAborted, arrive, build_released

__all__ = ["Group", "CommError", "connect_store", "new_group", "backend_for", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0


class CommError(RuntimeError):
    """A collective failed or timed out (a peer died or the group was misconfigured)."""


def connect_store(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A client connection to the job's ``TCPStore`` (the driver hosts the master)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def backend_for(device: str | torch.device | None) -> str:
    """The backend of a group whose tensors live on ``device``: ``nccl`` for a CUDA device when this
    torch build has NCCL (``torch.distributed.is_nccl_available()``), else ``gloo`` (CPU, or a CUDA
    build without NCCL: tensors are then staged through host memory)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """``ProcessGroupNCCL(store, rank, size, opts)`` with ``opts._timeout`` (the collective timeout;
    with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` a timed-out collective aborts the communicator and the
    worker's wait raises). The device is the worker's current CUDA device (``torch.cuda.set_device``)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


@dataclass
class Group:
    """A communicator among ``members`` (worker ids, in group-rank order).

    Attributes:
        name: unique prefix it was built under.
        members: worker ids; ``members[i]`` has group rank ``i``.
        rank: this worker's group rank.
        pg: the gloo or NCCL process group, or None for a group of one (collectives are no-ops).
        meter: where timings and bytes go.
        backend: ``gloo`` or ``nccl`` (:func:`backend_for`).
        device: where the group's buffers live: ``cpu`` for gloo, the worker's CUDA device for NCCL.
    """

    name: str
    members: tuple[int, ...]
    rank: int
    pg: object | None
    meter: Meter
    timeout_s: float = DEFAULT_TIMEOUT_S
    _tag: int = field(default=0, repr=False)
    backend: str = "gloo"
    device: str = "cpu"

    @property
    def direct(self) -> bool:
        """Collectives take the tensors where they are (NCCL): no host staging."""
        return self.backend == "nccl"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """The buffer a collective runs on: ``t`` itself for NCCL (which must be on the device) or a CPU
        tensor; a CPU copy of a device tensor for gloo."""
        if self.direct:
            if t.device.type != "cuda":
                raise CommError(f"group {self.name!r} is NCCL: tensors must be on a CUDA device, got {t.device}")
            return t
        return t if t.device.type == "cpu" else t.cpu()

    @property
    def size(self) -> int:
        return len(self.members)

    def _run(self, op: str, work_fn, sent_bytes: float) -> None:
        t0 = time.perf_counter()
        try:
            with self.meter.wait_in(op):
                work_fn().wait()
        except RuntimeError as e:
            raise self._error(op, e) from e
        self.meter.add_time(f"{op}@{self.backend}", time.perf_counter() - t0)
        self.meter.add_bytes(sent_bytes, f"{op}@{self.backend}")

    def _error(self, op: str, e: Exception) -> CommError:
        return CommError(f"{op} in group {self.name!r} (members {self.members}, rank {self.rank}) "
                         f"failed or timed out after {self.timeout_s:.0f}s: {str(e)[:300]}")

    # ------------------------------------------------------------------ collectives
    # Gloo runs on host memory: a device tensor is staged through a contiguous CPU copy; NCCL takes
    # CUDA tensors directly (``_host``).
    def all_reduce(self, t: torch.Tensor, avg: bool = False) -> torch.Tensor:
        """In-place sum (or mean) of contiguous ``t`` over the group; returns ``t``."""
        if self.size == 1:
            return t
        assert t.is_contiguous()
        n = self.size
        buf = self._host(t)
        self._run("allreduce", lambda: self.pg.allreduce([buf]), 2 * (n - 1) / n * t.numel() * t.element_size())
        if buf is not t:
            t.copy_(buf)
        if avg:
            t.div_(n)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Equal-shape ``t`` from every member, in group-rank order (on ``t``'s device)."""
        if self.size == 1:
            return [t]
        src = self._host(t.contiguous())
        out = [torch.empty_like(src) for _ in range(self.size)]
        n = self.size
        self._run("allgather", lambda: self.pg.allgather([out], [src]), (n - 1) * t.numel() * t.element_size())
        return [o.to(t.device) for o in out]

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of contiguous ``t`` (``numel`` divisible by the group size) over the group, this rank's
        ``1/n`` slice of it (rank ``r`` gets elements ``[r·k, (r+1)·k)``, ``k = numel/n``); payload
        ``(n-1)/n·B`` (ring). ZeRO's gradient reduce (``worker/zero.py``)."""
        n = self.size
        if n == 1:
            return t.clone()
        if t.numel() % n:
            raise ValueError(f"reduce_scatter in group {self.name!r}: {t.numel()} elements do not split "
                             f"into {n} equal slices")
        src = self._host(t.contiguous())
        out = torch.empty(t.numel() // n, dtype=t.dtype, device=src.device)
        pieces = list(src.view(n, -1).unbind(0))
        self._run("reducescatter", lambda: self.pg.reduce_scatter([out], [pieces], dist.ReduceScatterOptions()),
                  (n - 1) / n * t.numel() * t.element_size())
        return out.to(t.device)

    def broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """In-place broadcast of contiguous ``t`` from group rank ``root``; returns ``t``."""
        if self.size == 1:
            return t
        assert t.is_contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        sent = t.numel() * t.element_size() if self.rank == root else 0
        buf = self._host(t)
        self._run("broadcast", lambda: self.pg.broadcast([buf], opts), sent)
        if buf is not t:
            t.copy_(buf)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Point-to-point send of ``t`` to group rank ``dst``."""
        buf = self._host(t.contiguous())
        self._run("p2p", lambda: self.pg.send([buf], dst, 0), t.numel() * t.element_size())

    def isend(self, t: torch.Tensor, dst: int) -> tuple:
        """Start sending ``t`` to group rank ``dst``; pass the handle to :meth:`wait` (the buffer stays
        alive until then)."""
        buf = self._host(t.detach().contiguous())
        t0 = time.perf_counter()
        try:
            work = self.pg.send([buf], dst, 0)
        except RuntimeError as e:
            raise self._error("p2p", e) from e
        self.meter.add_time(f"p2p@{self.backend}", time.perf_counter() - t0)
        self.meter.add_bytes(t.numel() * t.element_size(), f"p2p@{self.backend}")
        return work, buf

    def wait(self, handle: tuple) -> None:
        """Finish an :meth:`isend`."""
        t0 = time.perf_counter()
        try:
            with self.meter.wait_in("p2p"):
                handle[0].wait()
        except RuntimeError as e:
            raise self._error("p2p", e) from e
        self.meter.add_time(f"p2p@{self.backend}", time.perf_counter() - t0)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into contiguous ``t`` from group rank ``src``; returns ``t``."""
        assert t.is_contiguous()
        buf = t if self.direct or t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
        if self.direct:
            self._host(t)  # refuses a CPU tensor
        self._run("p2p", lambda: self.pg.recv([buf], src, 0), 0)
        if buf is not t:
            t.copy_(buf)
        return t

    def sendrecv(self, send: torch.Tensor | None, recv: torch.Tensor | None, peer: int) -> None:
        """Send ``send`` to and receive into ``recv`` from group rank ``peer`` (either may be None).

        Gloo: the send is posted first, then the receive (no ordering needed: gloo buffers sends).
        NCCL: a pair's send and receive share one stream, so the lower rank sends then receives and
        the higher rank receives then sends; a set of pairs visited in one global order by every rank
        cannot deadlock.
        """
        if not self.direct:
            h = self.isend(send, peer) if send is not None else None
            if recv is not None:
                self.recv(recv, peer)
            if h is not None:
                self.wait(h)
            return
        first_send = self.rank < peer
        for do_send in ((True, False) if first_send else (False, True)):
            if do_send and send is not None:
                self.send(send, peer)
            elif not do_send and recv is not None:
                self.recv(recv, peer)


def new_group(store: dist.Store, name: str, members: tuple[int, ...], me: int, meter: Meter,
              timeout_s: float = DEFAULT_TIMEOUT_S, device: str | torch.device | None = None) -> Group:
    """Build the communicator ``name`` among ``members``; every member must call this.

    Args:
        store: the job's TCPStore client.
        name: a prefix unique to this group's lifetime (reuse after teardown needs a new name).
        members: worker ids in group-rank order; no repeats.
        me: this worker's id; must be in ``members``.
        timeout_s: seconds before a collective (or the rendezvous) gives up.
        device: where the tensors of its collectives live; a CUDA device gives an NCCL group
            (:func:`backend_for`), None or ``cpu`` a gloo group. Every member must pass the same
            kind of device.

    Raises:
        ValueError: ``me`` not a member, repeated members, or a non-positive timeout.
    """
    members = tuple(int(m) for m in members)
    if len(set(members)) != len(members):
        raise ValueError(f"group {name!r}: members repeat: {members}")
    if me not in members:
        raise ValueError(f"group {name!r}: worker {me} is not a member of {members}")
    if not timeout_s > 0:
        raise ValueError(f"group {name!r}: timeout_s must be > 0, got {timeout_s}")
    rank = members.index(me)
    backend = backend_for(device)
    pg = None
    if len(members) > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        t0 = time.perf_counter()
        try:
            with meter.wait_in("group_setup"):
                prefixed = dist.PrefixStore(name, store)
                if getattr(meter, "abort", None) is not None:  # a worker's: the driver may release it
                    arrive(prefixed, rank, len(members), timeout_s, meter.abort)
                if backend == "nccl":
                    pg = _nccl_group(prefixed, rank, len(members), timeout)
                elif getattr(meter, "abort", None) is not None:  # its store waits released too
                    pg = build_released(lambda s: dist.ProcessGroupGloo(dist.PrefixStore(name, s), rank, len(members),
                                                                        timeout), store, timeout_s, meter.abort)
                else:
                    pg = dist.ProcessGroupGloo(prefixed, rank, len(members), timeout)
        except RendezvousAborted as e:
            raise CommError(f"rendezvous of group {name!r} among workers {members} aborted: {e}") from e
        except RuntimeError as e:
            raise CommError(f"could not build group {name!r} among workers {members} within "
                            f"{timeout_s:.0f}s: {str(e)[:300]}") from e
        meter.add_time(f"group_setup@{backend}", time.perf_counter() - t0)
    dev = str(torch.device(device)) if backend == "nccl" else "cpu"
    return Group(name=name, members=members, rank=rank, pg=pg, meter=meter, timeout_s=timeout_s,
                 backend=backend, device=dev)


# ---------------------------------------------------------------------- autograd wrappers (Megatron f/g)
class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.group.all_reduce(g)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward, own slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.width = x.shape[-1]
        return torch.cat(group.all_gather(x.contiguous()), dim=-1)

    @staticmethod
    def backward(ctx, g):
        r, w = ctx.group.rank, ctx.width
        return g[..., r * w:(r + 1) * w].contiguous(), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherLastDim.apply(x, group)
