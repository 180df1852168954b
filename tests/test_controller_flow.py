"""The controller driven through its public interface with a fake planner (hand-computed numbers)."""

import ast
import pathlib
from dataclasses import replace

import pytest

from nereus.controller.controller import Controller, ControllerConfig, state_survives
from nereus.controller.decisions import Keep, Restart, Transition, TransitionCost
from nereus.controller.monitor import StepReport
from nereus.spec import hardware, job, presets, workload
from nereus.spec.plan import Candidate, Plan

JOB = job.JobSpec(presets.get_model("llama-3.1-8b"), hardware.ClusterSpec(hardware.get_gpu("h100"), 1, 8),
                  workload.WorkloadSpec(algorithm="grpo", reward_model=False, response_len=1000))


def _plan(tp, gpus):
    dp = len(gpus) // tp
    return Plan(candidates=(Candidate("actor.train", tp, 1, dp, gpus=tuple(gpus)),))


class FakePlanner:
    """L_step = len/100 · (1 + 0.1·tp) / (#GPUs/4); tp=1 is infeasible above 2000 tokens."""

    def __init__(self):
        self.calls = []

    def estimate(self, job, plan, pool=None):
        c = plan.candidates[0]
        n = job.workload.response_len
        return replace(plan, l_step=n / 100 * (1 + 0.1 * c.tp) / (c.num_gpus / 4))

    def memory_ok(self, job, plan):
        return plan.candidates[0].tp > 1 or job.workload.response_len <= 2000

    def plan(self, job, pool, current, urgent):
        self.calls.append((len(pool), urgent))
        gpus = sorted(pool)[: 4 if len(pool) < 8 else 8]
        if len(gpus) < 2:
            raise ValueError("nothing fits on 1 GPU")
        tp = 1 if job.workload.response_len <= 2000 else 2
        return self.estimate(job, _plan(tp, gpus))

    def alternatives(self, job, pool, current, best):
        return []

    def calibrate(self, *a, **k):
        pass

    def note_oom(self):
        pass

    def efficiencies(self):
        return {}


def _ctl(plan, l_tran=20.0, **cfg):
    fp = FakePlanner()
    return Controller(JOB, fp.estimate(JOB, plan), fp, transition_cost=lambda *a: TransitionCost(l_tran),
                      config=ControllerConfig(**cfg)), fp


POOL8 = frozenset(range(8))


def test_no_trigger_keeps_and_first_step_sets_reference():
    ctl, fp = _ctl(_plan(1, range(8)))
    d = ctl.observe(StepReport(0, 1000, POOL8, step_time=10))
    assert isinstance(d, Keep) and d.reason == "no trigger" and fp.calls == []


def test_rejected_replan_still_resets_reference():
    # on 4 of 8 GPUs, tp=1: L_step(1400) = 14·1.1 = 15.4; best on 8 GPUs: 14·1.1/2 = 7.7 → ΔL 7.7
    ctl, fp = _ctl(_plan(1, range(4)), l_tran=20.0)       # payback 20/7.7 = 2.6 > 0.5·H = 0.5
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1400, POOL8))
    assert isinstance(d, Keep) and "payback 2.60 steps" in d.reason and d.triggers == ("seq_len",)
    d = ctl.observe(StepReport(2, 1450, POOL8))           # 3.6% from the reset reference 1400
    assert isinstance(d, Keep) and d.reason == "no trigger"
    assert len(fp.calls) == 1


def test_repeated_growth_builds_horizon_until_admitted():
    ctl, _ = _ctl(_plan(1, range(4)), l_tran=20.0)
    ctl.observe(StepReport(0, 1000, POOL8))
    lens = {10: 1310, 20: 1710}                            # crossings at steps 10 and 20
    for s in range(1, 21):
        d = ctl.observe(StepReport(s, lens.get(s, 1000 if s < 10 else 1310 if s < 20 else 1710), POOL8))
    # step 20: H = 10 (one interval), ΔL = 17.1·1.1/2 = 9.405, payback 2.13 <= 0.5·10
    assert isinstance(d, Transition) and not d.urgent
    assert d.delta_l == pytest.approx(17.1 * 1.1 / 2)
    assert ctl.plan.candidates[0].num_gpus == 8


def test_gamma_zero_rejects_opportunistic_but_not_urgent():
    ctl, _ = _ctl(_plan(1, range(8)), gamma=0.0)
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 2600, POOL8))           # tp=1 infeasible at 2600 → urgent (memory)
    assert isinstance(d, Transition) and d.urgent and set(d.triggers) == {"memory", "seq_len"}
    assert ctl.plan.candidates[0].tp == 2


def test_lost_gpus_take_the_urgent_path_even_if_it_never_pays_back():
    ctl, fp = _ctl(_plan(1, range(8)), l_tran=1e6)
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(4))))
    assert isinstance(d, Transition) and d.urgent and d.triggers == ("pool",)
    assert fp.calls == [(4, True)] and ctl.plan.gpus_used() == frozenset(range(4))


def test_restart_when_state_lost_or_nothing_fits():
    ctl, _ = _ctl(_plan(8, range(8)))                      # one replica on all 8 GPUs
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(4))))
    assert isinstance(d, Restart) and d.plan is not None and "checkpoint" in d.reason
    assert d.cause == "state_lost" and d.to_dict()["cause"] == "state_lost"
    ctl, _ = _ctl(_plan(1, range(8)))
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset({0})))
    assert isinstance(d, Restart) and d.plan is None and "nothing fits" in d.reason and d.cause == "no_plan"


def test_state_survives_needs_one_whole_train_replica():
    p = _plan(2, range(8))                                 # replicas {0,1} {2,3} {4,5} {6,7}
    assert state_survives(p, frozenset({0, 1}))
    assert not state_survives(p, frozenset({1, 2, 5, 6}))


def test_replan_all_admits_without_payback():
    ctl, _ = _ctl(_plan(1, range(4)), l_tran=1e6, always_admit=True)
    ctl.observe(StepReport(0, 1000, POOL8))
    assert isinstance(ctl.observe(StepReport(1, 1400, POOL8)), Transition)


def test_controller_config_validates():
    with pytest.raises(ValueError, match="gamma"):
        ControllerConfig(gamma=1.5)


def test_controller_imports_nothing_from_sim_or_runtime():
    root = pathlib.Path(__file__).resolve().parents[1] / "nereus" / "controller"
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert not n.startswith(("nereus.sim", "nereus.runtime")), (f.name, n)


def test_restart_saves_first_when_state_is_alive_under_a_notice():
    ctl, _ = _ctl(_plan(8, range(8)))                      # one replica: a loss kills its only copy
    ctl.transition_cost = lambda *a: TransitionCost(1.0, feasible=False, reason="no memory")
    ctl.observe(StepReport(0, 1000, POOL8))
    # GPUs 4-7 got a preemption notice: out of P_gpu but still alive
    d = ctl.observe(StepReport(1, 1000, frozenset(range(4)), alive=POOL8))
    assert isinstance(d, Restart) and d.checkpoint_first and "no memory" in d.reason
    assert d.cause == "infeasible_transition"
    ctl, _ = _ctl(_plan(8, range(8)))
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(4))))  # no notice: the copy is gone
    assert isinstance(d, Restart) and not d.checkpoint_first


def test_revisit_readmits_a_rejected_target_after_a_quiet_horizon():
    # seq_len crosses at step 1 and is rejected (payback 20/7.7 = 2.6 steps > 0.5·H, H = 1);
    # revisits use H = steps since that crossing and wait that long again: steps 2, 3, 5, 9
    ctl, _ = _ctl(_plan(1, range(4)), l_tran=20.0, revisit=True)
    ctl.observe(StepReport(0, 1000, POOL8))
    seen = {}
    for s in range(1, 10):
        d = ctl.observe(StepReport(s, 1400, POOL8))
        seen[s] = (type(d).__name__, d.triggers)
    assert seen[1] == ("Keep", ("seq_len",))
    assert [s for s, v in seen.items() if v[1] == ("stale:seq_len",)] == [2, 3, 5, 9]
    assert seen[5][0] == "Keep"                          # 2.6 > 0.5·4
    assert seen[9][0] == "Transition"                    # 2.6 <= 0.5·8


def test_an_executor_revisit_replans_with_the_steps_since_the_crossing_as_horizon():
    # rejected at step 1 (payback 20/7.7 = 2.6 steps > 0.5·1); the target then gets cheaper (L_tran 1 s:
    # its engines were warmed) and the executor asks for a revisit after step 3: H = 3 − 1 = 2 steps,
    # payback 1/7.7 = 0.13 <= 0.5·2, admitted; without the request the boundary has no trigger
    cost = {"l": 20.0}
    fp = FakePlanner()
    ctl = Controller(JOB, fp.estimate(JOB, _plan(1, range(4))), fp, transition_cost=lambda *a: TransitionCost(cost["l"]))
    ctl.observe(StepReport(0, 1000, POOL8))
    assert isinstance(ctl.observe(StepReport(1, 1400, POOL8)), Keep)
    cost["l"] = 1.0
    assert ctl.observe(StepReport(2, 1400, POOL8)).reason == "no trigger"
    ctl.revisit(3, "seq_len")
    d = ctl.observe(StepReport(3, 1400, POOL8))
    assert isinstance(d, Transition) and d.triggers == ("stale:seq_len",) and "payback 0.13 steps" in d.reason, d
    assert "γ·H = 0.5·2.00" in d.reason


def test_cost_model_planner_passes_urgent_options_to_the_search():
    from nereus.controller.planning import CostModelPlanner

    calls = []

    def fake_plan_job(job, pool=None, current=None, cost=None, **kw):
        calls.append(kw)
        raise ValueError("nothing fits")

    pl = CostModelPlanner(plan_fn=fake_plan_job, options={"x": 1})
    for urgent in (False, True):
        with pytest.raises(ValueError):
            pl.plan(JOB, POOL8, None, urgent)
    assert calls[0] == {"x": 1}
    opts = calls[1]["options"]
    assert opts.recompute_modes == ("none", "selective", "full") and opts.min_micro_batch == 1


class FixedPlanner(FakePlanner):
    """Always proposes ``target``; every plan takes 10 s/step and fits."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def estimate(self, job, plan, pool=None):
        return replace(plan, l_step=10.0)

    def memory_ok(self, job, plan):
        return True

    def plan(self, job, pool, current, urgent):
        self.calls.append((len(pool), urgent))
        return self.estimate(job, self.target)


def _two_stage(train_gpus, ref_gpus):
    return Plan((Candidate("reference.infer", 1, 1, len(ref_gpus), gpus=tuple(ref_gpus)),
                 Candidate("actor.train", 2, 1, len(train_gpus) // 2, gpus=tuple(train_gpus))))


def test_losing_every_frozen_replica_is_a_live_transition_but_losing_train_state_restarts():
    """With the DAG estimate (default transition cost): reference.infer on the reclaimed GPUs 6, 7 is
    reloaded from storage by an urgent transition; actor.train there forces a checkpoint restore."""
    target = _two_stage((0, 1, 2, 3), (4, 5))
    fp = FixedPlanner(target)
    ctl = Controller(JOB, fp.estimate(JOB, _two_stage((0, 1, 2, 3), (6, 7))), fp)
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(6))))
    assert state_survives(_two_stage((0, 1, 2, 3), (6, 7)), frozenset(range(6)))
    assert isinstance(d, Transition) and d.urgent, d
    assert d.estimate.feasible and "reference.infer (from storage)" in d.estimate.reason
    assert d.estimate.l_tran == pytest.approx(2.0 + 8_030_261_248 * 2 / 2e9 + 0.05 + 8_030_261_248 * 2 / 450e9 + 5e-6)
    fp = FixedPlanner(_two_stage((0, 1, 2, 3), (4, 5)))
    ctl = Controller(JOB, fp.estimate(JOB, _two_stage((4, 5, 6, 7), (0, 1))), fp)
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(6))))  # actor.train#1 on 6, 7 lost, #0 on 4, 5 alive
    assert isinstance(d, Transition) and d.urgent
    ctl = Controller(JOB, fp.estimate(JOB, _two_stage((4, 5, 6, 7), (0, 1))), fp)
    ctl.observe(StepReport(0, 1000, POOL8))
    d = ctl.observe(StepReport(1, 1000, frozenset(range(4))))  # both actor.train replicas lost
    assert isinstance(d, Restart) and not d.checkpoint_first and "trainable" in d.reason and d.cause == "state_lost"
    # the count is of GPUs lost (4-7 held both actor.train replicas), not the model-stage's size
    assert d.reason.startswith("4 GPU(s) of the plan were lost (4-7), taking every replica of the trainable "
                               "model-stage(s) actor.train")
