"""The fresh-buffer surcharge ``φ`` with each worker's direct fault probe as samples beside the
primitives' (``calibrate.fit_copy``'s ``direct``, ``runtime/transit/fault_probe.py``), by hand.

P = FAULT_PROBE_BYTES = 64 MiB = 67,108,864 B, the weight of one direct sample; a direct value
``t`` seconds per byte is the sample ``t·C`` of ``φ``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from nereus.runtime.transit.driver_side import PrimitiveRecord, TransitionExecutor
from nereus.runtime.transit.fault_probe import measure
from nereus.transition.calibrate import TransitionCalibration, fit_copy
from nereus.transition.copy_cost import FAULT_PROBE_BYTES, FRESH_BUFFER_BYTES

P = FAULT_PROBE_BYTES
PLAIN = (10e6, 0, 0, 0.010, 1)  # 10 MB in 10 ms: C = 1 GB/s


def test_probe_bytes_are_past_glibcs_largest_mmap_threshold():
    assert P == 67_108_864 == 2 * FRESH_BUFFER_BYTES


def test_direct_samples_outweigh_one_noisy_primitive():
    """C = 1 GB/s. One fresh 40 MB packing in 160 ms: φ = (160 − 40) / 40 = 3 (weight 40e6). Four
    workers' probes t = 1, 1, 1.5, 2 ns/B: samples 1, 1, 1.5, 2 (weight P each). Sorted, the
    cumulative weights are P, 2P, 3P, 4P, 4P + 40e6; half of 4P + 40e6 = 154.2e6 lies between 2P
    (134.2e6) and 3P (201.3e6): φ = 1.5 (the primitive alone: 3)."""
    fresh = (40e6, 0, 40e6, 0.160, 1)
    assert fit_copy([PLAIN, fresh])["fresh_copy_factor"] == pytest.approx(3.0)
    f = fit_copy([PLAIN, fresh], [1e-9, 1e-9, 1.5e-9, 2e-9])
    assert f["fresh_copy_factor"] == pytest.approx(1.5)
    assert f["copy_bandwidth"] == pytest.approx(1e9)  # C and σ are the primitives' alone
    assert f["strided_copy_factor"] is None


def test_primitive_samples_take_over_as_they_accumulate():
    """Four probes at 1 ns/B (φ = 1, weight 4P = 268.4e6) against eight fresh 40 MB packings at φ = 3
    (weight 320e6): half of 588.4e6 = 294.2e6 > 4P, so φ = 3."""
    rows = [PLAIN] + [(40e6, 0, 40e6, 0.160, 1)] * 8
    assert fit_copy(rows, [1e-9] * 4)["fresh_copy_factor"] == pytest.approx(3.0)


def test_direct_samples_alone_and_without_a_copy_rate():
    """No fresh primitive: two probes 1 and 3 ns/B at C = 1 GB/s, equal weights, half met exactly
    at the first: the mean, φ = 2. A negative probe value is dropped (a probe never measures a
    speed-up), a zero one counts (memory reused: no faults). Without a plain phase there is no C
    to convert with: φ stays None."""
    assert fit_copy([PLAIN], [1e-9, 3e-9])["fresh_copy_factor"] == pytest.approx(2.0)
    assert fit_copy([PLAIN], [1e-9, 3e-9, -5e-9])["fresh_copy_factor"] == pytest.approx(2.0)
    assert fit_copy([PLAIN], [0.0, 0.0, 4e-9])["fresh_copy_factor"] == pytest.approx(0.0)
    assert fit_copy([PLAIN])["fresh_copy_factor"] is None
    assert fit_copy([], [1e-9])["fresh_copy_factor"] is None
    assert fit_copy([(10e6, 4e6, 0, 0.012, 1)], [1e-9])["fresh_copy_factor"] is None


def test_calibration_keeps_each_workers_latest_probe():
    """A plain PP Merge (10 MB packed and written in 10 ms each: C = 1 GB/s) whose records carry the
    probes of workers 0 and 1 (2 and 4 ns/B: φ = mean 3, equal weights); a later record from worker
    0 (JSON keys are strings: the same worker) at 1 ns/B replaces its value: samples 1 and 4, φ =
    2.5; a third worker at 1 ns/B: samples 1, 1, 4, φ = 1. The params carry it with the threshold."""
    pp = {"kind": "merge", "received": {1: 10e6}, "transfer_s": 0.01, "pack_s": 0.010, "assemble_s": 0.010,
          "copy_bytes": 20e6, "pack_bytes": 10e6, "assemble_bytes": 10e6, "pack_workers": 1,
          "assemble_workers": 1}
    cal = TransitionCalibration()
    cal.observe([{**pp, "fault_s_per_byte": {0: 2e-9, 1: 4e-9}}])
    assert cal.fresh_copy_factor == pytest.approx(3.0)
    cal.observe([{**pp, "fault_s_per_byte": {"0": 1e-9}}])
    assert cal.faults == {"0": 1e-9, "1": 4e-9}
    assert cal.fresh_copy_factor == pytest.approx(2.5)
    cal.observe([{**pp, "fault_s_per_byte": {2: 1e-9}}])
    assert cal.fresh_copy_factor == pytest.approx(1.0)
    p = cal.params()  # the runtime's executor pools its buffers: none is fresh, φ prices nothing
    assert (p.fresh_copy_factor, p.fresh_buffer_bytes) == (pytest.approx(1.0), math.inf)
    cal = TransitionCalibration(fresh_buffer_bytes=FRESH_BUFFER_BYTES)
    cal.observe([{**pp, "fault_s_per_byte": {0: 2e-9}}])
    p = cal.params()
    assert (p.fresh_copy_factor, p.fresh_buffer_bytes) == (pytest.approx(2.0), FRESH_BUFFER_BYTES)
    with pytest.raises(ValueError, match="fresh_buffer_bytes"):
        TransitionCalibration(fresh_buffer_bytes=0)
    # records without probes (older runs) leave φ to the primitives, as before
    assert TransitionCalibration().fresh_copy_factor is None


class _Worker:
    """A stand-in worker: ``fault_probe.remote(measure)`` logs ``(id, measure)`` and returns the
    kept value (``Transit.fault_probe``: measured on the first call with ``measure``)."""

    def __init__(self, value, log, i, kept=False):
        self.kept = value if kept else None

        def call(measure=True):
            log.append((i, measure))
            if self.kept is None and measure:
                self.kept = value
            return self.kept
        self.fault_probe = SimpleNamespace(remote=call)


def test_executor_probes_each_unmeasured_worker_once_and_alone():
    """One primitive ran on workers 0, 1, 2: worker 0 already reports 2 ns/B, worker 2 a GPU's None
    (measured: nothing to pay); 1 does not and is measured alone (one ``_get`` of one call). Live
    workers 3 and 4 ran nothing: both are asked at once without measuring; 3 has measured (4 ns/B),
    4 has not and is measured alone, after 1. A second transition with the same results measures
    nothing again (1 now reports it)."""
    log, gets = [], []
    d = SimpleNamespace(workers=[_Worker(None, log, 0), _Worker({"s_per_byte": 3e-9}, log, 1),
                                 _Worker(None, log, 2), _Worker({"s_per_byte": 4e-9}, log, 3, kept=True),
                                 _Worker({"s_per_byte": 5e-9}, log, 4)],
                        _get=lambda futs, what: gets.append(len(futs)) or list(futs))
    results = {"merge:a": [{"worker": 0, "fault_s_per_byte": 2e-9}, {"worker": 2, "fault_s_per_byte": None},
                           {"worker": 1}]}
    ex = TransitionExecutor(d)
    assert ex._fault_probes(results, [0, 1, 2, 3, 4]) == {0: 2e-9, 1: 3e-9, 3: 4e-9, 4: 5e-9}
    assert log == [(3, False), (4, False), (1, True), (4, True)] and gets == [2, 1, 1]
    log.clear()
    results["merge:a"][2]["fault_s_per_byte"] = 3e-9
    assert ex._fault_probes(results, [0, 1, 2]) == {0: 2e-9, 1: 3e-9}
    assert log == []
    assert PrimitiveRecord("p", "merge", "a", 0, 0, 0, 0, 0, 0).fault_s_per_byte == {}


def test_measure_reports_a_fresh_mapping():
    """One pair at 64 MiB: the fields, and page faults on the fresh buffer's first touch (at least
    one: every fresh mapping faults on first write, 4 KiB pages or huge ones); bad input named."""
    m = measure(reps=1)
    assert set(m) == {"bytes", "fresh_s", "warm_s", "faults", "s_per_byte"}
    assert m["bytes"] == P and m["faults"] >= 1 and m["s_per_byte"] >= 0
    with pytest.raises(ValueError, match="nbytes"):
        measure(nbytes=10)
    with pytest.raises(ValueError, match="reps"):
        measure(reps=0)
