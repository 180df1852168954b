"""ZeRO-sharded DP groups and idle (offloaded/dropped) state in the transition planner (issue 13 item 2).

Hand counts use the ``tiny`` preset (h=64, F=128, 4 query / 2 KV heads of 16, V=64, 4 layers,
untied head): a layer has q 64·64 + k 64·32 + v 64·32 + o 64·64 + MLP 3·64·128 + 2 norms·64
= 36,992 parameters, so a (tp1, pp1) shard holds P = 4·36,992 + 64·64 (embedding) + 64 (final
norm) + 64·64 (head) = 156,224 parameters: W = 2·P = 312,448 B of bf16 weights and OPT = 12·P =
1,874,688 B of Adam state (fp32 master, exp_avg, exp_avg_sq). ZeRO-k over a DP group of z ranks
(``nereus.cost.memory``): a rank holds W + OPT/z (k = 1, 2; gradients are empty at a step boundary)
or (W + OPT)/z (k = 3); rank r holds the slice [r/z, (r+1)/z) of the group's flat buffer.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.cost.shapes import params_on_rank
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, GPUSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.cost import CostParams
from nereus.transition.emu import EMU, model_of, phi, state_parts
from nereus.transition.estimate import estimate_transition
from nereus.transition.exact import exact_schedule
from nereus.transition.global_dag import GlobalDAG
from nereus.transition.primitives import Primitive, destroy, split
from nereus.transition.schedule import Schedule
from nereus.transition.verify import ScheduleError, verify_schedule

TINY = get_model("tiny")
LAYER = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64  # 36,992
P = 4 * LAYER + 64 * 64 + 64 + 64 * 64  # 156,224
W, OPT = 2 * P, 12 * P  # 312,448 B and 1,874,688 B
H100 = get_gpu("h100")
JOB = JobSpec(TINY, ClusterSpec(H100, 2, 8), WorkloadSpec())
NVLINK, NVLINK_LAT = 450e9, 5e-6  # H100 scale-up bytes/s per direction and latency (GPUSpec)
SETUP = 0.05  # CostParams.comm_setup_intra_s


def plan(*cands) -> Plan:
    return Plan(tuple(cands))


def train(tp, pp, dp, zero, gpus, offload="none", ms="actor.train") -> Candidate:
    return Candidate(ms, tp, pp, dp, zero=zero, offload=offload, gpus=tuple(gpus))


def estimate(cur: Candidate, tgt: Candidate, **kw):
    est = estimate_transition(JOB, plan(cur), plan(tgt), **kw)
    assert est.feasible, est.reason
    verify_schedule(est.dag, est.schedule)
    return est


def test_hand_count_of_the_tiny_shard():
    assert P == 156_224 == params_on_rank(TINY, 1, 1, 0)
    assert state_parts(JOB, "actor.train") == (2, 12) and state_parts(JOB, "reference.infer") == (2, 0)


def test_phi_of_a_zero_group_is_one_emu_with_sliced_optimizer_state():
    (g,) = phi(JOB, train(1, 1, 4, 1, range(4)))
    assert (g.z, g.zero, g.layout, g.gpus) == (4, 1, (1, 1, 4, 1), (0, 1, 2, 3))
    assert g.shard_bytes == (W + OPT // 4,) and g.sharded == (OPT,)  # 312,448 + 468,672
    (g3,) = phi(JOB, train(1, 1, 4, 3, range(4)))
    assert g3.shard_bytes == (math.ceil((W + OPT) / 4),) == (546_784,)
    # ZeRO with dp 1 is an ordinary replica; zero=0 gives dp replicas (today's EMUs)
    assert phi(JOB, train(1, 1, 1, 1, (0,)))[0].signature() == phi(JOB, train(1, 1, 1, 0, (0,)))[0].signature()
    assert [e.shard_bytes for e in phi(JOB, train(1, 1, 2, 0, (0, 1)))] == [(W + OPT,)] * 2
    with pytest.raises(ValueError, match="zero=1 is not a ZeRO stage infer model-stages can have; valid: 0, 3"):
        phi(JOB, Candidate("reference.infer", 1, 1, 2, zero=1, gpus=(0, 1)))
    with pytest.raises(ValueError, match="valid: 0$"):
        phi(JOB, Candidate("actor.generate", 1, 1, 2, zero=3, concurrency=4, gpus=(0, 1)))


def test_phi_of_a_zero3_inference_engine_is_one_group_of_weight_slices():
    # a ZeRO-3 engine's forward passes (OpenRLHF's reference model): weights only, sharded over dp 4
    (g,) = phi(JOB, Candidate("reference.infer", 1, 1, 4, micro_batch=1, zero=3, gpus=(4, 5, 6, 7)))
    assert (g.z, g.zero, g.gpus) == (4, 3, (4, 5, 6, 7))
    assert g.shard_bytes == (W // 4,) == (78_112,) and g.sharded == (W,)  # 2 B x 156,224 / 4


def test_a_zero1_group_shrinking_dp_4_to_2_receives_the_leaving_ranks_slices():
    """(a) ZeRO-1 dp 4 → 2 keeping ranks 0 and 2: each survivor receives the optimizer quarter of the
    rank that leaves next to it (ranks 1 and 3): OPT/2 in all, no weights (they are replicated)."""
    est = estimate(train(1, 1, 4, 1, range(4)), train(1, 1, 2, 1, (0, 2)))
    (n,) = est.dag.nodes
    assert n.kind == "split" and n.recv == {0: OPT // 4, 2: OPT // 4}
    assert est.bytes_moved == est.min_bytes == OPT // 2 == 937_344
    # survivors grow from W + OPT/4 to W + OPT/2; the leaving GPUs free all they held
    assert n.mem_net == {0: OPT // 4, 2: OPT // 4, 1: -(W + OPT // 4), 3: -(W + OPT // 4)}
    # one all-to-all over the 4 GPUs of one node: setup + OPT/4 / NVLink + 3 latencies
    assert est.l_tran == pytest.approx(SETUP + (OPT // 4) / NVLINK + 3 * NVLINK_LAT, rel=1e-12)


def test_a_zero1_group_shrinking_onto_adjacent_ranks_moves_three_quarters():
    """(a') dp 4 → 2 keeping ranks 0 and 1: the target's halves are ranks {0,1} and {2,3} of the old
    buffer, so GPU 0 receives quarter 1 and GPU 1 receives quarters 2 and 3 (its own quarter 1 is
    GPU 0's): 3·OPT/4. No DP order does better (swapping the two ranks gives the same total)."""
    est = estimate(train(1, 1, 4, 1, range(4)), train(1, 1, 2, 1, (0, 1)))
    (n,) = est.dag.nodes
    assert n.recv == {0: OPT // 4, 1: OPT // 2}
    assert est.bytes_moved == est.min_bytes == 3 * OPT // 4 == 1_406_016


def test_a_zero1_group_growing_dp_2_to_4_sends_new_ranks_weights_and_their_slice():
    """(b) ZeRO-1 dp 2 → 4 on GPUs 0-3: the new GPUs 2 and 3 need the replicated weights (2·W) and
    their optimizer quarter (2·OPT/4); the old ranks keep a quarter of their half (target ranks 0 and
    2, chosen so), receive nothing and free OPT/4 each."""
    est = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 4, 1, range(4)))
    (n,) = est.dag.nodes
    assert n.kind == "merge" and set(n.acquires) == {2, 3}
    assert est.dag.target[0].gpus == (0, 2, 1, 3)  # old rank 0 → new rank 0, old rank 1 → new rank 2
    assert n.recv == {2: W + OPT // 4, 3: W + OPT // 4}
    assert est.bytes_moved == est.min_bytes == 2 * W + OPT // 2 == 1_562_240
    assert n.mem_net == {0: -(OPT // 4), 1: -(OPT // 4), 2: W + OPT // 4, 3: W + OPT // 4}


def test_replicas_growing_into_a_larger_zero_group_merge_first():
    """ZeRO-0 dp 2 (0, 1) → ZeRO-1 dp 4 (0-3): the two replicas first merge into a ZeRO-1 dp 2 group
    (each keeps its half, nothing moves), which then grows as in (b): 2·W + OPT/2 in all."""
    est = estimate(train(1, 1, 2, 0, (0, 1)), train(1, 1, 4, 1, range(4)))
    assert [n.kind for n in est.dag.nodes] == ["merge", "merge"] and est.dag.nodes[0].bytes_moved == 0
    assert est.bytes_moved == est.min_bytes == 2 * W + OPT // 2


def test_switching_zero1_on_at_the_same_dp_moves_nothing_and_frees_half():
    """(c) ZeRO-0 dp 2 → ZeRO-1 dp 2 on the same GPUs: each rank keeps its half of the optimizer
    state (a Merge of the two replicas) and frees the other half; no byte moves."""
    est = estimate(train(1, 1, 2, 0, (0, 1)), train(1, 1, 2, 1, (0, 1)))
    (n,) = est.dag.nodes
    assert n.kind == "merge" and est.bytes_moved == est.min_bytes == 0
    assert n.mem_net == {0: -(OPT // 2), 1: -(OPT // 2)}
    # and back: each rank gathers the other half, OPT in all
    back = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 2, 0, (0, 1)))
    assert back.bytes_moved == back.min_bytes == OPT


def test_zero_stage_changes_in_place():
    """ZeRO-1 → ZeRO-3 at dp 2 drops the other half of the weights (nothing moves); ZeRO-3 → ZeRO-1
    gathers it: each rank receives W/2."""
    up = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 2, 3, (0, 1)))
    assert up.bytes_moved == 0 and up.dag.nodes[0].mem_net == {0: -(W // 2), 1: -(W // 2)}
    down = estimate(train(1, 1, 2, 3, (0, 1)), train(1, 1, 2, 1, (0, 1)))
    assert down.bytes_moved == down.min_bytes == W


def test_zero3_dp4_to_tp2_without_zero_unshards_then_merges():
    """(d) ZeRO-3 dp 4 (tp 1) → tp 2, ZeRO-0, dp 1 on GPUs 0-1. The slices of a tp1 buffer are not
    slices of the tp2 shards, so the common layout is unsharded (1, 1): GPUs 0 and 1 all-gather the
    whole tp1 shard (each receives 14·P - ceil(14·P/4) = 1,640,352 B), GPUs 2 and 3 only send and
    free, then the tp2 Merge keeps each GPU's TP half (nothing moves). The lower bound lets each
    GPU's ZeRO-3 quarter (14·P/4 = 546,784 B) count as if it all lay in its tp2 shard (the buffer
    order is not modelled, so the bound assumes the best): 2 × (78,400·14 - 546,784) = 1,101,632 B,
    a tp2 shard being 4·(64·32 + 64·16 + 64·16 + 32·64 + 3·64·64 + 128) + 32·64 + 64 + 32·64 =
    78,400 parameters."""
    est = estimate(train(1, 1, 4, 3, range(4)), train(2, 1, 1, 0, (0, 1)))
    kinds = [n.kind for n in est.dag.nodes]
    assert kinds == ["split", "merge"]
    gather = 14 * P - math.ceil(14 * P / 4)
    assert est.dag.nodes[0].recv == {0: gather, 1: gather} and gather == 1_640_352
    assert est.bytes_moved == 2 * gather
    tp2 = 4 * (64 * 32 + 64 * 16 + 64 * 16 + 32 * 64 + 3 * 64 * 64 + 128) + 32 * 64 + 64 + 32 * 64
    assert tp2 == 78_400 == params_on_rank(TINY, 2, 1, 0)
    assert est.min_bytes == 2 * (14 * tp2 - 14 * P // 4) == 1_101_632
    assert est.dag.target[0].shard_bytes == (14 * tp2,)


def test_a_zero_group_moving_to_other_gpus_is_extended_then_destroyed():
    est = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 2, 1, (2, 3)))
    assert sorted(n.kind for n in est.dag.nodes) == ["destroy", "extend"]
    assert est.bytes_moved == est.min_bytes == 2 * (W + OPT // 2)


def test_losing_one_rank_of_a_zero_group_loses_training_state():
    """A ZeRO group is one copy: its slices exist once, so a reclaimed rank takes its optimizer slice
    with it (restore from a checkpoint), where dp replicas survive the loss of all but one."""
    pool = frozenset(range(16)) - {3}
    est = estimate_transition(JOB, plan(train(1, 1, 4, 1, range(4))), plan(train(1, 1, 2, 1, (0, 1))), pool=pool)
    assert not est.feasible and "checkpoint" in est.reason
    ok = estimate_transition(JOB, plan(train(1, 1, 4, 0, range(4))), plan(train(1, 1, 2, 0, (0, 1))), pool=pool)
    assert ok.feasible


def _zero_dag():
    (g,) = phi(JOB, train(1, 1, 2, 1, (0, 1)))
    target = EMU("actor.train*0", "actor.train", 1, 1, (0,), (W + OPT,))
    cap = {0: 80 * 2**30, 1: 80 * 2**30}
    return g, target, cap


def test_verify_refuses_destroying_the_last_copy_of_a_zero_group():
    """(e) Destroying the group before anything copied it loses every optimizer slice."""
    g, target, cap = _zero_dag()
    d = destroy(g)
    dag = GlobalDAG((d,), (), (g,), (target,), cap, models={"actor.train": (TINY, (2, 12))})
    with pytest.raises(ScheduleError, match="last copy"):
        verify_schedule(dag, Schedule({d.pid: 0.0}, {d.pid: 0.01}, 0.01))


def test_verify_refuses_a_split_that_drops_a_leaving_ranks_optimizer_shard():
    """(e) A Split of a ZeRO-1 dp 2 group onto GPU 0 that claims GPU 0 ends with the whole optimizer
    state but receives nothing: rank 1's half (OPT/2 = 937,344 B) would be freed with GPU 1 and
    exist nowhere. The correct Split (GPU 0 receives OPT/2) passes."""
    g, target, cap = _zero_dag()
    good = split(g, (1, 1), TINY, (2, 12), keep={"actor.train#0/s0"})
    assert good.recv == {0: OPT // 2} and good.bytes_moved == OPT // 2
    bogus = Primitive(pid=good.pid, kind="split", model_stage="actor.train", consumes=good.consumes,
                      produces=good.produces, gpus=good.gpus, mem_hi=good.mem_hi, mem_net=good.mem_net)
    for models in ({"actor.train": (TINY, (2, 12))}, {}):  # exact held bytes, and the model-free bound
        ok = GlobalDAG((good,), (), (g,), tuple(good.produces), cap, models=models)
        verify_schedule(ok, Schedule({good.pid: 0.0}, {good.pid: 1.0}, 1.0))
        bad = GlobalDAG((bogus,), (), (g,), tuple(good.produces), cap, models=models)
        with pytest.raises(ScheduleError, match="937,344 B of actor.train's state"):
            verify_schedule(bad, Schedule({bogus.pid: 0.0}, {bogus.pid: 1.0}, 1.0))


# --- idle state (Candidate.offload) -------------------------------------------------------------

def test_host_offloaded_state_holds_no_gpu_and_is_restored_or_re_cut():
    """A model-stage idle in host memory (offload='host') holds no GPU bytes at a step boundary.
    host → resident: one Restore writes every target shard from host memory (W + OPT/2 per GPU over
    PCIe at CostParams.host_bandwidth = 25 GB/s); host → host with the same layout and GPUs: nothing;
    host → host at dp 4: the host copy is re-cut into the target's four shards (W + OPT/4 each)."""
    cur = train(1, 1, 2, 1, (0, 1), offload="host")
    (e,) = phi(JOB, cur)
    assert e.host and e.bytes_on(0) == 0 and e.shard_on(0) == W + OPT // 2
    est = estimate(cur, train(1, 1, 2, 1, (0, 1)))
    (r,) = est.dag.nodes
    assert r.kind == "restore" and est.bytes_moved == 2 * (W + OPT // 2) and set(r.acquires) == {0, 1}
    assert est.l_tran == pytest.approx((W + OPT // 2) / 25e9, rel=1e-12)
    same = estimate(cur, train(1, 1, 2, 1, (0, 1), offload="host"))
    assert same.dag.nodes == () and same.bytes_moved == 0
    grow = estimate(cur, train(1, 1, 4, 1, range(4), offload="host"))
    (r,) = grow.dag.nodes
    assert r.acquires == () and r.mem_net == {} and grow.bytes_moved == 4 * (W + OPT // 4)


def test_resident_to_host_offloads_then_re_cuts():
    est = estimate(train(1, 1, 2, 0, (0, 1)), train(1, 1, 2, 0, (0, 1), offload="host"))
    assert [n.kind for n in est.dag.nodes] == ["offload", "restore"]
    off = est.dag.nodes[0]
    assert off.mem_net == {0: -(W + OPT), 1: -(W + OPT)}  # frees the GPUs; one replica goes to host
    assert est.bytes_moved == (W + OPT) + 2 * (W + OPT) and "offload='host'" in est.reason


def test_dropped_idle_state_is_reloaded_or_destroyed_and_colocated_idle_stages_share_gpus():
    """offload='drop' (frozen or derived state only): no EMU at a step boundary; dropped → resident
    reloads from storage (Load), resident → dropped destroys. A model-stage whose idle state is off
    the GPUs owns none, so it may share GPUs with a concurrent one (colocation)."""
    ref = Candidate("reference.infer", 1, 1, 1, gpus=(0,))
    crit = Candidate("critic.infer", 1, 1, 1, gpus=(1,))
    dropped = Candidate("reference.infer", 1, 1, 1, offload="drop", gpus=(1,))
    est = estimate_transition(JOB, plan(ref, crit), plan(dropped, crit))
    assert est.feasible and [n.kind for n in est.dag.nodes] == ["destroy"]
    verify_schedule(est.dag, est.schedule)
    back = estimate_transition(JOB, plan(dropped, crit), plan(ref, crit))
    assert back.feasible and [n.kind for n in back.dag.nodes] == ["load"] and back.reloads == {
        "reference.infer": "storage"} and "idle state dropped" in back.reason
    assert back.bytes_moved == 2 * P  # reference.infer has the tiny LM head (no value head)
    verify_schedule(back.dag, back.schedule)
    with pytest.raises(ValueError, match="concurrent model-stages"):
        estimate_transition(JOB, plan(ref, crit), plan(Candidate("reference.infer", 1, 1, 1, gpus=(1,)), crit))
    with pytest.raises(ValueError, match="lose its training state"):
        estimate_transition(JOB, plan(train(1, 1, 1, 0, (0,))), plan(train(1, 1, 1, 0, (0,), offload="drop")))


def test_plain_plans_keep_todays_emus():
    """zero=0, offload='none': Φ is unchanged (one EMU per replica, no sharding fields)."""
    es = phi(JOB, train(2, 2, 2, 0, range(8)))
    assert [(e.z, e.zero, e.sharded, e.host, e.layout) for e in es] == [(1, 0, (), False, (2, 2))] * 2
    assert "z" not in es[0].to_dict()


def test_exact_scheduler_matches_the_greedy_on_a_zero_transition():
    """CP-SAT is generic over nodes, edges, memory and ports: ZeRO DAGs need nothing new, and the
    greedy reaches its optimum on a two-model-stage example."""
    from nereus.transition.cost import ports
    cur = plan(train(1, 1, 4, 1, range(4)), train(1, 1, 2, 0, (4, 5), ms="critic.train"))
    tgt = plan(train(1, 1, 2, 1, (0, 2)), train(1, 1, 4, 1, (4, 5, 6, 7), ms="critic.train"))
    est = estimate_transition(JOB, cur, tgt)
    assert est.feasible
    prt = {n.pid: ports(n, JOB.cluster) for n in est.dag.nodes}
    ex = exact_schedule(est.dag, est.durations, prt, time_limit_s=10)
    assert ex.optimal and ex.schedule.makespan == pytest.approx(est.l_tran, abs=1e-5)
    verify_schedule(est.dag, ex.schedule)


# --- property: random ZeRO / non-ZeRO / offloaded candidates ----------------------------------------

def _random_candidate(rng: random.Random, ms: str, gpus: list[int], free: set[int], prev=None):
    stage = ms.partition(".")[2]
    for _ in range(30):
        tp, pp = rng.choice((1, 2, 4)), rng.choice((1, 2, 4))
        dp = rng.randint(1, 4)
        n = tp * pp * dp
        if n > len(free):
            continue
        pool = [g for g in gpus if g in free]
        keep = [g for g in (prev.gpus if prev else ()) if g in free] if rng.random() < 0.6 else []
        rest = [g for g in pool if g not in keep]
        pick = (keep + rng.sample(rest, len(rest)))[:n] if rng.random() < 0.5 else (keep + rest)[:n]
        if len(pick) < n:
            continue
        zero = rng.choice((0, 0, 1, 2, 3)) if stage == "train" else 0
        offload = rng.choice(("none", "none", "none", "host") + (("drop",) if stage != "train" else ()))
        if offload == "none":
            free -= set(pick)
        return Candidate(ms, tp, pp, dp, zero=zero, offload=offload, gpus=tuple(pick))
    return None


def _asap(dag, rng: random.Random) -> Schedule:
    """Every primitive as soon as its DAG predecessors end, with random durations: one of the
    executions the DAG allows (verify checks memory, copies and ownership in it)."""
    preds = dag.preds()
    start, end = {}, {}
    order = list(dag.nodes)
    while len(end) < len(order):
        for n in order:
            if n.pid not in end and preds[n.pid] <= set(end):
                start[n.pid] = max((end[p] for p in preds[n.pid]), default=0.0)
                end[n.pid] = start[n.pid] + rng.uniform(0.01, 1.0)
    return Schedule(start, end, max(end.values(), default=0.0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_zero_and_offload_transitions_keep_every_byte(seed):
    """Random plan pairs of the tiny model on 2 nodes x 8 GPUs, training with ZeRO 0-3 and idle
    state resident, in host memory or dropped, model-stages of one stage on disjoint GPUs or (30%,
    a colocating framework) on any: every feasible estimate passes ``verify_schedule``
    in the greedy schedule and in random as-soon-as-possible executions (last copy at every instant,
    every produced shard held or received, memory, ownership, end state = target), each target
    GPU ends holding exactly the bytes its ZeRO stage gives it, and the bytes moved are at least
    the lower bound (where TP does not replicate KV heads: ``resident_bytes`` counts them as split,
    a limit of the lower bound since before ZeRO). 2.5-6 MiB GPUs make memory bind (staging, drops, infeasible targets)."""
    rng = random.Random(seed)
    mem = rng.choice((0.0025, 0.004, 0.006, 80.0))
    gpu = GPUSpec(name="g", peak_flops=1e15, memory_bytes=int(mem * 2**30), hbm_bandwidth=3e12,
                  scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    coloc = rng.random() < 0.3  # a framework that colocates model-stages of one stage
    job = JobSpec(TINY, ClusterSpec(gpu, 2, 8), WorkloadSpec(),
                  framework=get_framework("megatron" if coloc else "nereus"))
    gpus = list(range(16))
    names = ["actor.train", "critic.train", "reference.infer"][:rng.randint(1, 3)]
    cur, tgt = [], []
    fc: dict[str, set[int]] = {}
    ft: dict[str, set[int]] = {}
    for ms in names:
        stage = ms.partition(".")[2]
        c = _random_candidate(rng, ms, gpus, set(gpus) if coloc else fc.setdefault(stage, set(gpus)))
        t = _random_candidate(rng, ms, gpus, set(gpus) if coloc else ft.setdefault(stage, set(gpus)), prev=c)
        if c is None or t is None:
            return
        cur.append(c)
        tgt.append(t)
    est = estimate_transition(job, Plan(tuple(cur)), Plan(tuple(tgt)))
    if not est.feasible:
        assert est.dag is None and est.reason
        return
    verify_schedule(est.dag, est.schedule)
    for k in range(2):
        verify_schedule(est.dag, _asap(est.dag, random.Random(seed + k)))
    if all(c.tp <= TINY.num_kv_heads for c in cur + tgt):  # resident_bytes undercounts replicated KV heads
        assert est.bytes_moved >= est.min_bytes
    for e in est.dag.target:
        c = tgt[names.index(e.model_stage)]
        assert e.host == (c.offload == "host")
        pb, ob = state_parts(job, e.model_stage)
        for g in e.gpus:
            p = e.position(g)[0]
            n = params_on_rank(model_of(job, e.model_stage), c.tp, c.pp, p)
            z = c.dp if c.zero else 1
            w = n * pb / (z if c.zero == 3 else 1)
            want = w + n * ob / z
            assert abs(e.shard_on(g) - want) <= 2, (e.uid, g, e.shard_on(g), want)


def test_cli_prints_zero_and_dropped_plans(tmp_path, capsys):
    """``nereus transition`` on plan files with a ZeRO group and a dropped idle state."""
    import json
    from dataclasses import replace

    from nereus.cli import main
    mb = JOB.workload.mini_batch_size
    cur = plan(replace(train(1, 1, 4, 1, range(4)), micro_batch=1, grad_accum=mb // 4),
               Candidate("reference.infer", 1, 1, 1, micro_batch=1, gpus=(4,)))
    tgt = plan(replace(train(1, 1, 2, 1, (0, 2)), micro_batch=1, grad_accum=mb // 2),
               Candidate("reference.infer", 1, 1, 1, micro_batch=1, offload="drop", gpus=(4,)))
    for name, p in (("a", cur), ("b", tgt)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"plan": p.to_dict(), "job": JOB.to_dict()}))
    assert main(["transition", "--from", str(tmp_path / "a.json"), "--to", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "tp1 pp1 dp4 z1 on GPUs 0-3 -> tp1 pp1 dp2 z1 on GPUs 0,2  T_sub (1, 1, 2, 1): split x1" in out
    assert "off:drop on GPUs 4  T_sub (1, 1): destroy x1" in out
    assert main(["transition", "--from", str(tmp_path / "b.json"), "--to", str(tmp_path / "a.json")]) == 0
    assert "off:drop on GPUs 4 -> tp1 pp1 dp1 on GPUs 4" in capsys.readouterr().out


def test_colocated_training_model_stages_share_gpus_when_the_framework_colocates():
    """Under a framework that colocates model-stages of one stage (megatron: verl's hybrid engine),
    actor.train and critic.train may both keep resident state on GPUs 0-1 (they run in turn): no
    ownership edges, memory alone orders the primitives. The actor's ZeRO-1 group grows 2 → 4 (2·W
    + OPT/2) while the critic's moves to GPUs 2-3 (one Extend of the group, 2·(W_c + O_c/2), with
    the value head: P_c = P - 64·64 + 65 = 152,193 parameters). The default framework (nereus)
    refuses two resident training model-stages on one GPU."""
    job = JobSpec(TINY, ClusterSpec(H100, 2, 8), WorkloadSpec(), framework=get_framework("megatron"))
    cur = plan(train(1, 1, 2, 1, (0, 1)), train(1, 1, 2, 1, (0, 1), ms="critic.train"))
    tgt = plan(train(1, 1, 4, 1, range(4)), train(1, 1, 2, 1, (2, 3), ms="critic.train"))
    est = estimate_transition(job, cur, tgt)
    assert est.feasible and est.dag.exclusive is False, est.reason
    assert not [e for e in est.dag.edges if e[2] == "ownership"]
    verify_schedule(est.dag, est.schedule)
    pc = P - 64 * 64 + 65
    assert est.bytes_moved == (2 * W + OPT // 2) + 2 * (2 * pc + 12 * pc // 2)
    with pytest.raises(ValueError, match="concurrent model-stages"):
        estimate_transition(JOB, cur, tgt)


def test_cpu_adam_state_moves_as_if_it_were_on_the_gpus():
    """``offload='cpu_adam'`` (ZeRO-Offload) keeps the weights on the GPUs, so its EMUs are GPU EMUs
    carrying weights and optimizer state together (docs/transition.md: an upper bound for the host
    part). ZeRO-1 dp 4 → 2 therefore moves what the on-GPU group moves, OPT/2; switching the same
    group between on-GPU Adam and cpu_adam moves nothing (no Offload/Restore staging)."""
    est = estimate(train(1, 1, 4, 1, range(4), offload="cpu_adam"), train(1, 1, 2, 1, (0, 2), offload="cpu_adam"))
    assert [n.kind for n in est.dag.nodes] == ["split"]
    assert est.bytes_moved == est.min_bytes == OPT // 2
    same = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 2, 1, (0, 1), offload="cpu_adam"))
    assert same.bytes_moved == 0 and all(n.kind not in ("offload", "restore") for n in same.dag.nodes)
    assert all(not e.host for e in phi(JOB, train(1, 1, 2, 1, (0, 1), offload="cpu_adam")))


def test_zero_recut_counts_the_executors_buffers():
    """A ZeRO re-cut with the runtime's buffers (``buffers.recut_buffers``, ``CostParams.transit_buffers``).

    (b) ZeRO-1 dp 2 → 4 on GPUs 0-3: the staying GPUs 0, 1 keep their weights (same position: the
    executor reuses them) and allocate their new quarter, OPT/4; each may send (``sent_bound``)
    min(2·(W + OPT/2), 2W + OPT/2) = 2W + OPT/2 (the new GPUs' weights and quarters); peak
    OPT/4 + 2W + OPT/2 = 2W + 3·OPT/4. The new GPUs 2, 3 receive W + OPT/4 and allocate as much:
    2W + OPT/2 (the paper's rule: W + OPT/4 on a new GPU, 0 on a staying one).

    A replica on GPU 0 becoming ZeRO-1 dp 2 on 0, 1: GPU 0 keeps its weights, allocates its new
    half OPT/2 and the flat copy of its Adam state, OPT (``flat.flatten``), and sends GPU 1
    W + OPT/2: peak W + 2·OPT; GPU 1 receives and allocates W + OPT/2: 2W + OPT."""
    buf = CostParams(transit_buffers=True)
    est = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 4, 1, range(4)), params=buf)
    (n,) = est.dag.nodes
    assert n.alloc == {0: OPT // 4, 1: OPT // 4, 2: W + OPT // 4, 3: W + OPT // 4}
    assert n.sent == {0: 2 * W + OPT // 2, 1: 2 * W + OPT // 2}
    assert n.mem_hi == {0: 2 * W + 3 * OPT // 4, 1: 2 * W + 3 * OPT // 4, 2: 2 * W + OPT // 2,
                        3: 2 * W + OPT // 2} == {0: 2_030_912, 1: 2_030_912, 2: 1_562_240, 3: 1_562_240}
    plain = estimate(train(1, 1, 2, 1, (0, 1)), train(1, 1, 4, 1, range(4)))
    assert plain.dag.nodes[0].mem_hi == {0: 0, 1: 0, 2: W + OPT // 4, 3: W + OPT // 4}
    grow = estimate(train(1, 1, 1, 0, (0,)), train(1, 1, 2, 1, (0, 1)), params=buf)
    (g,) = [x for x in grow.dag.nodes if x.kind == "merge"]
    assert g.alloc == {0: OPT // 2 + OPT, 1: W + OPT // 2} and g.sent == {0: W + OPT // 2}
    assert g.mem_hi == {0: W + 2 * OPT, 1: 2 * W + OPT} == {0: 4_061_824, 1: 2_499_584}


def test_a_lost_derived_copy_syncs_from_the_host_resident_train_state():
    """actor.infer lost its only replica (GPU 4 reclaimed) while actor.train's idle state sits in host
    memory (offload='host') in both plans: the Load writes actor.infer's weights (2·P = W bytes, no
    value head) from the host copy of actor.train#0 onto GPU 2, as a Restore does: W / 25 GB/s over
    GPU 2's own PCIe link (CostParams.host_bandwidth; GPU 2 sits on node 0, where the host copy is),
    no GPU-to-GPU pair and no communicator. Before, no GPU copy to sync from made it infeasible."""
    tr = train(1, 1, 2, 0, (0, 1), offload="host")
    cur = plan(tr, Candidate("actor.infer", 1, 1, 1, gpus=(4,)))
    tgt = plan(tr, Candidate("actor.infer", 1, 1, 1, gpus=(2,)))
    est = estimate_transition(JOB, cur, tgt, pool=frozenset(range(4)))
    assert est.feasible, est.reason
    verify_schedule(est.dag, est.schedule)
    (ld,) = est.dag.nodes
    assert ld.kind == "load" and ld.reads == ("actor.train#0",) and est.reloads == {"actor.infer": "actor.train#0"}
    assert ld.pairs == ((-1, 2, W),) and ld.home == (0,) and ld.num_comms == 0 and ld.sent == {}
    assert ld.mem_hi == {2: W} and est.bytes_moved == W
    assert est.l_tran == pytest.approx(W / 25e9, rel=1e-12)
    from nereus.transition.cost import ports
    assert ports(ld, JOB.cluster) == frozenset({(2, "host", "rx")})
    # the trainer's only copy, in the host memory of a departed node, is gone: restore from a checkpoint
    lost = plan(train(1, 1, 1, 0, (4,), offload="host"), Candidate("actor.infer", 1, 1, 1, gpus=(5,)))
    gone = estimate_transition(JOB, lost, plan(train(1, 1, 1, 0, (0,), offload="host"),
                                               Candidate("actor.infer", 1, 1, 1, gpus=(2,))), pool=frozenset(range(4)))
    assert not gone.feasible and "checkpoint" in gone.reason
