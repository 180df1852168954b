"""Break-even admission (the ski-rental rule, ``nereus.controller.break_even``): hand-computed numbers,
the controller driven through its public interface with fake planners."""

import math
from dataclasses import replace

import pytest

from nereus.controller.admission import Option, admit
from nereus.controller.break_even import BREAK_EVEN, ForgoneSaving, rejected_rate
from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import Keep, Transition, TransitionCost
from nereus.controller.monitor import StepReport
from nereus.controller.transition_calibration import TransitionCalibration
from nereus.spec import hardware, job, presets, workload
from nereus.spec.plan import Candidate, Plan

JOB = job.JobSpec(presets.get_model("llama-3.1-8b"), hardware.ClusterSpec(hardware.get_gpu("h100"), 1, 8),
                  workload.WorkloadSpec(algorithm="grpo", reward_model=False, response_len=1000))


def _plan(n, l_step=0.0):
    return Plan(candidates=(Candidate("actor.train", 1, 1, n, gpus=tuple(range(n))),), l_step=l_step)


def test_admit_takes_a_rejected_move_once_the_steps_waited_cover_its_payback():
    # ΔL = 100 − 90 = 10 s/step, L_tran 30 s: payback 3 steps > γ·H = 0.5·4 = 2
    o = Option(_plan(8, 90.0), TransitionCost(30.0))
    assert isinstance(admit(100.0, [o], gamma=0.5, horizon=4, urgent=False), Keep)
    assert isinstance(admit(100.0, [o], gamma=0.5, horizon=4, urgent=False, waited=2), Keep)   # 20 s < 30
    d = admit(100.0, [o], gamma=0.5, horizon=4, urgent=False, waited=3)                        # 30 s >= 30
    assert isinstance(d, Transition) and not d.urgent and d.delta_l == pytest.approx(10.0)
    assert d.reason.startswith("break-even: payback 3.00 steps <= 3 steps waited") and "γ·H = 0.5·4.00" in d.reason
    # a slower target is never admitted, however long the wait
    slow = Option(_plan(8, 101.0), TransitionCost(0.5))
    assert isinstance(admit(100.0, [slow], gamma=0.5, horizon=4, urgent=False, waited=1e9), Keep)


def test_forgone_saving_counts_steps_at_the_newest_rate_by_hand():
    f = ForgoneSaving()
    assert not f.pending and not f.due()
    f.advance(5)                                  # nothing pending: nothing counted
    assert f.forgone == 0.0 and f.waited == 0
    f.reject(1, 7.7, 20.0)                        # rejected after step 1: 7.7 s/step, L_tran 20 s
    f.advance(3)                                  # steps 2, 3 on the slower plan: 2 · 7.7 = 15.4 s
    assert f.waited == 2 and f.forgone == pytest.approx(15.4) and not f.due()
    f.reject(3, 5.0, 12.0)                        # a new rejection keeps the wait, takes the new rate and price
    assert f.since == 1 and f.forgone == pytest.approx(10.0) and not f.due()   # 2 · 5 = 10 < 12
    f.advance(4)
    assert f.forgone == pytest.approx(15.0) and f.due()                       # 3 · 5 = 15 >= 12
    t = f.trigger(4)
    assert (t.signal, t.urgent, t.value, t.reference, t.horizon) == (BREAK_EVEN, False, pytest.approx(15.0), 12.0, 3.0)
    f.advance(2)                                  # the run was rewound (restart): start again
    assert not f.pending and f.forgone == 0.0 and f.waited == 0
    f.reject(7, 0.0, 10.0)                        # nothing faster now: nothing to count
    assert not f.pending
    f.reject(7, 3.0, math.inf)
    assert not f.pending
    with pytest.raises(ValueError, match="L_tran"):
        f.reject(7, 3.0, -1.0)
    # the rate is the largest positive saving, the price the smallest L_tran among those that save
    assert rejected_rate([(4.0, 50.0), (6.0, 80.0), (-1.0, 1.0)]) == (6.0, 50.0)
    assert rejected_rate([(-1.0, 1.0), (0.0, 2.0)]) is None


class GrowPlanner:
    """L_step = 100 / #GPUs (s); every plan fits memory; the best plan uses the whole pool."""

    def estimate(self, job, plan, pool=None):
        return replace(plan, l_step=100.0 / plan.candidates[0].num_gpus)

    def memory_ok(self, job, plan):
        return True

    def plan(self, job, pool, current, urgent):
        return self.estimate(job, _plan(len(pool)))

    def alternatives(self, job, pool, current, best):
        return []

    def calibrate(self, *a, **k):
        pass

    def note_oom(self):
        pass

    def efficiencies(self):
        return {}


def _run_after_burst(break_even):
    """8 GPUs, then two quick losses (to 4 after step 1, to 2 after step 3), a gain back to 4 after
    step 4 and a quiet pool after it. The clock advances by the running plan's step time (100/#GPUs s);
    L_tran = 30 s; the pool horizon is the loss process's (``pool_horizon="process"``)."""
    fp = GrowPlanner()
    ctl = Controller(JOB, fp.plan(JOB, frozenset(range(8)), None, False), fp,
                     transition_cost=lambda *a: TransitionCost(30.0),
                     config=ControllerConfig(pool_horizon="process", break_even=break_even))
    t, out = 0.0, []
    for s, n in enumerate([8, 4, 4, 2, 4, 4, 4, 4, 4, 4, 4]):
        t += ctl.plan.l_step
        out.append(ctl.observe(StepReport(s, 1000, frozenset(range(n)), step_time=ctl.plan.l_step, elapsed_s=t)))
    return ctl, out


def test_break_even_admits_the_growth_a_burst_horizon_rejects_and_the_quiet_pool_never_revisits():
    ema, d_off = _run_after_burst(False)
    ctl, d_on = _run_after_burst(True)
    for d in (d_off, d_on):
        assert isinstance(d[1], Transition) and d[1].urgent and isinstance(d[3], Transition) and d[3].urgent
        # at step 4 (t = 125 s): loss intervals [12.5, 50] s (the first from the first report, at
        # 12.5 s), age 50 s: H = (50 + 0) / 1 = 50 s = 1 step of 50 s. The move 2 → 4 GPUs saves
        # 50 − 25 = 25 s/step for L_tran 30 s: payback 1.2 steps > 0.5·1, rejected
        assert isinstance(d[4], Keep) and "payback 1.20 steps > γ·H = 0.5·1.00" in d[4].reason
    assert ctl.pool_process.intervals == [12.5, 50.0]
    # without break-even no signal crosses again: the job stays on 2 of 4 GPUs to the end
    assert all(d.reason == "no trigger" for d in d_off[5:]) and ema.plan.candidates[0].num_gpus == 2
    # break-even: 25 s forgone after step 5 (< 30), 50 s after step 6 (>= 30): replan; the payback
    # 30 / 25 = 1.2 steps is within the 2 steps waited: admitted
    assert d_on[5].reason == "no trigger"
    assert isinstance(d_on[6], Transition) and d_on[6].triggers == (BREAK_EVEN,) and not d_on[6].urgent
    assert d_on[6].reason.startswith("break-even: payback 1.20 steps <= 2 steps waited")
    assert ctl.plan.candidates[0].num_gpus == 4 and not ctl.rent.pending
    assert all(d.reason == "no trigger" for d in d_on[7:])



class ReestimatePlanner(GrowPlanner):
    """GrowPlanner whose 4-GPU plan runs at ``l4`` s/step (a calibration that changes the estimate)."""

    l4 = 25.0

    def estimate(self, job, plan, pool=None):
        n = plan.candidates[0].num_gpus
        return replace(plan, l_step=self.l4 if n == 4 else 100.0 / n)


def test_a_saving_reestimated_lower_at_the_break_even_replan_waits_for_its_own_payback():
    # as the burst above: rejected at step 4 (25 s/step, L_tran 30 s); after step 5 calibration says the
    # 4-GPU plan runs at 45 s/step, a saving of 5 s/step. At step 6 (2 · 25 = 50 s >= 30) the replan
    # finds payback 30 / 5 = 6 steps > the 2 waited: rejected, and the count goes on at 5 s/step from
    # step 4: 5 · w >= 30 at w = 6, step 10, where payback 6 <= 6 waited admits it
    fp = ReestimatePlanner()
    ctl = Controller(JOB, fp.plan(JOB, frozenset(range(8)), None, False), fp,
                     transition_cost=lambda *a: TransitionCost(30.0),
                     config=ControllerConfig(pool_horizon="process", break_even=True))
    t, out = 0.0, []
    for s, n in enumerate([8, 4, 4, 2, 4, 4, 4, 4, 4, 4, 4, 4]):
        if s == 6:
            fp.l4 = 45.0
        t += ctl.plan.l_step
        out.append(ctl.observe(StepReport(s, 1000, frozenset(range(n)), step_time=ctl.plan.l_step, elapsed_s=t)))
    assert isinstance(out[4], Keep) and "payback 1.20 steps" in out[4].reason
    assert isinstance(out[6], Keep) and out[6].triggers == (BREAK_EVEN,) and "payback 6.00 steps" in out[6].reason
    assert [s for s, d in enumerate(out) if d.triggers == (BREAK_EVEN,)] == [6, 10]
    assert isinstance(out[10], Transition) and out[10].reason.startswith("break-even: payback 6.00 steps <= 6 steps")
    assert ctl.plan.candidates[0].num_gpus == 4


# ------------------------------------------------------------------ L_tran calibrated from measured transitions
def test_transition_calibration_is_the_ratio_of_sums_by_hand():
    cal = TransitionCalibration()
    assert cal.scale == 1.0
    cal.observe(50.0)                                     # nothing pending: not counted
    assert cal.count == 0
    cal.decided(Transition(_plan(8), TransitionCost(100.0), "x"))
    cal.observe(130.0)
    assert cal.scale == pytest.approx(1.3)
    # the next estimate is handed back scaled (apply): 1.3 · 10 = 13 s; 10 s (unscaled) is what is kept
    c = cal.apply(TransitionCost(10.0))
    assert c.l_tran == pytest.approx(13.0)
    cal.decided(Transition(_plan(8), c, "x"))
    cal.observe(30.0)
    assert cal.scale == pytest.approx((130 + 30) / (100 + 10)) and cal.count == 2
    cal.decided(Keep("x"))                                # no transition: nothing pending
    cal.observe(99.0)
    assert cal.count == 2
    cal.decided(Transition(_plan(8), TransitionCost(10.0), "x"))
    cal.observe(None)                                     # not measured (aborted): consumed, not counted
    assert cal.count == 2 and cal.pending is None
    assert cal.apply(TransitionCost(math.inf, feasible=False)).l_tran == math.inf
    off = TransitionCalibration(enabled=False, measured=130.0, estimated=100.0)
    assert off.scale == 1.0 and off.apply(TransitionCost(10.0)).l_tran == 10.0
    with pytest.raises(ValueError, match="measured"):
        cal.observe(-1.0)
    with pytest.raises(ValueError, match="transition_s"):
        StepReport(0, 1000, frozenset({0}), transition_s=-2.0)


def _run_calibrated(calibrate):
    """4 GPUs; the pool loses 2 after step 1 (urgent) and gets them back after step 5. Every
    transition is estimated at 20 s and measured at 60 s (reported with the next step); the pool
    horizon is the EMA with the paper's H = 1 before the first interval."""
    fp = GrowPlanner()
    ctl = Controller(JOB, fp.plan(JOB, frozenset(range(4)), None, False), fp,
                     transition_cost=lambda *a: TransitionCost(20.0),
                     config=ControllerConfig(calibrate_transitions=calibrate))
    out, measured = [], None
    for s, n in enumerate([4, 2, 2, 2, 2, 4]):
        d = ctl.observe(StepReport(s, 1000, frozenset(range(n)), step_time=ctl.plan.l_step, transition_s=measured))
        measured = 60.0 if isinstance(d, Transition) else None
        out.append(d)
    return ctl, out


def test_measured_transitions_raise_the_payback_price():
    off, d_off = _run_calibrated(False)
    on, d_on = _run_calibrated(True)
    for d in (d_off, d_on):
        assert isinstance(d[1], Transition) and d[1].urgent          # the loss: 4 → 2 GPUs
    # the move was estimated at 20 s and took 60 s: scale 3 from the step-2 report on
    assert on.tran_cal.scale == pytest.approx(3.0) and off.tran_cal.scale == 1.0
    # step 5: growing 2 → 4 GPUs saves 50 − 25 = 25 s/step; H_pool = 4 (crossings at steps 1 and 5)
    # uncalibrated: payback 20 / 25 = 0.8 <= 0.5·4, admitted; calibrated: 60 / 25 = 2.4 > 2, rejected
    assert isinstance(d_off[5], Transition) and "payback 0.80 steps <= γ·H = 0.5·4.00" in d_off[5].reason
    assert isinstance(d_on[5], Keep) and "payback 2.40 steps > γ·H = 0.5·4.00" in d_on[5].reason
    assert "L_tran 60.0s" in d_on[5].reason
