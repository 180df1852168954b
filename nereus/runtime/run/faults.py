"""Surviving a worker that dies or hangs in the middle of a step (DESIGN.md §4.9).

The driver side; the worker side (heartbeats answered in a thread of their own, the rollback point,
fault injection) is :mod:`nereus.runtime.worker.fault_tolerant`.

* **Detection.** :func:`monitored_get` waits for a batch of remote calls and, every ``poll_s``, pings
  every live worker (:func:`probe`); a worker that is dead, or silent for ``hang_timeout_s``, is
  killed (``ray.kill``), which closes its TCP connections so every surviving worker blocked in a gloo
  collective with it fails at once instead of waiting for the group timeout (its communicators are
  dropped with the engines during recovery). A survivor waiting in a group *rendezvous* for it (whose
  store wait no socket ends) is released by the cancel every survivor then gets
  (``FaultTolerantWorker.cancel`` sets the abort event ``comm/rendezvous.py`` polls): its call fails
  at once and the recovery starts, instead of after the communicator timeout. It raises :class:`WorkerLost` naming the lost workers
  and the detection time.
* **Recovery** (driven by ``run/adaptive.py``): every survivor rolls back
  (:meth:`FaultTolerantWorker.restore`: engines, units and communicators dropped, the snapshot's
  units of intact EMUs kept), the controller replans on the surviving pool (urgent path), and the
  live executor builds the target from those units (``TransitionExecutor.execute(adopt=False)``).
  The step then re-runs from its start with the same samples. Only a training model-stage that lost
  every replica falls back to the last durable checkpoint (``durable/driver_side.py``).

**Slow peers.** A worker that is slow but alive answers heartbeats, so silence never catches it.
Each heartbeat also reports the watched call the worker is in (a compute call, a transition
primitive ``transition_run:<kind>:<pid>`` or its ``transition_finish``, a synchronous checkpoint
write ``dcp_save``, or ``dcp_wait`` for a background one), how many ops it has timed
(``Meter.ops``) and whether it waits for peers (``Meter.waiting``). When the pool has a
``progress_bound_s`` (the adaptive run sets it to ``max(hang_timeout, 4 × the predicted step
time)``, the cost model's ``l_step`` of the plan in effect, or the last measured step if longer), a
worker busy outside any communication wait whose op count has not moved for that long is declared
lost (``WorkerLost``, its ``slow`` ids), killed, and recovered from like a hung one. A checkpoint
write (``dcp_save``, ``dcp_wait``) gets the longer of that bound and the pool's ``phase_bounds_s``
(the adaptive run sets ``max(communicator timeout, 4 × the longest checkpoint so far)``): its
duration is the file system's, which a step's time does not bound (a healthy save of the tiny model
took 3.5 s on a loaded machine where a step took under 1 s).

A worker lost in the background write of an asynchronous checkpoint (``durable.begin_save``) is
found the same way by whatever call comes next; the run abandons that checkpoint and keeps the
previous complete one (``AdaptiveRun._complete_save``).
"""

from __future__ import annotations

import time

from nereus.runtime.comm.rendezvous import RELEASED
from nereus.runtime.worker.failures import WorkerFailure, WorkerLost

__all__ = ["WorkerLost", "monitored_get", "probe", "probe_info", "Progress"]

#: extra heartbeat timeouts a probe round waits when no worker answered at all (:func:`probe_info`)
ALL_SILENT_PATIENCE = 3


def probe(workers: list, timeout_s: float) -> tuple[list[int], list[int]]:
    """Ping every live worker's ``control`` group; ``(dead, silent)`` ids within ``timeout_s``."""
    dead, silent, _ = probe_info(workers, timeout_s)
    return dead, silent


def probe_info(workers: list, timeout_s: float) -> tuple[list[int], list[int], dict[int, dict]]:
    """:func:`probe`, with each answering worker's heartbeat (``FaultTolerantWorker.heartbeat``:
    ``busy``, ``ops``, ``waiting``) by id.

    When no live worker answers within ``timeout_s`` (none dead, all silent), the heartbeats get
    ``ALL_SILENT_PATIENCE × timeout_s`` more before any is called silent: heartbeats run in a thread
    of their own on each worker, so every worker hanging at once is far less likely than the
    driver's host being too loaded to collect the answers in time (seen on a 2-core machine at load
    16: every worker of a healthy run declared lost, then ``shared_plan needs at least one
    worker``). Only such a round waits longer; a single silent worker among answering ones is
    called silent after ``timeout_s`` as before.
    """
    import ray

    refs = {w.heartbeat.options(concurrency_group="control").remote(): i for i, w in enumerate(workers)
            if w is not None}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if refs and len(pending) == len(refs):  # nobody answered: the host's load, not every worker hung
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=ALL_SILENT_PATIENCE * timeout_s)
        ready = list(ready) + list(more)
    dead, info = [], {}
    for r in ready:
        try:
            info[refs[r]] = ray.get(r)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            dead.append(refs[r])
    silent = [refs[r] for r in pending]
    return sorted(dead), sorted(silent), info


class Progress:
    """The progress check of one wait (module docstring, "Slow peers"): a worker that is busy in a
    watched call (a compute call, a transition primitive, a checkpoint write), not waiting for peers, and has timed no op (``Meter.ops``) for ``bound_s`` seconds
    makes no progress; its peers that wait in a collective with it would otherwise wait for the
    communicator timeout (4x ``--timeout``, minutes)."""

    def __init__(self, bound_s: float | None, phase_bounds_s: dict[str, float] | None = None) -> None:
        self.bound_s = bound_s
        # a longer bound for some phases, by the phase's first word (``dcp_save``, ``dcp_wait``: a
        # checkpoint write's duration is the disk's and the file system's, not a step's)
        self.phase_bounds_s = dict(phase_bounds_s or {})
        self.seen: dict[int, tuple[int, float]] = {}  # worker -> (ops, since when unchanged)
        self.phase: dict[int, str] = {}  # worker -> the watched call it was last seen busy in

    def stalled(self, info: dict[int, dict], now: float) -> dict[int, float]:
        """``{worker: seconds without progress}`` of the workers past the bound."""
        out = {}
        if self.bound_s is None:
            return out
        for i, hb in info.items():
            if not isinstance(hb, dict) or not hb.get("busy") or hb.get("waiting"):
                self.seen.pop(i, None)
                continue
            ops = int(hb.get("ops", 0))
            prev = self.seen.get(i)
            if prev is None or prev[0] != ops or self.phase.get(i) != hb["busy"]:
                self.seen[i] = (ops, now)
                self.phase[i] = hb["busy"]
            elif now - prev[1] > max(self.bound_s, self.phase_bounds_s.get(hb["busy"].split(":")[0], 0.0)):
                out[i] = now - prev[1]
        return out


def _cancel_all(pool, timeout_s: float) -> None:
    """Cancel the survivors' queued calls and wait for every acknowledgement, so no cancel can land
    after the rollback that clears it."""
    import ray

    refs = [w.cancel.options(concurrency_group="control").remote() for w in pool.workers if w is not None]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def monitored_get(pool, futures, what: str, timeout_s: float, hang_timeout_s: float, poll_s: float = 1.0):
    """``ray.get(futures)`` that detects dead and hung workers (module docstring).

    Args:
        pool: the :class:`~nereus.runtime.run.pool.WorkerPool` (its ``workers`` list; lost ones are
            killed and set to None there).
        timeout_s: overall seconds before giving up (a slow but alive run).
        hang_timeout_s: seconds a worker may leave a heartbeat unanswered.
        poll_s: seconds between heartbeat rounds.

    Raises:
        WorkerLost: a worker died or hung (after every other call has ended or failed).
        WorkerFailure: no loss, but a call failed or the overall timeout passed.
    """
    import ray

    t0 = time.perf_counter()
    pending = list(futures)
    lost: set[int] = set()
    hung: set[int] = set()
    detect = None
    deadline = t0 + timeout_s
    progress = Progress(getattr(pool, "progress_bound_s", None), getattr(pool, "phase_bounds_s", None))
    slow: dict[int, float] = {}
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        if not pending:
            break
        dead, silent, info = probe_info(pool.workers, hang_timeout_s)
        stalled = progress.stalled(info, time.perf_counter())
        slow.update({i: s for i, s in stalled.items() if i not in lost})
        silent = sorted(set(silent) | set(stalled))
        new = set(dead) | set(silent)
        if new - lost:
            detect = detect if detect is not None else time.perf_counter() - t0
            hung |= set(silent)
            for i in sorted(new - lost):
                pool.remove(i, force=True)  # its sockets close: peers in a collective with it fail now
            lost |= new
            _cancel_all(pool, hang_timeout_s)  # calls queued behind a failed one give up at once
        if time.perf_counter() > deadline:
            break
    errors = []
    results = []
    for f in futures:
        try:
            results.append(ray.get(f, timeout=max(1.0, hang_timeout_s)))
        except ray.exceptions.RayActorError as e:
            errors.append(e)
        except ray.exceptions.RayTaskError as e:
            errors.append(e)
        except ray.exceptions.GetTimeoutError as e:
            errors.append(e)
    if errors and not lost:  # a call failed: was it because a worker died?
        dead, silent = probe(pool.workers, hang_timeout_s)
        if dead or silent:
            detect = time.perf_counter() - t0
            hung |= set(silent)
            for i in dead + silent:
                pool.remove(i, force=True)
            lost |= set(dead) | set(silent)
            _cancel_all(pool, hang_timeout_s)
    if lost:
        where = sorted({progress.phase[i] for i in slow if i in progress.phase})
        how = ((f"slow: no progress for {max(slow.values()):.1f}s in {', '.join(where)}" if slow else "hung")
               if hung else "died")
        err = WorkerLost(f"{what}: worker(s) {sorted(lost)} lost ({how}); detected after {detect or 0.0:.2f}s, "
                         f"the calls ended after {time.perf_counter() - t0:.2f}s", sorted(lost), detect or 0.0,
                         sorted(hung))
        err.slow, err.wait_s = sorted(slow), time.perf_counter() - t0
        err.slow_in = where
        err.released = sum(RELEASED in str(e) for e in errors)  # calls a released rendezvous ended
        raise err
    if errors:
        raise WorkerFailure(f"{what}: {str(errors[0])[-600:]}")
    return results
