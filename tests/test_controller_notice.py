"""``nereus.controller.notice``: moves that must end before announced GPUs leave, and whether a
checkpoint can still be saved (hand-built plans and windows; then the controller's decision)."""

from dataclasses import replace

import pytest
from test_sim_run import JOB

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import Restart, Transition, TransitionCost
from nereus.controller.monitor import StepReport
from nereus.controller.notice import can_checkpoint, notice_window, plan_save_s, within_notice
from nereus.controller.planning import CostModelPlanner
from nereus.controller.risk import RiskModel, state_survives
from nereus.spec import hardware
from nereus.spec.plan import Candidate, Plan

CLUSTER = hardware.ClusterSpec(hardware.get_gpu("h100"), 4, 8)


def _train(gpus, dp=1):
    """``critic.train`` with ``dp`` replicas over ``gpus`` (tp 1, pp = len / dp)."""
    gpus = tuple(gpus)
    return replace(Plan(candidates=(Candidate("critic.train", 1, len(gpus) // dp, dp, gpus=gpus),)), l_step=100.0)


def test_the_window_is_the_first_announced_source_gpu_to_leave():
    cur, tgt = _train(range(16)), _train(range(8))
    leave = {12: 90.0, 13: 90.0, 14: 30.0, 15: 30.0, 20: 1.0}   # GPU 20 is not a source
    assert notice_window(cur, tgt, leave) == 30.0
    assert notice_window(cur, _train(range(16)), leave) == float("inf")  # 12-15 kept: not sources
    ok = TransitionCost(25.0, bytes_moved=1.0, source="dag", reason="ok")
    assert within_notice(ok, cur, tgt, leave) is ok
    late = within_notice(TransitionCost(31.0, reason="ok"), cur, tgt, leave)
    assert not late.feasible and "31.0s exceeds the 30.0s notice window of GPU(s) 12-15" in late.reason
    assert within_notice(TransitionCost(31.0), cur, tgt, {}).feasible  # no notice: unchanged


def test_a_checkpoint_is_possible_when_a_replica_stays_or_the_save_fits():
    alive = frozenset(range(16))
    two = _train(range(16), dp=2)  # replicas on 0-7 and 8-15
    one = _train(range(16))        # one replica over 0-15
    leave = {g: 60.0 for g in range(12, 16)}
    assert can_checkpoint(two, alive, leave, 1e9, CLUSTER)              # replica 0-7 stays
    # one replica on 2 of the 4 nodes: the save takes 80 s x 4 / 2 = 160 s > 60 s
    assert plan_save_s(80.0, CLUSTER, one) == pytest.approx(160.0)
    assert not can_checkpoint(one, alive, leave, 80.0, CLUSTER)
    assert can_checkpoint(one, alive, leave, 20.0, CLUSTER)             # 40 s <= 60 s
    assert can_checkpoint(one, alive, leave, None, CLUSTER)             # save time unknown
    assert not can_checkpoint(one, alive - {15}, {}, None, CLUSTER)     # GPU 15 already gone


def _controller(risk=None, l_tran=50.0):
    """The 8B job on 16 GPUs; every transition priced ``l_tran`` s, the GPUs it may read recorded."""
    planner = CostModelPlanner()
    pool = frozenset(range(16))
    plan = planner.plan(JOB, pool, None, False)
    reads = []

    def cost(job, current, target, gpus):
        reads.append(frozenset(gpus))
        return TransitionCost(l_tran, source="dag", reason="ok")
    ctl = Controller(JOB, plan, planner, transition_cost=cost, config=ControllerConfig(calibrate=False, risk=risk))
    ctl.observe(StepReport(step=0, response_len=500, pool=pool, alive=pool, step_time=10.0, elapsed_s=10.0))
    return ctl, reads


def _notice(ctl, gpus, seconds):
    """``gpus`` announced to leave in ``seconds``."""
    return ctl.observe(StepReport(step=1, response_len=500, pool=frozenset(range(16)) - set(gpus),
                                  alive=frozenset(range(16)), step_time=10.0, elapsed_s=20.0,
                                  leave_in_s={g: seconds for g in gpus}))


def test_the_urgent_move_reads_announced_gpus_only_when_no_replica_stays_and_it_fits():
    announced = (0, 4, 8, 12)
    ctl, reads = _controller()
    assert not state_survives(ctl.plan, frozenset(range(16)) - set(announced))  # one GPU of every replica
    d = _notice(ctl, announced, 110.0)
    assert isinstance(d, Transition) and d.urgent and d.excluded == frozenset()
    assert reads[-1] == frozenset(range(16))


@pytest.mark.parametrize("seconds", [30.0, 110.0])
def test_a_move_is_planned_around_the_announced_gpus_when_a_replica_stays(seconds):
    ctl, reads = _controller()
    assert state_survives(ctl.plan, frozenset(range(12)))  # actor.train dp 4: replicas stay on 0-11
    d = _notice(ctl, range(12, 16), seconds)  # whether or not the 50 s move would fit the window
    assert isinstance(d, Transition) and d.excluded == frozenset(range(12, 16))
    assert reads[-1] == frozenset(range(12))  # priced reading only the GPUs that stay


def test_a_move_too_long_for_the_notice_without_a_replica_staying_is_a_restart():
    announced = (0, 4, 8, 12)
    ctl, _ = _controller()
    assert not state_survives(ctl.plan, frozenset(range(16)) - set(announced))  # one GPU of every replica
    d = _notice(ctl, announced, 30.0)
    assert isinstance(d, Restart) and d.cause == "infeasible_transition" and "notice window" in d.reason
    assert d.checkpoint_first  # the state is whole on the alive GPUs, save time unknown
    ctl, _ = _controller(risk=RiskModel(save_s=1e4))  # a save far longer than the 30 s left
    d = _notice(ctl, announced, 30.0)
    assert isinstance(d, Restart) and not d.checkpoint_first
