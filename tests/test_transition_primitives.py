"""Primitives, EMUs, T_sub, costs and input validation on small hand-computed cases."""

from __future__ import annotations

import json

import pytest

from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.cost import CostParams, duration, min_bytes, ports
from nereus.transition.emu import EMU, aligned_gpus, phi, state_bytes_per_param, sub_units, t_sub
from nereus.transition.estimate import estimate_transition
from nereus.transition.exact import exact_schedule
from nereus.transition.primitives import STORAGE, TransitionState, apply, destroy, extend, load, merge, split

TINY = get_model("tiny")  # h=64, F=128, L=4, a=4, g=2, d=16, V=64, untied
JOB = JobSpec(TINY, ClusterSpec(get_gpu("h100"), 2, 4), WorkloadSpec())
# tiny by hand: per layer q,o 2*64*64 + k,v 2*64*32 + MLP 3*64*128 + norms 2*64 = 36992
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64


def emu(uid, tp, pp, gpus, ms="actor.generate"):
    c = Candidate(ms, tp, pp, 1, gpus=tuple(gpus))
    e = phi(JOB, c)[0]
    return EMU(uid, ms, tp, pp, e.gpus, e.shard_bytes)


def test_state_bytes_per_param():
    assert state_bytes_per_param(JOB, "actor.generate") == 2
    assert state_bytes_per_param(JOB, "reference.infer") == 2
    assert state_bytes_per_param(JOB, "critic.train") == 14
    with pytest.raises(ValueError, match="stage"):
        state_bytes_per_param(JOB, "actor.rollout")


def test_phi_shards_by_hand():
    e = emu("a", 1, 2, (0, 1))
    # rank 0: 2 layers + embedding V*h; rank 1: 2 layers + final norm + lm_head
    assert e.shard_bytes == ((2 * LAYER + 64 * 64) * 2, (2 * LAYER + 64 + 64 * 64) * 2)
    es = phi(JOB, Candidate("critic.train", 1, 1, 2, gpus=(3, 5)))
    assert [x.gpus for x in es] == [(3,), (5,)]
    assert es[0].shard_bytes == ((4 * LAYER + 64 * 64 + 64 + 64 + 1) * 14,)  # value head [1, h] + bias


def test_t_sub_is_the_largest_common_layout():
    assert t_sub((4, 8), (8, 2)) == (4, 2)
    assert t_sub((1, 4), (2, 4)) == (1, 4)
    assert t_sub((2, 1), (1, 2)) == (1, 1)


def test_sub_units_and_aligned_gpus_are_inverse():
    e = emu("a", 2, 2, (10, 11, 12, 13))  # (p,t): (0,0)=10 (0,1)=11 (1,0)=12 (1,1)=13
    units = sub_units(e, (1, 1), TINY, 2)
    assert [u.gpus for u in units] == [(10,), (11,), (12,), (13,)]
    units = sub_units(e, (1, 2), TINY, 2)  # a=2: unit i takes TP rank i of every stage
    assert [u.gpus for u in units] == [(10, 12), (11, 13)]
    assert aligned_gpus(units, (2, 2)) == e.gpus
    with pytest.raises(ValueError, match="T_sub"):
        sub_units(e, (3, 1), TINY, 2)


def test_split_memory_keeps_source_buffers():
    e = emu("a", 2, 1, (0, 1))
    s = split(e, (1, 1), TINY, 2)
    full = (4 * LAYER + 2 * 64 * 64 + 64) * 2  # whole model on one GPU
    half = e.shard_bytes[0]
    assert [u.gpus for u in s.produces] == [(0,), (1,)]
    assert s.mem_hi == {0: full, 1: full}  # the new shard while the old is still alive
    assert s.mem_net == {0: full - half, 1: full - half}
    assert s.bytes_moved == 2 * (full - half)
    assert s.groups == (((0, 1), full - half),)
    with pytest.raises(ValueError, match="nothing to split"):
        split(e, (2, 1), TINY, 2)


def test_merge_aligned_moves_nothing_and_misaligned_moves_shards():
    e = emu("t", 2, 1, (4, 5))
    a, b = emu("u0", 1, 1, (4,)), emu("u1", 1, 1, (5,))
    m = merge([a, b], e, TINY, 2)
    assert m.bytes_moved == 0 and m.mem_hi == {4: 0, 5: 0}
    assert m.mem_net[4] == e.shard_bytes[0] - a.shard_bytes[0] < 0
    pp2 = emu("t2", 1, 2, (4, 5))  # (1,2): GPU 4 rank 0, GPU 5 rank 1; units hold whole copies
    assert merge([a, b], pp2, TINY, 2).bytes_moved == 0
    swapped = emu("t3", 1, 2, (4, 5))
    c = emu("u2", 1, 2, (5, 4))
    m2 = merge([c], swapped, TINY, 2)  # a k=1 Merge that only permutes the two stages
    assert m2.bytes_moved == sum(swapped.shard_bytes)
    with pytest.raises(ValueError, match="cover"):
        merge([a], e, TINY, 2)


def test_extend_and_destroy_specs_and_pre_conditions():
    a = emu("a", 1, 2, (0, 1))
    b = emu("b", 1, 2, (4, 5))
    x = extend(a, b)
    assert x.pairs == ((0, 4, a.shard_bytes[0]), (1, 5, a.shard_bytes[1]))
    assert x.acquires == (4, 5) and x.bytes_moved == sum(a.shard_bytes)
    with pytest.raises(ValueError, match="disjoint"):
        extend(a, emu("c", 1, 2, (1, 2)))
    st = TransitionState.of([a])
    apply(st, x)
    assert st.copies("actor.generate") == 2 and st.used[4] == a.shard_bytes[0]
    apply(st, destroy(a))
    assert st.used[0] == 0 and set(st.emus) == {"b"}
    with pytest.raises(ValueError, match="does not exist"):
        apply(st, destroy(a))
    # a concurrent model-stage cannot take a GPU another one of its stage owns
    st2 = TransitionState.of([emu("r", 1, 1, (6,), ms="reward.infer")])
    grab = extend(emu("s", 1, 1, (7,), ms="critic.infer"), emu("d", 1, 1, (6,), ms="critic.infer"))
    st2.emus["s"] = emu("s", 1, 1, (7,), ms="critic.infer")
    with pytest.raises(ValueError, match="concurrent"):
        apply(st2, grab)


def test_durations_by_hand():
    c = JOB.cluster  # 2 nodes x 4 H100: NVLink 450 GB/s inside, 50 GB/s NIC across
    a, b = emu("a", 1, 1, (0,)), emu("b", 1, 1, (1,))
    x = extend(a, b)
    assert duration(x, c) == pytest.approx(0.05 + a.shard_bytes[0] / 450e9 + 5e-6)
    y = extend(a, emu("c", 1, 1, (4,)))
    assert duration(y, c) == pytest.approx(0.2 + a.shard_bytes[0] / 50e9 + 10e-6)
    assert ports(y, c) == frozenset({(0, "ib", "tx"), (4, "ib", "rx")})
    assert duration(destroy(a), c) == 0.01
    assert duration(destroy(a), c, CostParams(teardown_s=0.5)) == 0.5
    with pytest.raises(ValueError, match="teardown_s"):
        CostParams(teardown_s=-1)


def test_min_bytes_by_hand():
    models = {"actor.generate": (TINY, 2)}
    a = emu("a", 1, 1, (0,))
    # TP 1 -> 2 on GPUs (0, 1): GPU 0 already holds its half, GPU 1 needs its half
    t = emu("t", 2, 1, (0, 1))
    assert min_bytes((a,), (t,), models) == t.shard_bytes[0]
    assert min_bytes((a,), (emu("t", 1, 1, (0,)),), models) == 0


def _plans(cur, tgt):
    return Plan(tuple(Candidate(*c[:4], gpus=c[4]) for c in cur)), Plan(tuple(Candidate(*c[:4], gpus=c[4]) for c in tgt))


def test_bad_inputs_raise_value_errors():
    cur, tgt = _plans([("actor.generate", 1, 1, 2, (0, 1))], [("reward.infer", 1, 1, 2, (0, 1))])
    with pytest.raises(ValueError, match="same model-stages"):
        estimate_transition(JOB, cur, tgt)
    cur, tgt = _plans([("actor.train", 1, 1, 1, (0,)), ("critic.train", 1, 1, 1, (0,))],
                      [("actor.train", 1, 1, 1, (0,)), ("critic.train", 1, 1, 1, (1,))])
    with pytest.raises(ValueError, match="concurrent model-stages"):
        estimate_transition(JOB, cur, tgt)
    cur, tgt = _plans([("actor.train", 1, 1, 1, (0,))], [("actor.train", 1, 1, 1, (9,))])
    with pytest.raises(ValueError, match="valid 0..7"):
        estimate_transition(JOB, cur, tgt)
    cur, tgt = _plans([("actor.train", 1, 1, 1, (0,))], [("actor.train", 1, 1, 1, (1,))])
    with pytest.raises(ValueError, match="reserved_bytes"):
        estimate_transition(JOB, cur, tgt, reserved_bytes={1: -5})


def test_lost_gpus_and_pool():
    cur, tgt = _plans([("actor.generate", 1, 1, 2, (0, 1))], [("actor.generate", 1, 1, 2, (1, 2))])
    est = estimate_transition(JOB, cur, tgt, pool=frozenset({1, 2, 3}))  # GPU 0 was reclaimed
    assert est.feasible
    assert [n.kind for n in est.dag.nodes] == ["extend"] and est.dag.nodes[0].pairs[0][:2] == (1, 2)
    lost = estimate_transition(JOB, _plans([("actor.generate", 1, 1, 1, (0,))], [])[0],
                               _plans([("actor.generate", 1, 1, 1, (1,))], [])[0], pool=frozenset({1, 2}))
    assert not lost.feasible and "checkpoint" in lost.reason


def test_shifted_gpu_set_uses_a_finer_t_sub():
    cur, tgt = _plans([("actor.generate", 2, 1, 1, (0, 1))], [("actor.generate", 2, 1, 1, (1, 2))])
    est = estimate_transition(JOB, cur, tgt)
    assert est.feasible, est.reason
    assert est.dag.local[0].t_sub == (1, 1)
    # the Extend onto GPU 2 is fused into the Merge (transition/growth.py): it receives its half only
    assert sorted(n.kind for n in est.dag.nodes) == ["destroy", "merge", "split"]


def test_everything_serializes_to_json_and_exact_matches_small_cases():
    cur, tgt = _plans([("actor.generate", 2, 2, 1, (0, 1, 2, 3)), ("critic.train", 1, 2, 1, (4, 5))],
                      [("actor.generate", 1, 2, 2, (0, 2, 1, 3)), ("critic.train", 1, 2, 2, (4, 5, 6, 7))])
    est = estimate_transition(JOB, cur, tgt)
    assert est.feasible, est.reason
    doc = json.loads(json.dumps(est.to_dict()))
    assert doc["l_tran_s"] == pytest.approx(est.l_tran)
    assert len(doc["dag"]["nodes"]) == est.num_primitives
    prt = {n.pid: ports(n, JOB.cluster) for n in est.dag.nodes}
    ex = exact_schedule(est.dag, est.durations, prt, time_limit_s=10)
    assert ex.optimal and ex.schedule.makespan <= est.l_tran + 1e-6
    assert est.l_tran <= 1.1 * ex.schedule.makespan


def test_last_replica_is_destroyed_only_after_an_extend_copied_it():
    cur, tgt = _plans([("critic.train", 1, 2, 1, (0, 1))], [("critic.train", 1, 2, 1, (2, 3))])
    est = estimate_transition(JOB, cur, tgt)
    assert est.feasible
    assert [n.kind for n in est.dag.nodes] == ["extend", "destroy"]
    assert ("extend:critic.train*0", "destroy:critic.train#0", "state") in est.dag.edges
    s = est.schedule
    assert s.end["extend:critic.train*0"] <= s.start["destroy:critic.train#0"]


def test_stage_order_breaks_ties_on_a_shared_link():
    """Three Extends into GPU 3 share its NVLink receive port, so they run one after another:
    generation → inference → training under the paper's order; the longest (training: 14 B/param)
    first under the critical-path order."""
    cur, tgt = _plans([("actor.generate", 1, 1, 1, (0,)), ("reward.infer", 1, 1, 1, (1,)),
                       ("critic.train", 1, 1, 1, (2,))],
                      [("actor.generate", 1, 1, 2, (0, 3)), ("reward.infer", 1, 1, 2, (1, 3)),
                       ("critic.train", 1, 1, 2, (2, 3))])
    est = estimate_transition(JOB, cur, tgt, order="stage")
    s = est.schedule
    starts = sorted(s.start, key=s.start.get)
    assert [p.split(":")[1].split("*")[0] for p in starts] == ["actor.generate", "reward.infer", "critic.train"]
    assert s.start["extend:reward.infer*1"] == pytest.approx(s.end["extend:actor.generate*1"])
    est = estimate_transition(JOB, cur, tgt)
    s = est.schedule
    assert min(s.start, key=s.start.get) == "extend:critic.train*1"
    assert est.l_tran == pytest.approx(sum(est.durations.values()))  # serialized on the port


def test_current_state_over_capacity_is_infeasible():
    cur, tgt = _plans([("critic.train", 1, 1, 1, (0,))], [("critic.train", 1, 1, 2, (0, 1))])
    full = {0: 80 * 2**30}  # workspace larger than what the tiny critic leaves free
    est = estimate_transition(JOB, cur, tgt, reserved_bytes=full)
    assert not est.feasible and "already holds" in est.reason


def test_split_and_merge_with_a_non_power_of_two_factor():
    """Split is defined for any integer factor: (1, 3) → three (1, 1) replicas and back."""
    e = emu("a", 1, 3, (0, 1, 2))  # 4 layers over 3 ranks: 2, 1, 1
    s = split(e, (1, 1), TINY, 2)
    full = (4 * LAYER + 2 * 64 * 64 + 64) * 2
    assert len(s.produces) == 3 and all(u.shard_bytes == (full,) for u in s.produces)
    assert s.groups == (((0, 1, 2), full - e.shard_bytes[1]),)  # ranks 1, 2 lack the most
    m = merge(list(s.produces), e, TINY, 2)
    assert m.bytes_moved == 0 and sum(m.mem_net.values()) == sum(e.shard_bytes) - 3 * full


def test_load_from_storage_by_hand():
    """Frozen weights come back from storage: setup + bytes landing on the node / storage bandwidth."""
    full = (4 * LAYER + 2 * 64 * 64 + 64) * 2  # tiny tp1 pp1: 312,448 B (bf16)
    dst = emu("reference.infer*0", 1, 1, (4,), "reference.infer")
    ld = load(dst, STORAGE)
    assert (ld.pid, ld.kind, ld.source, ld.reads, ld.consumes) == ("load:reference.infer*0", "load", STORAGE, (), ())
    assert ld.acquires == (4,) and ld.mem_hi == ld.mem_net == {4: full} and ld.bytes_moved == full
    assert ld.pairs == () and ld.groups == ()
    prm = CostParams(storage_bandwidth=1e6, load_setup_s=0.5)
    assert duration(ld, JOB.cluster, prm) == pytest.approx(0.5 + 312448 / 1e6)
    # defaults: 2 s setup + 2 GB/s per node (nereus/sim/restart.py's storage assumption)
    assert duration(ld, JOB.cluster) == pytest.approx(2.0 + 312448 / 2e9)
    # tp=2 on GPUs 4, 5 (one node, 156,800 B each): the node reads both shards at 2 GB/s
    two = load(emu("reference.infer*1", 2, 1, (4, 5), "reference.infer"), STORAGE)
    assert duration(two, JOB.cluster, prm) == pytest.approx(0.5 + 2 * 156800 / 1e6)
    # on two nodes the nodes read in parallel
    split_nodes = load(emu("reference.infer*2", 2, 1, (3, 4), "reference.infer"), STORAGE)
    assert duration(split_nodes, JOB.cluster, prm) == pytest.approx(0.5 + 156800 / 1e6)
    # Loads on one node share its storage port, on different nodes they do not
    assert ports(ld, JOB.cluster) == ports(two, JOB.cluster) == frozenset({(1, "storage", "rx")})
    assert ports(split_nodes, JOB.cluster) == frozenset({(0, "storage", "rx"), (1, "storage", "rx")})
    st = TransitionState.of([])
    apply(st, ld)
    assert st.copies("reference.infer") == 1 and st.used[4] == full
    assert ld.to_dict()["source"] == STORAGE and "source" not in destroy(dst).to_dict()


def test_load_from_the_train_emu_is_a_weight_sync_by_hand():
    """Derived copies (actor.infer) come from a live actor.train EMU: weights only (2 B/param)."""
    train = emu("actor.train#0", 1, 1, (0,), "actor.train")
    dst = emu("actor.infer*0", 2, 1, (4, 5), "actor.infer")
    ld = load(dst, train)
    assert ld.reads == ("actor.train#0",) and ld.source == "actor.train#0"
    assert ld.pairs == ((0, 4, 156800), (0, 5, 156800)) and ld.bytes_moved == 2 * 156800
    assert ld.mem_hi == {4: 156800, 5: 156800} and 0 not in ld.mem_net
    # GPU 0 (node 0) sends both shards over the NIC one after another; inter-node setup 0.2 s
    assert duration(ld, JOB.cluster) == pytest.approx(0.2 + 2 * (156800 / 50e9 + 10e-6))
    assert ports(ld, JOB.cluster) == frozenset({(0, "ib", "tx"), (4, "ib", "rx"), (5, "ib", "rx")})
    # two train GPUs in the node: one shard each over NVLink, intra-node setup 0.05 s
    train2 = emu("actor.train#1", 2, 1, (6, 7), "actor.train")
    ld2 = load(dst, train2)
    assert ld2.pairs == ((6, 4, 156800), (7, 5, 156800))
    assert duration(ld2, JOB.cluster) == pytest.approx(0.05 + 156800 / 450e9 + 5e-6)
    with pytest.raises(ValueError, match="unique training state"):
        load(emu("actor.train*0", 1, 1, (4,), "actor.train"), STORAGE)
    with pytest.raises(ValueError, match="derive from actor.train"):
        load(dst, emu("critic.train#0", 1, 1, (0,), "critic.train"))
    with pytest.raises(ValueError, match="source must be"):
        load(dst, "s3")


def test_lost_every_replica_of_frozen_or_derived_state_reloads_but_train_stays_infeasible():
    # GPUs 4-7 (node 1) are reclaimed; reference.infer and actor.infer had every replica there
    cur, tgt = _plans([("reference.infer", 1, 1, 2, (6, 7)), ("actor.infer", 1, 1, 2, (4, 5)),
                       ("actor.train", 1, 1, 2, (0, 1))],
                      [("reference.infer", 1, 1, 2, (2, 3)), ("actor.infer", 1, 1, 2, (0, 1)),
                       ("actor.train", 1, 1, 2, (0, 1))])
    est = estimate_transition(JOB, cur, tgt, pool=frozenset(range(4)))
    assert est.feasible, est.reason
    assert est.reloads == {"reference.infer": STORAGE, "actor.infer": "actor.train#0"}
    assert "reference.infer (from storage)" in est.reason and "weight sync from actor.train#0" in est.reason
    kinds = sorted((n.kind, n.model_stage) for n in est.dag.nodes)
    assert kinds == [("extend", "actor.infer"), ("extend", "reference.infer"), ("load", "actor.infer"),
                     ("load", "reference.infer")]
    full = (4 * LAYER + 2 * 64 * 64 + 64) * 2
    # storage read once (2 s + 312,448 B / 2 GB/s), then an NVLink Extend 2 -> 3
    assert est.durations["load:reference.infer*0"] == pytest.approx(2.0 + full / 2e9)
    assert est.durations["extend:reference.infer*1"] == pytest.approx(0.05 + full / 450e9 + 5e-6)
    # actor.infer*0 lands on GPU 0 which holds actor.train#0: a local copy, no link, no setup; the
    # device reads and writes its full weights once (2 x 312,448 B at the H100's 3.35 TB/s), not 0 s
    assert est.durations["load:actor.infer*0"] == pytest.approx(2 * full / 3.35e12, rel=1e-12)
    assert est.l_tran == pytest.approx(2.0 + full / 2e9 + 0.05 + full / 450e9 + 5e-6)
    doc = json.loads(json.dumps(est.to_dict()))
    assert doc["reloads"] == est.reloads
    assert {n["source"] for n in doc["dag"]["nodes"] if n["kind"] == "load"} == {STORAGE, "actor.train#0"}
    # losing every actor.train replica stays infeasible: its state is unique
    cur, tgt = _plans([("reference.infer", 1, 1, 2, (0, 1)), ("actor.train", 1, 1, 2, (4, 5))],
                      [("reference.infer", 1, 1, 2, (0, 1)), ("actor.train", 1, 1, 2, (2, 3))])
    est = estimate_transition(JOB, cur, tgt, pool=frozenset(range(4)))
    assert not est.feasible and "actor.train" in est.reason and "checkpoint" in est.reason
    # and so does a derived copy whose train model-stage is lost too
    cur, tgt = _plans([("actor.infer", 1, 1, 1, (6,)), ("actor.train", 1, 1, 1, (7,))],
                      [("actor.infer", 1, 1, 1, (0,)), ("actor.train", 1, 1, 1, (1,))])
    est = estimate_transition(JOB, cur, tgt, pool=frozenset(range(4)))
    assert not est.feasible and "training state is unique" in est.reason


def test_a_load_from_the_train_emu_ends_before_the_train_emu_is_consumed():
    cur, tgt = _plans([("actor.generate", 1, 1, 1, (6,)), ("actor.train", 1, 1, 1, (0,))],
                      [("actor.generate", 1, 1, 1, (2,)), ("actor.train", 1, 1, 1, (1,))])
    est = estimate_transition(JOB, cur, tgt, pool=frozenset(range(4)))
    assert est.feasible, est.reason
    assert ("load:actor.generate*0", "destroy:actor.train#0", "state") in est.dag.edges
    s = est.schedule
    assert s.end["load:actor.generate*0"] <= s.start["destroy:actor.train#0"]
    prt = {n.pid: ports(n, JOB.cluster) for n in est.dag.nodes}
    ex = exact_schedule(est.dag, est.durations, prt, time_limit_s=10)
    assert ex.optimal and ex.schedule.makespan <= est.l_tran + 1e-6


def test_drop_and_reload_local_dag_and_its_limits():
    """A reload with live current EMUs destroys them first (no edges: the state survives in storage
    or the train model-stage), then Loads and Extends; training state is never dropped."""
    from nereus.transition.local_dag import build_local_dag

    cur = (emu("reference.infer#0", 1, 2, (0, 1), ms="reference.infer"),)
    tgt = (emu("reference.infer*0", 1, 2, (2, 3), ms="reference.infer"), emu("reference.infer*1", 1, 2, (4, 5), ms="reference.infer"))
    ld = build_local_dag("reference.infer", cur, tgt, TINY, 2, JOB.cluster, reload_from=STORAGE)
    assert [n.pid for n in ld.nodes] == ["destroy:reference.infer#0", "load:reference.infer*0",
                                         "extend:reference.infer*1"]
    assert ("load:reference.infer*0", "extend:reference.infer*1") in {(a, b) for a, b, *_ in ld.edges}
    assert not any("destroy" in a or "destroy" in b for a, b, *_ in ld.edges)
    train = (emu("actor.train#0", 1, 2, (0, 1), ms="actor.train"),)
    with pytest.raises(ValueError, match="cannot be dropped"):
        build_local_dag("actor.train", train, (emu("actor.train*0", 1, 2, (2, 3), ms="actor.train"),), TINY, 16,
                        JOB.cluster, reload_from=STORAGE)
    # a Load that syncs from a train *target* EMU reads nothing until that model-stage is done
    src = emu("actor.train*0", 1, 2, (6, 7), ms="actor.train")
    ld = build_local_dag("actor.infer", (emu("actor.infer#0", 1, 2, (0, 1), ms="actor.infer"),),
                         (emu("actor.infer*0", 1, 2, (2, 3), ms="actor.infer"),), TINY, 2, JOB.cluster, reload_from=src)
    lo = next(n for n in ld.nodes if n.kind == "load")
    assert lo.reads == () and lo.source == "actor.train"


def test_stage_spec_duration_and_ports_by_hand():
    """Offload (1,2) on GPUs 0,1 (node 0) to host, Restore as (2,1) on 1 and 4 (node 1): GPU 4 is on
    a node holding none of the host copy, so it is fed at the NIC's rate when that is below the
    host link's. In between the state is a host copy that holds no GPU memory and owns no GPU."""
    from nereus.transition.cost import CostParams
    from nereus.transition.staging import HOST, HOST_ID, stage

    a = emu("critic.train#0", 1, 2, (0, 1), ms="critic.train")
    b = emu("critic.train*0", 2, 1, (1, 4), ms="critic.train")
    off, back = stage((a,), (b,))
    assert (off.kind, back.kind) == ("offload", "restore") and off.source == back.source == HOST
    host = off.produces[0]
    assert host.host and host.uid == "critic.train@host" and host.bytes_on(0) == 0
    assert off.consumes == (a.uid,) and back.consumes == (host.uid,) and back.produces == (b,)
    assert off.acquires == () and back.acquires == (1, 4) and back.home == (0, 1)
    assert off.mem_hi == {0: 0, 1: 0} and off.mem_net == {0: -a.bytes_on(0), 1: -a.bytes_on(1)}
    assert back.mem_hi == back.mem_net == {1: b.bytes_on(1), 4: b.bytes_on(4)}
    assert off.pairs == ((0, HOST_ID, a.bytes_on(0)), (1, HOST_ID, a.bytes_on(1)))
    assert back.pairs == ((HOST_ID, 1, b.bytes_on(1)), (HOST_ID, 4, b.bytes_on(4)))
    params = CostParams(host_bandwidth=100e9, host_setup_s=0.5)
    nic = JOB.cluster.gpu.scaleout_bandwidth
    assert nic < 100e9
    assert duration(off, JOB.cluster, params) == pytest.approx(0.5 + max(a.shard_bytes) / 100e9, rel=1e-12)
    assert duration(back, JOB.cluster, params) == pytest.approx(
        max(b.bytes_on(1) / 100e9, b.bytes_on(4) / nic), rel=1e-12)
    assert ports(off, JOB.cluster) == {(0, "host", "tx"), (1, "host", "tx")}
    assert ports(back, JOB.cluster) == {(1, "host", "rx"), (4, "host", "rx")}
    state = TransitionState.of([a])
    apply(state, off)
    assert set(state.emus) == {host.uid} and state.used[0] == 0 and state.owners(0) == set()
    apply(state, back)
    assert set(state.emus) == {b.uid} and state.used[4] == b.bytes_on(4)
    with pytest.raises(ValueError, match="belongs to"):
        stage((a,), (emu("actor.train*0", 2, 1, (1, 4), ms="actor.train"),))
