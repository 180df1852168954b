"""The simulated cluster, the restart cost model and the policy loop on small scenarios."""

import pytest

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.monitor import StepReport
from nereus.controller.planning import CostModelPlanner
from nereus.sim.cluster import TRUE_EFFICIENCY, SimulatedCluster, Truth
from nereus.sim.growth import growth_scenario
from nereus.sim.policies import make_policy
from nereus.sim.restart import RestartCost
from nereus.sim.run import simulate
from nereus.sim.traces import AvailabilityTrace
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

JOB = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8),
              WorkloadSpec(algorithm="grpo", reward_model=False, prompts_per_step=64, samples_per_prompt=4,
                           response_len=500, mini_batch_size=64))
STEADY = AvailabilityTrace("steady", (0.0,), (16,), 7200.0, unit="gpus")
DROP = AvailabilityTrace("drop", (0.0, 1800.0, 3600.0), (16, 12, 16), 5400.0, unit="gpus")


def test_restart_cost_hand_computed():
    job = JOB.with_workload(WorkloadSpec(algorithm="ppo"))
    rc = RestartCost()
    n_actor, n_critic = 8_030_261_248, 7_504_928_769        # Llama-3.1-8B and its value-head variant
    assert rc.state_bytes(job) == 14 * (n_actor + n_critic)  # actor + critic: bf16 weights + Adam
    assert rc.load_bytes(job) == 16 * (n_actor + n_critic)   # + reference and reward weights
    assert rc.save_s(job, 4) == pytest.approx(14 * (n_actor + n_critic) / 8e9)
    assert rc.restart_s(job, 4) == pytest.approx(60 + 16 * (n_actor + n_critic) / 8e9 + 60)
    with pytest.raises(ValueError, match="checkpoint_every"):
        RestartCost(checkpoint_every=0)


def test_cluster_reports_true_times_and_calibration_converges():
    # without the effects the planner does not model, calibration recovers the true efficiencies
    truth = Truth(step_noise=0.0, congestion_per_hour=0.0, tp_penalty=0.0, overlap=0.0)
    cl = SimulatedCluster(JOB, STEADY, growth_scenario(50, sigma=0.0), truth)
    planner = CostModelPlanner()
    plan = planner.plan(cl.job_at(500), cl.pool_at(0), None, False)
    ctl = Controller(JOB, plan, planner, config=ControllerConfig())
    for step in range(12):
        out = cl.execute_step(ctl.plan, step, 0.0)
        assert out.completed and out.duration == pytest.approx(cl.true_plan(ctl.plan, out.response_len, 0).l_step)
        ctl.observe(out.report)
    assert planner.efficiency.get("gemm") == pytest.approx(TRUE_EFFICIENCY["gemm"], rel=0.01)
    assert planner.efficiency.get("memory_bound") == pytest.approx(TRUE_EFFICIENCY["memory_bound"], rel=0.01)
    assert planner.memory_correction["actor.train"] == pytest.approx(truth.memory_factor, rel=0.01)


def test_oom_costs_half_a_step_and_is_reported():
    cl = SimulatedCluster(JOB, STEADY, growth_scenario(5), Truth(memory_factor=5.0, step_noise=0.0))
    plan = CostModelPlanner().plan(cl.job_at(500), cl.pool_at(0), None, False)
    out = cl.execute_step(plan, 0, 0.0)
    assert out.oom and not out.completed and out.report.oom
    assert out.duration == pytest.approx(0.5 * cl.true_plan(plan, out.response_len, 0).l_step)


def test_gpu_loss_aborts_step_at_the_loss():
    cl = SimulatedCluster(JOB, DROP, growth_scenario(5), Truth(step_noise=0.0, detect_s=(0.0, 0.0)))
    plan = CostModelPlanner().plan(cl.job_at(500), cl.pool_at(0), None, False)
    assert plan.gpus_used() - cl.pool_at(1800.0)            # the plan uses GPUs 12-15
    out = cl.execute_step(plan, 0, 1800.0 - 1.0)
    assert out.aborted_by_pool and out.duration == pytest.approx(1.0) and len(out.report.pool) == 12
    # default truth: an unannounced loss is seen only after failure detection, 15-50 s (Ray's health check)
    cl = SimulatedCluster(JOB, DROP, growth_scenario(5), Truth(step_noise=0.0, detect_s=(20.0, 20.0)))
    out = cl.execute_step(plan, 0, 1800.0 - 1.0)
    assert out.aborted_by_pool and out.detect_s == 20.0 and out.duration == pytest.approx(21.0)
    assert out.report.elapsed_s == pytest.approx(1820.0)
    # with a 120 s notice the GPUs leave P_gpu at 1680 s: the plan does not start, nothing to detect
    cl = SimulatedCluster(JOB, DROP, growth_scenario(5), Truth(step_noise=0.0, notice_s=120.0))
    out = cl.execute_step(plan, 0, 1700.0)
    assert out.aborted_by_pool and out.detect_s == 0.0 and out.duration == 0.0


def test_cluster_rejects_unscaled_or_oversized_trace():
    with pytest.raises(ValueError, match="scaled"):
        SimulatedCluster(JOB, AvailabilityTrace("x", (0.0,), (4,), 1.0), growth_scenario(5))
    with pytest.raises(ValueError, match="cluster has 16"):
        SimulatedCluster(JOB, AvailabilityTrace("x", (0.0,), (32,), 1.0, unit="gpus"), growth_scenario(5))


@pytest.mark.parametrize("name", ["static", "nereus"])
def test_policies_survive_a_gpu_drop(name):
    truth = Truth()
    cl = SimulatedCluster(JOB, DROP, growth_scenario(2000, over_steps=200), truth, hours=1.5)
    pol = make_policy(name, JOB, 0.5, truth.table(), truth.memory_factor)
    r = simulate(pol, cl, 1.5)
    assert r.steps > 0 and r.tokens > 0 and r.throughput == pytest.approx(r.tokens / 5400.0)
    assert r.time_lost + r.checkpoint_time <= r.duration
    assert sum(r.summary()["restarts_by_cause"].values()) == r.restarts
    assert all(e["cause"] for e in r.events if e["kind"] == "restart" and "waiting" not in e["reason"])
    if name == "static":
        assert r.restarts >= 1 and r.transitions == 0
        assert any("lost 4 GPUs" in e["reason"] for e in r.events)
    else:
        assert r.transitions + r.restarts >= 1
        assert all("decision" in e for e in r.log)


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("greedy", JOB, 0.5, Truth().table(), 1.0)
    with pytest.raises(ValueError, match="γ"):
        make_policy("gamma=abc", JOB, 0.5, Truth().table(), 1.0)


def test_step_report_validates():
    with pytest.raises(ValueError, match="response_len"):
        StepReport(0, 0.0, frozenset({0}))


def test_policy_configs_price_state_loss_risk_except_the_paper_variants():
    """Risk pricing comes from the restart-cost model: restart_s = 60 + load + 60 s with the whole
    cluster reading (checkpoint + frozen weights) at 2 GB/s per node; checkpoint every 25 steps."""
    from nereus.sim.restart import RestartCost

    t = Truth()
    rc = RestartCost()
    expect = 60.0 + rc.load_bytes(JOB) / (2e9 * JOB.cluster.num_nodes) + 60.0
    for name, admit_all, priced in [("nereus", False, True), ("nereus-paper", False, False),
                                    ("replan-all", True, True), ("replan-all-paper", True, False),
                                    ("uncalibrated", False, True), ("gamma=0.25", False, True)]:
        cfg = make_policy(name, JOB, 0.5, t.table(), t.memory_factor).config
        assert cfg.always_admit is admit_all, name
        assert (cfg.risk is not None) is priced, name
        if priced:
            assert cfg.risk.restart_s == pytest.approx(expect) and cfg.risk.checkpoint_interval == 25
    assert make_policy("gamma=0.25", JOB, 0.5, t.table(), t.memory_factor).config.gamma == 0.25
    for name, replay, margin in [("nereus", False, False), ("nereus+replay", True, False),
                                 ("nereus+margin", False, True), ("nereus+replay+margin", True, True)]:
        cfg = make_policy(name, JOB, 0.5, t.table(), t.memory_factor).config
        assert (cfg.loss_replay, cfg.memory_margin) == (replay, margin), name
