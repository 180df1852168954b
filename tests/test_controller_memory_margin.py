"""A plan over the planning headroom but within the device at the measured peak ratio is not invalid
(``nereus.controller.memory_margin``), by hand with a fake planner."""

from dataclasses import replace

import pytest

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import Keep, Transition, TransitionCost
from nereus.controller.memory_margin import measured_ratio
from nereus.controller.monitor import StepReport
from nereus.spec import hardware, job, presets, workload
from nereus.spec.plan import Candidate, Plan

JOB = job.JobSpec(presets.get_model("llama-3.1-8b"), hardware.ClusterSpec(hardware.get_gpu("h100"), 1, 8),
                  workload.WorkloadSpec(algorithm="grpo", reward_model=False, response_len=2000))
POOL8 = frozenset(range(8))
CAP = 80e9


def _plan(tp, gpus=range(8)):
    return Plan(candidates=(Candidate("actor.train", tp, 1, len(gpus) // tp, gpus=tuple(gpus)),))


class MarginPlanner:
    """Predicted peak 70 GB · len / 2000 (tp 1) or half of it (tp 2); headroom 10%: usable 72 GB;
    L_step = len / 100 · (1 + 0.1 · tp)."""

    def estimate(self, job, plan, pool=None):
        c, n = plan.candidates[0], job.workload.response_len
        return replace(plan, l_step=n / 100 * (1 + 0.1 * c.tp),
                       peak_memory={"actor.train": 70e9 * n / 2000 / c.tp})

    def memory_ok(self, job, plan):
        return self.estimate(job, plan).peak_memory["actor.train"] <= 0.9 * CAP

    def memory_fits(self, job, plan, correction):
        return self.estimate(job, plan).peak_memory["actor.train"] * max(1.0, correction) <= CAP

    def plan(self, job, pool, current, urgent, min_train_replicas=1):
        return self.estimate(job, _plan(2))

    def alternatives(self, job, pool, current, best):
        return []

    def calibrate(self, *a, **k):
        pass

    def note_oom(self):
        pass

    def efficiencies(self):
        return {}


def _run(margin: bool, measured_factor: float):
    fp = MarginPlanner()
    ctl = Controller(JOB, fp.estimate(JOB, _plan(1)), fp, transition_cost=lambda *a: TransitionCost(100.0),
                     config=ControllerConfig(memory_margin=margin))
    ctl.observe(StepReport(0, 2050, POOL8, step_time=21.0, peak_memory={"actor.train": 71.75e9 * measured_factor}))
    # 2,100 tokens: predicted 73.5 GB > 72 GB usable (2.4% length drift: no seq_len trigger)
    return ctl.observe(StepReport(1, 2100, POOL8, step_time=21.5, peak_memory={"actor.train": 73.5e9 * measured_factor}))


def test_measured_ratio_is_the_worst_stage():
    p = replace(_plan(1), peak_memory={"actor.train": 50e9, "ref.infer": 10e9})
    assert measured_ratio(p, {"actor.train": 52e9, "ref.infer": 11e9}) == pytest.approx(1.1)
    assert measured_ratio(p, {}) is None


def test_over_headroom_is_urgent_without_the_margin_rule():
    d = _run(margin=False, measured_factor=1.05)
    assert isinstance(d, Transition) and d.urgent and "memory" in d.reason


def test_over_headroom_within_the_device_keeps_running():
    # 73.5 GB · 1.05 = 77.2 GB <= 80 GB: the plan is over the planning margin, not invalid
    d = _run(margin=True, measured_factor=1.05)
    assert isinstance(d, Keep) and d.reason == "no trigger"


def test_over_the_device_at_the_measured_ratio_is_still_urgent():
    # 73.5 GB · 1.12 = 82.3 GB > 80 GB
    d = _run(margin=True, measured_factor=1.12)
    assert isinstance(d, Transition) and d.urgent
