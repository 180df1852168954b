"""GPU-exact loss rates (``nereus.controller.loss_replay``): the loss events seen replayed against a
plan's own GPU set, by hand."""

from dataclasses import replace

import pytest

from nereus.controller.loss_replay import LossReplay
from nereus.controller.risk import RiskModel
from nereus.spec import hardware
from nereus.spec.plan import Candidate, Plan

CLUSTER = hardware.ClusterSpec(hardware.get_gpu("h100"), 4, 8)
P32, P28, P24, P20 = (frozenset(range(n)) for n in (32, 28, 24, 20))


def _single(gpus, l_step=100.0):
    """One ``critic.train`` replica over ``gpus`` (tp 1, pp = len)."""
    return replace(Plan(candidates=(Candidate("critic.train", 1, len(gpus), 1, gpus=tuple(sorted(gpus))),)),
                   l_step=l_step)


def _two_copies(a, b, l_step=100.0):
    """``critic.train`` dp 2: replica 0 on ``a``, replica 1 on ``b`` (tp 1, pp = len(a))."""
    return replace(Plan(candidates=(Candidate("critic.train", 1, len(a), 2, gpus=tuple(a) + tuple(b)),)),
                   l_step=l_step)


def _history() -> LossReplay:
    """32 GPUs for 1,000 s, GPUs 28-31 lost; 28 GPUs for 500 s, GPUs 24-27 lost; 24 for 300 s, then
    24-31 return (announced growth) and GPUs 28-31 go again 200 s later: the last arrivals go first."""
    r = LossReplay()
    r.observe(P32, P32, 0.0)
    assert r.observe(P28, P28, 1000.0) == frozenset(range(28, 32))
    assert r.observe(P24, P24, 1500.0) == frozenset(range(24, 28))
    assert r.observe(P32, P32, 1800.0) == frozenset()
    assert r.observe(P28, P28, 2000.0) == frozenset(range(28, 32))
    return r


def test_exposure_and_counts_by_hand():
    r = _history()
    # spans: P32 1,000 s, P28 500 s, P24 300 s, P32 200 s
    assert r.exposure(range(16)) == pytest.approx(2000.0)
    assert r.exposure(range(28)) == pytest.approx(1700.0)  # 1,000 + 500 + 200
    assert r.exposure(range(32)) == pytest.approx(1200.0)
    # the plan on GPUs 0-15 was exposed to all 3 events and touched by none
    assert r.counts(_single(range(16))) == (0, 0)
    # GPUs 0-27: exposed to events 1 (28-31 went: no touch), 2 (24-27: hit) and 3 (no touch)
    assert r.counts(_single(range(28))) == (1, 1)
    # all 32: exposed to events 1 and 3 (not to event 2: GPUs 28-31 were not in the pool), hit by both
    assert r.counts(_single(range(32))) == (2, 2)
    # two copies, 0-15 and 16-31: events 1 and 3 touch only the second copy, so the state survives
    assert r.counts(_two_copies(range(16), range(16, 32))) == (0, 2)


def test_rates_are_the_gamma_poisson_estimate_by_hand():
    r = _history()
    lam = 3 / 2000.0  # the pool's event rate, events/s (1/λ = 666.7 s of prior exposure)
    # (n + P0) / (T + 1/λ)
    low = r.rates(_single(range(16)), lam, 0.5, 0.5)
    assert low == pytest.approx((0.5 / (2000 + 2000 / 3), 0.5 / (2000 + 2000 / 3)))
    top = r.rates(_single(range(32)), lam, 1.0, 1.0)
    assert top == pytest.approx((3.0 / (1200 + 2000 / 3),) * 2)
    # redundant copies: the touch rate counts both events, the hit rate only the prior
    red = r.rates(_two_copies(range(16), range(16, 32)), lam, 0.0, 1.0)
    assert red == pytest.approx((0.0, 3.0 / (1200 + 2000 / 3)))
    assert r.rates(_single(range(16)), 0.0, 0.5, 0.5) == (0.0, 0.0)
    with pytest.raises(ValueError, match="p0_hit"):
        r.rates(_single(range(16)), lam, 1.5, 0.5)


def test_no_events_gives_the_uniform_prior_rate():
    r = LossReplay()
    r.observe(P32, P32, 0.0)
    # nothing observed yet (no exposure): r = P0 / (1/λ) = λ · P0, the uniform model's rate
    assert r.rates(_single(range(16)), 1e-3, 0.5, 0.5) == pytest.approx((5e-4, 5e-4))
    r.observe(P32, P32, 3000.0)  # 3,000 s of exposure, still no loss: not discounted (not 1/(3+1))
    assert r.exposure(range(16)) == 3000.0
    assert r.rates(_single(range(16)), 1e-3, 0.5, 0.25) == pytest.approx((5e-4, 5e-4))
    assert r.rates(_single(range(16)), 1e-3, 0.25, 0.5) == pytest.approx((2.5e-4, 5e-4))


def test_announced_losses_are_not_events():
    r = LossReplay()
    r.observe(P32, P32, 0.0)
    r.observe(P28, P32, 100.0)  # notice: 28-31 left P_gpu but still run
    assert r.observe(P28, P28, 200.0) == frozenset()
    assert r.events == []


def test_risk_at_rates_matches_the_per_event_formula_by_hand():
    m = RiskModel(restart_s=300.0, checkpoint_interval=10, detect_s=30.0)
    # L · (r_hit · (restart + interval/2 · L) + r_touch · (L/2 + detect))
    assert m.risk_at_rates(100.0, 1e-4, 3e-4) == pytest.approx(100 * (1e-4 * (300 + 500) + 3e-4 * (50 + 30)))
    # a plan's risk at λ and its uniform probabilities equals risk_at_rates at λ · P
    r = LossReplay()
    plan = _single(range(32))
    assert r.risk(m, plan, CLUSTER, P32, 1e-3) == pytest.approx(m.risk(plan, CLUSTER, P32, 1e-3))
    with pytest.raises(ValueError, match="rates"):
        m.risk_at_rates(100.0, -1.0, 0.0)
