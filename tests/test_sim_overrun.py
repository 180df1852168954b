"""A live transition cut short by departing GPUs (``nereus.sim.run``, cause ``transition_overrun``).

The loop is driven by a scripted policy on a cluster whose steps take a fixed 10 s and whose
transitions take a fixed 50 s, so every expected time and step count below follows from the trace
by hand. The plans are hand-built: ``actor.train`` TP 8 x DP 2 (one whole replica per node).
"""

import pytest

from nereus.controller.decisions import Keep, Transition, TransitionCost
from nereus.controller.monitor import StepReport
from nereus.sim.cluster import SimulatedCluster, StepOutcome, Truth
from nereus.sim.growth import growth_scenario
from nereus.sim.restart import RestartCost
from nereus.sim.run import overrun_at, simulate
from nereus.sim.traces import AvailabilityTrace
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

JOB = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8),
              WorkloadSpec(algorithm="grpo", reward_model=False, prompts_per_step=64, samples_per_prompt=4,
                           response_len=500, mini_batch_size=64))
STEP_S = 10.0
TRANSITION_S = 50.0


def _plan(train_gpus, gen_gpus) -> Plan:
    n = len(train_gpus) // 8
    return Plan((Candidate("actor.train", 8, 1, n, gpus=tuple(train_gpus)),
                 Candidate("actor.generate", 1, 1, len(gen_gpus), gpus=tuple(gen_gpus))))


# both nodes: actor.train replicas on GPUs 0-7 and 8-15
WIDE = _plan(range(16), range(16))
# node 0 only
NARROW = _plan(range(8), range(8))
# actor.train's replicas each straddle both nodes: GPUs 0-3 + 8-11 and 4-7 + 12-15
STRADDLE = Plan((Candidate("actor.train", 8, 1, 2, gpus=(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)),
                 Candidate("actor.generate", 1, 1, 16, gpus=tuple(range(16)))))


class FixedCluster(SimulatedCluster):
    """Steps of ``STEP_S`` seconds (aborted at a loss of one of the plan's GPUs, no detection delay),
    transitions of ``TRANSITION_S`` seconds; pool, losses and liveness from the real trace code."""

    def execute_step(self, plan, step, t, save_s=0.0):
        length = self.lengths.at(step)
        if not plan.gpus_used() <= self.pool_at(t):
            return self._aborted(step, length, 0.0, t)
        lost_at = self.loss_time(plan.gpus_used(), t)
        if lost_at < t + STEP_S:
            return self._aborted(step, length, lost_at - t, lost_at)
        end = t + STEP_S
        report = StepReport(step=step, response_len=length, pool=self.pool_at(end), step_time=STEP_S,
                            alive=self.alive_at(end), elapsed_s=end)
        return StepOutcome(STEP_S, True, False, False, length, report)

    def transition_time(self, current, target, pool, response_len):
        return TRANSITION_S


class Scripted:
    """Starts on ``first``; after the first report of step ``at`` asks for a transition to ``target``."""

    name = "scripted"

    def __init__(self, first, target, at):
        self.plan, self.target, self.at, self.log, self.asked = first, target, at, [], False

    def start(self, pool, response_len):
        return self.plan

    def observe(self, report):
        if report.step == self.at and not self.asked:
            self.plan, self.asked = self.target, True
            return Transition(self.target, TransitionCost(TRANSITION_S), "scripted", urgent=True)
        return Keep("scripted")

    def resume(self, plan):
        self.plan = plan


def _cluster(times, counts, end):
    trace = AvailabilityTrace("t", tuple(times), tuple(counts), end, unit="gpus")
    return FixedCluster(JOB, trace, growth_scenario(100, sigma=0.0), Truth(step_noise=0.0))


def test_overrun_when_a_source_gpu_leaves_during_the_transition():
    # node 1 (GPUs 8-15) leaves at 100 s; a 50 s transition off it that starts at 60 s is cut at 100 s
    cl = _cluster((0.0, 100.0), (16, 8), 400.0)
    assert overrun_at(cl, WIDE, NARROW, cl.alive_at(60.0), 60.0, TRANSITION_S) == 100.0
    # one that starts at 40 s ends at 90 s, before the loss
    assert overrun_at(cl, WIDE, NARROW, cl.alive_at(40.0), 40.0, TRANSITION_S) is None


def test_gpus_already_gone_are_not_sources():
    # GPUs 12-15 leave at 55 s; at 80 s two come back (12-13 alive again, 14-15 still gone). A
    # transition planned at 55 s onto GPUs 0-7 reads nothing from 12-15: the change at 80 s does
    # not cut it short (it did when the already-gone GPUs counted as sources)
    cl = _cluster((0.0, 55.0, 80.0), (16, 12, 14), 400.0)
    assert overrun_at(cl, WIDE, NARROW, cl.alive_at(55.0), 55.0, TRANSITION_S) is None
    # but GPUs 8-11, alive at 55 s and read by the transition, leave at 80 s in this trace
    cl = _cluster((0.0, 55.0, 80.0), (16, 12, 8), 400.0)
    assert overrun_at(cl, WIDE, NARROW, cl.alive_at(55.0), 55.0, TRANSITION_S) == 80.0


def test_loop_runs_the_transition_when_only_gone_gpus_are_involved():
    # the WIDE plan's step 5 (50-60 s) is aborted by the loss at 55 s; the policy moves onto NARROW
    # (55 -> 105 s); the gain at 80 s must not turn it into a restart
    cl = _cluster((0.0, 55.0, 80.0), (16, 12, 14), 400.0)
    res = simulate(Scripted(WIDE, NARROW, at=5), cl, 300.0 / 3600.0, RestartCost(checkpoint_rule="fixed"))
    assert res.restarts == 0 and res.transitions == 1
    assert res.transition_time == TRANSITION_S and res.lost_time == pytest.approx(5.0)
    # 5 steps before the loss, then (300 - 105) / 10 = 19.5 -> 19 more
    assert res.steps == 5 + 19


def test_overrun_keeps_progress_when_a_whole_replica_survives():
    # 6 steps (0-60 s) on WIDE, then a transition to NARROW from 60 s; node 1 leaves at 100 s.
    # actor.train's replica on GPUs 0-7 is intact: save a checkpoint from it, restart, redo nothing
    rc = RestartCost(checkpoint_rule="fixed")  # no periodic save in these 400 s
    cl = _cluster((0.0, 100.0), (16, 8), 1000.0)
    res = simulate(Scripted(WIDE, NARROW, at=5), cl, 400.0 / 3600.0, rc)
    assert res.restart_causes == {"transition_overrun": 1} and res.transitions == 0
    ev = [e for e in res.events if e["kind"] == "restart"][0]
    assert ev["redone_s"] == 0.0
    save, restart = rc.save_s(JOB, 2), rc.restart_s(JOB, 2)        # both nodes held the plan and the pool
    assert res.checkpoint_time == pytest.approx(save)
    assert res.lost_time == pytest.approx(100.0 - 60.0)             # the aborted transition only
    resumed = 100.0 + save + restart
    assert res.steps == 6 + int((400.0 - resumed) // STEP_S)        # no step was lost (fewer than 25: no periodic save)


def test_overrun_redoes_the_steps_when_no_whole_replica_survives():
    # the same, but each actor.train replica straddles both nodes: the loss of node 1 breaks both,
    # so the trained state is gone and the 6 steps since the start are redone
    rc = RestartCost(checkpoint_rule="fixed")  # no periodic save in these 400 s
    cl = _cluster((0.0, 100.0), (16, 8), 1000.0)
    res = simulate(Scripted(STRADDLE, NARROW, at=5), cl, 400.0 / 3600.0, rc)
    ev = [e for e in res.events if e["kind"] == "restart"][0]
    assert res.restart_causes == {"transition_overrun": 1}
    assert ev["redone_s"] == pytest.approx(6 * STEP_S) and res.checkpoint_time == 0.0
    assert res.lost_time == pytest.approx(6 * STEP_S + 40.0)
    resumed = 100.0 + rc.restart_s(JOB, 2)
    assert res.steps == int((400.0 - resumed) // STEP_S)
