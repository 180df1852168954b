"""Cost model: memory terms, collective formulas, pipeline bubble, calibration, critical path."""

import math

import pytest

from nereus.cost.collectives import allgather_time, allreduce_time, broadcast_time, p2p_time
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.latency import microbatch_stage_times
from nereus.cost.memory import activation_bytes_per_layer, stage_memory
from nereus.cost.model import CostModel
from nereus.cost.shapes import layers_of_rank, max_params_per_gpu, params_on_rank, valid_tp
from nereus.cost.step import critical_path
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

GIB = 2**30
M8 = get_model("llama-3.1-8b")


def _job(**wl):
    return JobSpec(M8, ClusterSpec(get_gpu("h100"), 2, 8), WorkloadSpec(**wl))


def test_params_on_ranks_sum_to_total_and_split_by_tp():
    for pp in (1, 2, 4, 8):
        assert sum(params_on_rank(M8, 1, pp, p) for p in range(pp)) == M8.num_params
    # TP=2: everything but the 2 norms per layer (and the final norm) halves.
    norms = 32 * 2 * 4096 + 4096
    assert sum(params_on_rank(M8, 2, 1, 0) for _ in [0]) == pytest.approx((M8.num_params - norms) / 2 + norms)
    assert list(layers_of_rank(30, 4, 0)) == list(range(0, 8))
    assert list(layers_of_rank(30, 4, 3)) == list(range(23, 30))


def test_activation_memory_matches_reference_34sbh():
    # cost-model.md §2.2: Llama-3.1-8B, s=4096, b=1, t=1 -> 34·s·b·h bytes per layer, 17.0 GiB for 32 layers.
    per_layer = activation_bytes_per_layer(M8, 4096, 1)
    assert per_layer == 34 * 4096 * 4096
    assert 32 * per_layer / GIB == pytest.approx(17.0, abs=0.01)
    # TP=2 shards Q, K, V, attention output and the MLP: 8 + 26/2 = 21 sbh.
    assert activation_bytes_per_layer(M8, 4096, 2) == 21 * 4096 * 4096


def test_training_memory_terms_by_hand():
    wl = WorkloadSpec(prompt_len=1024, response_len=3072, micro_batch_size=1, mini_batch_size=256)
    mem = stage_memory("train", M8, wl, tp=1, pp=1, micro_batch=1, inflight=1)
    n = M8.num_params
    assert mem["weights"] == 2 * n
    assert mem["optimizer"] == 12 * n           # fp32 master + exp_avg + exp_avg_sq
    assert mem["gradients"] == 4 * n            # fp32 main gradients (Megatron)
    assert mem["activations"] == 32 * 34 * 4096 * 4096
    assert mem["logits"] == 4 * 4096 * (4096 + 128256)  # 4·s·b·(h+V)/t, 2.0 GiB
    assert mem["logits"] / GIB == pytest.approx(2.02, abs=0.01)
    # Full recompute keeps each layer's input (2sbh) plus one layer's working set.
    full = stage_memory("train", M8, wl, tp=1, pp=1, micro_batch=1, recompute="full", inflight=1)
    assert full["activations"] == 32 * 2 * 4096 * 4096 + 34 * 4096 * 4096


def test_kv_cache_memory_by_hand():
    wl = WorkloadSpec(prompt_len=1000, response_len=3096)
    mem = stage_memory("generate", M8, wl, tp=2, pp=1, concurrency=64)
    assert mem["kv_cache"] == 64 * 4096 * 65_536
    assert mem["resident"] == mem["weights"] == max_params_per_gpu(M8, 2, 1) * 2


def test_collective_formulas_small_cases():
    # nccl-tests PERFORMANCE.md bandwidth terms; alpha = 0 isolates them.
    assert allreduce_time(1e9, 4, 1e11, 0) == pytest.approx(2 * 3 / 4 * 1e9 / 1e11)
    assert allgather_time(1e9, 4, 1e11, 0) == pytest.approx(3 / 4 * 1e9 / 1e11)
    assert broadcast_time(1e9, 4, 1e11, 0) == pytest.approx(1e9 / 1e11)
    assert p2p_time(1e9, 1e11, 0) == pytest.approx(1e-2)
    # latency term: 2·ceil(log2 8)·alpha for all-reduce
    assert allreduce_time(1.0, 8, 1e30, 5e-6) == pytest.approx(6 * 5e-6)
    assert allreduce_time(1e9, 1, 1e11, 1e-5) == 0.0


def test_pipeline_bubble_fraction():
    # Value head: the last rank costs the same as the others, so the schedule is balanced and
    # bubble / total must equal (p-1)/(m+p-1) (Narayanan et al. 2021).
    job = _job(prompt_len=512, response_len=512, micro_batch_size=1, mini_batch_size=256, recompute="none")
    cm = CostModel(job)
    for pp, dp in ((2, 4), (4, 2), (8, 1)):
        c = Candidate("critic.train", 1, pp, dp, micro_batch=1, grad_accum=256 // dp)
        e = cm.estimate_candidate(c)
        m = 256 // dp
        mid, last = microbatch_stage_times("train", job.model("critic"), job.workload, job.cluster, cm.eff,
                                           1, pp, 1, "none")
        updates = job.workload.updates_per_step
        assert e.breakdown["bubble"] == pytest.approx(updates * (pp - 1) * sum(mid.values()))
        pipe = m * sum(last.values()) + (pp - 1) * sum(mid.values())
        assert e.breakdown["bubble"] / updates / pipe == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-3)


def test_tp_allreduce_on_nvlink_inside_node_and_nic_across():
    cm = CostModel(_job(micro_batch_size=1))
    inside = cm.estimate_candidate(Candidate("actor.train", 8, 1, 1, micro_batch=1, grad_accum=256))
    cm16 = CostModel(JobSpec(M8, ClusterSpec(get_gpu("h100"), 2, 4), WorkloadSpec(micro_batch_size=1)))
    across = cm16.estimate_candidate(Candidate("actor.train", 8, 1, 2, micro_batch=1, grad_accum=128))
    assert "allreduce@nvlink" in inside.breakdown and "allreduce@ib" not in inside.breakdown
    assert "allreduce@ib" in across.breakdown
    # across 2 nodes the TP all-reduce is hierarchical (4 ranks per node over NVLink, 1/4 of the
    # message per NIC), and still slower per micro-batch than inside one node (the replica across
    # nodes runs 128 micro-batches per update, the one inside 256)
    tp_across = across.breakdown["allreduce@ib"] + across.breakdown["allreduce@nvlink"]
    assert tp_across / 128 > inside.breakdown["allreduce@nvlink"] / 256


def test_calibration_moves_class_efficiency_towards_measurement():
    t = EfficiencyTable(alpha=1.0)
    assert t.get("gemm") == 0.6 and t.get("allreduce@ib") == 0.75 and t.get("foo@bar") == 0.5
    t.update("gemm", measured_s=2.0, predicted_s=1.0)  # twice as slow as predicted
    assert t.get("gemm") == pytest.approx(0.3)
    cm = CostModel(_job(), efficiency=t)
    t2 = EfficiencyTable()
    slow = cm.estimate_candidate(Candidate("actor.infer", 1, 1, 4, micro_batch=8))
    fast = CostModel(_job(), efficiency=t2).estimate_candidate(Candidate("actor.infer", 1, 1, 4, micro_batch=8))
    assert slow.breakdown["gemm"] == pytest.approx(2 * fast.breakdown["gemm"])
    with pytest.raises(ValueError):
        t.update("gemm", 0.0, 1.0)


def test_critical_path_sync_and_async():
    times = {"actor.generate": 10, "actor.infer": 3, "reference.infer": 4, "actor.train": 7}
    wf = workflow_for(WorkloadSpec(algorithm="grpo", reward_model=False))
    assert critical_path(wf, times) == 10 + 4 + 7
    wfa = workflow_for(WorkloadSpec(algorithm="grpo", reward_model=False, asynchronous=True))
    assert critical_path(wfa, times) == max(10, 4 + 7)
    assert CostModel(_job(algorithm="grpo", reward_model=False)).stage_latency(times) == 21


def test_invalid_tp_is_a_clear_error():
    assert "num_attention_heads" in valid_tp(get_model("tiny"), 8)
    assert valid_tp(M8, 16) is None  # 16 is a multiple of the 8 KV heads: replicated
    assert "intermediate" in valid_tp(M8, 3) or "heads" in valid_tp(M8, 3)
    with pytest.raises(ValueError, match="does not divide"):
        CostModel(_job()).estimate_candidate(Candidate("actor.infer", 3, 1, 1, micro_batch=1))


def test_memory_check_uses_headroom_and_coresidency():
    cm = CostModel(_job(prompt_len=1024, response_len=2048))
    assert cm.capacity == pytest.approx(0.9 * 81559 * 2**20)
    from nereus.spec.plan import Plan
    gen = Candidate("actor.generate", 1, 1, 1, concurrency=8, gpus=(0,))
    train = Candidate("actor.train", 1, 1, 1, micro_batch=1, grad_accum=256, gpus=(0,))
    plan = cm.estimate(Plan(candidates=(gen, train)))
    eg, et = plan.estimates["actor.generate"], plan.estimates["actor.train"]
    assert plan.gpu_memory[0] == pytest.approx(cm.workspace + eg.resident + et.resident
                                               + max(eg.transient, et.transient))
    assert not cm.memory_ok(plan)  # 8B training state alone exceeds one 80 GB GPU
    assert math.isfinite(plan.l_step)


# --- issue 13 bugs: each reproduction from the public API, with the right value as the test -------


def test_estimate_candidate_uses_grad_accum_and_refuses_a_mismatch():
    # Reproduction: grad_accum 2 and 50 gave the same time. mini 256 over dp 2 x b 2 is a = 64
    # micro-batches per mini-batch; 4 updates per step (global 1024 / mini 256); critic.train has no
    # weight-sync term, so time = 4 * (64 * t_last + t_dp + t_opt) with dp=2 on one node.
    from nereus.cost.latency import dp_sync_time, optimizer_time

    job = _job()
    cm = CostModel(job)
    critic = job.model("critic")
    _, last = microbatch_stage_times("train", critic, job.workload, job.cluster, cm.eff, 1, 1, 2)
    t_dp = sum(dp_sync_time(critic, job.workload, job.cluster, cm.eff, 1, 1, 2).values())
    t_opt = optimizer_time(critic, job.workload, job.cluster, cm.eff, 1, 1)
    want = 4 * (64 * sum(last.values()) + t_dp + t_opt)
    got = cm.estimate_candidate(Candidate("critic.train", 1, 1, 2, micro_batch=2, grad_accum=64)).time
    assert got == pytest.approx(want, rel=1e-12)
    for a in (2, 50):
        with pytest.raises(ValueError, match=rf"grad_accum={a} gives dp\*micro_batch\*grad_accum = 2\*2\*{a}.*"
                                             r"valid: grad_accum = mini_batch_size/\(dp\*micro_batch\) = 256/4 = 64"):
            cm.estimate_candidate(Candidate("critic.train", 1, 1, 2, micro_batch=2, grad_accum=a))


def test_dp_times_micro_batch_above_the_mini_batch_is_an_error():
    # Reproduction: dp 32 x b 4 on a mini-batch of 64 gave 64 // 128 = 0 micro-batches, no error.
    cm = CostModel(_job(mini_batch_size=64))
    with pytest.raises(ValueError, match=r"critic.train \(tp1 pp1 dp32 b4\): dp\*micro_batch = 32\*4 = 128 exceeds "
                                         r"the job's mini_batch_size 64"):
        cm.estimate_candidate(Candidate("critic.train", 1, 1, 32, micro_batch=4))


def test_dp_not_dividing_the_mini_batch_is_an_error():
    # Reproduction: dp 3, b 4 on 64 ran 5 micro-batches x 4 x 3 = 60 of the 64 sequences.
    cm = CostModel(_job(mini_batch_size=64))
    with pytest.raises(ValueError, match=r"dp=3 does not divide the job's mini_batch_size 64 .*drop 1 sequence"):
        cm.estimate_candidate(Candidate("critic.train", 1, 1, 3, micro_batch=4))
    with pytest.raises(ValueError, match=r"micro_batch=3 does not divide the 32 sequences per replica"):
        cm.estimate_candidate(Candidate("critic.train", 1, 1, 2, micro_batch=3))
    ms = cm.workflow.get("actor.train")  # the array API refuses the same rows
    with pytest.raises(ValueError, match=r"dp=3 does not divide"):
        cm.candidate_arrays(ms, [1, 1], [1, 1], [2, 3], micro_batch=[4, 4])


def test_full_recompute_does_not_recompute_the_lm_head():
    # The head GEMM (h x V on the last rank) runs forward + backward = 3 forward-equivalents with
    # or without full recompute: 2·h·V·tokens·3 FLOPs at the size-scaled GEMM efficiency.
    wl = WorkloadSpec(prompt_len=1024, response_len=1024)
    cl = ClusterSpec(get_gpu("h100"), 1, 8)
    eff = EfficiencyTable()
    tokens = 2048 * 2
    size = 2.0 * 4096 * 128256 * tokens  # FLOPs per head GEMM call
    gpu = cl.gpu
    head = 3 * size / (gpu.peak_flops * eff.get("gemm") * size / (size + gpu.gemm_half_flops))
    for rc in ("none", "full"):
        mid, last = microbatch_stage_times("train", M8, wl, cl, eff, 1, 2, 2, rc)
        assert last["gemm"] - mid["gemm"] == pytest.approx(head, rel=1e-12)
    # The layers do pay the extra forward: 4/3 of the no-recompute GEMM time.
    mid_none, _ = microbatch_stage_times("train", M8, wl, cl, eff, 1, 2, 2, "none")
    mid_full, _ = microbatch_stage_times("train", M8, wl, cl, eff, 1, 2, 2, "full")
    assert mid_full["gemm"] == pytest.approx(mid_none["gemm"] * 4 / 3, rel=1e-12)


def test_stage_groups_join_chains_of_overlapping_gpu_sets():
    # infer stage: actor.infer {0,1} overlaps reference.infer {1,2}, which overlaps reward.infer
    # {2,3}; actor.infer and reward.infer share no GPU but run in one group through reference.infer.
    # critic.infer {6,7} is alone. Other stages: one model-stage each.
    from nereus.cost.step import stage_groups
    from nereus.spec.plan import Plan

    cm = CostModel(_job())
    c = [Candidate("actor.generate", 1, 1, 8, concurrency=8, gpus=tuple(range(8))),
         Candidate("actor.infer", 1, 1, 2, micro_batch=1, gpus=(0, 1)),
         Candidate("critic.infer", 1, 1, 2, micro_batch=1, gpus=(6, 7)),
         Candidate("reference.infer", 1, 1, 2, micro_batch=1, gpus=(1, 2)),
         Candidate("reward.infer", 1, 1, 2, micro_batch=1, gpus=(2, 3)),
         Candidate("actor.train", 1, 1, 4, micro_batch=1, gpus=(0, 1, 2, 3)),
         Candidate("critic.train", 1, 1, 4, micro_batch=1, gpus=(4, 5, 6, 7))]
    groups = stage_groups(Plan(candidates=tuple(c)), cm.workflow)
    assert sorted(groups) == sorted([("actor.generate",), ("actor.infer", "reference.infer", "reward.infer"),
                                     ("critic.infer",), ("actor.train",), ("critic.train",)])
    # L_step by hand: generation, then the slower of the chain (times add) and critic.infer, then
    # the slower trainer; equal to the networkx critical path over the same groups
    plan = cm.estimate(Plan(candidates=tuple(c)))
    e = {x.model_stage: cm.estimate_candidate(x) for x in c}
    want = (e["actor.generate"].time
            + max(e["actor.infer"].time + e["reference.infer"].time + e["reward.infer"].time, e["critic.infer"].time)
            + max(e["actor.train"].time, e["critic.train"].time))
    assert plan.l_step == pytest.approx(want, rel=1e-12)
    assert plan.l_step == pytest.approx(critical_path(cm.workflow, {k: v.time for k, v in e.items()}, groups),
                                        rel=1e-12)
    # actor.infer and reference.infer run the same candidate on the same shapes: equal estimates
    assert plan.estimates["actor.infer"] == e["reference.infer"]
