"""Hand-computed cases for H_x, triggers, reference reset and the payback rule."""

import json

import pytest

from nereus.controller.admission import Option, admit, payback_ok
from nereus.controller.decisions import Keep, Restart, Transition, TransitionCost, decision_to_dict
from nereus.controller.horizon import Horizon
from nereus.controller.monitor import Monitor
from nereus.spec.plan import Candidate, Plan


def _plan(l_step, tp=1):
    return Plan(candidates=(Candidate("actor.train", tp, 1, 4 // tp, gpus=(0, 1, 2, 3)),), l_step=l_step)


# ------------------------------------------------------------------ H_x
def test_horizon_one_step_before_first_interval_then_ema():
    h = Horizon(alpha=0.5)
    assert h.value == 1.0
    assert h.crossing(10) == 1.0          # first crossing: no interval yet
    assert h.crossing(14) == 4.0          # first interval = 4
    assert h.crossing(20) == 5.0          # 0.5*6 + 0.5*4
    assert h.crossing(22) == 3.5          # 0.5*2 + 0.5*5


def test_horizon_rejects_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        Horizon(alpha=0)


# ------------------------------------------------------------------ triggers
def test_seq_len_trigger_is_strictly_above_delta_and_reference_resets():
    m = Monitor()
    pool = frozenset(range(4))
    assert m.check(0, {"seq_len": 1000.0}, pool) == []     # first value becomes the reference
    assert m.check(1, {"seq_len": 1300.0}, pool) == []     # exactly 30%: not above δ
    fired = m.check(2, {"seq_len": 1301.0}, pool)
    assert [t.signal for t in fired] == ["seq_len"] and not fired[0].urgent
    assert fired[0].reference == 1000.0 and fired[0].horizon == 1.0
    assert m.check(3, {"seq_len": 1302.0}, pool)            # no reset yet: still drifted
    m.reset({"seq_len": 1302.0}, pool)
    assert m.check(4, {"seq_len": 1500.0}, pool) == []     # 15% from the new reference
    fired = m.check(9, {"seq_len": 1700.0}, pool)          # 30.6% from 1302
    assert fired and fired[0].horizon == pytest.approx(0.5 * 6 + 0.5 * 1)  # crossings at 2, 3, 9


def test_downward_drift_fires_too():
    m = Monitor()
    pool = frozenset({0})
    m.check(0, {"seq_len": 1000.0}, pool)
    assert [t.signal for t in m.check(1, {"seq_len": 690.0}, pool)] == ["seq_len"]


def test_pool_change_is_urgent_and_memory_violation_is_urgent():
    m = Monitor()
    m.check(0, {}, frozenset(range(8)))
    fired = m.check(5, {}, frozenset(range(4)))
    assert [(t.signal, t.urgent, t.value, t.reference) for t in fired] == [("pool", True, 4, 8)]
    m.reset({}, frozenset(range(4)))
    assert m.check(6, {}, frozenset(range(4))) == []
    fired = m.check(7, {}, frozenset(range(4)), memory_violation=True)
    assert [(t.signal, t.urgent) for t in fired] == [("memory", True)]


def test_efficiency_signal_uses_eff_threshold():
    m = Monitor()
    pool = frozenset({0})
    m.check(0, {"eff:allreduce@ib": 0.75}, pool)
    assert m.check(1, {"eff:allreduce@ib": 0.61}, pool) == []    # 18.7% < 20%
    assert m.check(2, {"eff:allreduce@ib": 0.59}, pool)[0].signal == "eff:allreduce@ib"


def test_monitor_rejects_bad_threshold():
    with pytest.raises(ValueError, match="seq_len"):
        Monitor(thresholds={"seq_len": 0})


# ------------------------------------------------------------------ payback rule
def test_payback_admit_and_reject_sides():
    # L_tran = 30 s, ΔL = 10 s/step → payback 3 steps
    assert payback_ok(30, 10, gamma=0.5, horizon=6)          # 3 <= 0.5*6
    assert not payback_ok(30, 10, gamma=0.5, horizon=5)      # 3 > 2.5
    assert not payback_ok(30, 10, gamma=0.0, horizon=1e9)    # γ = 0: only urgent transitions
    assert not payback_ok(0, -1, gamma=1, horizon=10)        # slower target never pays back
    with pytest.raises(ValueError, match="gamma"):
        payback_ok(1, 1, gamma=-0.1, horizon=1)


def test_admit_picks_cheaper_slower_option_when_best_fails_payback():
    best = Option(_plan(90.0, tp=2), TransitionCost(100.0))   # ΔL 10, payback 10 steps
    alt = Option(_plan(92.0, tp=4), TransitionCost(16.0))     # ΔL 8, payback 2 steps
    d = admit(100.0, [best, alt], gamma=0.5, horizon=4.0, urgent=False, triggers=("seq_len",))
    assert isinstance(d, Transition) and d.plan is alt.plan and d.delta_l == pytest.approx(8.0)
    d = admit(100.0, [best, alt], gamma=0.5, horizon=3.0, urgent=False)  # 2 > 1.5: reject both
    assert isinstance(d, Keep) and "payback 10.00 steps" in d.reason


def test_admit_gamma_zero_keeps_and_replan_all_admits():
    o = Option(_plan(90.0), TransitionCost(1000.0))
    assert isinstance(admit(100.0, [o], gamma=0.0, horizon=100, urgent=False), Keep)
    d = admit(100.0, [o], gamma=0.0, horizon=1, urgent=False, always=True)
    assert isinstance(d, Transition) and not d.urgent


def test_admit_infeasible_targets_are_skipped():
    bad = Option(_plan(80.0, tp=2), TransitionCost(1.0, feasible=False, reason="no memory for Split"))
    good = Option(_plan(85.0, tp=4), TransitionCost(10.0))
    d = admit(100.0, [bad, good], gamma=0.5, horizon=2, urgent=False)
    assert isinstance(d, Transition) and d.plan is good.plan        # 10/15 = 0.67 <= 1
    d = admit(100.0, [bad], gamma=0.5, horizon=2, urgent=False)
    assert isinstance(d, Keep) and "no memory for Split" in d.reason


def test_urgent_path_waives_profitability_and_falls_back_to_restart():
    slow = Option(_plan(500.0), TransitionCost(1e6))
    d = admit(float("inf"), [slow], gamma=0.0, horizon=1, urgent=True, triggers=("pool",))
    assert isinstance(d, Transition) and d.urgent and d.delta_l == 0.0
    bad = Option(_plan(50.0), TransitionCost(1.0, feasible=False, reason="x"))
    d = admit(float("inf"), [bad], gamma=0.5, horizon=1, urgent=True)
    assert isinstance(d, Restart) and d.plan is bad.plan
    d = admit(float("inf"), [], gamma=0.5, horizon=1, urgent=True)
    assert isinstance(d, Restart) and d.plan is None


def test_decisions_serialize_to_json():
    o = Option(_plan(90.0), TransitionCost(10.0, bytes_moved=1e9))
    for d in (Keep("x", ("seq_len",)), admit(100.0, [o], gamma=1, horizon=10, urgent=False),
              Restart(None, "nothing fits")):
        s = json.dumps(decision_to_dict(d))
        assert json.loads(s)["kind"] in ("keep", "transition", "restart")
    with pytest.raises(Exception):  # noqa: B017 - frozen
        Keep("x").reason = "y"
