"""The live-transition executor on Ray workers: every primitive kind and composed changes keep the
logical state bit for bit, move exactly the planner's bytes, pass no tensor through the driver, and
training continues as if nothing happened (DESIGN.md §4.8)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from live_state import CFG, SPEC, TASK, TRAIN, W, assert_equal, layout_plan, reference_states, states  # noqa: E402

from nereus.runtime.model.sharding import param_shapes  # noqa: E402
from nereus.runtime.run.device_model import runtime_job  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.transit.driver_side import TransitionExecutor  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402
from nereus.transition.schedule import Schedule  # noqa: E402
from nereus.transition.verify import ScheduleError  # noqa: E402

BASE = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 2, 1, (1, 2)),
        "critic.infer": (1, 1, 1, (3,)), "actor.train": (2, 1, 1, (0, 1)), "critic.train": (1, 2, 1, (2, 3))}


def plan(**changes) -> Plan:
    return layout_plan(BASE, changes)


def _transition(d: RLDriver, target: Plan, pool_ids=None):
    job = runtime_job(SPEC, W, 4)
    current = Plan(candidates=tuple(d.cands.values()))
    est = estimate_transition(job, current, target, frozenset(pool_ids or range(4)))
    assert est.feasible, est.reason
    return est, TransitionExecutor(d).execute(est, target)


#: (name, target plan) in the order the test applies them; each starts from the previous one
CHAIN = [
    ("TP 2->1", plan(actor_train=(1, 1, 1, (0,)))),
    ("TP 1->2", plan(actor_train=(2, 1, 1, (0, 1)))),
    ("PP 1->2 via TP->PP", plan(actor_train=(1, 2, 1, (0, 1)))),
    ("PP 2->1", plan(actor_train=(1, 1, 1, (1,)))),
    ("DP 1->2", plan(actor_train=(1, 1, 2, (1, 0)))),
    ("DP 2->1", plan(actor_train=(1, 1, 1, (0,)))),
    ("multi-model-stage on a full pool", plan(actor_train=(2, 1, 1, (2, 3)), critic_train=(1, 2, 1, (0, 1)),
                                              actor_generate=(2, 1, 2, (0, 1, 2, 3)),
                                              critic_infer=(1, 1, 1, (0,)), actor_infer=(1, 1, 1, (3,)))),
]


@pytest.mark.slow
def test_live_transitions_keep_state_move_planned_bytes_and_training_continues(pool):
    steps = len(CHAIN) + 1
    # reference: the same steps (same samples) without any transition
    want = reference_states(pool, plan(), steps)
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        kinds = set()
        for name, target in CHAIN:
            before = states(d)
            est, rep = _transition(d, target)
            assert_equal(states(d), before, name)
            assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved, (name, rep.summary())
            for r in rep.primitives:  # per primitive too, not only in total
                assert r.bytes_received == r.predicted_bytes, (name, r.pid, r.bytes_received, r.predicted_bytes)
            assert rep.driver_bytes < 64 * 1024, (name, rep.driver_bytes)  # metadata only
            if name == "TP 1->2":  # growth: worker 1 receives only its half (transition/growth.py)
                assert rep.bytes_moved == est.min_bytes > 0 and [r.kind for r in rep.primitives] == ["merge"]
            kinds |= {r.kind for r in rep.primitives}
            for ms, c in d.cands.items():
                assert (c.tp, c.pp, c.dp, c.gpus) == (target[ms].tp, target[ms].pp, target[ms].dp, target[ms].gpus)
            if d.layouts["actor.train"].dp == 2:  # every replica holds the same state
                r1 = d.gather_logical_state("actor.train", 1)
                assert all(torch.equal(r1["params"][n], before["actor.train"]["params"][n]) for n in r1["params"])
            d.step()
        assert {"split", "merge", "extend", "destroy"} <= kinds, kinds
        got = states(d)
    finally:
        d.close()
    # same samples, same updates up to fp32 reduction order, which Adam amplifies where its second
    # moment is tiny (rarely seen embedding rows): 1% of one step's size (lr) bounds the drift, a
    # different sample or update would move parameters by O(lr)
    atol = 1e-2 * CFG.actor_lr
    for ms in TRAIN:
        assert got[ms]["update_count"] == want[ms]["update_count"] == 2 * steps
        assert got[ms]["position"] == want[ms]["position"]
        for n in want[ms]["params"]:
            assert torch.allclose(got[ms]["params"][n], want[ms]["params"][n], atol=atol, rtol=1e-4), (ms, n)
            assert torch.allclose(got[ms]["exp_avg"][n], want[ms]["exp_avg"][n], atol=1e-6, rtol=1e-3), (ms, n)


@pytest.mark.slow
def test_executor_refuses_a_schedule_that_breaks_the_last_copy_rule_before_moving(pool):
    d = RLDriver(SPEC, W, plan(actor_train=(1, 1, 1, (0,))), TASK, 4, CFG).start(pool)
    try:
        d.step()
        before = states(d)
        target = plan(actor_train=(1, 1, 1, (2,)), critic_train=(1, 2, 1, (0, 1)))
        job = runtime_job(SPEC, W, 4)
        est = estimate_transition(job, Plan(candidates=tuple(d.cands.values())), target, frozenset(range(4)))
        assert est.feasible, est.reason
        destroy = next(p.pid for p in est.dag.nodes if p.kind in ("destroy", "offload")
                       and p.model_stage == "actor.train")
        # move that release to time 0, before the copy that must precede it exists
        s = est.schedule
        start, end = dict(s.start), dict(s.end)
        dur = end[destroy] - start[destroy]
        start[destroy], end[destroy] = -1.0 - dur, -1.0
        bad = Schedule(start, end, s.makespan)
        with pytest.raises(ScheduleError):
            TransitionExecutor(d).execute(type(est)(**{**est.__dict__, "schedule": bad}), target)
        # nothing moved: same layouts, same state, and training goes on
        assert d.cands["actor.train"].gpus == (0,)
        assert_equal(states(d), before, "refused")
        d.step()
    finally:
        d.close()


@pytest.mark.slow
def test_bf16_live_transitions_keep_master_weights_and_moments_bit_for_bit(pool):
    """Mixed precision (``RLConfig(precision="bf16")``): a training unit holds bf16 weights, the fp32
    master and fp32 moments; after every transition of :data:`CHAIN` all four kinds gathered equal the
    state before bit for bit, and the bytes received equal the planner's for a job costed in bf16
    (2 + 12 bytes per trained parameter, 2 per weight-copy parameter)."""
    d = RLDriver(SPEC, W, plan(), TASK, 4, dataclasses.replace(CFG, precision="bf16")).start(pool)
    job = runtime_job(SPEC, W, 4, precision="bf16")
    try:
        d.step()
        for name, target in CHAIN[:3] + CHAIN[-1:]:
            before = states(d)
            assert before["actor.train"]["master"].keys() == before["actor.train"]["params"].keys()
            est = estimate_transition(job, Plan(candidates=tuple(d.cands.values())), target, frozenset(range(4)))
            assert est.feasible, est.reason
            rep = TransitionExecutor(d).execute(est, target)
            after = states(d)
            assert_equal(after, before, name, kinds=("params", "master", "exp_avg", "exp_avg_sq"))
            assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved, (name, rep.summary())
            for r in rep.primitives:
                assert r.bytes_received == r.predicted_bytes, (name, r.pid, r.bytes_received, r.predicted_bytes)
            d.step()
            st = d.gather_logical_state("actor.train")
            for n, w in st["params"].items():  # the weights are the master rounded to bf16
                assert torch.equal(w, st["master"][n].to(torch.bfloat16).float()), (name, n)
            # the weight sync sent bf16 weights: the rollout copy equals the bf16 training weights
            g = d.gather_logical_state("actor.generate")["params"]
            assert all(torch.equal(g[n], st["params"][n]) for n in g), name
        assert st["update_count"] == 2 * 5
    finally:
        d.close()


@pytest.mark.slow
def test_weight_sync_moves_only_what_each_rank_lacks(pool):
    """actor.train TP 2 on workers 0-1 → actor.generate (1,1,2) on 2-3 and actor.infer (1,1,1) on 0:
    each generate rank receives the full fp32 weights once; the infer rank on worker 0 already holds
    TP rank 0's half of every split tensor and the norms, and receives only the other half."""
    total = sum(math.prod(shape) for shape, _ in param_shapes(SPEC).values())
    split = sum(math.prod(shape) for shape, rule in param_shapes(SPEC).values() if rule != "rep")
    layouts = dict(actor_generate=(1, 1, 2, (2, 3)), actor_infer=(1, 1, 1, (0,)), reference_infer=(1, 2, 1, (1, 2)),
                   critic_infer=(1, 1, 1, (3,)), actor_train=(2, 1, 1, (0, 1)), critic_train=(1, 1, 1, (2,)))
    d = RLDriver(SPEC, W, plan(**layouts), TASK, 4, CFG).start(pool)
    try:
        d.step()
        value = MODEL_PRESETS["tiny"].value_head()
        critic = sum(math.prod(shape) for shape, _ in param_shapes(value).values())
        # critic.train on 2 → critic.infer on 3: the full value model once
        assert d.last_sync["recv"] == 4 * (2 * total + split // 2 + critic)
        assert d.last_sync["sent"] == d.last_sync["recv"]
        g0 = d.gather_logical_state("actor.generate", 1)["params"]
        t0 = d.gather_logical_state("actor.train")["params"]
        assert all(torch.equal(g0[n], t0[n]) for n in t0)
        # the next step's syncs reuse every communicator (comm/cache.py): actor.train -> generate
        # among workers 0-3, -> infer between 0 and 1 (1 sends the other half), critic 2 -> 3
        before = d._get([w.comm_stats.remote() for w in d.workers], "comm stats")
        d.step()
        after = d._get([w.comm_stats.remote() for w in d.workers], "comm stats")
        assert [a["built"] for a in after] == [b["built"] for b in before]
        assert [a["reused"] - b["reused"] for a, b in zip(after, before)] == [2, 2, 2, 2]
        assert [a["setup_s"] for a in after] == [b["setup_s"] for b in before]
    finally:
        d.close()


@pytest.mark.slow
def test_transition_onto_fewer_workers_after_one_leaves(pool):  # last: it kills worker 3
    # worker 3 holds a replica of actor.train, the only copy of actor.generate (derived from
    # actor.train) and half of reference.infer's only replica (frozen)
    d = RLDriver(SPEC, W, plan(actor_train=(1, 1, 2, (0, 3)), critic_train=(1, 1, 2, (2, 1)),
                               reference_infer=(1, 2, 1, (2, 3)), critic_infer=(1, 1, 1, (1,)),
                               actor_infer=(1, 1, 1, (0,)), actor_generate=(1, 1, 1, (3,))), TASK, 4, CFG)
    d.start(pool)
    try:
        d.step()
        before = states(d)
        ref0 = d.gather_logical_state("reference.infer")["params"]
        # worker 3 is lost: actor.train keeps replica 0 on worker 0, critic.train its replica on 2
        target = plan(actor_train=(1, 1, 1, (0,)), critic_train=(1, 1, 1, (2,)), actor_generate=(1, 1, 2, (0, 1)),
                      reference_infer=(1, 1, 1, (2,)), critic_infer=(1, 1, 1, (1,)), actor_infer=(1, 1, 1, (0,)))
        pool.remove(3)  # the actor is killed; the driver shares the pool's list and sees None
        assert d.workers[3] is None
        est, rep = _transition(d, target, pool_ids=(0, 1, 2))
        assert_equal(states(d), before, "shrink")
        assert rep.bytes_moved == rep.predicted_bytes
        assert sorted(est.reloads) == ["actor.generate", "reference.infer"] and est.reloads["reference.infer"] == "storage"
        # frozen weights re-created from storage equal the lost copy; the derived copies equal their train
        ref1 = d.gather_logical_state("reference.infer")["params"]
        assert all(torch.equal(ref1[n], ref0[n]) for n in ref0)
        for r in (0, 1):
            g = d.gather_logical_state("actor.generate", r)["params"]
            assert all(torch.equal(g[n], before["actor.train"]["params"][n]) for n in g)
        loads = {r.model_stage: r for r in rep.primitives if r.kind == "load"}
        assert loads["reference.infer"].bytes_received == loads["reference.infer"].predicted_bytes > 0
        d.step()
        # a worker joins (id 4): actor.train grows onto it by Extend, state copied rank-aligned
        assert pool.add(1) == [4]
        d.num_workers = len(pool.workers)
        before = states(d)
        target = plan(actor_train=(1, 1, 2, (0, 4)), critic_train=(1, 1, 1, (2,)), actor_generate=(1, 1, 2, (0, 1)),
                      reference_infer=(1, 1, 1, (2,)), critic_infer=(1, 1, 1, (1,)), actor_infer=(1, 1, 1, (0,)))
        job = runtime_job(SPEC, W, 5)
        est = estimate_transition(job, Plan(candidates=tuple(d.cands.values())), target, frozenset((0, 1, 2, 4)))
        assert est.feasible, est.reason
        rep = TransitionExecutor(d).execute(est, target)
        assert [r.kind for r in rep.primitives] == ["extend"] and rep.primitives[0].received == {
            4: rep.primitives[0].predicted_bytes}
        assert_equal(states(d), before, "grow")
        r1 = d.gather_logical_state("actor.train", 1)
        assert all(torch.equal(r1["exp_avg"][n], before["actor.train"]["exp_avg"][n]) for n in r1["exp_avg"])
        d.step()
    finally:
        d.close()
