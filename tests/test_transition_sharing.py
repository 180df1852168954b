"""Primitives on workers that share cores (``transition/sharing.py``), one primitive at a time per
worker (``CostParams.serial_workers``) and the calibration's fixed + per-byte fit and core-sharing
correction (``transition/calibrate.py``), by hand."""

from __future__ import annotations

import math

import pytest

from nereus.spec.plan import Candidate, Plan
from nereus.transition.calibrate import TransitionCalibration, fit_line, weighted_median
from nereus.transition.cost import CostParams, duration, ports
from nereus.transition.estimate import estimate_transition
from nereus.transition.primitives import Primitive
from nereus.transition.schedule import Schedule
from nereus.transition.sharing import share_factors, shared_schedule, width


def _p(pid: str, gpus: tuple) -> Primitive:
    return Primitive(pid=pid, kind="merge", model_stage="actor.train", gpus=gpus)


def _job():
    from nereus.runtime.run.device_model import runtime_job
    from nereus.spec.presets import MODEL_PRESETS
    from nereus.spec.workload import WorkloadSpec

    w = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                     mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
    return runtime_job(MODEL_PRESETS["tiny"], w, 4)


def test_concurrent_primitives_share_the_cores():
    """A on workers 0,1 (1 s), B on 2,3 (2 s), C on 0 after A (0.5 s). The greedy runs A and B at
    once: A [0, 1], B [0, 2], C [1, 1.5]; makespan 2. On 2 cores, 4 busy workers run at half speed:
    A's 1 s of work ends at t = 2, B has done 1 s of its 2; then B (2 workers) and C (1 worker)
    are 3 busy workers on 2 cores, rate 2/3: C's 0.5 s ends at t = 2.75, B has 1 - 0.5 = 0.5 s
    left, alone at full speed: ends at 3.25. The work, 1·2 + 2·2 + 0.5·1 = 6.5 worker-seconds, over
    2 cores is 3.25 s: the cores serialize everything beyond their count."""
    nodes = {"A": _p("A", (0, 1)), "B": _p("B", (2, 3)), "C": _p("C", (0,))}
    dur = {"A": 1.0, "B": 2.0, "C": 0.5}
    preds = {"A": set(), "B": set(), "C": {"A"}}
    sched = Schedule({"A": 0.0, "B": 0.0, "C": 1.0}, {"A": 1.0, "B": 2.0, "C": 1.5}, 2.0)
    port = {p: frozenset() for p in nodes}
    s = shared_schedule(sched, nodes, preds, port, dur, 2)
    assert (s.start["A"], s.end["A"], s.start["C"]) == pytest.approx((0.0, 2.0, 2.0))
    assert s.end["C"] == pytest.approx(2.75) and s.end["B"] == pytest.approx(3.25)
    assert s.makespan == pytest.approx(3.25) and s.algo == "greedy+shared"
    # 4 cores: nobody waits, the greedy's times
    s4 = shared_schedule(sched, nodes, preds, port, dur, 4)
    assert (s4.end["A"], s4.end["B"], s4.end["C"]) == pytest.approx((1.0, 2.0, 1.5))
    assert shared_schedule(sched, nodes, preds, port, dur, math.inf) is sched  # GPUs: unchanged
    # one primitive on 4 workers alone on 2 cores takes twice its duration
    one = {"W": _p("W", (0, 1, 2, 3))}
    s1 = shared_schedule(Schedule({"W": 0.0}, {"W": 0.3}, 0.3), one, {"W": set()}, {"W": frozenset()},
                         {"W": 0.3}, 2)
    assert s1.makespan == pytest.approx(0.6) and width(one["W"]) == 4
    with pytest.raises(ValueError, match="cores"):
        shared_schedule(sched, nodes, preds, port, dur, 0)


def test_replay_keeps_the_greedy_order_on_a_common_gpu():
    """D and E share GPU 0 and no edge: the greedy ran D [0, 1] then E [1, 2]; the replay keeps E
    after D (the executor submits them in that order to worker 0), and F (GPU 1) runs beside D:
    two workers on 2 cores, full speed."""
    nodes = {"D": _p("D", (0,)), "E": _p("E", (0,)), "F": _p("F", (1,))}
    sched = Schedule({"D": 0.0, "E": 1.0, "F": 0.0}, {"D": 1.0, "E": 2.0, "F": 1.0}, 2.0)
    s = shared_schedule(sched, nodes, {p: set() for p in nodes}, {p: frozenset() for p in nodes},
                        {"D": 1.0, "E": 1.0, "F": 1.0}, 2)
    assert (s.start["E"], s.end["E"], s.end["F"]) == pytest.approx((1.0, 2.0, 1.0))


def test_share_factors_by_hand():
    """Two 2-worker primitives over [0, 2] on 2 cores: 4 busy workers, each ran 2x slower. A
    2-worker one over [0, 1] beside one over [0, 2]: the first saw (2·1 + 2·1) / 1 = 4 busy (2x),
    the second (2·1 + 2·2) / 2 = 3 busy (1.5x)."""
    assert share_factors([(0, 2, 2), (0, 2, 2)], 2) == pytest.approx([2.0, 2.0])
    assert share_factors([(0, 1, 2), (0, 2, 2)], 2) == pytest.approx([2.0, 1.5])
    assert share_factors([(0, 1, 2), (0, 2, 2)], math.inf) == [1.0, 1.0]
    assert share_factors([(1, 1, 4)], 2) == [1.0]  # no span
    with pytest.raises(ValueError, match="cores"):
        share_factors([], -1)


def test_serial_workers_hold_a_worker_port_and_serialize_a_swap_of_links():
    """actor.generate extends 0 -> 1 while actor.train extends 1 -> 0: disjoint link ports, so the
    paper's model overlaps them (makespan = the longer one); the runtime's executor runs one call at
    a time per worker, so with ``serial_workers`` they follow each other (makespan = the sum)."""
    job = _job()
    cur = Plan((Candidate("actor.generate", 1, 1, 1, gpus=(0,)), Candidate("actor.train", 1, 1, 1, gpus=(1,))))
    tgt = Plan((Candidate("actor.generate", 1, 1, 2, gpus=(0, 1)), Candidate("actor.train", 1, 1, 2, gpus=(1, 0))))
    free = estimate_transition(job, cur, tgt, params=CostParams())
    ser = estimate_transition(job, cur, tgt, params=CostParams(serial_workers=True))
    ext = sorted(p for p in free.durations if p.startswith("extend"))
    assert len(ext) == 2
    d = [free.durations[p] for p in ext]
    assert free.l_tran == pytest.approx(max(d))
    assert ser.l_tran == pytest.approx(sum(d))
    x = next(n for n in ser.dag.nodes if n.pid == ext[0])
    assert {(g, "worker", "run") for g in x.gpus} <= ports(x, job.cluster, CostParams(serial_workers=True))
    assert not any(k == "worker" for _, k, _ in ports(x, job.cluster))
    # on 1 core the two extends' 2 workers each run at half speed: the sum again, but each twice as
    # long as alone (sharing.py); the calibrated copy term is the same in both
    one = estimate_transition(job, cur, tgt, params=CostParams(serial_workers=True, worker_cores=1))
    assert one.l_tran == pytest.approx(2 * sum(d))
    with pytest.raises(ValueError, match="worker_cores"):
        CostParams(worker_cores=0)
    assert duration(x, job.cluster, CostParams(worker_cores=1)) == duration(x, job.cluster)


def test_fit_line_by_hand():
    """``y = 0.05 + x / 1e8``: intercept 0.05 s, slope 1e-8 s/B, also with one point slowed 5x (a
    median of the pairwise slopes and of the residuals, Theil–Sen: the 5 pairs without the slow
    point all have slope 1e-8). A negative intercept (``y = x / 1e8 - 0.01``) gives the line through
    the origin: the x-weighted median of y/x = 9e-9 (weight 1), 9.5e-9 (2), 9.667e-9 (3): half the
    weight, 3, is met exactly at 9.5e-9, so the mean of it and the next, (9.5e-9 + 0.29/3e7) / 2."""
    xs = [0.0, 10e6, 20e6, 30e6]
    f, a = fit_line(xs, [0.05 + x / 1e8 for x in xs])
    assert (f, a) == pytest.approx((0.05, 1e-8))
    xs5 = [0.0, 10e6, 20e6, 30e6, 40e6]
    ys5 = [0.05 + x / 1e8 for x in xs5]
    ys5[2] *= 5  # one primitive slowed by other work
    f, a = fit_line(xs5, ys5)
    assert (f, a) == pytest.approx((0.05, 1e-8))
    f, a = fit_line([1e7, 2e7, 3e7], [0.09, 0.19, 0.29])
    assert f == 0.0 and a == pytest.approx((9.5e-9 + 0.29 / 3e7) / 2)
    assert weighted_median([1.0, 2.0], [1.0, 1.0]) == 1.5 and weighted_median([1.0, 2.0, 9.0], [1, 3, 1]) == 2.0
    with pytest.raises(ValueError, match="weights"):
        weighted_median([1.0], [0.0])
    assert fit_line([1e7, 2e7], [0.1, 0.2]) is None  # too few points
    assert fit_line([1e7, 1e7, 1.01e7], [0.1, 0.2, 0.3]) is None  # no spread in bytes
    assert fit_line([1e7, 2e7, 3e7], [0.3, 0.2, 0.1]) is None  # slope <= 0


def test_calibration_fits_a_fixed_term_apart_from_the_bytes():
    """Three Merges one after another of 0, 10 and 20 MB, each ``span - copy = 0.05 + bytes / 1e8``:
    the fixed term is 0.05 s a primitive and the link 1e8 B/s (a ratio of sums would give
    30e6 / (Σ spans - copies) = 30e6 / 0.45 = 6.7e7 B/s and no fixed term). Copy: pack + assembly
    seconds against the planner's copy bytes, (20e6 + 40e6) / (0.1 + 0.2)."""
    recs, t = [], 0.0
    for mb, copy in ((0, 0.0), (10, 0.1), (20, 0.2)):
        span = 0.05 + mb * 1e6 / 1e8 + copy
        recs.append({"kind": "merge", "received": {1: mb * 1e6} if mb else {}, "transfer_s": span - copy,
                     "pack_s": copy / 2, "assemble_s": copy / 2, "copy_bytes": 2 * mb * 1e6, "setup_s": 0.0,
                     "t_start": t, "t_ready": t, "t_end": t + span, "workers": 2})
        t += span
    cal = TransitionCalibration(cores=2)
    cal.observe(recs)
    assert cal.setup_s == pytest.approx(0.05) and cal.bandwidth == pytest.approx(1e8)
    assert cal.copy_bandwidth == pytest.approx(60e6 / 0.3)
    p = cal.params()
    assert (p.comm_setup_intra_s, p.worker_cores, p.serial_workers, p.transit_buffers) == \
        pytest.approx((0.05, 2.0, True, True))
    assert TransitionCalibration().params().worker_cores == math.inf
    with pytest.raises(ValueError, match="cores"):
        TransitionCalibration(cores=0)


def test_calibration_undoes_core_sharing():
    """Two 2-worker Splits of 10 MB each over the same 0.2 s on 2 cores: each ran at half speed, so
    the link did 20e6 B in 0.2 s of own-speed wire (1e8 B/s), not 20e6 / 0.4. Without ``cores``: 5e7.
    A Destroy's span gives the teardown, its own span undivided (it ran alone)."""
    recs = [{"kind": "split", "received": {0: 10e6}, "transfer_s": 0.2, "pack_s": 0.0, "assemble_s": 0.0,
             "setup_s": 0.0, "t_start": 0.0, "t_ready": 0.0, "t_end": 0.2, "workers": 2} for _ in range(2)]
    recs.append({"kind": "destroy", "received": {}, "transfer_s": 0.0, "setup_s": 0.0,
                 "t_start": 0.3, "t_ready": 0.3, "t_end": 0.31, "workers": 1})
    shared = TransitionCalibration(cores=2)
    shared.observe(recs)
    assert shared.bandwidth == pytest.approx(1e8) and shared.teardown_s == pytest.approx(0.01)
    alone = TransitionCalibration()
    alone.observe(recs)
    assert alone.bandwidth == pytest.approx(5e7)


def test_dependent_primitives_wait_for_the_dispatch():
    """The same A, B, C with a dispatch of 0.25 s after a DAG predecessor. Without sharing: A
    [0, 1], B [0, 2]; C depends on A, so it starts at 1 + 0.25 and ends at 1.75 (worked out for 2
    cores below)."""
    nodes = {"A": _p("A", (0, 1)), "B": _p("B", (2, 3)), "C": _p("C", (0,))}
    dur = {"A": 1.0, "B": 2.0, "C": 0.5}
    preds = {"A": set(), "B": set(), "C": {"A"}}
    sched = Schedule({"A": 0.0, "B": 0.0, "C": 1.0}, {"A": 1.0, "B": 2.0, "C": 1.5}, 2.0)
    port = {p: frozenset() for p in nodes}
    s = shared_schedule(sched, nodes, preds, port, dur, math.inf, dispatch=0.25)
    assert (s.start["C"], s.end["C"], s.end["B"]) == pytest.approx((1.25, 1.75, 2.0))
    assert s.makespan == pytest.approx(2.0)
    # 2 cores: A ends at 2 (B has 1 s left); B alone at full speed until C starts at 2.25 (B: 0.75 s
    # left); then 3 workers on 2 cores, rate 2/3: C's 0.5 s ends at 2.25 + 0.75 = 3.0, B's 0.75 s
    # would end at 3.375, but it has 0.75 − 0.5 = 0.25 s left at 3.0, alone: ends at 3.25
    s2 = shared_schedule(sched, nodes, preds, port, dur, 2, dispatch=0.25)
    assert (s2.end["A"], s2.start["C"], s2.end["C"], s2.end["B"]) == pytest.approx((2.0, 2.25, 3.0, 3.25))
    with pytest.raises(ValueError, match="dispatch"):
        shared_schedule(sched, nodes, preds, port, dur, 2, dispatch=-1.0)


def test_calibration_measures_the_dispatch():
    """Two primitives on workers 0, 1 end at 0.10 s and 0.12 s; a third on workers 1, 2 depends on
    the first and starts (its last worker) at 0.15 s: it waited for the first (0.10) and for the
    second, which ran on its worker 1 (0.12): dispatch 0.15 − 0.12 = 0.03 s. A fourth, on worker 3
    after the first, starts at 0.13: 0.03 s too. One without predecessors counts nothing."""
    recs = [{"pid": "a", "kind": "destroy", "t_ready": 0.0, "t_end": 0.10, "worker_ids": [0]},
            {"pid": "b", "kind": "destroy", "t_ready": 0.0, "t_end": 0.12, "worker_ids": [1]},
            {"pid": "c", "kind": "destroy", "t_ready": 0.15, "t_end": 0.16, "worker_ids": [1, 2], "preds": ["a"]},
            {"pid": "d", "kind": "destroy", "t_ready": 0.13, "t_end": 0.14, "worker_ids": [3], "preds": ["a"]}]
    cal = TransitionCalibration()
    cal.observe(recs)
    assert cal.dispatch_s == pytest.approx(0.03)
    assert cal.params().dispatch_s == pytest.approx(0.03)
    assert TransitionCalibration().params().dispatch_s == 0.0
