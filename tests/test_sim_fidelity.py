"""Issue 15: the elastic checkpoint/restart baselines, the H_x prior, the unmodelled effects of the
simulated truth, trace time units, windows and length normalization. Expected values by hand."""

import math

import pytest

from nereus.cli import main
from nereus.controller.horizon import Horizon
from nereus.controller.monitor import Monitor, StepReport
from nereus.controller.planning import CostModelPlanner
from nereus.controller.transition_cost import engine_reinit, estimate_transition_cost
from nereus.sim.cluster import SimulatedCluster, Truth, unmodelled
from nereus.sim.growth import growth_scenario
from nereus.sim.policies import ElasticPolicy, make_policy, restart_pays
from nereus.sim.restart import RestartCost
from nereus.sim.trace_formats import infer_time_unit
from nereus.sim.traces import AvailabilityTrace, LengthTrace, load_availability
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import StageEstimate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

JOB = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8),
              WorkloadSpec(algorithm="grpo", reward_model=False, prompts_per_step=64, samples_per_prompt=4,
                           response_len=500, mini_batch_size=64))
N_ACTOR = 8_030_261_248  # Llama-3.1-8B parameters


# ------------------------------------------------------------------ elastic checkpoint/restart
def test_restart_pays_threshold_by_hand():
    # L 100 -> 80 s/step, R = 200 s: restart iff W * 20/100 > 200, i.e. W > 1000 s
    assert not restart_pays(100.0, 80.0, 1000.0, 200.0)
    assert restart_pays(100.0, 80.0, 1001.0, 200.0)
    assert restart_pays(100.0, 80.0, math.inf, 200.0)
    assert not restart_pays(100.0, 100.0, 1e9, 0.0)       # not faster: never
    assert not restart_pays(100.0, 80.0, 0.0, 0.0)         # no time left: never


def _elastic(future=None):
    pol = make_policy("elastic-oracle" if future else "elastic", JOB, 0.5, Truth().table(), 1.08,
                      RestartCost(), future=future)
    assert isinstance(pol, ElasticPolicy)
    return pol


def test_elastic_restart_cost_by_hand():
    pol = _elastic()
    plan = pol.start(frozenset(range(16)), 500)
    # GRPO without a reward model: the actor is trained (14 B/param saved), the reference is frozen
    # (2 B/param loaded); save over the plan's nodes, load over the pool's, 2 GB/s per node
    nodes = len(JOB.cluster.nodes_of(plan.gpus_used()))
    save = 14 * N_ACTOR / (2e9 * nodes)
    restart = 60 + 16 * N_ACTOR / (2e9 * 2) + 60
    assert pol.restart_cost(plan, frozenset(range(16))) == pytest.approx(save + restart)


def test_elastic_grows_only_when_the_window_repays_the_restart():
    small = frozenset(range(8))
    big = frozenset(range(16))
    for window, expect_restart in ((1.0, False), (1e7, True)):
        pol = _elastic(future=lambda gpus, t, w=window: w)
        plan = pol.start(small, 500)
        rep = StepReport(step=3, response_len=500, pool=big, step_time=60.0, elapsed_s=600.0)
        d = pol.observe(rep)
        assert (type(d).__name__ == "Restart") == expect_restart, d.reason
        if expect_restart:
            assert d.checkpoint_first and d.cause == "elastic_resize" and d.plan.gpus_used() - small
        else:
            assert pol.plan is plan and "does not pay" in d.reason
    # no pool change and not at a checkpoint boundary: nothing to decide
    pol = _elastic()
    pol.start(small, 500)
    assert type(pol.observe(StepReport(step=1, response_len=500, pool=small, step_time=60.0,
                                       elapsed_s=120.0))).__name__ == "Keep"


def test_elastic_window_is_elapsed_over_losses_plus_one():
    pol = _elastic()
    plan = pol.start(frozenset(range(16)), 500)
    assert pol.window(plan, 900.0) == 900.0                 # no loss seen: W = t / 1
    pol.observe(StepReport(step=1, response_len=500, pool=frozenset(range(15)), step_time=60.0,
                           elapsed_s=1000.0))               # a loss (forced restart if it hit the plan)
    assert pol.losses == 1 and pol.window(pol.plan, 1000.0) == 500.0


def test_elastic_forced_restart_on_a_lost_gpu_of_its_plan():
    pol = _elastic()
    plan = pol.start(frozenset(range(16)), 500)
    assert 15 in plan.gpus_used()
    d = pol.observe(StepReport(step=1, response_len=500, pool=frozenset(range(12)), step_time=0.0,
                               alive=frozenset(range(12)), elapsed_s=100.0))
    assert type(d).__name__ == "Restart" and d.plan.gpus_used() <= frozenset(range(12))


def test_elastic_oracle_needs_the_future():
    with pytest.raises(ValueError, match="elastic-oracle"):
        make_policy("elastic-oracle", JOB, 0.5, Truth().table(), 1.08)


# ------------------------------------------------------------------ H_x before the first interval
def test_horizon_elapsed_prior_by_hand():
    h = Horizon(alpha=0.5, first="elapsed", started=3)
    assert h.value == 1.0
    assert h.crossing(10) == 7.0            # quiet since step 3
    assert h.crossing(14) == 5.5            # 0.5*4 + 0.5*7
    assert Horizon(first="elapsed", started=5).crossing(5) == 1.0   # at least one step
    assert Horizon().crossing(10) == 1.0    # the paper's rule is unchanged
    with pytest.raises(ValueError, match="'first'.*one, elapsed.*'two'"):
        Horizon(first="two")
    with pytest.raises(ValueError, match="'started'"):
        Horizon(first="elapsed", started=-1)


def test_monitor_first_pool_change_carries_the_quiet_steps():
    pool = frozenset(range(8))
    m = Monitor(first_horizon="elapsed")
    m.check(0, {}, pool)
    fired = m.check(40, {}, frozenset(range(12)))
    assert fired[0].signal == "pool" and fired[0].horizon == 40.0
    m.reset({}, frozenset(range(12)))
    fired = m.check(44, {}, frozenset(range(16)))
    assert fired[0].horizon == pytest.approx(0.5 * 4 + 0.5 * 40)
    assert Monitor().check(0, {}, pool) == [] and Monitor().check(40, {}, frozenset(range(12))) == []
    with pytest.raises(ValueError, match="first_horizon"):
        Monitor(first_horizon="never")


def test_simulator_policies_use_the_prior_and_paper_keeps_one():
    rc = RestartCost()
    assert make_policy("nereus", JOB, 0.5, Truth().table(), 1.08, rc).monitor.first_horizon == "elapsed"
    assert make_policy("nereus-h1", JOB, 0.5, Truth().table(), 1.08, rc).monitor.first_horizon == "one"
    paper = make_policy("nereus-paper", JOB, 0.5, Truth().table(), 1.08, rc)
    assert paper.monitor is None  # the controller's default Monitor(): H_x = 1


# ------------------------------------------------------------------ unmodelled effects
def test_unmodelled_effects_by_hand():
    est = StageEstimate(time=10.0, breakdown={"gemm": 6.0, "attention": 1.0, "allreduce@nvlink": 2.0,
                                              "p2p@nvlink": 0.5})
    t, bd = unmodelled(est, tp=4, train=True, tp_penalty=0.06, overlap=0.5)
    f = 1 + 0.06 * 2                                   # log2(4) = 2
    assert bd["gemm"] == pytest.approx(6 * f) and bd["attention"] == pytest.approx(f)
    assert bd["allreduce@nvlink"] == 2.0 and bd["p2p@nvlink"] == 0.5
    assert t == pytest.approx(10 + (f - 1) * 7 - 0.5 * 2)   # p2p is not overlapped
    t, _ = unmodelled(est, tp=1, train=False, tp_penalty=0.06, overlap=0.5)
    assert t == 10.0                                   # TP 1, no training collectives to hide


def test_transition_truth_is_movement_times_factor_plus_engine():
    truth = Truth(transition_noise=0.0, engine_noise=0.0)
    trace = AvailabilityTrace("steady", (0.0,), (16,), 7200.0, unit="gpus")
    cl = SimulatedCluster(JOB, trace, growth_scenario(5), truth)
    planner = CostModelPlanner()
    a = planner.plan(cl.job_at(500), frozenset(range(8)), None, False)
    b = planner.plan(cl.job_at(500), frozenset(range(16)), None, False)
    est = estimate_transition_cost(cl.job_at(500), a, b, frozenset(range(16)))
    assert engine_reinit(a, b) == 20.0                 # the flat assumption without a job
    eng = engine_reinit(a, b, job=cl.job_at(500))
    # by hand (engine_start): the slowest new actor.generate engine, 3.1 + 2.74·8.03 + 5·log2(tp·pp),
    # plus 1 s · log2(N) for the process groups of a re-laid-out *.train stage on N GPUs
    gen = next(c for c in b.candidates if c.model_stage == "actor.generate")
    n = max(len(c.gpus) for c in b.candidates if c.model_stage.endswith(".train")
            and (c.key(), c.gpus) != (a[c.model_stage].key(), a[c.model_stage].gpus))
    assert eng == pytest.approx(3.1 + 2.74 * 8.030261248 + 5 * math.log2(gen.tp * gen.pp) + math.log2(n))
    assert est.feasible
    assert cl.transition_time(a, b, frozenset(range(16)), 500) == pytest.approx((est.l_tran - eng) * 1.3 + eng)


def test_truth_rejects_bad_fields():
    with pytest.raises(ValueError, match="'overlap'.*1.5"):
        Truth(overlap=1.5)
    with pytest.raises(ValueError, match="'detect_s'"):
        Truth(detect_s=(50.0, 15.0))


# ------------------------------------------------------------------ traces
def test_time_unit_inference_by_hand():
    month_s = [i * 195.0 for i in range(13_800)]         # 31 days polled every 195 s: max 2.69e6
    assert infer_time_unit(month_s)[0] == "s"
    parcae_ms = [i * 120_000.0 for i in range(342)]      # 11.4 h in ms, 2-minute gaps
    assert infer_time_unit(parcae_ms)[0] == "ms"
    assert infer_time_unit([0, 1800])[0] == "s"
    assert infer_time_unit([0, 150])[0] == "h"
    assert infer_time_unit([0, 5000], "x_scaled.csv")[0] == "h"


def test_inferred_unit_is_recorded(tmp_path):
    p = tmp_path / "month.csv"
    p.write_text("".join(f"{i * 195},{1 + i % 2}\n" for i in range(13_800)))
    tr = load_availability(p)
    assert tr.end == pytest.approx(13_799 * 195.0)       # 747 h, not 0.75 h
    assert "time unit s (inferred" in tr.time_note and "--time-unit" in tr.time_note
    assert load_availability(p, time_unit="ms").time_note == "time unit ms (given)"


def test_window_starts_late_and_scaling_uses_the_window():
    tr = AvailabilityTrace("t", (0.0, 3600.0, 7200.0), (10, 20, 5), 10800.0)
    w = tr.window(0.5, 1.0)
    assert w.times == (0.0, 1800.0) and w.counts == (10, 20) and w.end == 3600.0
    w = tr.window(1.5)
    assert w.times == (0.0, 1800.0) and w.counts == (20, 5) and w.end == 5400.0
    assert tr.window(2.5, 0.5).scaled(32).counts == (32,)     # the window's max (5) becomes 32 GPUs
    assert tr.scaled(32).counts == (16, 32, 8)
    with pytest.raises(ValueError, match="start 3 h.*valid: 0 <= start < 3.00"):
        tr.window(3.0)


def test_length_normalization_by_hand():
    lt = LengthTrace("log", (100.0, 150.0, 200.0))
    assert lt.normalized("max", 8000).lengths == (4000.0, 6000.0, 8000.0)
    assert lt.normalized("mean", 300).lengths == (200.0, 300.0, 400.0)
    assert lt.normalized("none", 1).lengths == lt.lengths
    assert lt.normalized("max", 8000).meta["scale"] == 40.0
    with pytest.raises(ValueError, match="mode.*none, mean, max.*'median'"):
        lt.normalized("median", 10)


def test_simulate_cli_new_options(tmp_path, capsys):
    lengths = tmp_path / "len.csv"
    lengths.write_text("step,mean_response_length\n" + "".join(f"{i},{150 + i % 3}\n" for i in range(20)))
    rc = main(["simulate", "--nodes", "2", "--hours", "0.3", "--policies", "nereus,elastic", "--gammas", "",
               "--jobs", "1", "--trace", "bamboo-p3", "--start", "2", "--length-trace", str(lengths),
               "--length-scale", "mean:1000", "--prompts-per-step", "64", "--mini-batch", "64",
               "--out", str(tmp_path / "o")])
    text = capsys.readouterr().out
    assert rc == 0 and "from 2 h" in text and "scaled x6.62" in text and "mean 151 -> 1,000 tokens" in text
    assert "length trace loops:" in text and "20 steps" in text
    assert main(["simulate", "--length-scale", "mean", "--out", str(tmp_path)]) == 2
    assert "--length-scale must be none, mean:TOKENS or max:TOKENS" in capsys.readouterr().err
    assert main(["simulate", "--start", "40", "--out", str(tmp_path)]) == 2
    assert "trace start 40 h is at or after the end" in capsys.readouterr().err
    assert main(["simulate", "--mini-batch", "300", "--out", str(tmp_path)]) == 2
    assert "mini_batch_size" in capsys.readouterr().err
