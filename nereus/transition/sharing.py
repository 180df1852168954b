"""Primitives that share CPU cores: a schedule replayed under processor sharing.

Source: ours (issue 26: on the runtime's CPU workers, primitives that run at once on workers that
share physical cores do not all run at their own speed). The greedy schedule (``schedule.py``)
prices primitives on disjoint links as parallel, true on GPUs (each device has its own links, copy
engines and streams). The runtime's CPU workers are single-threaded processes
(``OMP_NUM_THREADS=1``) on a machine with ``cores`` cores: when more workers are busy than there
are cores, the operating system shares the cores among them, each busy worker running at
``cores / busy`` of a core. On a CPU worker a primitive's setup, packing, loopback transfer and
assembly are all its processes' work, so the whole primitive progresses at that rate.

:func:`shared_schedule` keeps the greedy schedule's order (every predecessor edge, and every pair
that the schedule put one after the other on a common port or GPU stays in that order; the
runtime's executor submits in that order, ``runtime/transit/driver_side.py``) and replays it as a
fluid processor-sharing system: a primitive starts when everything ordered before it ended; while
the primitives ``R`` run, each progresses at rate ``min(1, cores / Σ_{q∈R} width_q)`` seconds of
its own duration per second, ``width_q`` the number of workers (GPUs) it runs on. A primitive on
``w > cores`` workers alone takes ``w / cores`` times its duration; ``n`` primitives of width ``w``
at once take ``max(1, n·w / cores)`` times theirs, as if serialized beyond the core count. With
``cores`` infinite the schedule is returned unchanged. The calibration (``calibrate.py``) undoes
the same factor when it reads measured seconds.

With ``dispatch`` > 0, a primitive starts no earlier than ``dispatch`` seconds after each of its DAG
predecessors ended: the runtime's executor submits a primitive's call to each of its workers with
the predecessors' results as arguments, and Ray dispatches the call once they are known (an actor
call per primitive and worker, ``runtime/transit/driver_side.py``). The calibration measures it
as the median of a primitive's last start less the latest end it waited for (``calibrate.py``):
about 0 on the benchmark's 2-core machine, where the gaps between dependent primitives were the
serial workers' own waits, which the replay already has.

Pure: no runtime import.
"""

from __future__ import annotations

import math

from nereus.transition.primitives import Primitive
from nereus.transition.schedule import Schedule, critical_chain
from nereus.transition.staging import HOST_ID

__all__ = ["shared_schedule", "width", "share_factors"]

_EPS = 1e-12


def width(p: Primitive) -> int:
    """Workers (GPUs, host memory excluded) a primitive runs on, at least 1."""
    return max(1, len({g for g in p.gpus if g != HOST_ID}))


def _before(sched: Schedule, nodes: dict[str, Primitive], preds: dict, ports: dict) -> dict[str, set[str]]:
    """pid → pids the replay keeps before it: its predecessors, and the primitives that ended no
    later than it started in ``sched`` and share a port or a GPU with it."""
    gpus = {p: set(n.gpus) for p, n in nodes.items()}
    out = {}
    for p in nodes:
        out[p] = set(preds.get(p, ())) | {
            q for q in nodes if q != p and sched.end[q] <= sched.start[p] + 1e-9
            and (ports.get(q, frozenset()) & ports.get(p, frozenset()) or gpus[q] & gpus[p])}
    return out


def shared_schedule(sched: Schedule, nodes: dict[str, Primitive], preds: dict, ports: dict,
                    dur: dict[str, float], cores: float, dispatch: float = 0.0) -> Schedule:
    """``sched`` replayed with the primitives sharing ``cores`` cores (module docstring).

    Args:
        sched: the greedy schedule (start/end per pid, seconds).
        nodes: pid → primitive (its GPUs give its width).
        preds: pid → predecessor pids (DAG edges).
        ports: pid → ports it holds (``cost.ports``).
        dur: pid → seconds at its own speed (``cost.duration``).
        cores: cores the workers share, > 0; ``inf`` (with ``dispatch`` 0) returns ``sched``.
        dispatch: seconds from a predecessor's end to the start of a primitive that depends on it
            (the runtime's executor: the dependent call on another worker is dispatched once the
            predecessor's result is known, ``CostParams.dispatch_s``), >= 0.

    Returns:
        A :class:`Schedule` with the replayed start/end, makespan and critical chain; ``algo`` is
        ``sched.algo + "+shared"``.

    Raises:
        ValueError: ``cores`` not > 0, or a pid of ``nodes`` missing from ``sched`` or ``dur``.
    """
    if not cores > 0:
        raise ValueError(f"shared_schedule: cores must be > 0, got {cores!r}")
    if not dispatch >= 0:
        raise ValueError(f"shared_schedule: dispatch must be >= 0 seconds, got {dispatch!r}")
    if (math.isinf(cores) and not dispatch) or not nodes:
        return sched
    missing = sorted(p for p in nodes if p not in sched.start or p not in dur)
    if missing:
        raise ValueError(f"shared_schedule: primitives {missing[:3]} have no start or duration")
    before = _before(sched, nodes, preds, ports)
    w = {p: width(n) for p, n in nodes.items()}
    rem = {p: max(0.0, float(dur[p])) for p in nodes}
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    running: set[str] = set()
    t = 0.0
    while len(end) < len(nodes):
        waiting = []  # ready once the dispatch after its last DAG predecessor has passed
        for p in sorted(nodes, key=lambda q: (sched.start[q], q)):
            if p not in start and before[p] <= end.keys():
                at = max((end[q] + dispatch for q in preds.get(p, ()) if q in end), default=0.0)
                if at > t + 1e-12:
                    waiting.append(at)
                    continue
                start[p] = t
                running.add(p)
        done = [p for p in running if rem[p] <= _EPS]
        if not done:
            if not running and not waiting:
                raise ValueError("shared_schedule: the replay is stuck (a cycle in the kept order)")
            rate = min(1.0, cores / sum(w[p] for p in running)) if running else 1.0
            dt = min([rem[p] / rate for p in running] + [a - t for a in waiting])
            t += dt
            for p in running:
                rem[p] -= rate * dt
            done = [p for p in running if rem[p] <= 1e-9]
        for p in done:
            end[p] = t
            running.discard(p)
    chain = critical_chain(start, end, {p: before[p] for p in nodes}, ports)
    return Schedule(start, end, max(end.values(), default=0.0), chain, algo=sched.algo + "+shared")


def share_factors(spans: list[tuple[float, float, int]], cores: float) -> list[float]:
    """How much slower than its own speed each of a transition's measured primitives ran.

    The inverse of :func:`shared_schedule`'s rate, for the calibration: primitive ``i`` ran on
    ``workers_i`` workers over ``[t0_i, t1_i]``; the workers busy during it, averaged over its span,
    are ``Σ_j workers_j · |[t0_i, t1_i] ∩ [t0_j, t1_j]| / (t1_i − t0_i)`` (``j = i`` included), and it
    ran ``max(1, busy / cores)`` times slower. A span of zero length gets 1.

    Args:
        spans: ``(t0, t1, workers)`` per primitive, seconds and a count.
        cores: cores the workers share, > 0 (``inf``: every factor 1).

    Raises:
        ValueError: ``cores`` not > 0.
    """
    if not cores > 0:
        raise ValueError(f"share_factors: cores must be > 0, got {cores!r}")
    out = []
    for a0, a1, _ in spans:
        if a1 - a0 <= _EPS or math.isinf(cores):
            out.append(1.0)
            continue
        busy = sum(k * max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1, k in spans) / (a1 - a0)
        out.append(max(1.0, busy / cores))
    return out
