"""The worker side of surviving faults (DESIGN.md §4.9): heartbeats, a local rollback point, fault injection.

:class:`FaultTolerantWorker` is the :class:`~nereus.runtime.worker.core.WorkerCore` every Ray worker
of a run is (:func:`fault_tolerant_class`). The driver side (:func:`~nereus.runtime.run.faults.monitored_get`:
heartbeat rounds, killing a hung worker; recovery in ``run/adaptive.py``) is in
:mod:`nereus.runtime.run.faults`.

* **Heartbeats.** Each worker answers :meth:`FaultTolerantWorker.heartbeat` in Ray's ``control``
  concurrency group, a thread of its own, so a worker busy in a long collective still answers while a
  dead process (Ray actor death) or a hung one (stopped, deadlocked, or holding the GIL) does not.
  :func:`monitored_get` waits for a batch of remote calls and, every ``poll_s``, pings every live
  worker; a worker that is dead, or silent for ``hang_timeout_s``, is killed (``ray.kill``), which
  closes its TCP connections so every surviving worker blocked in a gloo collective with it fails at
  once instead of waiting for the group timeout (its communicators are dropped with the engines
  during recovery). It raises :class:`WorkerLost` naming the lost workers and the detection time.
* **Rollback point.** At every safe boundary (before a step, before a transition) each worker copies
  the state of every engine it holds into local memory (:meth:`FaultTolerantWorker.snapshot`: the
  parameter shards, Adam moments and counters, tagged with their EMU uid). This is the state the
  interrupted step or transition started from; no byte of it leaves the worker. On a GPU it would sit
  in pinned host memory, as Gemini keeps in-memory checkpoints (it is a full extra copy of the
  worker's state: the price of re-running a step without a storage round trip).
* **Fault injection** (:meth:`FaultTolerantWorker.arm`, for tests and ``benchmarks/bench_faults.py``):
  a worker is killed, stopped or slowed at one of :data:`FAULT_POINTS`.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from nereus.runtime.transit.residency import snapshot_meta, unit_tensors
from nereus.runtime.transit.worker_side import Unit
from nereus.runtime.worker.core import WorkerCore
from nereus.runtime.worker.failures import WorkerFailure

__all__ = ["FaultTolerantWorker", "fault_tolerant_class", "FAULT_POINTS"]


def _clone_tensors(tensors: dict) -> dict:
    return {k: {n: t.detach().clone() for n, t in d.items()} for k, d in tensors.items()}


class FaultTolerantWorker(WorkerCore):
    """:class:`~nereus.runtime.worker.core.WorkerCore` with heartbeats and a local rollback point."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snap: dict[str, Unit] = {}
        self.meter.abort = threading.Event()  # set by cancel: releases a rendezvous (comm/rendezvous.py)
        self._moved_on = threading.Event()  # set by every call after a dcp_save (fault timing)

    def heartbeat(self) -> dict:
        """Answered in the ``control`` concurrency group, even while the worker is in a collective.

        Returns:
            ``{"worker", "pid", "time", "busy": the watched call running or None (a compute call's
            method name; ``transition_run:<kind>:<pid>`` inside a transition primitive,
            ``transition_finish``; ``dcp_save`` inside a synchronous checkpoint write, ``dcp_wait``
            while it waits for its background write),
            "ops": ops timed so far (``Meter.ops``: every GEMM, attention and collective), "waiting":
            the communication it waits in now (``Meter.waiting``) or None}``: the driver's progress
            check (``run/faults.py``) declares a worker that is busy, not waiting for peers, and has
            timed no op for its bound slow, and recovers from it as from a hung one.
        """
        busy = getattr(self, "_busy", None)
        return {"worker": self.id, "pid": os.getpid(), "time": time.time(), "busy": busy,
                "ops": int(getattr(self.meter, "ops", 0)), "waiting": getattr(self.meter, "waiting", None)}

    def snapshot(self) -> list[str]:
        """Copy every engine's state into local memory as the rollback point (module docstring).

        Returns:
            uids of the EMUs snapshotted (``"<model_stage>#<replica>"``).
        """
        self._moved_on.set()
        snap = {}
        for ms, e in self.engines.items():
            meta = snapshot_meta(ms, e, self.built.get(ms, {}))  # ZeRO groups and host copies as phi names them
            counters = {k: int(getattr(e, k)) for k in ("step", "update_count", "version", "policy_version",
                                                        "position")}
            # every kind, bf16's master too; an offloaded engine's state is its host copy
            held = self.pools.host[ms] if ms in self.pools.offloaded else e.state_tensors()
            snap[ms] = Unit(meta, _clone_tensors(unit_tensors(e, meta, self.id, held)), counters)  # as the executor holds them
        self.snap = snap
        return sorted(u.meta.uid for u in snap.values())

    def restore(self, intact: list[str]) -> list[str]:
        """Roll back to the snapshot: drop every engine, unit and communicator, and hold (as units, for
        the live executor) copies of the snapshot's EMUs whose uid is in ``intact``.

        Returns:
            uids of the units now held.
        """
        self._cancelled = False
        self.meter.abort.clear()
        for ms in list(self.engines):
            self.destroy(ms)
        self.groups.clear()
        self.transit.comms.clear()
        self.transit.units.clear()
        keep = set(intact)
        for u in self.snap.values():
            if u.meta.uid in keep:
                self.transit.units[u.meta.uid] = Unit(u.meta, _clone_tensors(u.tensors), dict(u.counters))
        return sorted(self.transit.units)

    # ------------------------------------------------------------------ fault injection
    def arm(self, method: str, how: str = "kill", skip: int = 0) -> None:
        """Fail inside the next call of ``method`` (after ``skip`` calls of it): ``kill`` exits the
        process, ``stop`` SIGSTOPs it (a hang nothing answers), ``slow:<seconds>`` sleeps that long
        while still answering heartbeats (a slow but alive peer), ``late:<seconds>`` exits that long
        after the call began (a second fault a moment after another). Its peers are then in the middle of
        the same collective phase (tests and ``benchmarks/bench_faults.py``). A ``late`` fault still
        armed when a :meth:`cancel` comes (another worker was lost first, so the call it waits for
        will be refused) goes off that long after the cancel instead, while the driver recovers: a
        second failure a moment after the first one, whichever call it was armed for.

        Raises:
            ValueError: an unknown method or ``how``.
        """
        if method not in FAULT_POINTS:
            raise ValueError(f"fault point {method!r} is not one of {FAULT_POINTS}")
        if how not in ("kill", "stop") and not how.startswith(("slow:", "late:")):
            raise ValueError(f"fault 'how' must be 'kill', 'stop', 'slow:<seconds>' or 'late:<seconds>', got {how!r}")
        self._armed = (method, how, int(skip))

    def cancel(self) -> None:
        """Refuse every queued call until the next :meth:`restore` (sent in the ``control`` group
        when a peer is lost, so calls queued behind a failed one do not each wait for a
        communicator timeout on the lost peer), and release the rendezvous the running call waits in
        (``comm/rendezvous.py``: it raises ``CommError`` at once instead of waiting for the group
        timeout for a member that will never arrive). It also drops every communicator held outside
        the engines (the transitions' cache): a peer blocked in a collective with this worker, whose
        own part of it is now refused here, fails at once when the idle communicator's sockets close,
        not at the group timeout (a recovery's transition waited 15 s for it; a communicator in use by
        a running call lives until that call ends). A ``late`` fault still armed goes off from now
        (:meth:`arm`)."""
        self._cancelled = True
        self.meter.abort.set()
        self.transit.comms.clear()  # the rollback rebuilds every communicator anyway (restore)
        self.groups.clear()
        armed = getattr(self, "_armed", None)
        if armed and armed[1].startswith("late:"):  # its call will be refused: it goes off from now (arm)
            self._armed = None
            t = threading.Timer(float(armed[1].split(":", 1)[1]), os._exit, (1,))
            t.daemon = True
            t.start()

    def _take(self, method: str) -> str | None:
        """``how`` if a fault armed for ``method`` fires in this call (the arm is then used up)."""
        armed = getattr(self, "_armed", None)
        if not armed or armed[0] != method:
            return None
        if armed[2] > 0:
            self._armed = (armed[0], armed[1], armed[2] - 1)
            return None
        self._armed = None
        return armed[1]

    @staticmethod
    def _fire(how: str) -> None:
        if how.startswith(("slow:", "late:")):
            time.sleep(float(how.split(":", 1)[1]))
            if how.startswith("slow:"):
                return
        if how == "stop":
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(1)

    @contextmanager
    def _compute(self, phase: str, point: str | None = None):
        """A call the progress check watches (a compute call, a transition primitive, a checkpoint
        write): its fault point (``point``, default ``phase``) fires inside it, and the heartbeat
        reports ``phase`` as busy (for a primitive ``transition_run:<kind>:<pid>``)."""
        self._busy = phase
        try:
            self._trip(point or phase)
            yield
        finally:
            self._busy = None

    def _trip(self, method: str) -> None:
        self._moved_on.set()
        if getattr(self, "_cancelled", False):
            raise WorkerFailure(f"worker {self.id}: {method} cancelled: a peer was lost; awaiting recovery")
        how = self._take(method)
        if how is not None:
            self._fire(how)

    def generate(self, *a, **k):
        with self._compute("generate"):
            return super().generate(*a, **k)

    def logprobs(self, *a, **k):
        with self._compute("logprobs"):
            return super().logprobs(*a, **k)

    def values(self, *a, **k):
        with self._compute("values"):
            return super().values(*a, **k)

    def train_fields(self, *a, **k):
        with self._compute("train_fields"):
            return super().train_fields(*a, **k)

    def sync_weights(self, *a, **k):
        with self._compute("sync_weights"):
            return super().sync_weights(*a, **k)

    def transition_run(self, spec, move, *a, **k):
        with self._compute(f"transition_run:{move.kind}:{move.pid}", point="transition_run"):
            return super().transition_run(spec, move, *a, **k)

    def build(self, *a, **k):
        self._trip("build")
        return super().build(*a, **k)

    def transition_finish(self, *a, **k):
        with self._compute("transition_finish"):
            return super().transition_finish(*a, **k)

    def dcp_save(self, model_stages, directory: str, background: bool = False) -> dict:
        """A fault armed for ``dcp_save`` fires when the files start being written: inside this call
        for a synchronous save, in the background thread (after this call returned, while the
        worker goes on) for an asynchronous one."""
        if getattr(self, "_cancelled", False):
            raise WorkerFailure(f"worker {self.id}: dcp_save cancelled: a peer was lost; awaiting recovery")
        how = self._take("dcp_save")
        hook = None
        if how is not None:
            self._moved_on.clear()

            def hook(phase: str) -> None:
                if phase != "metadata":  # fire in the middle of the write: data written, not readable yet
                    return
                if background:  # and once this worker has gone on to its next call (the next boundary)
                    self._moved_on.wait(timeout=5.0)
                self._fire(how)
        self._busy = "dcp_save"  # a synchronous save writes in this call: the progress check watches it
        try:
            return self._dcp_save(model_stages, directory, background, hook)
        finally:
            self._busy = None

    def dcp_wait(self, ignore_errors: bool = False) -> dict:
        """:meth:`~nereus.runtime.durable.worker_calls.CheckpointCallsMixin.dcp_wait`, reported busy
        (``dcp_wait``) while it waits for this worker's background write: a write that makes no progress
        for the bound is declared slow like a stalled compute call."""
        outer, self._busy = getattr(self, "_busy", None), "dcp_wait"
        try:
            return super().dcp_wait(ignore_errors)
        finally:
            self._busy = outer


#: where a fault can be injected: the worker method it fires in (generation, forward for log-probs or
#: values, forward+backward+optimizer step, weight sync, a transition primitive, a checkpoint save)
FAULT_POINTS = ("generate", "logprobs", "values", "train_fields", "sync_weights", "transition_run", "dcp_save")


def fault_tolerant_class(num_gpus: float = 0):
    """:class:`FaultTolerantWorker` as a Ray actor taking one device, with a ``control`` concurrency
    group for heartbeats (calls run there with ``.options(concurrency_group="control")``)."""
    import ray

    return ray.remote(num_cpus=1, num_gpus=num_gpus, max_restarts=0,
                      concurrency_groups={"control": 1})(FaultTolerantWorker)
