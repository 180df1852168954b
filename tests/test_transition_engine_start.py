"""The engine-start term of L_tran (``nereus/transition/engine_start.py``), hand-computed."""

from __future__ import annotations

import pytest

from nereus.transition.engine_start import DEFAULT_FIXED_S, EngineStartModel, engine_start_term


def test_prior_and_one_size_calibration():
    m = EngineStartModel()
    assert m.predict(2e9) == DEFAULT_FIXED_S  # no per-GB term before two sizes were seen
    m.observe(1e9, 30.0)
    m.observe(1e9, 40.0)
    assert m.fixed_s == pytest.approx(35.0) and m.per_gb_s == 0.0  # one size: the mean


def test_two_sizes_fit_a_line():
    m = EngineStartModel()
    for gb, s in ((1, 20.0), (3, 40.0), (5, 60.0)):  # 10 s + 10 s/GB exactly
        m.observe(gb * 1e9, s)
    assert m.per_gb_s == pytest.approx(10.0) and m.fixed_s == pytest.approx(10.0)
    assert m.predict(17.5e9) == pytest.approx(185.0)


def test_term_charges_one_start_only_when_the_layout_changes():
    m = EngineStartModel(fixed_s=12.0, per_gb_s=2.0)
    assert engine_start_term(m, False, 4e9) == 0.0
    assert engine_start_term(m, True, 4e9) == pytest.approx(20.0)
    assert engine_start_term(m, True, 4e9, overlap_s=15.0) == pytest.approx(5.0)
    assert engine_start_term(m, True, 4e9, overlap_s=30.0) == 0.0
    with pytest.raises(ValueError, match="seconds > 0"):
        m.observe(1e9, 0.0)
    with pytest.raises(ValueError, match="fixed_s"):
        EngineStartModel(fixed_s=-1.0)
