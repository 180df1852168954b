"""A probe round that nobody answers waits longer before calling every worker silent
(``nereus/runtime/run/faults.py``, ``probe_info``); the recovery with no worker left stops at once."""

from __future__ import annotations

import sys
import types

import pytest

from nereus.runtime.run import faults


class _Ref:
    def __init__(self, wid: int) -> None:
        self.wid = wid


class _Worker:
    def __init__(self, wid: int) -> None:
        self.wid = wid
        outer = self

        class _Heartbeat:
            def options(self, **_kw):
                return self

            def remote(self):
                return _Ref(outer.wid)

        self.heartbeat = _Heartbeat()


def _fake_ray(answer_after: dict[int, float], calls: list):
    """A ``ray`` whose ``wait`` returns the refs whose worker answers within the timeout given
    (worker id → seconds until it answers; ``inf``: never), recording every timeout asked for."""
    ray = types.ModuleType("ray")

    def wait(refs, num_returns, timeout):
        calls.append(timeout)
        ready = [r for r in refs if answer_after[r.wid] <= timeout + sum(calls[:-1])]
        return ready, [r for r in refs if r not in ready]

    ray.wait = wait
    ray.get = lambda r: {"busy": None, "ops": 0, "waiting": False}
    ray.exceptions = types.SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}),
                                           RayTaskError=type("RayTaskError", (Exception,), {}))
    return ray


@pytest.mark.parametrize("answer_after, silent, waits", [
    # every worker answers late (the driver's host under load): the second wait hears all of them
    ({0: 12.0, 1: 15.0, 2: 25.0}, [], [10.0, 30.0]),
    # nobody ever answers: all silent, but only after 10 + 3 x 10 seconds
    ({0: float("inf"), 1: float("inf")}, [0, 1], [10.0, 30.0]),
    # one silent worker among answering ones: silent after the plain timeout, no second wait
    ({0: 1.0, 1: float("inf"), 2: 2.0}, [1], [10.0]),
])
def test_a_round_nobody_answers_gets_the_longer_patience(monkeypatch, answer_after, silent, waits):
    calls: list = []
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(answer_after, calls))
    workers = [_Worker(i) for i in sorted(answer_after)]
    dead, got_silent, info = faults.probe_info(workers, 10.0)
    assert dead == []
    assert got_silent == silent
    assert sorted(info) == sorted(set(answer_after) - set(silent))
    assert calls == waits  # 3 x 10 s = ALL_SILENT_PATIENCE timeouts more, only when nobody answered
    assert faults.ALL_SILENT_PATIENCE == 3


@pytest.mark.parametrize("written, says", [
    (True, r"the durable checkpoint of step 3 is kept: start the run again with --resume"),
    (False, r"no checkpoint was written yet: start the run again from the beginning"),
])
def test_a_recovery_with_no_worker_left_stops_at_once(tmp_path, written, says):
    from nereus.runtime.run.recovery import RecoveryMixin
    from nereus.runtime.worker.failures import AllWorkersLost, WorkerFailure, WorkerLost

    if written:  # what durable.restart reads first (fresh_start.has_checkpoint)
        (tmp_path / "driver.json").write_text("{}")

    class _Run(RecoveryMixin):
        def __init__(self) -> None:
            self.driver = types.SimpleNamespace(workers=[None, None, None])
            self.ckpt_step = 3
            self.tries = 0
            self.logs: list[str] = []

        def log(self, msg: str) -> None:
            self.logs.append(msg)

        def _ckpt_path(self) -> str:
            return str(tmp_path)

        def _inject_in_recovery(self, k: int) -> None:
            self.tries += 1

        def _name_all_lost(self, e) -> None:
            pass

        def _complete_save(self, k: int) -> None:
            pass

    run = _Run()
    with pytest.raises(AllWorkersLost, match=r"every worker was lost \(worker\(s\) \[0, 1, 2\]\); nothing is left "
                                             r"to recover onto; " + says):
        run._recover(WorkerLost("gone", [0, 1, 2], 0.5), 4, "step")
    assert run.tries == 1  # not retried: no attempt can help
    assert issubclass(AllWorkersLost, WorkerFailure)  # callers catching WorkerFailure still see it
