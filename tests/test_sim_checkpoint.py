"""Young's adaptive checkpoint interval (``nereus.sim.checkpoint``), the failed relaunch of a restart
(``nereus.sim.run.restart_overrun``) and ZeRO-sharded training state as a single copy (issue 29).

The loop tests reuse ``test_sim_overrun``'s cluster (steps of exactly 10 s, no noise), so every
checkpoint time and step count below follows from the formulas by hand.
"""

import math

import pytest
from test_sim_overrun import JOB, NARROW, _cluster

from nereus.controller.controller import state_survives
from nereus.controller.decisions import Keep, Restart
from nereus.controller.risk import hit_probability, state_copies, vulnerable_nodes
from nereus.sim.checkpoint import CheckpointSchedule, young_interval
from nereus.sim.restart import RestartCost
from nereus.sim.run import simulate
from nereus.spec.plan import Candidate, Plan

# 14 bytes per parameter of the trained actor (Llama-3.1-8B, 8,030,261,248 parameters) over
# 2 GB/s per node x 2 nodes: 14 * 8,030,261,248 / 4e9 = 28.1059 s
SAVE_S = 14 * 8_030_261_248 / 4e9


def test_young_interval_by_hand():
    # sqrt(2 * 57 * 1000) = sqrt(114,000) = 337.64 s
    assert young_interval(57.0, 1000.0) == pytest.approx(337.6389, rel=1e-6)
    assert young_interval(0.0, 1000.0) == 0.0 and young_interval(10.0, math.inf) == math.inf
    for bad in ((-1.0, 10.0), (1.0, -1.0), (math.nan, 1.0)):
        with pytest.raises(ValueError, match="must be >= 0 s"):
            young_interval(*bad)


def test_schedule_mtbf_cost_and_due_by_hand():
    s = CheckpointSchedule()
    # no failure yet: M = t; before a save, C is the model's estimate
    assert s.mtbf(400.0) == 400.0 and s.cost(50.0) == 50.0
    assert s.interval(400.0, 50.0) == pytest.approx(200.0)           # sqrt(2 * 50 * 400)
    assert s.due(200.0, 400.0, 50.0) and not s.due(199.0, 400.0, 50.0)
    assert not s.due(0.0, 0.0, 50.0)                                  # nothing to protect yet
    # two failures and a measured save of 40 s: M = 900 / 3 = 300, T = sqrt(2 * 40 * 300) = 154.92 s
    s.failed()
    s.failed()
    s.saved(40.0)
    assert s.mtbf(900.0) == 300.0 and s.cost(50.0) == 40.0
    assert s.interval(900.0, 50.0) == pytest.approx(math.sqrt(24000.0))


class Steady:
    """Keeps its plan; restarts per ``script`` (report step -> (plan, cause)) and starts on
    ``start_plans`` (pool size -> plan)."""

    name = "steady"

    def __init__(self, plan, script=None, start_plans=None):
        self.plan, self.script, self.start_plans, self.log, self.done = plan, script or {}, start_plans or {}, [], set()

    def start(self, pool, response_len):
        self.plan = self.start_plans.get(len(pool), self.plan)
        return self.plan

    def observe(self, report):
        if report.step in self.script and report.step not in self.done and not report.step_time:
            self.done.add(report.step)
            plan, cause = self.script[report.step]
            return Restart(plan, "scripted", checkpoint_first=False, cause=cause)
        return Keep("steady")

    def resume(self, plan):
        self.plan = plan


def test_loop_saves_at_young_intervals_on_a_stable_pool():
    """No failure, so M = t. The run starts from a checkpoint; after step k (t = 10k s of work) it
    saves when 10k >= sqrt(2 C t): step 5 gives 50 < sqrt(2 * 28.106 * 50) = 53.0, step 6 gives
    60 >= 58.07 -> save at 60 s, done at 88.106 s. Then j steps later (t = 88.106 + 10j): j = 10 gives
    100 < sqrt(2 * 28.106 * 188.106) = 102.83, j = 11 gives 110 >= 105.52 -> save after step 17."""
    rc = RestartCost()
    assert rc.save_s(JOB, 2) == pytest.approx(SAVE_S)
    cl = _cluster((0.0,), (16,), 1000.0)
    wide = Plan((Candidate("actor.train", 8, 1, 2, gpus=tuple(range(16))),
                 Candidate("actor.generate", 1, 1, 16, gpus=tuple(range(16)))))
    res = simulate(Steady(wide), cl, 250.0 / 3600.0, rc)
    assert res.checkpoints == 2 and res.checkpoint_time == pytest.approx(2 * SAVE_S)
    # 17 steps by 198.106 + 28.106 = 226.2 s, then 2 more by 246.2 s (the third ends past 250 s)
    assert res.steps == 19
    # the fixed rule (every 25 steps) saves once, after step 25 (which ends at exactly 250 s)
    fixed = simulate(Steady(wide), _cluster((0.0,), (16,), 1000.0), 250.0 / 3600.0,
                     RestartCost(checkpoint_rule="fixed"))
    assert fixed.checkpoints == 1 and fixed.steps == 25


def test_failure_shortens_the_interval():
    """A restart that redoes work counts as a failure: M = t / 2 afterwards."""
    s = CheckpointSchedule()
    before = s.interval(1000.0, SAVE_S)
    s.failed()
    assert s.interval(1000.0, SAVE_S) == pytest.approx(before / math.sqrt(2.0))


def test_restart_whose_gpus_leave_fails_at_the_loss_and_relaunches_on_the_pool():
    """GPUs 12-15 leave at 55 s (aborting step 5 of the 16-GPU plan, 50-60 s), GPUs 8-11 at 100 s.
    The restart at 55 s onto GPUs 0-11 would take R = 152.1 s; its GPUs 8-11 leave at 100 s, so it
    fails then (45 s of restart time) and the policy relaunches on the 8 GPUs left (another R)."""
    rc = RestartCost(checkpoint_rule="fixed")
    cl = _cluster((0.0, 55.0, 100.0), (16, 12, 8), 1000.0)
    wide = Plan((Candidate("actor.train", 8, 1, 2, gpus=tuple(range(16))),
                 Candidate("actor.generate", 1, 1, 16, gpus=tuple(range(16)))))
    twelve = Plan((Candidate("actor.train", 8, 1, 1, gpus=tuple(range(8))),
                   Candidate("actor.generate", 1, 1, 12, gpus=tuple(range(12)))))
    pol = Steady(wide, script={5: (twelve, "state_lost")}, start_plans={8: NARROW})
    res = simulate(pol, cl, 600.0 / 3600.0, rc)
    r8, r12 = rc.restart_s(JOB, 1), rc.restart_s(JOB, 2)
    assert r12 == pytest.approx(152.121, abs=1e-3)
    assert res.restarts == 1 and res.restart_causes == {"state_lost": 1}
    assert res.restart_time == pytest.approx(45.0 + r8)
    # 5 steps redone (50 s) plus the aborted 5 s of step 5
    assert res.lost_time == pytest.approx(55.0)
    # up at 100 + R8 = 284.24 s; 25 steps by 534.24 s, the 25-step save on one node (2 * SAVE_S =
    # 56.21 s) ends at 590.45 s, and step 26 would end past 600 s
    assert res.checkpoint_time == pytest.approx(2 * SAVE_S)
    assert res.steps == 25
    assert pol.plan is NARROW


def _sharded(zero):
    return Plan((Candidate("actor.train", 8, 1, 2, zero=zero, gpus=tuple(range(16))),
                 Candidate("actor.generate", 1, 1, 16, gpus=tuple(range(16)))))


def test_zero_sharded_replicas_hold_one_copy_of_the_state():
    # DP 2 without ZeRO: two copies (GPUs 0-7 and 8-15); node 1 may go and the state survives
    plain, zero1 = _sharded(0), _sharded(1)
    assert state_copies(plain["actor.train"]) == (tuple(range(8)), tuple(range(8, 16)))
    assert state_survives(plain, frozenset(range(8)))
    assert vulnerable_nodes(plain, JOB.cluster) == {"actor.train": frozenset()}
    # ZeRO-1 over the same DP 2: the optimizer state is sharded over both nodes, one copy
    assert state_copies(zero1["actor.train"]) == (tuple(range(16)),)
    assert not state_survives(zero1, frozenset(range(8)))
    assert state_survives(zero1, frozenset(range(16)))
    assert vulnerable_nodes(zero1, JOB.cluster) == {"actor.train": frozenset({0, 1})}
    # uniform hits of one node among 2: P_hit = 1 * 2 / 2 = 1 (was 0 when DP 2 counted as 2 copies)
    assert hit_probability(zero1, JOB.cluster, frozenset(range(16))) == 1.0
    assert hit_probability(plain, JOB.cluster, frozenset(range(16))) == 0.0


def test_redundant_training_candidates_are_unsharded():
    from nereus.cost.model import CostModel
    from nereus.planner.candidates import enumerate_candidates
    from nereus.spec.framework import get_framework

    job = JOB.with_framework(get_framework("megatron"))
    cost = CostModel(job)
    ms = next(m for m in cost.workflow.model_stages if m.name == "actor.train")
    any_z = enumerate_candidates(cost, ms, 16, True)
    red = enumerate_candidates(cost, ms, 16, True, min_train_replicas=2)
    assert (any_z.z > 0).any()          # megatron offers ZeRO-1 to DP > 1 rows
    assert red.dp.size and (red.dp >= 2).all() and not (red.z > 0).any()
