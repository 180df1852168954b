"""Warming a rejected target's vLLM engines (``run/vllm_warm.py``) and the engine-start charge with warm
engines (``run/vllm_driver.py`` ``start_term``), without vLLM or Ray: fake workers and a fake run.

Hand-computed: a fitted start of 100 s (``EngineStartModel(fixed_s=100)``, no per-byte term), a transition
DAG of 2 s beside it. TP 1 on worker 0 → TP 2 on workers 0-1 starts one engine (replica key
``(2, (0, 1), 0)``): charged ``100 − 2 = 98`` s when nothing warms, ``100 − 2 − 30 = 68`` s when its
engine began warming 30 s ago, 0 once it is up; and 0 for DP 1 → 1 on the same worker (kept).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from nereus.spec.plan import Candidate
from nereus.spec.presets import MODEL_PRESETS
from nereus.transition.engine_start import EngineStartModel

GEN = "actor.generate"
KEY = (2, (0, 1), 0)


def _plan(tp, dp, gpus):
    return {GEN: Candidate(GEN, tp, 1, dp, gpus=tuple(gpus))}


class _Call:
    def __init__(self, log, wid, name, answers):
        self.log, self.wid, self.name, self.answers = log, wid, name, answers

    def remote(self, *args):
        self.log.append((self.wid, self.name, args))
        return self.answers.get(self.name, {})


class _Worker:
    def __init__(self, wid, log, answers):
        self.wid, self.log, self.answers = wid, log, answers

    def __getattr__(self, name):
        return _Call(self.log, self.wid, name, self.answers)


def _run(answers=None):
    log: list = []
    answers = answers if answers is not None else {}
    d = SimpleNamespace(cfg=SimpleNamespace(rollout="vllm", vllm={}, precision="fp32"), spec=MODEL_PRESETS["tiny-d64"],
                        workers=[_Worker(i, log, answers) for i in range(2)], cands=_plan(1, 1, [0]),
                        _get=lambda calls, what, timeout=None: list(calls))
    lines: list = []
    return SimpleNamespace(driver=d, engine_start=EngineStartModel(fixed_s=100.0), log=lines.append), log, lines


def test_the_start_charge_drops_while_the_engine_warms_and_is_zero_once_it_is_up():
    from nereus.runtime.run import vllm_driver as vd

    run, _log, _ = _run()
    cur, tgt = _plan(1, 1, [0]), _plan(2, 1, [0, 1])
    assert vd.start_term(run, cur, tgt, 2.0) == 98.0
    run.driver.vllm_warm = {"keys": {KEY: {"t0": time.perf_counter() - 30.0, "done": False}}, "asked": False}
    assert 67.0 < vd.start_term(run, cur, tgt, 2.0) <= 68.0
    run.driver.vllm_warm["keys"][KEY]["done"] = True
    assert vd.start_term(run, cur, tgt, 2.0) == 0.0
    assert vd.start_term(run, cur, _plan(1, 1, [0]), 2.0) == 0.0  # the replica keeps its engine
    # a warm engine of another replica does not hide this one's start
    run.driver.vllm_warm = {"keys": {(2, (0, 1), 1): {"t0": 0.0, "done": True}}, "asked": False}
    assert vd.start_term(run, cur, tgt, 2.0) == 98.0


def test_warm_prestarts_the_new_replicas_and_poll_asks_for_a_revisit_once_they_are_up():
    from nereus.runtime.run import vllm_warm as vw

    answers = {"vllm_prestart_status": {"key": (2, 0), "done": False, "elapsed_s": 5.0, "error": None}}
    run, log, lines = _run(answers)
    assert vw.warm(run, _plan(2, 1, [0, 1])) == [KEY]
    assert [(w, n, a[2:4]) for w, n, a in log] == [(0, "prestart_vllm", (2, 0))]  # TP 2, replica 0, on worker 0
    assert vw.warm(run, _plan(2, 1, [0, 1])) == []  # already warming: not started twice
    assert vw.warm(run, _plan(1, 2, [0, 1])) == []  # nor another target while one warms
    assert len(log) == 1
    assert not vw.poll(run)  # still starting
    answers["vllm_prestart_status"] = {"key": (2, 0), "done": True, "elapsed_s": 41.0, "error": None}
    assert vw.poll(run) and run.driver.vllm_warm["keys"][KEY]["start_s"] == 41.0
    assert not vw.poll(run)  # asked once
    assert any("warm engines up (started in 41.0s" in x for x in lines)


def test_a_failed_warm_start_is_dropped_and_no_revisit_is_asked():
    from nereus.runtime.run import vllm_warm as vw

    answers = {"vllm_prestart_status": {"key": (2, 0), "done": True, "elapsed_s": 3.0, "error": "RuntimeError('x')"}}
    run, _log, lines = _run(answers)
    vw.warm(run, _plan(2, 1, [0, 1]))
    assert not vw.poll(run) and run.driver.vllm_warm["keys"] == {}
    assert any("lost (RuntimeError('x'))" in x for x in lines)


def test_a_relayout_drops_warm_engines_of_another_target():
    from nereus.runtime.run import vllm_driver as vd

    run, log, _ = _run()
    d = run.driver
    d.vllm_warm = {"keys": {KEY: {"t0": 0.0, "done": True}, (1, (1,), 1): {"t0": 0.0, "done": True}}, "asked": True}
    vd.drop_warm(d, [KEY])
    assert [(w, n) for w, n, _a in log] == [(1, "drop_vllm_prestart")] and d.vllm_warm is None
