"""Live transitions of ZeRO-sliced, offloaded and colocated state through the transition executor
(issue 24 item 4; ``transit/flat.py``, ``transit/residency.py``): ZeRO DP 2->4 and 4->2, ZeRO-1 ->
plain DP and back, colocated (idle state in the host pool) -> disjoint and back, offloaded state
restored onto new workers. After each, the gathered logical state equals the state before bit for
bit, every primitive received exactly the bytes the transition planner predicted for it, and the
run trains on; the ZeRO chain ends where a reference run without transitions ends (same samples,
fp32 reduction tolerance)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from live_state import CFG, SPEC, TASK, TRAIN, W, assert_equal, layout_plan, reference_states, states  # noqa: E402

from nereus.runtime.run.device_model import runtime_job  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.transit.driver_side import TransitionExecutor  # noqa: E402
from nereus.runtime.transit.flat import flat_numel  # noqa: E402
from nereus.spec.framework import get_framework  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402

BASE = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 2, 1, (1, 2)),
        "critic.infer": (1, 1, 1, (3,)), "actor.train": (1, 1, 2, (0, 1)), "critic.train": (1, 2, 1, (2, 3))}
#: the tiny actor's flat shard (tp = pp = 1): N elements, divisible by 2 and 4, so a rank's slice is
#: exactly the planner's N·8 B / z (transit/flat.py)
N_ACTOR = flat_numel(SPEC, 1, 1, 0, 0)


def plan(zero=1, **changes) -> Plan:
    return layout_plan(BASE, changes, zero=zero)


def _job(w: WorkloadSpec = W):
    """The job as the planners see this runtime, in the plan space it executes (``runtime``: ZeRO-1,
    offload, colocation; concurrent model-stages may share a worker)."""
    return replace(runtime_job(SPEC, w, 4), framework=get_framework("runtime"))


def _live(d: RLDriver, target: Plan, w: WorkloadSpec = W):
    """Plan the transition with the transition planner, execute it, return (estimate, report)."""
    job = _job(w)
    est = estimate_transition(job, Plan(candidates=tuple(d.cands.values())), target, frozenset(range(4)))
    assert est.feasible, est.reason
    return est, TransitionExecutor(d).execute(est, target)


def _assert_bytes(est, rep, what: str) -> None:
    assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved > 0, (what, rep.summary())
    for r in rep.primitives:  # per primitive, not only in total
        assert r.bytes_received == r.predicted_bytes, (what, r.pid, r.bytes_received, r.predicted_bytes)
    assert rep.driver_bytes < 64 * 1024, (what, rep.driver_bytes)  # metadata only


#: (name, target, bytes every primitive must receive, derived by hand from N_ACTOR: 4 B weights and
#: two 4 B Adam moments per element, fp32)
ZERO_CHAIN = [
    # the two new ranks (workers 2, 3) receive the weights and their quarter of both moments; the
    # old ranks 0 and 1 become ranks 0 and 2 of 4 (transition/group_ranks.py) and keep their quarter
    ("ZeRO DP 2->4", plan(actor_train=(1, 1, 4, (0, 1, 2, 3))), 2 * (4 + 8 / 4) * N_ACTOR),
    # back onto workers 0 and 1: each gathers the quarter it lacks of both moments
    ("ZeRO DP 4->2", plan(actor_train=(1, 1, 2, (0, 1))), 2 * (8 / 4) * N_ACTOR),
    # each replica all-gathers the other half of both moments
    ("ZeRO-1 -> plain DP", plan(zero=0, actor_train=(1, 1, 2, (0, 1))), 2 * (8 / 2) * N_ACTOR),
    # a plain replica keeps its half: nothing but a re-cut (planned and moved: 0 bytes), so DP 1 -> ZeRO 2 instead
    ("plain DP 1 -> ZeRO DP 2", None, None),
]


@pytest.mark.slow
def test_zero_live_transitions_reshard_slices_bit_exact_with_the_planned_bytes(pool):
    assert N_ACTOR % 4 == 0
    chain = ZERO_CHAIN[:3]
    steps = len(chain) + 1
    want = reference_states(pool, plan(), steps)
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        for name, target, moved in chain:
            before = states(d)
            est, rep = _live(d, target)
            assert_equal(states(d), before, name)
            _assert_bytes(est, rep, name)
            assert rep.bytes_moved == moved, (name, rep.bytes_moved, moved)
            c = d.cands["actor.train"]
            assert (c.dp, c.zero, sorted(c.gpus)) == (target["actor.train"].dp, target["actor.train"].zero,
                                                      sorted(target["actor.train"].gpus))
            d.step()
        got = states(d)
    finally:
        d.close()
    atol = 1e-2 * CFG.actor_lr  # as test_runtime_executor: reduction order (reduce-scatter at dp 4)
    for ms in TRAIN:
        assert got[ms]["update_count"] == want[ms]["update_count"] == 2 * steps
        assert got[ms]["position"] == want[ms]["position"]
        for n in want[ms]["params"]:
            assert torch.allclose(got[ms]["params"][n], want[ms]["params"][n], atol=atol, rtol=1e-4), (ms, n)
            assert torch.allclose(got[ms]["exp_avg"][n], want[ms]["exp_avg"][n], atol=1e-6, rtol=1e-3), (ms, n)


def test_plain_dp1_to_zero_group_is_planned_as_a_grow():
    """The 1 -> 2 growth into a ZeRO group (no Ray): the new rank receives the weights and its half of
    the moments; the old replica keeps its half (the planner's figure, derived by hand)."""
    job = _job()
    cur = plan(actor_train=(1, 1, 1, (0,)))
    est = estimate_transition(job, cur, plan(actor_train=(1, 1, 2, (0, 1))), frozenset(range(4)))
    assert est.feasible, est.reason
    assert est.bytes_moved == (4 + 8 / 2) * N_ACTOR


#: bytes each worker may account (test_runtime_colocate.py): a trained tiny model's state with its
#: activations fits, all seven model-stages of worker 0 resident at once do not
CAPACITY = 4_000_000
W_RM = replace(W, reward_model=True)
COL_CFG = replace(CFG, kl_coef=0.05, device_capacity=CAPACITY)


def colocated() -> Plan:
    """Every inference model-stage on worker 0 and generation on 0-1, their idle copies dropped; both
    trainers on workers 0-1 taking turns, idle state offloaded to the host pool, the actor ZeRO-1."""
    out = []
    for ms in ("actor.generate", "actor.infer", "reference.infer", "reward.infer", "critic.infer",
               "actor.train", "critic.train"):
        if ms.endswith("generate"):
            out.append(Candidate(ms, 1, 1, 2, gpus=(0, 1), offload="drop"))
        elif ms.endswith("train"):
            out.append(Candidate(ms, 1, 1, 2, micro_batch=1, gpus=(0, 1), offload="host",
                                 zero=1 if ms.startswith("actor") else 0))
        else:
            out.append(Candidate(ms, 1, 1, 1, micro_batch=4, gpus=(0,), offload="drop"))
    return Plan(candidates=tuple(out))


def _relaid(p: Plan, **changes) -> Plan:
    return Plan(candidates=tuple(replace(c, **changes.get(c.model_stage, {})) for c in p.candidates))


@pytest.mark.slow
def test_colocated_offloaded_state_live_transitions(pool):
    """Colocated -> disjoint: the critic's idle state, in workers 0-1's host pools, is restored onto
    workers 2-3 (every target byte from host memory: 2 replicas x 12 B x N_critic); disjoint ->
    colocated: one replica is offloaded to worker 2's host pool (12 B x N) and the host copies on
    workers 0-1 are cut from it (2 x 12 B x N); the actor's ZeRO-1 slices, offloaded at DP 2, restored
    as a device-resident DP 4 group on all four workers (4 ranks x (4 + 8/4) B x N_actor). Steps after
    the first two equal a run without transitions bit for bit (colocated and disjoint steps are equal,
    test_runtime_colocate.py); accounted device bytes stay within the capacity throughout."""
    import ray

    n_critic = flat_numel(SPEC.value_head(), 1, 1, 0, 0)
    col = colocated()
    dis = _relaid(col, **{"critic.train": {"gpus": (2, 3), "offload": "none"}})
    chain = [("colocated -> disjoint (host -> new workers)", dis, {"restore": 2 * 12 * n_critic}),
             ("disjoint -> colocated", col, {"offload": 12 * n_critic, "restore": 2 * 12 * n_critic}),
             ("offloaded ZeRO DP 2 -> resident DP 4 on new workers",
              _relaid(col, **{"actor.train": {"dp": 4, "gpus": (0, 1, 2, 3), "offload": "none"}}),
              {"restore": 4 * (4 + 8 // 4) * N_ACTOR})]
    want = reference_states(pool, col, 3, W_RM, COL_CFG)
    d = RLDriver(SPEC, W_RM, col, TASK, 4, COL_CFG).start(pool)
    try:
        d.step()
        assert ray.get(d.workers[0].measurements.remote())["memory"]["host_bytes"] > 0  # idle state offloaded
        for i, (name, target, kinds) in enumerate(chain):
            before = states(d)
            est, rep = _live(d, target, W_RM)
            assert_equal(states(d), before, name)
            _assert_bytes(est, rep, name)
            assert {r.kind: r.bytes_received for r in rep.primitives} == kinds, (name, rep.summary())
            d.reset_measurements()
            d.step()
            for pw in d.measurements()["per_worker"]:
                assert pw["peak_bytes"] <= CAPACITY, (name, pw["worker"])
            if i == 1:  # back where the reference run is, after the same three steps
                assert_equal(states(d), want, "training continues as without the transitions")
        assert d.gather_logical_state("actor.train")["update_count"] == 8
    finally:
        d.close()


@pytest.mark.slow
def test_derived_copy_loaded_live_from_the_host_resident_trainer(pool):
    """The colocated critic: critic.infer's idle copy is dropped and critic.train's idle state sits in
    workers 0-1's host pools, so no GPU copy of the critic exists at a step boundary. Making
    critic.infer resident on worker 2 is one Load from the host copy critic.train#0 (worker 0):
    its fp32 weights, 4 B x N_critic, from host memory (transition/primitives.load; infeasible
    before: "no GPU copy to sync from"). critic.infer then holds exactly critic.train's weights, the
    trainers' state is untouched (bit-exact), and the next step equals a run without the transition."""
    n_critic = flat_numel(SPEC.value_head(), 1, 1, 0, 0)
    col = colocated()
    target = _relaid(col, **{"critic.infer": {"gpus": (2,), "offload": "none"}})
    want = reference_states(pool, col, 2, W_RM, COL_CFG)
    d = RLDriver(SPEC, W_RM, col, TASK, 4, COL_CFG).start(pool)
    try:
        d.step()
        before = states(d)
        est, rep = _live(d, target, W_RM)
        assert est.reloads == {"critic.infer": "critic.train#0"}, est.reason
        (ld,) = est.dag.nodes
        assert ld.kind == "load" and ld.home == (0,) and ld.pairs == ((-1, 2, 4 * n_critic),)
        _assert_bytes(est, rep, "host load")
        assert {r.kind: r.bytes_received for r in rep.primitives} == {"load": 4 * n_critic}, rep.summary()
        assert_equal(states(d), before, "host load")
        infer, trained = d.gather_logical_state("critic.infer"), d.gather_logical_state("critic.train")
        assert set(infer["params"]) == set(trained["params"])
        for n, w in trained["params"].items():
            assert torch.equal(infer["params"][n], w), n
        d.step()
        assert_equal(states(d), want, "training continues as without the transition")
    finally:
        d.close()


def test_lost_training_state_held_in_host_memory_is_not_re_created():
    """A training model-stage whose only copy (idle, in host memory) was on workers that left cannot
    be re-created by its next run as a frozen or derived copy can: the transition is infeasible (the
    durable checkpoint restores it). Before issue 24's fix the planner skipped it as "no state to
    move" when the target kept it in host memory too."""
    job = _job(W_RM)
    col = colocated()
    away = _relaid(col, **{"critic.train": {"gpus": (2, 3)}})
    est = estimate_transition(job, away, col, frozenset((0, 1)))
    assert not est.feasible and "critic.train" in est.reason and "unique" in est.reason, est.reason
    assert estimate_transition(job, away, col, frozenset(range(4))).feasible
