"""The end of an adaptive run (``AdaptiveRun.run``'s ``finally``): the save in flight, the engines,
the pool and the temporary checkpoint directory, with every wait bounded when the run was
interrupted.

After an error the save in flight is abandoned the usual way (``CheckpointingMixin._abandon_save``:
its writers' background writes end, then its slot goes; ``current`` stays), the engines are
dropped (``RLDriver.close``) and a pool the run started is stopped.

After Ctrl-C or SIGTERM (``KeyboardInterrupt``, the CLI's ``Terminated``, ``SystemExit``) the user
wants the prompt back, and those waits are not bounded by anything the user chose: the interrupted
step's calls are still queued on the workers ahead of the clean-up's. One that the interrupt cut
off half-submitted (its call reached some workers of a collective, not the others) blocks those
workers until the communicator timeout, and a worker waiting in a collective answers heartbeats
and makes no progress by design, so neither check of ``run/faults.py`` ends it: the abandoned
save's wait on it ran to its 4x ``--timeout`` bound (240 s by default) before the one-line message
was printed (``tests/test_cli_run_signals.py`` once saw no line for 120 s under heavy load). So on
an interrupt:

* a pool the run started is stopped first (``WorkerPool.close``: its actors killed, nothing left to
  write into the abandoned slot), then the engines (no live worker left to call) and the slot;
* with a caller's pool (it outlives the run), the writers get :data:`INTERRUPT_WAIT_S` seconds in
  all to end their background writes before the slot is removed, and the engines are dropped with
  the same bound.

``current``, the last complete checkpoint, is never touched (``durable/store.py``: the slot becomes
current with one rename only when complete).
"""

from __future__ import annotations

import shutil
import time

from nereus.runtime.worker.failures import WorkerFailure

__all__ = ["INTERRUPT_WAIT_S", "end_run", "is_interrupt"]

#: seconds an interrupted run's clean-up waits on a caller's workers, in all (their background
#: writes, then the engines' release); an own pool is killed without waiting
INTERRUPT_WAIT_S = 10.0


def is_interrupt(e: BaseException | None) -> bool:
    """``e`` is Ctrl-C or a termination (``KeyboardInterrupt``, its subclass the CLI's ``Terminated``,
    or ``SystemExit``, which Ray's SIGTERM handler raises), not a failure of the run."""
    return isinstance(e, (KeyboardInterrupt, SystemExit))


def end_run(run, driver, pool, own: bool, completed: bool, interrupted: bool = False) -> None:
    """Clean up after :meth:`AdaptiveRun.run` (module docstring).

    Args:
        run: the :class:`~nereus.runtime.run.adaptive.AdaptiveRun` (its ``_pending`` save,
            ``_abandon_save``, ``_drop_own_checkpoints`` and ``log``).
        driver: its :class:`~nereus.runtime.run.driver.RLDriver`.
        pool: its :class:`~nereus.runtime.run.pool.WorkerPool`.
        own: the run started ``pool`` (and stops it).
        completed: every step ran (the temporary checkpoint directory may go).
        interrupted: Ctrl-C or SIGTERM ended the run (:func:`is_interrupt`): no unbounded wait.
    """
    pending, run._pending = run._pending, None
    if not interrupted:
        if pending is not None:  # an error ended the run: let the writers finish, keep `current`
            try:
                run._abandon_save(pending, "the run ended before it was complete")
            except Exception:  # noqa: BLE001  (never hide the error that ended the run)
                pass
        driver.close()
        if own:
            pool.close()
        run._drop_own_checkpoints(completed)
        return
    if own:
        pool.close()  # every actor killed: no write lands in the abandoned slot after this
    elif pending is not None:
        _wait_writers(driver, INTERRUPT_WAIT_S)
    if pending is not None:
        shutil.rmtree(pending.directory, ignore_errors=True)
        run.log(f"  checkpoint of step {pending.meta.get('step_index')} abandoned (the run was interrupted); "
                f"the checkpoint of step {run.ckpt_step} stays current")
    _close_bounded(driver, INTERRUPT_WAIT_S)
    run._drop_own_checkpoints(completed)


def _wait_writers(driver, timeout_s: float) -> None:
    """At most ``timeout_s`` seconds for every live worker's background checkpoint write to end."""
    import ray

    futures = [w.dcp_wait.remote(True) for w in driver.workers if w is not None]
    if futures:
        ray.wait(futures, num_returns=len(futures), timeout=timeout_s)


def _close_bounded(driver, timeout_s: float) -> None:
    """``driver.close()`` whose waits on live workers (a caller's pool) end ``timeout_s`` seconds from
    now in all (``RLDriver._get`` waits 4x ``--timeout`` by default, the engines' release 30 s): not
    worth more of the user's time after an interrupt; the pool's owner stops the workers."""
    driver._get = _deadline_get(driver._get, time.perf_counter() + timeout_s)  # this call only
    try:
        driver.close()
    except WorkerFailure:
        pass
    finally:
        driver.__dict__.pop("_get", None)


def _deadline_get(get, deadline: float):
    """``get`` (``RLDriver._get``) with each wait's timeout cut to what is left before ``deadline``."""

    def bounded(futures, what: str, timeout: float | None = None):
        left = max(0.1, deadline - time.perf_counter())
        return get(futures, what, min(timeout or left, left))

    return bounded
