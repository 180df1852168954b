"""The Destroy term: tensors freed per GPU, its cost, and its calibration with the warm-up discount
(``transition/teardown.py``, ``calibrate.fit_teardown``). Values by hand."""

from dataclasses import replace

import pytest

from nereus.runtime.model.sharding import names_of_stage
from nereus.spec.presets import MODEL_PRESETS
from nereus.transition.calibrate import TransitionCalibration, fit_teardown
from nereus.transition.cost import CostParams, duration
from nereus.transition.emu import EMU
from nereus.transition.primitives import destroy
from nereus.transition.teardown import freed_tensors, tensors_on_rank, trend_slope, with_freed_tensors

SMALL = MODEL_PRESETS["small"]


def test_tensors_on_rank_by_hand_and_against_the_runtime_names():
    # 8 layers x 9 tensors + embedding + final norm + lm_head
    assert tensors_on_rank(SMALL, 1, 0) == 75
    assert tensors_on_rank(replace(SMALL, head="value"), 1, 0) == 76  # score.weight + score.bias
    assert (tensors_on_rank(SMALL, 2, 0), tensors_on_rank(SMALL, 2, 1)) == (4 * 9 + 1, 4 * 9 + 2)
    # the runtime's parameter list is the reference (runtime/model/sharding.py)
    for spec in (SMALL, replace(SMALL, head="value"), replace(SMALL, tie_word_embeddings=True),
                 replace(SMALL, qk_norm=True, qkv_bias=True, o_bias=True)):
        for pp in (1, 2, 4, 3):
            for p in range(pp):
                assert tensors_on_rank(spec, pp, p) == len(names_of_stage(spec, pp, p)), (spec, pp, p)


def test_freed_tensors_and_the_destroy_duration():
    train = EMU("actor.train#0", "actor.train", 1, 1, (1,), (57_000_000,))
    half = EMU("critic.train#0", "critic.train", 1, 2, (2, 3), (28_400_000, 28_400_000))
    assert freed_tensors(train, SMALL, 3) == 225  # params, exp_avg, exp_avg_sq
    assert freed_tensors(half, SMALL, 3) == 3 * 38  # the last rank's 38 tensors
    [d1, d2] = with_freed_tensors((destroy(train), destroy(half)), (train, half), SMALL, 3)
    assert (d1.freed_tensors, d2.freed_tensors) == (225, 114)
    params = CostParams(teardown_s=1e-4, teardown_tensor_s=2e-6)
    assert duration(d1, None, params) == pytest.approx(1e-4 + 225 * 2e-6)
    assert duration(destroy(train), None, params) == pytest.approx(1e-4)  # not annotated: the fixed part


def test_trend_slope():
    # pairwise slopes (1-3)/1 = -2, (2-3)/2 = -0.5, (2-1)/1 = 1: median -0.5
    assert trend_slope([3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert trend_slope([5.0]) == 0.0


def test_fit_teardown_line_warm_up_and_fallbacks():
    assert fit_teardown([]) is None
    # on the line 1e-4 + 2e-6 n: Theil-Sen gives it back, residuals 0, no trend
    pts = [(75, 2.5e-4), (225, 5.5e-4), (114, 3.28e-4), (225, 5.5e-4)]
    assert fit_teardown(pts) == pytest.approx((1e-4, 2e-6))
    # one size, getting 2x faster each time (the allocator warming up): through the origin,
    # a = median(s / 225) = 1.5e-3 / 225; every residual slope ln(1/2); the trend's value at the
    # newest point is the newest seconds, 0.5 ms
    f, a = fit_teardown([(225, 4e-3), (225, 2e-3), (225, 1e-3), (225, 0.5e-3)])
    assert (f, a * 225) == pytest.approx((0.0, 0.5e-3))
    # getting slower (load) is not extrapolated: the median
    f, a = fit_teardown([(225, 1e-3), (225, 2e-3), (225, 4e-3)])
    assert (f, a * 225) == pytest.approx((0.0, 2e-3))
    # records without tensor counts (older callers): the median seconds as the fixed part
    assert fit_teardown([(0, 0.01), (0, 0.03), (0, 0.02)]) == pytest.approx((0.02, 0.0))


def test_calibration_prices_a_destroy_by_its_tensors():
    cal = TransitionCalibration(cores=2)
    for s in (4e-3, 2e-3, 1e-3, 0.5e-3):  # one Destroy per transition, alone on its worker
        cal.observe([{"kind": "destroy", "received": {}, "transfer_s": 0.0, "setup_s": 0.0, "t_start": 0.0,
                      "t_ready": 0.0, "t_end": s, "workers": 1, "freed_tensors": 225}])
    assert (cal.teardown_s, cal.teardown_tensor_s * 225) == pytest.approx((0.0, 0.5e-3))
    p = cal.params()
    assert (p.teardown_s, p.teardown_tensor_s) == pytest.approx((0.0, 0.5e-3 / 225))
    train = EMU("actor.train#0", "actor.train", 1, 1, (1,), (57_000_000,))
    [d] = with_freed_tensors((destroy(train),), (train,), SMALL, 3)
    assert duration(d, None, p) == pytest.approx(0.5e-3)


def test_worker_destroy_counts_the_tensors_it_frees():
    import torch

    from nereus.runtime.transit.plans import MoveSpec, UnitMeta
    from nereus.runtime.transit.worker_side import Transit, Unit

    t = Transit(0, None, None, 1.0)
    meta = UnitMeta("actor.train#0", "actor.train", 1, 1, (0,))
    t.units[meta.uid] = Unit(meta, {"params": {"a": torch.zeros(2), "b": torch.zeros(3)},
                                    "exp_avg": {"a": torch.zeros(2), "b": torch.zeros(3)}}, {})
    out = t.run(SMALL, MoveSpec("destroy:actor.train#0", "destroy", "actor.train", consumes=(meta.uid,)),
                "g", torch.float32, "cpu")
    assert out["freed_tensors"] == 4 and not t.units
