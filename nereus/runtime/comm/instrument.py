"""Measurements a worker reports to the controller (DESIGN.md §4.3, §4.7).

The runtime never derives costs; it only measures:

* ``stage_seconds``: wall seconds per model-stage call (e.g. ``"actor.train"``);
* ``op_seconds``: seconds per op class: ``gemm``, ``attention`` and one per collective, e.g.
  ``allreduce@gloo``, ``allgather@gloo``, ``broadcast@gloo``, ``p2p@gloo``, ``group_setup@gloo``;
* ``peak_bytes``: the CUDA allocator peak on GPU; on CPU the peak of *tracked* tensor bytes
  (parameters, gradients, optimizer state, KV cache and the storages saved for backward, each once);
* ``bytes_sent``: payload bytes this worker sent in collectives (see ``comm/groups.py`` for the model),
  and ``op_bytes``: the same per op class (``allreduce@gloo``, ``reducescatter@gloo``, ...);
* ``op_seconds_by_stage`` and ``peak_bytes_by_stage``: the same, attributed to the model-stage whose
  call was running (the shape ``nereus.controller.monitor.StepReport`` takes).

CPU kernels run synchronously, so ``time.perf_counter`` around an op measures it. On GPU the timers
synchronize first.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch

__all__ = ["Meter", "DeviceMemoryError"]


class DeviceMemoryError(RuntimeError):
    """The tracked device bytes of a worker would exceed its capacity (``Meter.capacity``): the CPU
    analogue of a CUDA out-of-memory error (``worker/memory_pool.py``)."""


class Meter:
    """Accumulates timings, bytes and tracked memory of one worker."""

    def __init__(self, capacity: int | None = None) -> None:
        self.reset()
        self._static: dict[str, int] = {}
        # progress, for the driver's hang detection (run/faults.py): ops timed so far (never reset),
        # and the communication this worker is waiting in now, if any (a collective or a rendezvous)
        self.ops = 0
        self.waiting: str | None = None
        # a worker's threading.Event the driver sets to release its rendezvous waits when a peer is
        # lost (comm/rendezvous.py); None: rendezvous wait for the group timeout
        self.abort = None
        self.capacity = capacity  # device bytes the tracked total may reach (None: unlimited)

    def reset(self) -> None:
        """Zero the timings, bytes and peak (static tracked bytes are kept)."""
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.op_seconds: dict[str, float] = defaultdict(float)
        self.by_stage: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.stage_peak: dict[str, int] = defaultdict(int)
        self.bytes_sent = 0.0
        self.op_bytes: dict[str, float] = defaultdict(float)
        self.current = getattr(self, "current", None)
        self._live = 0
        self._peak = 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    # ---------------------------------------------------------------- time and bytes
    def add_time(self, op_class: str, seconds: float) -> None:
        self.ops = getattr(self, "ops", 0) + 1
        self.op_seconds[op_class] += seconds
        if self.current is not None:
            self.by_stage[self.current][op_class] += seconds

    def add_bytes(self, n: float, op_class: str | None = None) -> None:
        self.bytes_sent += n
        if op_class is not None:
            self.op_bytes[op_class] += n

    @contextmanager
    def op(self, op_class: str):
        """Time a block under ``op_class``."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.add_time(op_class, time.perf_counter() - t0)

    @contextmanager
    def wait_in(self, what: str):
        """Mark a block as waiting for peers (a collective, a point-to-point transfer, a group
        rendezvous): a worker that makes no progress outside such a block is the slow one."""
        outer, self.waiting = getattr(self, "waiting", None), what
        try:
            yield
        finally:
            self.waiting = outer

    @contextmanager
    def stage(self, model_stage: str):
        """Time one model-stage call (wall seconds); ops and peaks inside it are attributed to it."""
        t0 = time.perf_counter()
        outer, self.current = self.current, model_stage
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._touch()
        try:
            yield
        finally:
            self.stage_seconds[model_stage] += time.perf_counter() - t0
            if torch.cuda.is_available():
                self.stage_peak[model_stage] = max(self.stage_peak[model_stage],
                                                   int(torch.cuda.max_memory_allocated()))
            self.current = outer

    # ---------------------------------------------------------------- tracked memory
    def set_static(self, key: str, nbytes: int) -> None:
        """Record long-lived bytes under ``key`` (parameters, optimizer state, KV cache).

        Raises:
            DeviceMemoryError: the tracked total would exceed ``capacity`` (nothing is recorded).
        """
        new = self.device_bytes - self._static.get(key, 0) + int(nbytes)
        self._check(new, f"{key} ({int(nbytes)} B)")
        self._static[key] = int(nbytes)
        self._touch()

    @property
    def device_bytes(self) -> int:
        """Tracked bytes resident now: static state plus live saved activations."""
        return sum(self._static.values()) + self._live

    def _check(self, total: int, what: str) -> None:
        if self.capacity is not None and total > self.capacity:
            held = {k: v for k, v in self._static.items() if v}
            raise DeviceMemoryError(f"device memory: {what} brings the tracked total to {total} B, over this "
                                    f"worker's capacity of {self.capacity} B (resident: {held})")

    def drop_static(self, key: str) -> None:
        self._static.pop(key, None)

    def _touch(self) -> None:
        now = sum(self._static.values()) + self._live
        self._peak = max(self._peak, now)
        if self.current is not None:
            self.stage_peak[self.current] = max(self.stage_peak[self.current], now)

    def _free(self, n: int) -> None:
        self._live -= n

    @contextmanager
    def track_activations(self, exclude: set[int] | None = None, static=()):
        """Count the storages autograd saves for backward while a saved reference to them is alive.

        Each storage counts once, with its ``nbytes``, however many saved tensors view it (a hidden
        state saved by three projections, ``x.view(-1, h)`` and ``x``), and the storages of static
        state never count: a matmul saves ``w.t()``, a view of the parameter ``w``, not an activation.
        The bytes are freed when the last saved reference to the storage is released (after its
        node's backward). This is the set of tensors held for backward, exactly and independently of
        the machine (a GPU allocator also sees transient buffers inside kernels, not counted here).

        Args:
            exclude: ``id()`` of tensors already counted as static (the parameters).
            static: tensors already counted as static; their storages and every view of them are
                excluded (the parameters again, as tensors).
        """
        exclude = exclude or set()
        skip = {w.untyped_storage().data_ptr() for w in static if w.numel()}
        held: dict[int, list[int]] = {}  # storage address -> [saved references alive, nbytes]

        def release(key: int) -> None:
            ref = held.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                del held[key]
                self._free(ref[1])

        def pack(t: torch.Tensor):
            if id(t) in exclude or isinstance(t, torch.nn.Parameter) or t.numel() == 0:
                return t
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in skip:
                return t
            if key not in held:
                n = st.nbytes()
                self._check(self.device_bytes + n, f"a saved activation ({n} B)")
                held[key] = [0, n]
                self._live += n
                self._touch()
            held[key][0] += 1
            weakref.finalize(t, release, key)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    @property
    def peak_bytes(self) -> int:
        if torch.cuda.is_available():  # stage() resets the CUDA peak, so fold in the stage peaks
            return max([int(torch.cuda.max_memory_allocated()), *self.stage_peak.values()])
        return int(self._peak)

    def measurements(self) -> dict:
        """``{"stage_seconds": {ms: s}, "op_seconds": {op class: s}, "op_seconds_by_stage": {ms: {op
        class: s}}, "peak_bytes": int, "peak_bytes_by_stage": {ms: int}, "bytes_sent": float}``."""
        return {"stage_seconds": dict(self.stage_seconds), "op_seconds": dict(self.op_seconds),
                "op_seconds_by_stage": {k: dict(v) for k, v in self.by_stage.items()},
                "peak_bytes": self.peak_bytes, "peak_bytes_by_stage": dict(self.stage_peak),
                "bytes_sent": float(self.bytes_sent), "op_bytes": dict(self.op_bytes)}
