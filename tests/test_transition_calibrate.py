"""The transition cost's three terms (setup, copy, wire) and their calibration from executor records
(``transition/cost.py``, ``transition/calibrate.py``), by hand."""

from __future__ import annotations

import math

import pytest

from nereus.spec.hardware import ClusterSpec
from nereus.transition.calibrate import TransitionCalibration
from nereus.transition.cost import CostParams, duration
from nereus.transition.emu import EMU
from nereus.transition.primitives import Primitive, extend


def _cluster() -> ClusterSpec:
    from nereus.runtime.run.device_model import runtime_job
    from nereus.spec.presets import MODEL_PRESETS
    from nereus.spec.workload import WorkloadSpec

    w = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                     mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
    return runtime_job(MODEL_PRESETS["tiny"], w, 4).cluster


def test_duration_is_setup_plus_copy_plus_wire():
    c = _cluster()
    bw, lat, _ = c.link_of((0, 1))
    m = Primitive(pid="merge:x", kind="merge", model_stage="actor.train", gpus=(0, 1), groups=(((0, 1), 4e6),))
    base = CostParams(comm_setup_intra_s=0.1)
    assert duration(m, c, base) == pytest.approx(0.1 + 4e6 / bw + lat)  # uncalibrated: no copy term
    p = CostParams(comm_setup_intra_s=0.1, copy_bandwidth=2e9)
    assert duration(m, c, p) == pytest.approx(0.1 + 4e6 / bw + 4e6 / 2e9 + lat)
    derived = CostParams(comm_setup_intra_s=0.1, copy_bandwidth=0.0)  # 0: HBM / 4
    assert duration(m, c, derived) == pytest.approx(0.1 + 4e6 / bw + 4e6 / (c.gpu.hbm_bandwidth / 4) + lat)
    a = EMU("a#0", "actor.train", 1, 1, (0,), (3_000_000,))
    b = EMU("a#1", "actor.train", 1, 1, (1,), (3_000_000,))
    x = extend(a, b)  # the source packs 3 MB, then the destination writes 3 MB: 6 MB on its path
    assert duration(x, c, p) == pytest.approx(0.1 + 3e6 / bw + 2 * 3e6 / 2e9 + lat)
    assert CostParams().copy_bandwidth == math.inf
    with pytest.raises(ValueError, match="copy_bandwidth"):
        CostParams(copy_bandwidth=-1.0)


def test_calibration_separates_setup_copy_and_wire():
    cal = TransitionCalibration()
    recs = [
        # a Merge: 0.9 s wall of which 0.2 s on the wire and 0.3 s packing/assembling 60 MB
        {"kind": "merge", "received": {1: 60e6}, "transfer_s": 0.2, "copy_s": 0.3, "setup_s": 0.25,
         "measured_s": 0.9},
        # an Extend that reused its communicator: 0.1 s fixed, 40 MB in 0.2 s wire + 0.1 s copy
        {"kind": "extend", "received": {2: 40e6}, "transfer_s": 0.2, "copy_s": 0.1, "setup_s": 0.0,
         "measured_s": 0.4},
        {"kind": "destroy", "received": {}, "transfer_s": 0.0, "copy_s": 0.0, "setup_s": 0.0, "measured_s": 0.02},
    ]
    cal.observe(recs)
    # medians weighted by bytes (two primitives: too few for the fixed + per-byte line, calibrate.py):
    # wire 60e6/0.2 = 3e8 B/s (weight 60) and 40e6/0.2 = 2e8 (weight 40): half the weight, 50, falls
    # on 3e8; copy 60e6/0.3 = 2e8 (60) and 40e6/0.1 = 4e8 (40): 2e8
    assert cal.bandwidth == pytest.approx(3e8)
    assert cal.copy_bandwidth == pytest.approx(2e8)
    assert cal.setup_s == pytest.approx((0.4 + 0.1) / 2)  # median of wall - wire - copy
    assert cal.teardown_s == pytest.approx(0.02)
    p = cal.params(CostParams(comm_setup_inter_s=0.5))
    assert (p.comm_setup_intra_s, p.comm_setup_inter_s, p.copy_bandwidth, p.teardown_s) == \
        pytest.approx((0.25, 0.5, 2e8, 0.02))
    # medians over the window of recent primitives, not an EMA: equal weights give the plain median
    two = TransitionCalibration()
    two.observe(recs[:1])
    two.observe([{**recs[0], "copy_s": 0.6, "measured_s": 1.2}])
    assert two.copy_bandwidth == pytest.approx((60e6 / 0.3 + 60e6 / 0.6) / 2)
    assert two.setup_s == pytest.approx(0.4)  # both 0.9 - 0.2 - 0.3 and 1.2 - 0.2 - 0.6
    assert [h["copy_bandwidth"] for h in two.history] == pytest.approx([60e6 / 0.3, 60e6 / 0.6])
    last = TransitionCalibration(window=1)  # only the latest primitive
    last.observe(recs[:1])
    last.observe([{**recs[0], "copy_s": 0.6, "measured_s": 1.2}])
    assert last.copy_bandwidth == pytest.approx(60e6 / 0.6)
    # the planner's copy bytes (cost.copy_bytes: sends plus new-shard writes) when the record has them
    k = TransitionCalibration()
    k.observe([{**recs[0], "copy_bytes": 120e6}])
    assert k.copy_bandwidth == pytest.approx(120e6 / 0.3) and k.bandwidth == pytest.approx(60e6 / 0.2)
    with pytest.raises(ValueError, match="window"):
        TransitionCalibration(window=0)


def test_records_without_wall_seconds_fall_back_to_setup():
    cal = TransitionCalibration()
    cal.observe([{"kind": "split", "received": {0: 1e6}, "transfer_s": 0.01, "setup_s": 0.05}])
    assert cal.setup_s == pytest.approx(0.05) and cal.copy_bandwidth is None
