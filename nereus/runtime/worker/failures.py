"""How a worker's failure reaches the driver: the two exceptions of a run (DESIGN.md §4.9).

:class:`WorkerFailure` is raised by a worker for a call it cancels (a peer was lost; it awaits
recovery) and by the driver's waits for a call that failed or timed out
(:mod:`nereus.runtime.run.pool`); :class:`WorkerLost` by the driver's heartbeat watch
(:func:`nereus.runtime.run.faults.monitored_get`) for workers that died or hung. Both sides import
them from here, so a worker never imports driver code.
"""

from __future__ import annotations

__all__ = ["WorkerFailure", "WorkerLost", "AllWorkersLost"]


class WorkerFailure(RuntimeError):
    """A worker died, a collective timed out, or a remote call failed."""


class WorkerLost(WorkerFailure):
    """Workers died or hung during a remote call.

    Attributes:
        lost: ids of the workers lost (killed if they were hung).
        detect_s: seconds from the start of the wait to the detection.
        hung: ids among ``lost`` that were alive but silent.
    """

    def __init__(self, message: str, lost: list[int], detect_s: float, hung: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost, self.detect_s, self.hung = sorted(lost), float(detect_s), sorted(hung or [])


class AllWorkersLost(WorkerFailure):
    """Every worker of the run was lost: no survivor holds state to roll back onto, so no recovery
    attempt can help (``run/recovery.py`` raises it at once instead of retrying); the durable
    checkpoint on disk is untouched and ``nereus run --resume`` continues from it."""
