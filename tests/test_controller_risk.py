"""State-loss risk pricing, redundant training placement and the growth horizon (hand-computed)."""

from dataclasses import replace

import pytest

from nereus.controller.admission import Option, admit
from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import TransitionCost
from nereus.controller.monitor import POOL_LOSS, Monitor
from nereus.controller.risk import LossRate, RiskModel, hit_probability, vulnerable_nodes
from nereus.planner.placement import place
from nereus.planner.search import SearchOptions, plan_job
from nereus.spec import hardware, job, presets, workload
from nereus.spec.plan import Candidate, Plan
from nereus.workflow import workflow_for

CLUSTER = hardware.ClusterSpec(hardware.get_gpu("h100"), 4, 8)
JOB = job.JobSpec(presets.get_model("llama-3.1-8b"), CLUSTER, workload.WorkloadSpec(algorithm="ppo", response_len=1000))
POOL32 = frozenset(range(32))


def _train(name, tp, pp, gpus):
    return Candidate(name, tp, pp, len(gpus) // (tp * pp), gpus=tuple(gpus))


# ---------------------------------------------------------------- loss rate
def test_loss_rate_counts_only_unannounced_losses():
    r = LossRate()
    assert r.observe(POOL32, POOL32, 100.0, 0.0) == 0 and r.rate == 0.0
    # 4 GPUs leave without notice: they were in P_gpu at the last boundary and are not alive now
    p28 = frozenset(range(28))
    assert r.observe(p28, p28, 200.0, 0.0) == 4
    assert r.events == 1 and r.rate == pytest.approx(1 / 200) and r.mean_event_gpus() == 4
    # announced: the GPUs leave P_gpu first (still alive), then leave alive: not a loss of state
    p24 = frozenset(range(24))
    assert r.observe(p24, p28, 300.0, 0.0) == 0
    assert r.observe(p24, p24, 400.0, 0.0) == 0
    assert r.events == 1 and r.rate == pytest.approx(1 / 400)


def test_loss_rate_prior_and_step_time_clock():
    r = LossRate(prior_events=1, prior_seconds=3600)
    assert r.rate == pytest.approx(1 / 3600)
    r.observe(POOL32, POOL32, None, 400.0)  # no executor clock: step times add up
    assert r.seconds == 400 and r.rate == pytest.approx(1 / 4000)
    with pytest.raises(ValueError, match="prior"):
        LossRate(prior_events=-1)


# ---------------------------------------------------------------- P_hit and risk
def test_vulnerable_nodes_and_hit_probability_by_hand():
    actor = _train("actor.train", 2, 2, [0, 1, 2, 3, 16, 17, 18, 19])  # replicas on nodes 0 and 2
    critic = _train("critic.train", 1, 8, range(8, 16))  # one replica on node 1
    gen = Candidate("actor.generate", 4, 1, 8, gpus=tuple(range(32)))
    plan = Plan(candidates=(gen, actor, critic))
    assert vulnerable_nodes(plan, CLUSTER) == {"actor.train": frozenset(), "critic.train": frozenset({1})}
    assert hit_probability(plan, CLUSTER, POOL32) == pytest.approx(1 / 4)
    wide = Plan(candidates=(actor, _train("critic.train", 1, 16, range(16, 32))))  # nodes 2 and 3
    assert hit_probability(wide, CLUSTER, POOL32) == pytest.approx(2 / 4)
    assert hit_probability(wide, CLUSTER, POOL32, event_nodes=2) == 1.0  # capped
    assert hit_probability(wide, CLUSTER, frozenset(range(24))) == pytest.approx(1 / 3)  # node 3 gone


def test_risk_formula_by_hand():
    critic = _train("critic.train", 1, 8, range(8, 16))
    plan = replace(Plan(candidates=(critic,)), l_step=40.0)
    rm = RiskModel(restart_s=150.0, checkpoint_interval=25)
    # C = 150 + 25/2 · 40 = 650 s; risk = 40 · (1/500) · (1/4) · 650 = 13 s per step
    assert rm.loss_cost(40.0) == 650.0
    assert rm.risk(plan, CLUSTER, POOL32, rate=1 / 500) == pytest.approx(13.0)
    assert rm.risk(plan, CLUSTER, POOL32, rate=0.0) == 0.0
    redundant = replace(Plan(candidates=(_train("critic.train", 1, 4, [8, 9, 10, 11, 16, 17, 18, 19]),)), l_step=40.0)
    assert rm.risk(redundant, CLUSTER, POOL32, rate=1 / 500) == 0.0
    for bad in ({"restart_s": -1.0}, {"checkpoint_interval": 0}, {"restart_s": float("inf")}):
        with pytest.raises(ValueError, match="risk field"):
            RiskModel(**bad)


# ---------------------------------------------------------------- search and placement
def test_min_train_replicas_gives_redundant_training_on_distinct_nodes():
    plan = plan_job(JOB, pool=POOL32, options=SearchOptions(min_train_replicas=2))
    for c in plan.candidates:
        if c.model_stage.endswith(".train"):
            assert c.dp >= 2
            nodes = [{CLUSTER.node_of(g) for g in c.replica_gpus(d)} for d in range(c.dp)]
            assert all(not (a & b) for i, a in enumerate(nodes) for b in nodes[i + 1:]), c
    assert vulnerable_nodes(plan, CLUSTER) == {"actor.train": frozenset(), "critic.train": frozenset()}
    with pytest.raises(ValueError, match="min_train_replicas"):
        SearchOptions(min_train_replicas=0)


def test_spread_placement_puts_replicas_on_distinct_nodes():
    wf = workflow_for(workload.WorkloadSpec(algorithm="grpo", reward_model=False))
    c = Candidate("actor.train", 2, 2, 2)
    free = frozenset(range(16))
    (packed,) = [x for x in place([c], free, CLUSTER, wf) if x.model_stage == "actor.train"]
    assert {CLUSTER.node_of(g) for g in packed.gpus} == {0}  # best fit packs node 0
    (spread,) = place([c], free, CLUSTER, wf, spread=frozenset({"actor.train"}))
    assert [CLUSTER.node_of(g) for g in spread.replica_gpus(0)] == [0] * 4
    assert [CLUSTER.node_of(g) for g in spread.replica_gpus(1)] == [1] * 4
    (one_node,) = place([c], frozenset(range(8)), CLUSTER, wf, spread=frozenset({"actor.train"}))
    assert len(set(one_node.gpus)) == 8  # only one node free: spreading is best effort


# ---------------------------------------------------------------- growth horizon
@pytest.mark.parametrize("grow, expected", [(True, 4.0), (False, 2.5)])
def test_growth_uses_the_horizon_of_losses(grow, expected):
    m = Monitor(grow_horizon=grow)
    for step, n in ((0, 8), (2, 6), (6, 4)):  # losses at steps 2 and 6: H_pool = H_loss = 4
        trig = m.check(step, {}, frozenset(range(n)))
        m.reset({}, frozenset(range(n)))
    assert m.horizon(POOL_LOSS).value == 4.0 and trig[0].horizon == 4.0
    (t,) = m.check(7, {}, frozenset(range(8)))  # growth after 1 step: H_pool = 0.5·1 + 0.5·4 = 2.5
    assert m.horizon("pool").value == 2.5
    assert t.horizon == expected


def test_growth_before_any_loss_keeps_the_pool_horizon():
    m = Monitor(grow_horizon=True)
    m.check(0, {}, frozenset(range(4)))
    m.reset({}, frozenset(range(4)))
    (t,) = m.check(3, {}, frozenset(range(8)))
    assert t.horizon == 1.0  # first crossing: H = 1 step (paper §4.3)


# ---------------------------------------------------------------- controller
class TwoPlanPlanner:
    """Fastest plan: one critic replica on node 0 (10 s); redundant plan: replicas on nodes 0 and 1."""

    def __init__(self, safe_l):
        self.safe_l = safe_l
        self.calls = []

    def plan(self, job, pool, current, urgent, min_train_replicas=1):
        self.calls.append(min_train_replicas)
        if min_train_replicas > 1:
            return replace(Plan(candidates=(_train("critic.train", 1, 4, [0, 1, 2, 3, 8, 9, 10, 11]),)),
                           l_step=self.safe_l)
        return replace(Plan(candidates=(_train("critic.train", 1, 8, range(8)),)), l_step=10.0)


@pytest.mark.parametrize("events, safe_l, pick_safe", [(0, 11.0, False), (1, 11.0, True), (1, 15.0, False)])
def test_best_plan_prices_the_risk_of_a_single_training_replica(events, safe_l, pick_safe):
    fp = TwoPlanPlanner(safe_l)
    first = fp.plan(JOB, POOL32, None, False)
    ctl = Controller(JOB, first, fp, transition_cost=lambda *a: TransitionCost(1.0),
                     config=ControllerConfig(risk=RiskModel(restart_s=100.0, checkpoint_interval=10)))
    ctl.loss.events, ctl.loss.seconds = events, 100.0
    # λ = 0.01/s, P_hit = 1/4, C = 100 + 5·10 = 150 s: risk = 10 · 0.01 · 0.25 · 150 = 3.75 s/step
    assert ctl.risk(first, POOL32) == pytest.approx(3.75 * events)
    best = ctl.best_plan(JOB, POOL32, None, False)
    assert (best.candidates[0].dp == 2) is pick_safe
    assert fp.calls[-1] == (2 if events else 1)


def test_admission_compares_risk_adjusted_step_times():
    fast_risky = replace(Plan(candidates=(_train("critic.train", 1, 8, range(8)),)), l_step=10.0)
    # current: 20 s; target: 10 s plus 12 s of priced risk = 22 s, so it is not faster
    d = admit(20.0, [Option(fast_risky, TransitionCost(1.0), expected_l=22.0)], gamma=0.5, horizon=100,
              urgent=False)
    assert d.reason == "replanned: no target is faster than the current plan"
    d = admit(20.0, [Option(fast_risky, TransitionCost(1.0))], gamma=0.5, horizon=100, urgent=False)
    assert d.delta_l == pytest.approx(10.0)


def test_controller_config_validates_risk_fields():
    assert ControllerConfig().risk is None  # the paper's rule by default
    with pytest.raises(ValueError, match="loss_prior"):
        ControllerConfig(loss_prior=(-1.0, 10.0))
    with pytest.raises(ValueError, match="'risk'"):
        ControllerConfig(risk=180.0)
    ctl = Controller(JOB, TwoPlanPlanner(11.0).plan(JOB, POOL32, None, False), TwoPlanPlanner(11.0),
                     config=ControllerConfig(risk=RiskModel(), loss_prior=(1.0, 3600.0)))
    assert ctl.loss.rate == pytest.approx(1 / 3600)


def test_risk_can_be_disabled():
    fp = TwoPlanPlanner(11.0)
    ctl = Controller(JOB, fp.plan(JOB, POOL32, None, False), fp, config=ControllerConfig(risk=None))
    ctl.loss.events, ctl.loss.seconds = 5, 100.0
    assert ctl.risk(ctl.plan, POOL32) == 0.0
    assert ctl.best_plan(JOB, POOL32, None, False).candidates[0].dp == 1


# ---------------------------------------------------------------- issue 29, third round: straddles, interruptions, Young
def test_straddling_event_prices_two_replicas_on_distinct_nodes():
    # critic.train dp 2: replica 0 on nodes 0-1 (GPUs 0-15), replica 1 on nodes 2-3 (GPUs 16-31)
    two = Plan(candidates=(_train("critic.train", 1, 16, range(32)),))
    assert vulnerable_nodes(two, CLUSTER) == {"critic.train": frozenset()}
    # whole-node events (m = 1) never take a node of each replica
    assert hit_probability(two, CLUSTER, POOL32) == 0.0
    # 2-node events: p_ab = m (m - 1) / (N (N - 1)) = 2 / 12 per pair, 2 x 2 pairs across the replicas:
    # 4/6, the exact chance that 2 of 4 nodes drawn at random fall one in each half
    assert hit_probability(two, CLUSTER, POOL32, event_nodes=2) == pytest.approx(4 / 6)
    # ZeRO-1 over the same GPUs is one copy: every node is vulnerable, 4 x 2/4 capped at 1
    assert hit_probability(Plan(candidates=(replace(two.candidates[0], zero=1),)), CLUSTER, POOL32,
                           event_nodes=2) == 1.0


def test_touch_probability_by_hand():
    from nereus.controller.risk import touch_probability

    low = Plan(candidates=(_train("critic.train", 1, 16, range(16)),))  # nodes 0-1
    assert touch_probability(low, CLUSTER, POOL32) == pytest.approx(2 / 4)
    assert touch_probability(low, CLUSTER, POOL32, event_nodes=3) == 1.0  # 2 x 3/4, capped
    assert touch_probability(low, CLUSTER, frozenset()) == 0.0


def test_risk_with_young_redo_and_interruptions_by_hand():
    critic = replace(Plan(candidates=(_train("critic.train", 1, 8, range(8, 16)),)), l_step=40.0)  # node 1
    rm = RiskModel(restart_s=150.0, checkpoint_interval=25, save_s=40.0, detect_s=30.0)
    # failure rate λ P_hit = (1/500)(1/4) = 1/2000 /s; Young: sqrt(2 · 40 · 2000) = 400 s, half redone
    assert rm.redo_s(40.0, 1 / 2000) == pytest.approx(200.0)
    assert rm.loss_cost(40.0, 1 / 2000) == pytest.approx(350.0)
    assert rm.redo_s(40.0, 0.0) == 500.0  # no failure rate: the fixed interval, 25/2 steps of 40 s
    # per event: P_hit C + P_touch (L/2 + detect) = 1/4 · 350 + 1/4 · (20 + 30) = 100 s; per step L λ = 40/500
    assert rm.risk(critic, CLUSTER, POOL32, rate=1 / 500) == pytest.approx(8.0)
    # redundant on nodes 1 and 2: no state loss from whole-node events, but two nodes can interrupt it
    red = replace(Plan(candidates=(_train("critic.train", 1, 8, range(8, 24)),)), l_step=40.0)
    assert rm.risk(red, CLUSTER, POOL32, rate=1 / 500) == pytest.approx(40 / 500 * 2 / 4 * 50)
    # without detect_s the interruption is not priced (the model before this round)
    assert RiskModel(restart_s=150.0, save_s=40.0).risk(red, CLUSTER, POOL32, rate=1 / 500) == 0.0
    for bad in ({"save_s": -1.0}, {"detect_s": float("nan")}):
        with pytest.raises(ValueError, match="risk field"):
            RiskModel(**bad)


def test_simulator_risk_model_follows_the_checkpoint_rule():
    from nereus.controller.risk import DETECT_S
    from nereus.sim.policies import risk_model
    from nereus.sim.restart import RestartCost

    young = risk_model(JOB)
    # 8B PPO trains actor and critic: their params x 14 B (bf16 weights + Adam) over 2 GB/s on each of 4 nodes
    params = JOB.model("actor").num_params + JOB.model("critic").num_params
    assert young.save_s == pytest.approx(params * 14 / (2e9 * 4))
    assert young.detect_s == DETECT_S == 32.5
    assert risk_model(JOB, RestartCost(checkpoint_rule="fixed")).save_s is None
