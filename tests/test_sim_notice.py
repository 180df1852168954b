"""Preemption notices in the simulated truth: the announced seconds reported, the step stopped at the
notice when it would leave no time to checkpoint, and a checkpoint save cut by the loss (by hand)."""

import pytest
from test_sim_run import DROP, JOB

from nereus.controller.decisions import Keep, Transition, TransitionCost
from nereus.controller.planning import CostModelPlanner
from nereus.controller.risk import state_survives
from nereus.sim.cluster import SimulatedCluster, Truth
from nereus.sim.growth import growth_scenario
from nereus.sim.restart import RestartCost
from nereus.sim.run import notice_during, overrun_at, save_overrun, simulate
from nereus.sim.traces import AvailabilityTrace

#: 16 GPUs, 3 from 1,800 s: no replica of this job's ``actor.train`` (tp 2, pp 2, dp 4) survives
DROP3 = AvailabilityTrace("drop3", (0.0, 1800.0, 3600.0), (16, 3, 16), 5400.0, unit="gpus")


def _setup(trace):
    cl = SimulatedCluster(JOB, trace, growth_scenario(5), Truth(step_noise=0.0, notice_s=120.0))
    plan = CostModelPlanner().plan(cl.job_at(500), cl.pool_at(0), None, False)
    return cl, plan, cl.true_plan(plan, 500, 0).l_step


def test_announced_gpus_and_their_seconds_are_reported():
    cl, _, _ = _setup(DROP)
    assert cl.leave_in(1600.0) == {}                                    # before the notice at 1,680 s
    assert cl.leave_in(1700.0) == {g: pytest.approx(100.0) for g in range(12, 16)}
    cl2, plan, _ = _setup(DROP)
    rep = cl2.execute_step(plan, 0, 1700.0).report                        # not started: 12-15 announced
    assert rep.leave_in_s == {g: pytest.approx(100.0) for g in range(12, 16)}


def test_step_stopped_at_the_notice_when_no_time_would_be_left_to_save():
    cl, plan, l_step = _setup(DROP3)
    assert not state_survives(plan, frozenset(range(3))) and l_step < 20.0
    t0 = 1675.0  # the notice arrives 5 s into the step; the step ends 1800 - (t0 + l_step) s before the loss
    left = 1800.0 - (t0 + l_step)
    out = cl.execute_step(plan, 0, t0, save_s=left + 1.0)   # a save would not fit after the step
    assert not out.completed and out.duration == pytest.approx(5.0)
    assert out.report.leave_in_s == {g: pytest.approx(120.0) for g in range(3, 16)}
    out = cl.execute_step(plan, 0, t0, save_s=left - 1.0)   # it would: the step completes
    assert out.completed and out.duration == pytest.approx(l_step)


def test_no_reserve_when_a_replica_survives_the_loss():
    cl, plan, l_step = _setup(DROP)
    assert state_survives(plan, frozenset(range(12)))       # actor.train dp 4: replicas on 0-11 stay
    out = cl.execute_step(plan, 0, 1675.0, save_s=1e6)
    assert out.completed and out.duration == pytest.approx(l_step)


def test_a_save_is_cut_by_a_loss_that_leaves_no_replica():
    cl, plan, _ = _setup(DROP3)
    assert save_overrun(cl, plan, 1790.0, 20.0) == 1800.0  # the loss at 1,800 s takes every replica
    assert save_overrun(cl, plan, 1700.0, 20.0) is None    # done at 1,720 s
    cl, plan, _ = _setup(DROP)
    assert save_overrun(cl, plan, 1790.0, 20.0) is None    # replicas on 0-11 finish it


def test_a_move_planned_around_announced_gpus_is_not_cut_by_their_loss():
    cl, plan, _ = _setup(DROP)
    target = CostModelPlanner().plan(cl.job_at(500), cl.pool_at(1700.0), plan, True)  # on GPUs 0-11
    alive = cl.alive_at(1790.0)
    assert overrun_at(cl, plan, target, alive, 1790.0, 20.0) == 1800.0  # reads 12-15, gone at 1,800 s
    # ``Transition.excluded`` = 12-15: the loop passes alive minus them, nothing read is lost
    assert overrun_at(cl, plan, target, alive - frozenset(range(12, 16)), 1790.0, 20.0) is None


class _Twice:
    """Asks for a move WIDE → NARROW after step 5; once a notice aborted it, asks again planned
    around the announced node (``excluded``)."""

    name = "twice"

    def __init__(self):
        from test_sim_overrun import WIDE
        self.plan, self.log, self.asked = WIDE, [], 0

    def start(self, pool, response_len):
        return self.plan

    def observe(self, report):
        from test_sim_overrun import NARROW, TRANSITION_S
        if (report.step == 5 and self.asked == 0) or not self.plan.gpus_used() <= report.pool:
            self.asked += 1
            excluded = frozenset(report.alive) - frozenset(report.pool) if self.asked > 1 else frozenset()
            self.plan = NARROW
            return Transition(NARROW, TransitionCost(TRANSITION_S), "scripted", urgent=True, excluded=excluded)
        return Keep("scripted")

    def resume(self, plan):
        self.plan = plan


def test_a_notice_during_a_move_aborts_it_at_the_notice_and_the_policy_decides_again():
    from test_sim_overrun import JOB as JOB2
    from test_sim_overrun import STEP_S, FixedCluster
    # node 1 (GPUs 8-15) leaves at 100 s, announced at 70 s; steps 0-5 end at 60 s and the 50 s move
    # off node 1 starts then: the notice at 70 s aborts it (10 s lost), the running plan is kept, its
    # next step does not start (its GPUs are announced), and the move planned around node 1 runs
    # 70 -> 120 s (not cut: nothing read from node 1), then steps of 10 s to 400 s with one periodic
    # save (after step 25) on the one node of NARROW
    trace = AvailabilityTrace("t", (0.0, 100.0), (16, 8), 1000.0, unit="gpus")
    cl = FixedCluster(JOB2, trace, growth_scenario(100, sigma=0.0), Truth(step_noise=0.0, notice_s=30.0))
    rc = RestartCost(checkpoint_rule="fixed")
    res = simulate(_Twice(), cl, 400.0 / 3600.0, rc)
    aborted = [e for e in res.events if e["kind"] == "transition_aborted"]
    assert len(aborted) == 1 and aborted[0]["t"] == pytest.approx(70.0)
    assert res.restarts == 0 and res.transitions == 1 and res.lost_time == pytest.approx(10.0)
    assert res.checkpoints == 1
    assert res.steps == 6 + int((400.0 - 120.0 - rc.save_s(JOB2, 1)) // STEP_S)


def test_notice_during_is_the_notice_of_the_loss_that_cuts_the_move():
    from test_sim_overrun import JOB as JOB2
    from test_sim_overrun import NARROW, WIDE, FixedCluster
    trace = AvailabilityTrace("t", (0.0, 100.0), (16, 8), 1000.0, unit="gpus")
    cl = FixedCluster(JOB2, trace, growth_scenario(100, sigma=0.0), Truth(step_noise=0.0, notice_s=30.0))
    # WIDE -> NARROW reads node 1, which leaves at 100 s, announced at 70 s
    assert notice_during(cl, overrun_at(cl, WIDE, NARROW, cl.alive_at(60.0), 60.0, 50.0), 60.0) == 70.0
    assert notice_during(cl, overrun_at(cl, WIDE, NARROW, cl.alive_at(75.0), 75.0, 50.0), 75.0) is None
    # growth onto node 1 reads nothing from it: it ends, and is not aborted
    assert notice_during(cl, overrun_at(cl, NARROW, WIDE, cl.alive_at(60.0), 60.0, 50.0), 60.0) is None
    cl0 = FixedCluster(JOB2, trace, growth_scenario(100, sigma=0.0), Truth(step_noise=0.0))
    assert notice_during(cl0, overrun_at(cl0, WIDE, NARROW, cl0.alive_at(60.0), 60.0, 50.0), 60.0) is None
