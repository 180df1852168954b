"""Last-in-first-out losses (``nereus.controller.loss_order``): join order, the LIFO share, the
event-size survival function and the plans on the oldest GPUs, by hand."""

from dataclasses import replace

import pytest
from test_controller_loss_sites import JOB, SizePlanner

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import TransitionCost
from nereus.controller.loss_order import LossOrder
from nereus.controller.risk import RiskModel
from nereus.spec.plan import Candidate, Plan


def _pool(n):
    return frozenset(range(n))


def _copies(*sets):
    """``critic.train`` with one replica per GPU set (tp 1, pp = len of each)."""
    gpus = tuple(g for s in sets for g in s)
    return replace(Plan(candidates=(Candidate("critic.train", 1, len(sets[0]), len(sets), gpus=gpus),)), l_step=1.0)


def _shrinking(sizes, start=32) -> LossOrder:
    """A pool of ``start`` GPUs (one arrival at t = 0) that loses its highest ids, ``sizes`` GPUs at
    a time, 100 s apart: every event takes the newest GPUs (ties broken by the higher id)."""
    o = LossOrder()
    n = start
    o.observe(_pool(n), _pool(n), 0.0)
    for i, s in enumerate(sizes):
        n -= s
        assert o.observe(_pool(n), _pool(n), 100.0 * (i + 1)) == frozenset(range(n, n + s))
    return o


def test_lifo_share_join_order_and_rejoins_by_hand():
    o = _shrinking([4])
    assert (o.events, o.lifo, o.sizes) == (1, 1, [4]) and o.rho == pytest.approx(1 / 2)
    o.observe(_pool(32), _pool(32), 200.0)                 # GPUs 28-31 rejoin: now the newest
    r = o.ranks(_pool(32))
    assert (r[31], r[28], r[27], r[0]) == (0, 3, 4, 31)
    gone = o.observe(_pool(32) - {0, 1}, _pool(32) - {0, 1}, 300.0)   # the oldest go: not LIFO
    assert gone == {0, 1} and (o.events, o.lifo, o.sizes) == (2, 1, [4, 2]) and o.rho == pytest.approx(1 / 3)
    o.observe(_pool(32), _pool(32), 400.0)                 # GPUs 0 and 1 are new again
    assert o.newest(_pool(32), 2) == {0, 1}
    # an announced loss leaves P_gpu while its GPUs still run: an announced event, in ρ and the sizes;
    # GPUs 28-31 are not the newest (0 and 1 rejoined after them): not LIFO
    assert o.observe(_pool(28), _pool(32), 500.0) == frozenset()
    assert (o.events, o.announced, o.lifo, o.sizes) == (3, 1, 1, [4, 2, 4]) and o.rho == pytest.approx(1 / 4)


def test_probabilities_mix_the_lifo_estimate_with_the_other_model_by_hand():
    o = _shrinking([4, 6, 9])                              # pool 0-12 left; ρ = 3 / (3 + 1)
    p13 = _pool(13)
    assert o.rho == pytest.approx(0.75)
    # ranks in 0-12: GPU g has rank 12 - g. Copies 0-3 (min rank 9) and 4-7 (min rank 5): an event
    # of k newest GPUs takes both iff k > 9; it touches the plan iff k > 5
    two = _copies(range(4), range(4, 8))
    assert o.thresholds(two, p13) == (9, 5)
    # S(9) = 0 of the sizes 4, 6, 9; S(5) = 2/3
    hit, touch = o.probabilities(two, p13, 0.2, 0.5)
    assert hit == pytest.approx(0.25 * 0.2)
    assert touch == pytest.approx(0.75 * 2 / 3 + 0.25 * 0.5)
    # one replica on the newest GPU: every event takes it
    assert o.probabilities(_copies(range(13)), p13, 0.2, 0.5) == pytest.approx((0.75 + 0.25 * 0.2, 0.75 + 0.25 * 0.5))
    # a GPU outside the pool ranks 0 (as good as gone); no trained model-stage: nothing to destroy
    assert o.thresholds(_copies(range(10, 14)), p13) == (0, 0)
    frozen = replace(Plan(candidates=(Candidate("reference.infer", 1, 2, 1, gpus=(0, 1)),)), l_step=1.0)
    assert o.thresholds(frozen, p13) == (13, 11)
    with pytest.raises(ValueError, match="p_hit_other"):
        o.probabilities(two, p13, 1.5, 0.5)


def test_no_lifo_evidence_keeps_the_other_model():
    o = LossOrder()
    o.observe(_pool(8), _pool(8), 0.0)
    assert o.rho == 0.0 and o.probabilities(_copies(range(8)), _pool(8), 0.3, 0.6) == (0.3, 0.6)
    assert o.oldest_pools(_pool(8)) == []
    o.observe(_pool(8) - {0}, _pool(8) - {0}, 10.0)        # the oldest-id GPU of a tie group: not LIFO
    assert (o.events, o.lifo, o.rho) == (1, 0, 0.0) and o.oldest_pools(_pool(8) - {0}) == []


def test_oldest_pools_drop_the_newest_gpus_for_each_event_size():
    o = _shrinking([4, 6, 9, 6])                           # pool 0-6 left
    assert o.oldest_pools(_pool(13)) == [_pool(9), _pool(7), _pool(4)]
    assert o.oldest_pools(_pool(7)) == [_pool(3), _pool(1)]   # sizes 9 would leave nothing


def test_best_plan_leaves_the_newest_gpus_when_losses_take_them_first():
    """Pool 0-18 after three LIFO losses of 4, 4 and 5 GPUs (ρ = 3/4, λ = 0.01/s); the planner's
    fastest plan is one replica over the pool, ``L = 320 / #GPUs`` (``SizePlanner``)."""
    risk = RiskModel(restart_s=100.0, checkpoint_interval=10)   # C = 100 + 5 L
    p19 = _pool(19)
    out = {}
    for lifo in (False, True):
        fp = SizePlanner()
        ctl = Controller(JOB, fp.plan(JOB, _pool(32), None, False), fp, transition_cost=lambda *a: TransitionCost(1.0),
                         config=ControllerConfig(risk=risk, loss_order=lifo))
        ctl.order = _shrinking([4, 4, 5])
        ctl.loss.events, ctl.loss.gpus_lost, ctl.loss.seconds = 3, 13, 300.0   # λ = 0.01/s, 1-node events
        out[lifo] = ctl.best_plan(JOB, p19, None, False), ctl, fp
    # uniform over 3 nodes, q = 1/3: the 19-GPU plan spans all three, P_hit = 1
    best, ctl, _ = out[False]
    l19 = 320 / 19
    assert len(best.gpus_used()) == 19 and ctl.expected_l(best, p19) == pytest.approx(l19 + l19 * 0.01 * (100 + 5 * l19))
    # LIFO: 19 GPUs P = 1; 0-14 (drop the newest 4) P = 0.75 S(4) + 0.25 (2/3) = 0.75/3 + 1/6;
    # 0-13 (drop 5) P = 0.75 S(5) + 0.25 (2/3) = 1/6 → risk-adjusted 47.9, 39.7, 31.0 s/step
    best, ctl, fp = out[True]
    l14 = 320 / 14
    assert fp.pools[-2:] == [15, 14]
    assert best.gpus_used() == _pool(14)
    assert ctl.expected_l(best, p19) == pytest.approx(l14 + l14 * 0.01 * (1 / 6) * (100 + 5 * l14))
    l15 = 320 / 15
    p15 = replace(_copies(range(15)), l_step=l15)
    assert ctl.expected_l(p15, p19) == pytest.approx(l15 + l15 * 0.01 * (0.25 + 1 / 6) * (100 + 5 * l15))


def test_announced_losses_are_priced_at_the_forced_moves_seen():
    """GPUs 12-15 of 0-15 announced at 100 s (the newest by id): ρ = 1/2, sizes [4]; one forced move
    of 50 s seen, restart + save = 250 s as the prior: C_a = (50 + 250) / 2."""
    from nereus.controller.decisions import Keep, Restart, Transition

    o = LossOrder()
    o.observe(_pool(16), _pool(16), 0.0)
    assert o.observe(_pool(12), _pool(16), 100.0) == frozenset()
    assert (o.announced, o.events, o.lifo, o.sizes) == (1, 1, 1, [4])
    one, two = _copies(range(12, 16)), _copies(range(4), range(12, 16))
    p12, alive = _pool(12), _pool(16)
    o.forced(one, p12, alive, Transition(one, TransitionCost(50.0), "urgent", urgent=True), 250.0)
    o.forced(two, p12, alive, Restart(None, "x"), 250.0)     # a replica stays on 0-3: not forced
    o.forced(one, p12, alive, Keep("no trigger"), 250.0)      # no move, no restart: nothing to record
    assert o.forced_s == [50.0]
    o.forced(one, p12, p12, Restart(None, "lost"), 250.0)     # GPUs already gone: a loss, not forced
    assert o.forced_s == [50.0]
    # a plan on node 0 (GPUs 0-7) of the pool 0-11: newest rank 4, S(4) = 0; uniform P_hit 1/2 (2 nodes)
    low = replace(_copies(range(8)), l_step=10.0)
    cluster = JOB.cluster
    assert o.announced_risk(low, cluster, p12, 1000.0, 250.0) == pytest.approx(10 * (1 / 1000) * 0.25 * 150)
    # every GPU of 0-11: rank 0, P_hit = 1/2 · 1 + 1/2 · 1
    assert o.announced_risk(replace(_copies(range(12)), l_step=10.0), cluster, p12, 1000.0, 250.0) == \
        pytest.approx(10 * (1 / 1000) * 1.0 * 150)
    assert LossOrder().announced_risk(low, cluster, p12, 1000.0, 250.0) == 0.0
    # the controller adds it to the (here zero) unannounced risk
    fp = SizePlanner()
    ctl = Controller(JOB, fp.plan(JOB, _pool(32), None, False), fp, transition_cost=lambda *a: TransitionCost(1.0),
                     config=ControllerConfig(risk=RiskModel(restart_s=200.0, save_s=50.0), loss_order=True))
    ctl.order, ctl.loss.seconds = o, 1000.0
    assert ctl.loss_rate() == 0.0 and ctl.risk(low, p12) == pytest.approx(0.375)
