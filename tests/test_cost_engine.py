"""Engine terms of the cost model (issue 27): hand-computed decode steps, per-step and per-call
overheads, launch latency per layer pass, padding and the fixed per-step cost."""

import math
from dataclasses import replace

import numpy as np
import pytest

from nereus.cost import engine_terms as et
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.fit import group_of
from nereus.cost.model import CostModel
from nereus.spec.engine import ENGINE_PRESETS, EngineCosts, get_engine
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec


def _job(engine=None, **wkw):
    w = dict(algorithm="ppo", prompts_per_step=64, samples_per_prompt=2, prompt_len=100, response_len=50,
             response_len_max=200, mini_batch_size=64, micro_batch_size=4, infer_micro_batch_size=8,
             reward_model=False)
    w.update(wkw)
    fw = replace(get_framework("fsdp"), engine=engine)
    return JobSpec(actor=get_model("qwen2.5-0.5b"), cluster=ClusterSpec(gpu=get_gpu("h100"), num_nodes=1, gpus_per_node=8),
                   workload=WorkloadSpec(**w), framework=fw)


def test_decode_steps_by_hand():
    # 100 sequences, mean 50, longest 200, concurrency 64: the longest response binds (200 > ceil(5000/64)=79)
    s, r = et.decode_steps(100, 64, 50, 200)
    assert float(s) == 200 and float(r) == pytest.approx(100 * 50 / 200)
    # 1000 sequences: the token volume over the concurrency binds: ceil(50000/64) = 782 steps
    s, r = et.decode_steps(1000, 64, 50, 200)
    assert float(s) == 782 and float(r) == pytest.approx(50000 / 782)
    with pytest.raises(ValueError, match="max_len"):
        et.decode_steps(10, 4, 50, 40)


def test_longest_equals_old_model_when_every_response_has_the_mean_length():
    # response_len_max = mean and all sequences concurrent: S = L steps at n running, the old model
    cand = Candidate("actor.generate", 1, 1, 8, concurrency=64)
    old = CostModel(_job(response_len_max=None)).estimate_candidate(cand)
    new = CostModel(_job(EngineCosts(generation="longest"), response_len_max=None)).estimate_candidate(cand)
    assert new.time == pytest.approx(old.time, rel=1e-12)


def test_decode_overhead_and_call_cost_by_hand():
    cand = Candidate("actor.generate", 1, 1, 8, concurrency=64)
    base = CostModel(_job(EngineCosts(generation="longest"))).estimate_candidate(cand)
    eng = EngineCosts(generation="longest", decode_step_s=0.01, decode_seq_s=1e-4, generate_call_s=3.0)
    got = CostModel(_job(eng)).estimate_candidate(cand)
    # 128 rollouts / 8 replicas = 16 sequences each, c = 16: S = max(200, ceil(16*50/16)) = 200, r = 4
    assert got.breakdown["decode_overhead"] == pytest.approx(200 * (0.01 + 1e-4 * 4))
    assert got.breakdown["engine"] == pytest.approx(3.0)
    assert got.time - base.time == pytest.approx(200 * 0.0104 + 3.0)
    # calibration: an efficiency of 0.5 on the class doubles it
    eff = EfficiencyTable()
    eff.set("decode_overhead", 0.5)
    assert CostModel(_job(eng), efficiency=eff).estimate_candidate(cand).breakdown["decode_overhead"] == \
        pytest.approx(2 * 200 * 0.0104)


def test_layer_pass_latency_by_hand():
    eng = EngineCosts(layer_pass_s=1e-3)
    inf = Candidate("reference.infer", 1, 1, 8, micro_batch=8, zero=3)
    d_inf = CostModel(_job(eng)).estimate_candidate(inf).time - CostModel(_job()).estimate_candidate(inf).time
    # 128 sequences / 8 replicas / micro-batch 8 = 2 micro-batches x 24 layers x 1 pass x 1 ms
    assert d_inf == pytest.approx(2 * 24 * 1e-3)
    tr = Candidate("actor.train", 1, 1, 8, micro_batch=4, grad_accum=2, zero=3, recompute="full")
    d_tr = CostModel(_job(eng)).estimate_candidate(tr).breakdown["launch"]
    # 2 updates (128/64) x 2 micro-batches x 24 layers x 4 passes (full recompute) x 1 ms
    assert d_tr == pytest.approx(2 * 2 * 24 * 4 * 1e-3)


def test_padding_and_fixed_step_cost():
    inf = Candidate("reference.infer", 1, 1, 8, micro_batch=8, zero=3)
    plain = CostModel(_job()).estimate_candidate(inf).time
    assert CostModel(_job(EngineCosts(pad_to=150))).estimate_candidate(inf).time == pytest.approx(plain)
    assert CostModel(_job(EngineCosts(pad_to=600))).estimate_candidate(inf).time > 2 * plain
    with pytest.raises(ValueError, match="pad_to"):
        CostModel(_job(EngineCosts(pad_to=100))).estimate_candidate(inf)
    cm0, cm1 = CostModel(_job()), CostModel(_job(EngineCosts(step_s=2.5)))
    assert cm1.stage_latency({"actor.generate": 1.0}) - cm0.stage_latency({"actor.generate": 1.0}) == 2.5


def test_engine_spec_validation_and_roundtrip():
    with pytest.raises(ValueError, match="generation"):
        EngineCosts(generation="median")
    with pytest.raises(ValueError, match="decode_step_s"):
        EngineCosts(decode_step_s=-1)
    with pytest.raises(ValueError, match="unknown engine preset"):
        get_engine("nope")
    fw = FrameworkSpec.from_dict({"preset": "fsdp", "engine": {"preset": "verl-eager", "step_s": 2.0}})
    assert fw.engine.step_s == 2.0 and fw.engine.generation == "longest"
    assert FrameworkSpec.from_dict(fw.to_dict()).engine == fw.engine
    assert "engine" not in get_framework("nereus").to_dict()
    assert not ENGINE_PRESETS["none"].active and ENGINE_PRESETS["verl-eager"].active
    assert group_of("decode_overhead") == "decode_overhead" and group_of("launch") == "launch"


def test_no_engine_presets_on_default_frameworks():
    # jobs that set no engine (every framework preset, the runtime's cpu jobs) keep the old model
    from nereus.spec.framework import FRAMEWORK_PRESETS
    assert all(f.engine is None for f in FRAMEWORK_PRESETS.values())
    assert np.isclose(et.step_overhead(None, EfficiencyTable()), 0.0)


def test_controller_calibrates_from_a_stage_total():
    # an external trainer reports actor.generate only as a whole: the fit moves the classes the
    # stage exercises so that its re-estimated time lies between the prediction and the
    # measurement, nearer the measurement (MAP with noise 0.1 against a prior of width 0.5)
    from nereus.controller.planning import STAGE_TOTAL, CostModelPlanner
    from nereus.spec.plan import Plan

    job = _job(get_engine("verl-eager"))
    pl = CostModelPlanner()
    plan = Plan(candidates=(Candidate("actor.generate", 1, 1, 8, concurrency=64, gpus=tuple(range(8))),))
    est = pl.estimate(job, plan)
    pred = est.estimates["actor.generate"].time
    pl.calibrate(job, est, {"actor.generate": {STAGE_TOTAL: 2.0 * pred}}, {})
    after = pl.estimate(job, plan).estimates["actor.generate"].time
    # the target is the edge of the 10% band: pred * exp(log 2 - 0.1) = 1.81 pred
    edge = pred * math.exp(math.log(2.0) - 0.1)
    assert 1.5 * pred < after < edge * 1.0001
    assert set(pl.efficiency.values) <= set(est.estimates["actor.generate"].breakdown)
    # a stage already predicted within 10% changes nothing
    pl2 = CostModelPlanner()
    pl2.calibrate(job, est, {"actor.generate": {STAGE_TOTAL: 1.08 * pred}}, {})
    assert pl2.estimate(job, plan).estimates["actor.generate"].time == pytest.approx(pred, rel=1e-6)


def test_deadband_targets_by_hand():
    from nereus.cost.fit import deadband_targets

    got = deadband_targets([10.0, 10.0, 10.0], [10.5, 20.0, 5.0])
    assert got[0] == 10.0  # within the band: the prediction itself
    assert got[1] == pytest.approx(10.0 * math.exp(math.log(2.0) - 0.1))
    assert got[2] == pytest.approx(10.0 * math.exp(math.log(0.5) + 0.1))
    with pytest.raises(ValueError, match="must be > 0"):
        deadband_targets([1.0], [0.0])


def test_flat_zero3_gathers_by_hand():
    from nereus.cost.shapes import params_rank
    from nereus.cost.zero3 import flat_zero3_times

    job = _job()
    model, cl = job.actor, ClusterSpec(gpu=get_gpu("h100"), num_nodes=2, gpus_per_node=8)
    times, mask = flat_zero3_times(model, job.workload, cl, EfficiencyTable(), 1, 1, 16, 3, 4)
    p = float(params_rank(model, 1, 1))
    bw = 50e9 * 0.75  # H100 NIC per GPU x the default NIC efficiency
    lat = 24 * 15 * 10e-6  # 24 layers x (n-1) ring steps x alpha
    assert bool(mask)
    assert float(times["allgather@ib"]) == pytest.approx(2 * 3 * (15 / 16 * 2 * p / bw + lat))
    assert float(times["reducescatter@ib"]) == pytest.approx(3 * (15 / 16 * 4 * p / bw + lat))
    # a group inside one node keeps the default model
    _, inside = flat_zero3_times(model, job.workload, cl, EfficiencyTable(), 1, 1, 8, 3, 4)
    assert not bool(inside)
    # through the cost model: only where the framework's ZeRO-3 implementation asks for it, and slower
    big = JobSpec(actor=model, cluster=cl, workload=job.workload, framework=job.framework)
    cand = Candidate("actor.train", 1, 1, 16, micro_batch=4, grad_accum=1, zero=3)
    t0 = CostModel(big).estimate_candidate(cand).time
    flat = big.with_framework(replace(big.framework, zero3_impl="deepspeed"))
    assert CostModel(flat).estimate_candidate(cand).time > t0
    assert get_framework("deepspeed").zero3_impl == "deepspeed" and get_framework("fsdp").zero3_impl == "fsdp"
    with pytest.raises(ValueError, match="zero3_impl"):
        FrameworkSpec(zero3_impl="tree")


def test_deepspeed_2021_forward_gathers_by_hand():
    from nereus.cost.efficiency import OVERLAP_COMPUTE_SLOWDOWN as S
    from nereus.cost.zero3 import backward_share, zero3_train_comm

    job = _job()
    model, cl, w = job.actor, job.cluster, job.workload  # 8 ranks in one node: no flat rings
    comm = {"allgather@nvlink": np.array([4.0]), "reducescatter@nvlink": np.array([2.0])}
    last = {"gemm": np.array([3.0])}
    args = (model, w, cl, EfficiencyTable(), 1, 1, 8, np.array([3]), 1, 4)
    got = zero3_train_comm("deepspeed-2021", comm, last, *args, 2, True)
    # forward gather (half the all-gather, 2 s) exposed; backward gather 2 s + reduce-scatter 2 s
    # against the backward's 3/4 of 3 s = 2.25 s: 1.75 s of the 4 s stay exposed, 0.4375 of each
    assert float(got["allgather@nvlink"][0]) == pytest.approx(2.0 + 2.0 * 1.75 / 4.0)
    assert float(got["reducescatter@nvlink"][0]) == pytest.approx(2.0 * 1.75 / 4.0)
    assert float(got["overlap"][0]) == pytest.approx(S * 2.25)
    # without recompute the backward is 2/3 of the compute: window 2 s
    got = zero3_train_comm("deepspeed-2021", comm, last, *args, 0, True)
    assert float(got["reducescatter@nvlink"][0]) == pytest.approx(2.0 * 2.0 / 4.0)
    assert float(backward_share(0)) == pytest.approx(2 / 3) and float(backward_share(2)) == 0.75
    # fsdp and deepspeed inside one node: the default overlap (the whole 3 s window hides 3 of 6 s)
    for impl in ("fsdp", "deepspeed"):
        got = zero3_train_comm(impl, comm, last, *args, 2, True)
        assert float(got["allgather@nvlink"][0]) == pytest.approx(2.0)
    # rows below ZeRO-3 keep the default model
    got = zero3_train_comm("deepspeed-2021", comm, last, *args[:7], np.array([2]), 1, 4, 2, True)
    assert float(got["allgather@nvlink"][0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="zero3_impl"):
        zero3_train_comm("tree", comm, last, *args, 2, True)


def test_zero3_infer_gathers_by_hand():
    from nereus.cost.overlap import overlap_dp
    from nereus.cost.shapes import params_rank
    from nereus.cost.zero3 import zero3_infer_comm

    job = _job()
    model, cl = job.actor, ClusterSpec(gpu=get_gpu("h100"), num_nodes=2, gpus_per_node=8)
    p = float(params_rank(model, 1, 1))
    one = 15 / 16 * 2 * p / (50e9 * 0.75) + 24 * 15 * 10e-6  # one flat ring gather of the bf16 weights
    comm = {"allgather@nvlink": np.array([0.1]), "allgather@ib": np.array([0.2])}  # the default model's
    last = {"gemm": np.array([0.05])}
    args = (model, job.workload, cl, EfficiencyTable(), 1, 1, 16, np.array([3]), 3)
    # deepspeed-2021: one gather per micro-batch (3), flat across the two nodes, nothing hidden
    got = zero3_infer_comm("deepspeed-2021", comm, last, *args, True)
    assert float(got["allgather@ib"][0]) == pytest.approx(3 * one)
    assert float(got["allgather@nvlink"][0]) == 0.0 and "overlap" not in got
    # deepspeed: the same bytes, hidden behind the 3 micro-batches' compute as the default overlap
    flat = {"allgather@ib": np.array([3 * one])}
    ref = overlap_dp(flat, last, np.array([3]), 3)
    got = zero3_infer_comm("deepspeed", comm, last, *args, True)
    assert float(got["allgather@ib"][0]) == pytest.approx(float(ref["allgather@ib"][0]))
    # fsdp without overlap: the default model's gathers as given
    got = zero3_infer_comm("fsdp", comm, last, *args, False)
    assert float(got["allgather@ib"][0]) == 0.2


def test_tp_overlap_share_by_hand():
    from nereus.cost.efficiency import OVERLAP_COMPUTE_SLOWDOWN
    from nereus.cost.latency import _overlap_tp

    parts = {"gemm": 10.0, "allreduce@nvlink": 4.0}
    full = _overlap_tp(parts)
    assert full["allreduce@nvlink"] == 0.0 and full["overlap"] == pytest.approx(OVERLAP_COMPUTE_SLOWDOWN * 4.0)
    half = _overlap_tp(parts, 0.5)  # hides min(0.5 * 4, 10) = 2 s of the 4
    assert half["allreduce@nvlink"] == pytest.approx(2.0)
    assert half["overlap"] == pytest.approx(OVERLAP_COMPUTE_SLOWDOWN * 2.0)
    short = _overlap_tp({"gemm": 1.0, "allreduce@nvlink": 4.0}, 0.5)  # the GEMMs bound it: 1 s hidden
    assert short["allreduce@nvlink"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="tp_overlap_share"):
        EngineCosts(tp_overlap_share=0.0)
