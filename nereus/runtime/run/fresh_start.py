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
"""

from __future__ import annotations

import os
import time

from nereus.runtime.worker.failures import WorkerFailure

__all__ = ["NoCheckpoint", "has_checkpoint", "initial_state_reproducible", "restart_initial"]


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
