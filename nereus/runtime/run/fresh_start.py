"""Recovering before the first durable checkpoint exists (issue 30): restart from step 0's initial state.

A run takes its first checkpoint before step 0 (``AdaptiveRun.run``); a worker lost while that save is
written (or after it was abandoned, e.g. a full disk) leaves no checkpoint to restore, so a recovery
that cannot go live (a training model-stage lost every replica) has nothing to read. At step 0 with
no update applied the state needs none: every engine starts from its seed
(``model/sharding.py``: an initial value depends on ``(spec, seed, name, position)`` only, never on
the layout, ``tests/test_runtime_init.py::test_shards_equal_slices_of_full``; a model with
``spec.checkpoint`` is read from the same files), Adam's moments are zero
and every counter (step, update count, versions, position) is 0 (``worker/engine.py``). Rebuilding
every model-stage in the target layout from its seed (:func:`restart_initial`) therefore reproduces
the boundary's state exactly and loses no step (``tests/test_runtime_faults.py``: such a run ends bit for
bit at a fault-free run started on the survivors). Past step 0 (or in a resumed run) it does not: the run
ends with :class:`NoCheckpoint`, one line naming what was lost.

:func:`restore_or_rebuild` picks the source for every path that restarts from stored state: a
recovery that cannot go live (``run/recovery.py``) and a decision that must restart rather than move
live (``AdaptiveRun._apply``: a departure without notice took a training model-stage's last
replica, or no live DAG exists). The latter read ``current`` unconditionally and crashed with a raw
``FileNotFoundError`` when no checkpoint had been completed yet (the first save abandoned: a full
disk, a worker lost in every attempt); now, while every training model-stage still has an intact
replica, the engines' live state is re-laid out through the driver (``run/relayout.py``, exact),
and otherwise the run rebuilds step 0 from the seeds or ends with one line.
"""

from __future__ import annotations

import os
import time

from nereus.runtime.worker.failures import WorkerFailure

__all__ = ["NoCheckpoint", "RESTART_FROM", "has_checkpoint", "initial_state_reproducible", "restart_initial",
           "restore_or_rebuild"]

#: what a restart of each source (:func:`restore_or_rebuild`) started from, for the run's log line
RESTART_FROM = {"checkpoint": "the durable checkpoint",
                "relayout": "the live state (no checkpoint written yet), re-laid out through the driver,",
                "initial": "the seeds (no checkpoint written yet)"}


class NoCheckpoint(WorkerFailure):
    """A recovery needs the durable checkpoint but none was written yet, and the state since step 0
    cannot be rebuilt; the message is one line naming the workers lost and what went with them."""


def has_checkpoint(directory: str) -> bool:
    """Whether ``directory`` (``<checkpoint_dir>/current``) holds a complete checkpoint's ``driver.json``
    (``durable.restart`` reads it first)."""
    return os.path.isfile(os.path.join(directory, "driver.json"))


def initial_state_reproducible(boundary: dict, resumed: bool) -> bool:
    """Whether the rollback point ``boundary`` (``{"step_index", "updates", ...}``, ``RecoveryMixin._mark``)
    is the run's initial state, which :func:`restart_initial` rebuilds exactly: step 0, no optimizer
    update, and the weights came from the seeds (not ``resumed`` from a checkpoint)."""
    return not resumed and int(boundary["step_index"]) == 0 and int(boundary["updates"]) == 0


def restart_initial(driver, target) -> dict:
    """Tear down every model-stage's engines on the live workers, take ``target``
    (``RLDriver.set_plan``) and rebuild every model-stage in its target layout from its seed, as
    ``RLDriver.build_engines`` does at start-up (the caller starts vLLM engines, if any); the step
    index and update counter are 0.

    Returns:
        ``{"seconds", "teardown_s", "build_s"}`` (driver wall-clock seconds).

    Raises:
        ValueError: ``target`` is invalid or uses workers that left the pool (nothing torn down then).
        WorkerLost: a worker was lost during the rebuild (``run/faults.py``).
    """
    t0 = time.perf_counter()
    gone = sorted({g for c in target.candidates for g in c.gpus if g >= len(driver.workers)
                   or driver.workers[g] is None})
    if gone:
        raise ValueError(f"restart from step 0: target uses workers {gone} that are not in the pool")
    driver.set_plan(target)  # validates first: on ValueError nothing has changed
    live = [i for i, w in enumerate(driver.workers) if w is not None]
    driver._get([driver.workers[i].destroy.remote(ms.name) for ms in driver.wf.model_stages for i in live],
                "restart teardown")
    t1 = time.perf_counter()
    driver.build_from_seeds("restart from step 0: building")  # the start-up calls (RLDriver.build_engines)
    driver.step_index = driver.updates = 0
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "teardown_s": t1 - t0, "build_s": t2 - t1}


def restore_or_rebuild(run, target, why: str, live_state: bool = False) -> tuple[dict, str]:
    """Bring ``run``'s driver to ``target`` from stored state: the last complete durable checkpoint
    (``durable.restart``); without one, the engines' live state re-laid out through the driver when
    ``live_state`` (every training model-stage has an intact replica whose engines still hold their
    state: ``run/relayout.py``, exact, no step lost; not with ``--rollout vllm``, whose engines the
    caller starts); else step 0's initial state rebuilt from the
    seeds (:func:`restart_initial`) when the driver is at it (:func:`initial_state_reproducible`).

    Args:
        run: the :class:`~nereus.runtime.run.adaptive.AdaptiveRun` (its ``driver``, ``resume`` and
            ``_ckpt_path()``).
        target: the plan to restart on.
        why: what made the restart necessary, for the :class:`NoCheckpoint` message.
        live_state: the engines hold the boundary's state (not after a rollback, which drops them).

    Returns:
        ``(info, source)``: ``info`` has ``"seconds"``; ``source`` is ``"checkpoint"``, ``"relayout"``
        or ``"initial"``.

    Raises:
        NoCheckpoint: none of the three applies (one line with ``why``).
        ValueError: ``target`` is invalid or uses workers that left (from the restart called).
        WorkerLost: a worker was lost during the restart.
    """
    from nereus.runtime.durable import driver_side as durable
    from nereus.runtime.run.relayout import relayout

    d = run.driver
    if has_checkpoint(run._ckpt_path()):
        return durable.restart(d, run._ckpt_path(), target), "checkpoint"
    if live_state and d.cfg.rollout != "vllm":  # (relayout starts vLLM engines itself; the caller does here)
        return relayout(d, target), "relayout"
    if initial_state_reproducible({"step_index": d.step_index, "updates": d.updates}, run.resume):
        return restart_initial(d, target), "initial"
    raise NoCheckpoint(f"step {d.step_index}: {why}, and no checkpoint was written to restore")
