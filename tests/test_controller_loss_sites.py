"""Learned loss sites (``nereus.controller.loss_sites``) in risk pricing and plan choice, by hand."""

from dataclasses import replace

import pytest

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import TransitionCost
from nereus.controller.loss_sites import LossSites
from nereus.controller.risk import RiskModel, hit_probability
from nereus.spec import hardware, job, presets, workload
from nereus.spec.plan import Candidate, Plan

CLUSTER = hardware.ClusterSpec(hardware.get_gpu("h100"), 4, 8)
JOB = job.JobSpec(presets.get_model("llama-3.1-8b"), CLUSTER, workload.WorkloadSpec(algorithm="ppo", response_len=1000))
P32, P28, P24, P20 = (frozenset(range(n)) for n in (32, 28, 24, 20))


def _single(gpus, l_step=0.0):
    """One ``critic.train`` replica over ``gpus`` (tp 1, pp = len)."""
    return replace(Plan(candidates=(Candidate("critic.train", 1, len(gpus), 1, gpus=tuple(sorted(gpus))),)),
                   l_step=l_step)


def _two_losses() -> LossSites:
    """GPUs 24-31 (node 3) leave, then 20-23 (half of node 2): the last-arrived capacity goes first."""
    s = LossSites(CLUSTER)
    assert s.observe(P32, P32) == frozenset()
    assert s.observe(P24, P24) == frozenset({3})
    assert s.observe(P20, P20) == frozenset({2})
    return s


def test_counts_and_beta_bernoulli_estimate_by_hand():
    s = _two_losses()
    # exposures: nodes 0-2 were in the pool at both events, node 3 only at the first
    assert s.events == 2 and s.exposed == {0: 2, 1: 2, 2: 2, 3: 1} and s.hits == {3: 1, 2: 1}
    # q_n = (h + α q0) / (e + α), α = 1, q0 = 1/3 (one-node events over 3 pool nodes)
    assert s.probability(0, 1 / 3) == pytest.approx((1 / 3) / 3)
    assert s.probability(2, 1 / 3) == pytest.approx((1 + 1 / 3) / 3)
    assert s.probability(3, 1 / 3) == pytest.approx((1 + 1 / 3) / 2)
    assert s.safest_nodes(P20, 1 / 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="prior"):
        s.probability(0, 1.5)


def test_announced_losses_are_not_counted():
    s = LossSites(CLUSTER)
    s.observe(P32, P32)
    s.observe(P28, P32)  # notice: GPUs 28-31 left P_gpu but still run
    s.observe(P28, P28)  # they stop after the notice: their state was moved, not lost
    assert s.events == 0 and s.probability(0, 0.25) == 0.25  # no evidence: the uniform prior


def test_hit_probability_with_sites_by_hand():
    s = _two_losses()
    whole, low = _single(range(20)), _single(range(16))
    # uniform: 3/3 and 2/3 of the pool's nodes
    assert hit_probability(whole, CLUSTER, P20) == pytest.approx(1.0)
    assert hit_probability(low, CLUSTER, P20) == pytest.approx(2 / 3)
    # learned: q0 + q1 + q2 = 1/9 + 1/9 + 4/9, and q0 + q1 = 2/9
    assert hit_probability(whole, CLUSTER, P20, sites=s) == pytest.approx(6 / 9)
    assert hit_probability(low, CLUSTER, P20, sites=s) == pytest.approx(2 / 9)
    # no event seen yet: the uniform model exactly
    assert hit_probability(low, CLUSTER, P20, sites=LossSites(CLUSTER)) == pytest.approx(2 / 3)


class SizePlanner:
    """The fastest plan is one replica over the whole given pool, ``L = 320 s / #GPUs``; no
    redundant plan fits."""

    def __init__(self):
        self.pools = []

    def plan(self, job, pool, current, urgent, min_train_replicas=1):
        if min_train_replicas > 1:
            raise ValueError("no redundant plan fits")
        self.pools.append(len(pool))
        return _single(pool, 320.0 / len(pool))

    def estimate(self, job, plan, pool=None):
        return plan

    def memory_ok(self, job, plan):
        return True

    def alternatives(self, job, pool, current, best):
        return []


@pytest.mark.parametrize("sites, gpus", [(True, 16), (False, 20)])
def test_best_plan_moves_the_state_to_the_nodes_never_hit(sites, gpus):
    fp = SizePlanner()
    ctl = Controller(JOB, fp.plan(JOB, P32, None, False), fp, transition_cost=lambda *a: TransitionCost(1.0),
                     config=ControllerConfig(risk=RiskModel(restart_s=100.0, checkpoint_interval=10),
                                             loss_sites=sites))
    ctl.sites = _two_losses()
    ctl.loss.events, ctl.loss.gpus_lost, ctl.loss.seconds = 20, 160, 1000.0  # λ = 0.02/s, events of 1 node
    # risk = L · λ · P_hit · (100 + 5 L); with sites:
    #   20 GPUs: L = 16, P = 6/9: 16 · 0.02 · 0.667 · 180 = 38.4 → 54.4 s/step
    #   16 GPUs (nodes 0, 1): L = 20, P = 2/9: 20 · 0.02 · 0.222 · 200 = 17.78 → 37.78 s/step
    #    8 GPUs (node 0): L = 40, P = 1/9: 40 · 0.02 · 0.111 · 300 = 26.67 → 66.67 s/step
    # uniform (sites off): 20 GPUs, P = 1 → 73.6 s/step (16 and 8 GPUs are not tried)
    best = ctl.best_plan(JOB, P20, None, False)
    assert len(best.gpus_used()) == gpus
    if sites:
        assert ctl.expected_l(best, P20) == pytest.approx(20 + 20 * 0.02 * (2 / 9) * 200)
        assert fp.pools[-2:] == [16, 8]  # 3 nodes - 1 down to 1
    else:
        assert ctl.expected_l(best, P20) == pytest.approx(16 + 16 * 0.02 * 1.0 * 180)


def test_a_plan_on_gpus_gone_before_the_first_report_is_urgent():
    """The first report only sets the monitor's pool reference; GPUs lost in step 0 must still make
    the plan invalid (before the fix: Keep "no trigger" forever, the simulator's 70B livelock)."""
    from nereus.controller.decisions import Keep, Restart
    from nereus.controller.monitor import StepReport

    fp = SizePlanner()
    ctl = Controller(JOB, fp.plan(JOB, P32, None, False), fp, transition_cost=lambda *a: TransitionCost(1.0),
                     config=ControllerConfig(calibrate=False))
    d = ctl.observe(StepReport(step=0, response_len=1000, pool=P24, alive=P24, elapsed_s=104.0))
    assert not isinstance(d, Keep)
    # the single training replica spanned GPUs 24-31 too: restore from checkpoint onto the 24 left
    assert isinstance(d, Restart) and d.cause == "state_lost" and len(d.plan.gpus_used()) == 24
    assert ctl.log[-1]["triggers"][0]["reason"] == "the plan uses 8 GPU(s) outside P_gpu"


def test_pair_counts_and_straddle_pricing_by_hand():
    s = _two_losses()
    # a third event takes GPUs 12-19: the upper half of node 1 and the lower half of node 2
    p12 = frozenset(range(12))
    assert s.observe(p12, p12) == frozenset({1, 2})
    assert s.events == 3 and s.mean_nodes_hit() == pytest.approx(4 / 3)
    # pairs exposed: all of {0..3} at event 1, all of {0, 1, 2} at events 2 and 3
    assert s.pair_exposed == {(0, 1): 3, (0, 2): 3, (1, 2): 3, (0, 3): 1, (1, 3): 1, (2, 3): 1}
    assert s.pair_hits == {(1, 2): 1}
    # p_ab = (c + α p0) / (x + α); on 4 pool nodes p0 = m_h (m_h - 1) / (N (N - 1)) = (4/3)(1/3)/12 = 1/27
    assert s.pair_probability(2, 1, 1 / 27) == pytest.approx((1 + 1 / 27) / 4)
    # critic.train dp 2 with replicas on nodes 1 and 2: destroyed by an event that takes both
    two = Plan(candidates=(Candidate("critic.train", 1, 8, 2, gpus=tuple(range(8, 24))),))
    assert hit_probability(two, CLUSTER, P32) == 0.0  # uniform whole-node events
    assert hit_probability(two, CLUSTER, P32, sites=s) == pytest.approx(7 / 27)
    with pytest.raises(ValueError, match="distinct"):
        s.pair_probability(1, 1, 0.1)
    with pytest.raises(ValueError, match="prior"):
        s.pair_probability(0, 1, -0.1)
