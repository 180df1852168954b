"""The end of an adaptive run (``run/teardown.py``), with stand-ins for the driver, the pool and the
workers (no Ray cluster): after Ctrl-C / SIGTERM no clean-up wait is unbounded. The case it fixes:
``tests/test_cli_run_signals.py``'s SIGINT variant once printed nothing for 120 s: the abandoned
save's wait sat behind a worker blocked in a collective the interrupt had cut off half-submitted,
up to its 4x ``--timeout`` bound (240 s by default)."""

from __future__ import annotations

import types

import pytest

from nereus.runtime.run import teardown
from nereus.runtime.run.teardown import INTERRUPT_WAIT_S, end_run, is_interrupt


class _Remote:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *a):
        self.log.append(self.name)
        return object()


class _Worker:
    def __init__(self, log):
        self.dcp_wait = _Remote(log, "dcp_wait")


class _Pool:
    def __init__(self, log, n=2):
        self.log = log
        self.workers = [_Worker(log) for _ in range(n)]

    def close(self):
        self.log.append("pool.close")
        for i in range(len(self.workers)):
            self.workers[i] = None


class _Driver:
    """``RLDriver``'s close and _get as the teardown uses them: ``close`` calls ``_get`` on the live
    workers with a 30 s timeout (the engines' destroy), ``_get`` here records the timeout."""

    def __init__(self, pool, log):
        self.pool, self.workers, self.log = pool, pool.workers, log
        self.timeouts = []

    def _get(self, futures, what, timeout=None):
        self.timeouts.append((what, len(futures), timeout if timeout is not None else 240.0))  # 4x 60 s default
        return [None] * len(futures)

    def close(self):
        self.log.append("driver.close")
        self._get([object() for w in self.workers if w is not None], "destroy", timeout=30)


def _run(tmp_path, log):
    slot = tmp_path / "slot-000002"
    slot.mkdir()
    (slot / "shard.distcp").write_bytes(b"x")
    current = tmp_path / "slot-000001"
    current.mkdir()
    run = types.SimpleNamespace(
        _pending=types.SimpleNamespace(directory=str(slot), meta={"step_index": 2}, writers=[0, 1]),
        ckpt_step=1, log=lambda s: log.append(("log", s)),
        _abandon_save=lambda p, why: log.append(("abandon", why)),
        _drop_own_checkpoints=lambda completed: log.append(("drop", completed)))
    return run, slot, current


def test_an_interrupt_is_ctrl_c_sigterm_or_system_exit_not_a_failure():
    class Terminated(KeyboardInterrupt):  # the CLI's SIGTERM exception
        pass

    assert is_interrupt(KeyboardInterrupt()) and is_interrupt(Terminated()) and is_interrupt(SystemExit(15))
    assert not is_interrupt(RuntimeError("worker lost")) and not is_interrupt(None)


def test_an_interrupted_run_with_its_own_pool_kills_the_workers_before_anything_waits_on_them(tmp_path):
    log = []
    pool = _Pool(log)
    driver = _Driver(pool, log)
    run, slot, current = _run(tmp_path, log)
    end_run(run, driver, pool, own=True, completed=False, interrupted=True)
    # no dcp_wait (a worker blocked behind the interrupted step would hold it for minutes), no abandon
    # wait; the pool goes first, then the engines with no live worker left to call
    assert [x for x in log if not isinstance(x, tuple)] == ["pool.close", "driver.close"], log
    assert [(w, n) for w, n, _t in driver.timeouts] == [("destroy", 0)], driver.timeouts  # nothing to wait on
    assert not slot.exists() and current.exists()  # the abandoned slot goes, `current` stays
    assert ("drop", False) in log and run._pending is None


def test_an_interrupted_run_on_a_callers_pool_waits_at_most_the_interrupt_bound(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    waits = []
    monkeypatch.setattr(ray, "wait", lambda futs, num_returns, timeout: waits.append((len(futs), num_returns, timeout))
                        or ([], list(futs)))  # the writers never finish
    log = []
    pool = _Pool(log)
    driver = _Driver(pool, log)
    run, slot, current = _run(tmp_path, log)
    end_run(run, driver, pool, own=False, completed=False, interrupted=True)
    assert waits == [(2, 2, INTERRUPT_WAIT_S)], waits  # both writers, one bounded wait
    assert "pool.close" not in log  # the caller's pool outlives the run
    what, n, timeout = driver.timeouts[0]
    assert (what, n) == ("destroy", 2) and 0 < timeout <= INTERRUPT_WAIT_S, driver.timeouts  # was 30 s
    assert "_get" not in driver.__dict__  # the bound applied to this close only
    assert not slot.exists() and current.exists()


def test_a_run_ended_by_an_error_abandons_its_save_as_before(tmp_path):
    log = []
    pool = _Pool(log)
    driver = _Driver(pool, log)
    run, slot, _current = _run(tmp_path, log)
    end_run(run, driver, pool, own=True, completed=False, interrupted=False)
    assert log[0] == ("abandon", "the run ended before it was complete")
    assert [x for x in log if not isinstance(x, tuple)] == ["driver.close", "pool.close"], log
    assert driver.timeouts == [("destroy", 2, 30)]  # unchanged: the engines are released normally


def test_the_deadline_cuts_every_wait_to_what_is_left():
    got = []
    bounded = teardown._deadline_get(lambda f, what, t: got.append(t), teardown.time.perf_counter() + 5.0)
    bounded([], "destroy", 30)
    bounded([], "stopping vLLM engines", timeout=120)
    bounded([], "x")
    assert all(0 < t <= 5.0 for t in got) and len(got) == 3, got
