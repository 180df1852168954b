"""The copy term's strided, fresh-buffer and crowding surcharges and their calibration
(``nereus/transition/copy_cost.py``, ``calibrate.fit_copy``), by hand.

tiny: h = 64, a·d = 64, F = 128, 4 layers, N = 156,224 parameters: the row-parallel tensors
(``o_proj`` 64·64, ``down_proj`` 64·128 per layer) hold 4·64·(64 + 128) = 49,152 of them, f =
49,152 / 156,224. actor.generate at 2 B/param: a TP 2 rank holds HALF = 156,800 B, a PP 2 stage 1
STAGE1 = 156,288 B (tests/test_transition_buffers.py derives both).
"""

from __future__ import annotations

import math

import pytest

from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.calibrate import TransitionCalibration, fit_copy
from nereus.transition.copy_cost import (
    FRESH_BUFFER_BYTES,
    copy_workers,
    crowd,
    effective_copy_bytes,
    fresh_bytes,
    fresh_recv_bytes,
    recv_buffers,
    row_parallel_fraction,
    send_buffers,
)
from nereus.transition.cost import CostParams, copy_bytes, duration
from nereus.transition.emu import EMU
from nereus.transition.estimate import estimate_transition
from nereus.transition.primitives import Primitive, extend

TINY = get_model("tiny")
JOB = JobSpec(TINY, ClusterSpec(get_gpu("h100"), 1, 4), WorkloadSpec())
HALF, STAGE1 = 156_800, 156_288
RUNTIME = CostParams(transit_buffers=True)  # the executor's constants: sent/alloc and strided set


def _gen(tp, pp, gpus):
    return Plan((Candidate("actor.generate", tp, pp, 1, gpus=tuple(gpus)),))


def test_row_parallel_fraction_by_hand():
    assert row_parallel_fraction(TINY) == pytest.approx(49_152 / 156_224)
    small = get_model("small")  # 8 layers, h 256, a·d 256, F 512: 8·256·768 of 4,755,712
    assert small.num_params == 4_755_712
    assert row_parallel_fraction(small) == pytest.approx(1_572_864 / 4_755_712)


def test_tp_growth_packs_and_reslices_columns():
    """TP 1 -> 2 (a remote-source Merge): GPU 0 cuts the columns of o_proj/down_proj out of its
    whole tensors for GPU 1 (f·HALF of its HALF sent) and re-slices its own half (f·HALF of the
    HALF it writes)."""
    m = next(n for n in estimate_transition(JOB, _gen(1, 1, (0,)), _gen(2, 1, (0, 1)), params=RUNTIME).dag.nodes
             if n.kind == "merge")
    assert m.sent == {0: HALF} and m.alloc == {0: HALF, 1: HALF}
    assert m.strided_sent == m.strided_alloc == 49_152 * HALF // 156_224 == 49_333
    assert copy_workers(m) == (1, 2)


def test_tp_to_pp_relayout_writes_columns_only():
    """TP 2 -> PP 2 on GPUs 0, 1 (one fused Merge): a sender holds narrower shards than its target
    (TP 2 -> 1), so it packs its own column blocks whole; the new stage (largest alloc STAGE1) is
    written as column slices where it is row parallel."""
    f = estimate_transition(JOB, _gen(2, 1, (0, 1)), _gen(1, 2, (0, 1)), params=RUNTIME).dag.nodes[0]
    assert max(f.alloc.values()) == STAGE1
    assert (f.strided_sent, f.strided_alloc) == (0, 49_152 * STAGE1 // 156_224) == (0, 49_172)


def test_pp_and_dp_moves_are_contiguous():
    pp = estimate_transition(JOB, _gen(1, 1, (0,)), _gen(1, 2, (0, 1)), params=RUNTIME).dag.nodes
    dp = estimate_transition(JOB, _gen(1, 1, (0,)), Plan((Candidate("actor.generate", 1, 1, 2, gpus=(0, 1)),)),
                             params=RUNTIME).dag.nodes
    assert [(n.strided_sent, n.strided_alloc) for n in pp + dp] == [(0, 0)] * len(pp + dp)
    # without the executor's constants nothing is annotated (the paper's GPU model)
    plain = estimate_transition(JOB, _gen(1, 1, (0,)), _gen(2, 1, (0, 1))).dag.nodes
    assert all(n.strided_sent == n.strided_alloc == 0 for n in plain)


def test_fresh_bytes_count_send_buffers_at_the_mmap_threshold():
    big, small = 40 * 2**20, 20 * 2**20
    x = extend(EMU("a#0", "actor.train", 1, 1, (0,), (big,)), EMU("a#1", "actor.train", 1, 1, (1,), (big,)))
    assert send_buffers(x) == {0: [float(big)]}
    assert fresh_bytes(x) == big  # 40 MiB >= 32 MiB: a fresh mmap
    y = extend(EMU("a#0", "actor.train", 1, 1, (0,), (small,)), EMU("a#1", "actor.train", 1, 1, (1,), (small,)))
    assert fresh_bytes(y) == 0
    assert fresh_bytes(x, math.inf) == 0  # GPUs: the caching allocator reuses memory
    # a group member sends its bytes split over the members that receive: 80 MiB to two is two
    # 40 MiB buffers (both fresh), to one an 80 MiB buffer
    g = Primitive(pid="split:s", kind="split", model_stage="actor.train", gpus=(0, 1, 2), groups=(((0, 1, 2), 1),),
                  sent={0: 2 * big}, recv={1: 1, 2: 1})
    assert send_buffers(g) == {0: [float(big), float(big)]} and fresh_bytes(g) == 2 * big
    assert fresh_bytes(g, 50 * 2**20) == 0
    assert FRESH_BUFFER_BYTES == 33_554_432
    with pytest.raises(ValueError, match="threshold"):
        fresh_bytes(x, 0)
    # receive buffers: one per sender; the Extend's receiver gets one 40 MiB buffer, the group
    # members 1 and 2 each one from GPU 0, the only member that sends
    assert recv_buffers(x) == {1: [float(big)]} and fresh_recv_bytes(x) == big
    assert fresh_recv_bytes(y) == 0 and fresh_recv_bytes(x, math.inf) == 0
    h = Primitive(pid="merge:m", kind="merge", model_stage="actor.train", gpus=(0, 1, 2), groups=(((0, 1, 2), 1),),
                  sent={0: 2 * big}, recv={1: big, 2: small})
    assert recv_buffers(h) == {1: [float(big)], 2: [float(small)]} and fresh_recv_bytes(h) == big
    with pytest.raises(ValueError, match="threshold"):
        fresh_recv_bytes(x, -1)


def test_crowd_by_hand():
    assert crowd(1, 0.5) == 1.0 and crowd(2, math.inf) == 1.0
    assert crowd(2, 1.0) == 2.0 and crowd(3, 2.0) == 1.5
    assert crowd(2, 0.5) == 2.0  # relative to one GPU, itself slowed to 1/0.5: max(1, 4) / max(1, 2)
    with pytest.raises(ValueError, match="cores"):
        crowd(2, 0.0)


def test_duration_prices_strided_fresh_and_crowded_bytes():
    """A Merge: GPU 0 packs 10 MB (3 MB as columns), GPUs 0 and 1 each write 10 MB (3 MB as
    columns). σ = 0.5, c = 1 core: packing 10 + 0.5·3 = 11.5 MB alone; assembly (10 + 1.5) MB on
    two GPUs sharing one core, ×2 = 23 MB; K_eff = 34.5 MB at C = 1 GB/s."""
    c = JOB.cluster
    bw, lat, _ = c.link_of((0, 1))
    m = Primitive(pid="merge:x", kind="merge", model_stage="actor.train", gpus=(0, 1), groups=(((0, 1), 10e6),),
                  recv={1: 10e6}, sent={0: 10e6}, alloc={0: 10e6, 1: 10e6}, strided_sent=3_000_000,
                  strided_alloc=3_000_000)
    assert copy_bytes(m) == 20e6
    p = CostParams(comm_setup_intra_s=0.1, copy_bandwidth=1e9, strided_copy_factor=0.5, copy_cores=1.0)
    assert effective_copy_bytes(m, copy_bytes(m), p) == pytest.approx(34.5e6)
    assert duration(m, c, p) == pytest.approx(0.1 + 10e6 / bw + lat + 34.5e6 / 1e9)
    # the defaults price every byte alike (σ = φ = 0, c infinite): K
    assert effective_copy_bytes(m, copy_bytes(m), CostParams()) == 20e6
    # a 40 MiB Extend with φ = 1 (and the CPU threshold): the packed and the received bytes twice
    big = 40 * 2**20
    x = extend(EMU("a#0", "actor.train", 1, 1, (0,), (big,)), EMU("a#1", "actor.train", 1, 1, (1,), (big,)))
    q = CostParams(copy_bandwidth=1e9, fresh_copy_factor=1.0, fresh_buffer_bytes=FRESH_BUFFER_BYTES)
    # K = 2·big, plus φ·big for the fresh send buffer and φ·big for the fresh receive buffer
    assert effective_copy_bytes(x, copy_bytes(x), q) == 4 * big
    assert effective_copy_bytes(x, copy_bytes(x), CostParams(copy_bandwidth=1e9, fresh_copy_factor=1.0)) == 2 * big
    with pytest.raises(ValueError, match="copy_cores"):
        CostParams(copy_cores=0.0)


def test_fit_copy_by_hand():
    """Plain one-worker phases: 10 MB in 10 ms and 20 MB in 20 ms, C = 1 GB/s. A strided phase of
    10 MB (4 MB columns) in 12 ms: σ = (12 − 10) MB / 4 MB = 0.5. A fresh 40 MB packing in 80 ms:
    φ = (80 − 40) / 40 = 1. Plain two-worker phases of 10 MB in 20, 15 and 10 ms ran ρ = 2, 1.5, 1
    times slower: cores max(1, 2/2) = 1, 2/1.5 = 1.333, infinite; median 1.333."""
    rows = [(10e6, 0, 0, 0.010, 1), (20e6, 0, 0, 0.020, 1), (10e6, 4e6, 0, 0.012, 1), (40e6, 0, 40e6, 0.080, 1),
            (10e6, 0, 0, 0.020, 2), (10e6, 0, 0, 0.015, 2), (10e6, 0, 0, 0.010, 2)]
    f = fit_copy(rows)
    assert f["copy_bandwidth"] == pytest.approx(1e9)
    assert f["strided_copy_factor"] == pytest.approx(0.5)
    assert f["fresh_copy_factor"] == pytest.approx(1.0)
    assert f["copy_cores"] == pytest.approx(4 / 3)
    # no plain phase: the rate from every row, nothing else measured
    g = fit_copy([(10e6, 4e6, 0, 0.012, 1)])
    assert g == {"copy_bandwidth": pytest.approx(10e6 / 0.012), "strided_copy_factor": None,
                 "fresh_copy_factor": None, "copy_cores": None}
    # a strided phase faster than a contiguous one gives σ = 0, not a negative surcharge
    assert fit_copy([(10e6, 0, 0, 0.010, 1), (10e6, 4e6, 0, 0.009, 1)])["strided_copy_factor"] == 0.0
    assert fit_copy([]) == {"copy_bandwidth": None, "strided_copy_factor": None, "fresh_copy_factor": None,
                            "copy_cores": None}


def test_calibration_fits_the_phases_apart():
    """Executor records with the two phases: a TP re-cut Split packs 10 MB contiguous in 10 ms and
    writes 20 MB (5 MB as columns) in 25 ms; a DP Extend packs a fresh 40 MB buffer in 80 ms and
    writes 40 MB in 40 ms. Plain phases: 10 MB / 10 ms and 40 MB / 40 ms, C = 1 GB/s; σ = (25 −
    20) / 5 = 1; φ = (80 − 40) / 40 = 1; no phase on two workers at once: c stays unset."""
    recs = [{"kind": "split", "received": {0: 10e6}, "transfer_s": 0.01, "pack_s": 0.010, "assemble_s": 0.025,
             "copy_bytes": 30e6, "pack_bytes": 10e6, "assemble_bytes": 20e6, "pack_strided": 0,
             "assemble_strided": 5e6, "fresh_bytes": 0, "pack_workers": 1, "assemble_workers": 1},
            {"kind": "extend", "received": {1: 40e6}, "transfer_s": 0.04, "pack_s": 0.080, "assemble_s": 0.040,
             "copy_bytes": 80e6, "pack_bytes": 40e6, "assemble_bytes": 40e6, "pack_strided": 0,
             "assemble_strided": 0, "fresh_bytes": 40e6, "pack_workers": 1, "assemble_workers": 1}]
    cal = TransitionCalibration(fresh_buffer_bytes=FRESH_BUFFER_BYTES)  # an executor allocating anew
    cal.observe(recs)
    assert cal.copy_bandwidth == pytest.approx(1e9)
    assert cal.strided_copy_factor == pytest.approx(1.0) and cal.fresh_copy_factor == pytest.approx(1.0)
    assert cal.copy_cores is None
    p = cal.params()
    assert (p.strided_copy_factor, p.fresh_copy_factor, p.fresh_buffer_bytes, p.copy_cores) == (
        pytest.approx(1.0), pytest.approx(1.0), FRESH_BUFFER_BYTES, math.inf)


def test_wire_excludes_the_senders_packing():
    """A receiver's transfer seconds start with its sender's packing, which the copy term prices:
    the wire fallback (fewer than 3 primitives, calibrate.py) takes transfer − pack. A Merge of
    28 MB: span 50 ms, the sender packs 10 ms, the receiver waits 30 ms (10 ms packing + 20 ms
    wire) and assembles 10 ms: B = 28 MB / 20 ms = 1.4 GB/s (not 28 / 30), F = 50 − 20 − 20 =
    10 ms."""
    rec = {"kind": "merge", "received": {1: 28e6}, "transfer_s": 0.030, "pack_s": 0.010, "assemble_s": 0.010,
           "t_ready": 0.0, "t_end": 0.050, "workers": 2}
    cal = TransitionCalibration()
    cal.observe([rec, dict(rec)])
    assert cal.bandwidth == pytest.approx(1.4e9)
    assert cal.setup_s == pytest.approx(0.010)


def test_wire_excludes_fresh_receive_page_faults():
    """Three Extends of a 40 MiB (fresh) buffer, each: pack 80 ms, assembly 40 ms, wire (transfer −
    pack) 60 ms, span 180 ms. Copy: the assembly is plain, C = 40 MiB / 40 ms; the packing gives
    φ = (80 − 40) / 40 = 1. The receive buffer's faults, φ·R_r / C = 40 ms, are the copy term's:
    the wire left is 20 ms, B = 40 MiB / 20 ms (not / 60 ms); F = 180 − 20 − 120 − 40 = 0."""
    big = 40 * 2**20
    rec = {"kind": "extend", "received": {1: big}, "transfer_s": 0.140, "pack_s": 0.080, "assemble_s": 0.040,
           "t_ready": 0.0, "t_end": 0.180, "workers": 2, "copy_bytes": 2 * big, "pack_bytes": big,
           "assemble_bytes": big, "fresh_bytes": big, "fresh_recv_bytes": big, "pack_workers": 1,
           "assemble_workers": 1}
    cal = TransitionCalibration()
    cal.observe([dict(rec) for _ in range(3)])
    assert cal.copy_bandwidth == pytest.approx(big / 0.040)
    assert cal.fresh_copy_factor == pytest.approx(1.0)
    assert cal.bandwidth == pytest.approx(big / 0.020)
    assert cal.setup_s == pytest.approx(0.0, abs=1e-12)


def test_surcharges_outlive_the_window():
    """window = 2: a TP re-cut Split (σ = 1, as in test_calibration_fits_the_phases_apart) then
    three plain PP moves (10 MB packed and written in 10 ms each). The window holds only the last
    two PP moves, but the Split's phases are kept apart: σ stays 1 (C = 1 GB/s from the plain
    phases), and a later primitive with strided phases replaces it."""
    split = {"kind": "split", "received": {0: 10e6}, "transfer_s": 0.01, "pack_s": 0.010, "assemble_s": 0.025,
             "copy_bytes": 30e6, "pack_bytes": 10e6, "assemble_bytes": 20e6, "pack_strided": 0,
             "assemble_strided": 5e6, "fresh_bytes": 0, "pack_workers": 1, "assemble_workers": 1}
    pp = {"kind": "merge", "received": {1: 10e6}, "transfer_s": 0.01, "pack_s": 0.010, "assemble_s": 0.010,
          "copy_bytes": 20e6, "pack_bytes": 10e6, "assemble_bytes": 10e6, "pack_strided": 0,
          "assemble_strided": 0, "fresh_bytes": 0, "pack_workers": 1, "assemble_workers": 1}
    cal = TransitionCalibration(window=2)
    cal.observe([split])
    for _ in range(3):
        cal.observe([dict(pp)])
    assert len(cal.rows) == 2
    assert cal.copy_bandwidth == pytest.approx(1e9) and cal.strided_copy_factor == pytest.approx(1.0)
    cal.observe([{**split, "assemble_s": 0.030}, {**split, "assemble_s": 0.030}])  # σ = (30 − 20) / 5 = 2
    assert cal.strided_copy_factor == pytest.approx(2.0)
