"""A worker's device-memory capacity and the host pool idle model-stages are offloaded into (DESIGN.md §4.7).

Colocated model-stages take turns on one worker (verl's hybrid engine; ``Candidate.offload`` says what
an idle one does, ``nereus/spec/framework.py``):

* ``none``: its state stays resident on the device;
* ``host``: before another model-stage runs here, its state is *copied* out of the device into the
  host pool and the device copy is freed; before it runs again it is copied back (both ways every
  turn, verl's ``param_offload`` / ``optimizer_offload``);
* ``drop``: its device copy is freed; the host pool keeps a copy that is written only when the state
  changed since the last one (a frozen model-stage's state never does, so after the first turn only
  the restore moves bytes: the planner's one-way reload; a derived copy that the weight sync rewrote
  is copied once more).

**Device and host pools.** On CUDA the device pool is the worker's GPU memory and the host pool is
pinned host memory (``pin_memory=True``, so the copies are DMA transfers); on CPU workers both are the
process's RAM, but the copy is still real: every tensor is copied into a new host buffer and the
device buffer is released (``tensor.data`` of a parameter is swapped, so autograd hooks and dict
entries stay the same objects). The device pool has a capacity (``MemoryPools.capacity``, bytes;
``None``: unlimited): the worker's :class:`~nereus.runtime.comm.instrument.Meter` accounts every
resident tensor it tracks (weights, master weights, Adam moments, KV cache, live saved activations)
and raises :class:`~nereus.runtime.comm.instrument.DeviceMemoryError` the moment the total would
exceed it, the CPU analogue of a CUDA out-of-memory error.

Each offload and restore is measured: bytes moved and seconds (``time.perf_counter`` around the
copies, synchronized on CUDA), reported in :meth:`MemoryPools.stats`.
"""

from __future__ import annotations

import time

import torch

__all__ = ["MemoryPools", "RESIDENCY_MODES", "MOVE_KEYS"]

#: the per-worker counters of :meth:`MemoryPools.stats` a driver sums over workers
MOVE_KEYS = ("offload_bytes", "restore_bytes", "offload_s", "restore_s", "offloads", "restores", "resync_bytes",
             "resync_s", "resyncs")

#: what an idle model-stage's state does (``Candidate.offload`` values the runtime executes)
RESIDENCY_MODES = ("none", "host", "drop")


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A new host tensor equal to ``t`` (pinned when ``pin``)."""
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    h.copy_(t.detach(), non_blocking=pin)
    return h


def _device_copy(h: torch.Tensor, device: str) -> torch.Tensor:
    """A new device tensor equal to host tensor ``h``."""
    d = torch.empty(h.shape, dtype=h.dtype, device=device)
    d.copy_(h, non_blocking=str(device).startswith("cuda"))
    return d


class MemoryPools:
    """The device pool's capacity and the host pool of one worker.

    Args:
        meter: the worker's meter (it accounts device bytes and enforces ``capacity``).
        device: the worker's device (``cpu`` or ``cuda:i``); host buffers are pinned on CUDA.

    Attributes:
        modes: model-stage → residency mode (``none``, ``host``, ``drop``).
        host: model-stage → kind → name → host tensor (the host pool).
        offloaded: model-stages whose device copy is currently freed.
    """

    def __init__(self, meter, device: str = "cpu") -> None:
        self.meter, self.device = meter, str(device)
        self.pin = self.device.startswith("cuda")
        self.modes: dict[str, str] = {}
        self.host: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.host_version: dict[str, int] = {}
        self.offloaded: set[str] = set()
        self.resync: set[str] = set()  # dropped derived copies whose host copy is their source's (defer)
        self.reset_stats()

    # ------------------------------------------------------------------ configuration
    @property
    def capacity(self) -> int | None:
        return self.meter.capacity

    def set_capacity(self, nbytes: int | None) -> None:
        """Device-pool capacity in bytes (None or 0: unlimited).

        Raises:
            ValueError: negative, or below what is resident now.
        """
        if nbytes is not None and (isinstance(nbytes, bool) or int(nbytes) < 0):
            raise ValueError(f"device capacity must be a non-negative number of bytes, got {nbytes!r}")
        cap = int(nbytes) if nbytes else None
        if cap is not None and self.meter.device_bytes > cap:
            raise ValueError(f"device capacity {cap} B is below the {self.meter.device_bytes} B already resident")
        self.meter.capacity = cap

    def set_mode(self, model_stage: str, mode: str) -> None:
        """Residency mode of ``model_stage`` while idle.

        Raises:
            ValueError: a mode outside :data:`RESIDENCY_MODES`.
        """
        if mode not in RESIDENCY_MODES:
            raise ValueError(f"model-stage {model_stage}: offload {mode!r} is not executed by the runtime; "
                             f"valid: {list(RESIDENCY_MODES)}")
        self.modes[model_stage] = mode

    def forget(self, model_stage: str) -> None:
        """Drop the host copy and mode of a model-stage whose engine is gone."""
        self.host.pop(model_stage, None)
        self.host_version.pop(model_stage, None)
        self.offloaded.discard(model_stage)
        self.resync.discard(model_stage)
        self.modes.pop(model_stage, None)

    def reset_stats(self) -> None:
        self.moved = {"offload_bytes": 0, "offload_s": 0.0, "restore_bytes": 0, "restore_s": 0.0,
                      "offloads": 0, "restores": 0, "resync_bytes": 0, "resync_s": 0.0, "resyncs": 0}

    def stats(self) -> dict:
        """``offload_bytes``/``restore_bytes`` (bytes copied device → host / host → device),
        ``offload_s``/``restore_s`` (seconds), their counts, ``resync_bytes``/``resync_s``/``resyncs``
        (deferred weight syncs: a derived copy filled from its source's host copy, :meth:`defer`),
        ``host_bytes`` (the host pool now),
        ``device_bytes`` (accounted resident now) and ``capacity`` (bytes or None)."""
        host = sum(t.numel() * t.element_size() for kinds in self.host.values() for d in kinds.values()
                   for t in d.values())
        return {**self.moved, "host_bytes": host, "device_bytes": self.meter.device_bytes, "capacity": self.capacity}

    # ------------------------------------------------------------------ turn-taking
    def make_room(self, engines: dict, running: set[str] | frozenset) -> None:
        """Offload every resident model-stage in ``engines`` that is not in ``running`` and whose mode
        is ``host`` or ``drop`` (called before a model-stage's turn, or before one is built)."""
        for ms, e in engines.items():
            if ms not in running and ms not in self.offloaded and self.modes.get(ms, "none") != "none":
                self.offload(ms, e)

    def activate(self, engines: dict, names, overwritten=()) -> None:
        """Make ``names`` resident (restoring those offloaded), after making room for them; those in
        ``overwritten`` get device buffers without the copy from host (the caller rewrites every
        tensor: a weight sync into a derived copy, ``worker/core.py``)."""
        names = {n for n in names if n in engines}
        self.make_room(engines, names)
        for n in sorted(names):
            if n in self.offloaded:
                self.restore(n, engines[n], copy=n not in overwritten)

    def restore_all(self, engines: dict) -> None:
        """Restore every offloaded model-stage (before a transition or checkpoint reads the engines)."""
        for ms in sorted(self.offloaded & set(engines)):
            self.restore(ms, engines[ms])

    def params_of(self, model_stage: str, engine) -> dict[str, torch.Tensor]:
        """name → ``engine``'s parameters where they are now: its host copy when offloaded, else the
        device tensors (no copy)."""
        if model_stage in self.offloaded:
            return self.host[model_stage]["params"]
        return {n: w.detach() for n, w in engine.model.params.items()}

    def defer(self, dst: str, engine, src: str, engines: dict, version: int) -> bool:
        """A weight sync from ``src`` into the dropped derived copy ``dst`` (same parameter shards on
        this worker), deferred to ``dst``'s turn, as the cost model assumes of a dropped derived copy
        (re-synced, never offloaded; verl syncs its rollout engine when rollout starts): idle
        model-stages are offloaded first (``make_room``; ``src`` would be at the next turn anyway),
        then ``dst``'s host copy becomes the references to ``src``'s host copy of its parameters (no
        bytes copied; ``src``'s later updates make new device tensors, so they keep the synced values),
        labelled ``version``. Its next restore copies them onto the device, counted as ``resync_bytes``.

        Returns:
            False (nothing more done) unless ``dst`` is ``drop`` and offloaded with a host copy,
            ``src`` offloads and ends up offloaded, and their parameters match by name, shape and dtype.
        """
        if self.modes.get(dst) != "drop" or self.modes.get(src, "none") == "none":
            return False
        self.make_room(engines, set())
        held = self.host.get(src, {}).get("params") if src in self.offloaded else None
        mine = self.host.get(dst, {}).get("params")  # the offloaded copy's own host tensors: shapes, dtypes
        if held is None or mine is None or dst not in self.offloaded or set(held) != set(mine) or any(
                tuple(held[n].shape) != tuple(w.shape) or held[n].dtype != w.dtype for n, w in mine.items()):
            return False
        self.host[dst], self.host_version[dst] = {"params": dict(held)}, int(version)
        self.resync.add(dst)
        return True

    # ------------------------------------------------------------------ the copies
    @staticmethod
    def _slots(engine) -> dict[str, dict[str, tuple]]:
        """kind → name → (getter, setter) of every state tensor of ``engine`` (parameters by their
        ``.data``, so the parameter objects stay; other kinds by their entry in the engine's own dict,
        which ``Engine.state_tensors`` returns itself)."""
        out: dict[str, dict[str, tuple]] = {}
        for kind, d in engine.state_tensors().items():
            slots = {}
            for n in d:
                if kind == "params":  # a ZeRO-3 engine's are its slice leaves (worker/zero3.py)
                    w = engine.model.params[n] if n in engine.model.params else d[n]
                    slots[n] = (lambda w=w: w.data, lambda t, w=w: setattr(w, "data", t))
                else:
                    slots[n] = (lambda d=d, n=n: d[n], lambda t, d=d, n=n: d.__setitem__(n, t))
            out[kind] = slots
        return out

    def offload(self, model_stage: str, engine) -> int:
        """Copy ``engine``'s state into the host pool (mode ``host``; ``drop``: only when it changed
        since the host copy) and free the device copy; returns bytes copied."""
        if model_stage in self.offloaded:
            return 0
        mode = self.modes.get(model_stage, "host")
        fresh = mode == "drop" and self.host_version.get(model_stage) == engine.version and model_stage in self.host
        t0 = time.perf_counter()
        moved = 0
        host = self.host.get(model_stage, {}) if fresh else {}
        for kind, slots in self._slots(engine).items():
            for n, (get, put) in slots.items():
                t = get()
                if not fresh:
                    host.setdefault(kind, {})[n] = _host_copy(t, self.pin)
                    moved += t.numel() * t.element_size()
                put(torch.empty(0, dtype=t.dtype, device=t.device))
        _sync(self.device)
        self.host[model_stage], self.host_version[model_stage] = host, engine.version
        self.offloaded.add(model_stage)
        self.meter.set_static(f"params:{id(engine)}", 0)
        self.moved["offload_bytes"] += moved
        self.moved["offload_s"] += time.perf_counter() - t0
        self.moved["offloads"] += 1
        return moved

    def restore(self, model_stage: str, engine, copy: bool = True) -> int:
        """Copy ``engine``'s state back from the host pool into new device tensors (accounted against
        the capacity first); returns bytes copied. ``host`` mode frees the host copy afterwards;
        ``drop`` keeps it. ``copy=False``: new device buffers of the same shapes, left unset (their
        contents are about to be overwritten), 0 bytes copied.

        Raises:
            DeviceMemoryError: the state does not fit next to what is resident.
        """
        if model_stage not in self.offloaded:
            return 0
        host = self.host[model_stage]
        nbytes = sum(t.numel() * t.element_size() for d in host.values() for t in d.values())
        self.meter.set_static(f"params:{id(engine)}", nbytes)  # raises if it does not fit
        t0 = time.perf_counter()
        for kind, slots in self._slots(engine).items():
            for n, (_, put) in slots.items():
                h = host[kind][n]
                put(_device_copy(h, self.device) if copy else torch.empty(h.shape, dtype=h.dtype, device=self.device))
        _sync(self.device)
        self.offloaded.discard(model_stage)
        if self.modes.get(model_stage, "host") != "drop":
            self.host.pop(model_stage, None)
            self.host_version.pop(model_stage, None)
        moved = nbytes if copy else 0
        kind = "resync" if model_stage in self.resync else "restore"  # a deferred weight sync (defer)
        self.resync.discard(model_stage)
        self.moved[f"{kind}_bytes"] += moved
        self.moved[f"{kind}_s"] += time.perf_counter() - t0
        self.moved[f"{kind}s"] += 1
        return moved
