"""Live transitions of ZeRO-3 and ZeRO-2 state through the transition executor (issue 24 item 4;
``transit/flat.py``: a ZeRO-2/3 rank's slices are one span of the flat shard per layer unit): ZeRO-3
DP 2->4 and 4->2, ZeRO-3 -> ZeRO-2 and back, ZeRO-3 -> plain DP, in a PPO run on Ray. After each, the
gathered logical state equals the state before bit for bit, every primitive received exactly the
bytes the transition planner predicted for it (and the figure derived by hand), the actor's engine is
of the target ZeRO stage, and the run trains on; the chain ends where a reference run without
transitions ends (same samples, fp32 reduction tolerance, as ``test_runtime_transit_zero.py``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from live_state import CFG, SPEC, TASK, TRAIN, W, assert_equal, reference_states, states  # noqa: E402
from test_runtime_transit_zero import N_ACTOR, _live, plan  # noqa: E402

from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402


def z3(zero: int = 3, **changes) -> Plan:
    """The test's plan with the actor at ZeRO ``zero`` (full recompute at stage 3, as ``--zero 3``)."""
    p = plan(zero=zero, **changes)
    return Plan(candidates=tuple(replace(c, recompute="full") if c.zero == 3 else c for c in p.candidates))


#: (name, target, bytes every primitive together must receive, by hand: fp32 weights and two fp32
#: moments, 12 B per element; every unit of the tiny actor's shard divides by 4, so a rank's slice of a
#: unit is exactly N_u/z, tests/test_transit_zero3_slices.py)
CHAIN = [
    # ranks 0, 1 become ranks 0, 2 of 4 (transition/group_ranks.py) and keep their quarter of every
    # unit; the new ranks on workers 2, 3 receive their quarter of weights and both moments
    ("ZeRO-3 DP 2->4", z3(actor_train=(1, 1, 4, (0, 1, 2, 3))), 2 * 12 * N_ACTOR // 4),
    # back onto workers 0 and 1: each receives the quarter of its new half it lacks
    ("ZeRO-3 DP 4->2", z3(), 2 * 12 * N_ACTOR // 4),
    # each rank all-gathers the other half of the weights; the moments' slices stay (same units)
    ("ZeRO-3 -> ZeRO-2", z3(zero=2), 2 * 4 * N_ACTOR // 2),
    # the weights are cut locally, the moments' slices stay: nothing moves
    ("ZeRO-2 -> ZeRO-3", z3(), 0),
    # each replica all-gathers the other half of every unit, all three kinds
    ("ZeRO-3 -> plain DP", z3(zero=0), 2 * 12 * N_ACTOR // 2),
]


@pytest.mark.slow
def test_zero3_live_transitions_reshard_unit_slices_bit_exact_with_the_planned_bytes(pool):
    steps = len(CHAIN) + 1
    want = reference_states(pool, z3(), steps)
    d = RLDriver(SPEC, W, z3(), TASK, 4, CFG).start(pool)
    moved = {}
    try:
        d.step()
        for name, target, by_hand in CHAIN:
            before = states(d)
            est, rep = _live(d, target)
            assert_equal(states(d), before, name)
            assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved == by_hand, (name, rep.summary())
            for r in rep.primitives:  # per primitive, not only in total
                assert r.bytes_received == r.predicted_bytes, (name, r.pid, r.bytes_received, r.predicted_bytes)
            assert rep.driver_bytes < 64 * 1024, (name, rep.driver_bytes)  # metadata only
            moved[name] = (int(est.bytes_moved), rep.bytes_moved)
            c, t = d.cands["actor.train"], target["actor.train"]
            assert (c.dp, c.zero, sorted(c.gpus)) == (t.dp, t.zero, sorted(t.gpus))
            d.step()
        got = states(d)
    finally:
        d.close()
    print("predicted vs moved bytes:", moved)
    atol = 1e-2 * CFG.actor_lr  # as test_runtime_transit_zero: reduction order (reduce-scatter at dp 4)
    for ms in TRAIN:
        assert got[ms]["update_count"] == want[ms]["update_count"] == 2 * steps
        assert got[ms]["position"] == want[ms]["position"]
        for n in want[ms]["params"]:
            assert torch.allclose(got[ms]["params"][n], want[ms]["params"][n], atol=atol, rtol=1e-4), (ms, n)
            assert torch.allclose(got[ms]["exp_avg"][n], want[ms]["exp_avg"][n], atol=1e-6, rtol=1e-3), (ms, n)


#: the tiny model's norm weights (2 per layer and the final one): replicated on every TP rank
R = (2 * SPEC.num_layers + 1) * SPEC.hidden_size
TP2 = {"actor_train": (2, 1, 2, (0, 1, 2, 3))}
PP2 = {"actor_train": (1, 2, 2, (0, 1, 2, 3))}
HOST_TP2 = Plan(candidates=tuple(replace(c, offload="host") if c.model_stage == "actor.train" else c
                                 for c in z3(zero=0, **TP2).candidates))
#: zero → [(name, target, bytes by hand)] (the planner's figure is asserted for every primitive too)
#: (transit/regroup.py; derivations in tests/test_transit_zero3_slices.py)
LAYOUT_CHAINS = {
    1: [("ZeRO-1 TP 1->2", z3(zero=1, **TP2), 2 * 8 * N_ACTOR // 2 + 2 * 12 * N_ACTOR),
        ("ZeRO-1 TP 2->1", z3(zero=1), 2 * (8 * N_ACTOR - 4 * R)),
        ("ZeRO-1 PP 1->2", z3(zero=1, **PP2), 2 * 8 * N_ACTOR // 2 + 2 * 12 * N_ACTOR),
        # Offload of the PP 2 group, Restore of its host slices into TP 2 replicas idle in host memory
        # (every target shard gathers rows or columns from both PP positions, transit/regroup.py):
        # 4 ranks x (4 + 8/2) B x N/2 offloaded, 4 workers x 12 B x (N + R)/2 restored
        ("ZeRO-1 PP 2 -> plain TP 2 offloaded", HOST_TP2, 4 * 8 * N_ACTOR // 2 + 4 * 12 * (N_ACTOR + R) // 2)],
    3: [("ZeRO-3 TP 1->2", z3(**TP2), 2 * 12 * N_ACTOR // 2 + 2 * 12 * N_ACTOR),
        ("ZeRO-3 TP 2->1", z3(), 2 * (9 * N_ACTOR - 3 * R)),
        ("ZeRO-3 PP 1->2", z3(**PP2), 2 * 12 * N_ACTOR // 2 + 2 * 12 * N_ACTOR),
        # 4 ranks x 12 B x N/4 offloaded, 4 workers x 12 B x (N + R)/2 restored
        ("ZeRO-3 PP 2 -> plain TP 2 offloaded", HOST_TP2, 12 * N_ACTOR + 4 * 12 * (N_ACTOR + R) // 2)],
}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_zero_slices_move_live_across_tp_and_pp_changes(pool, zero):
    """ZeRO-1 and ZeRO-3 groups changing TP (1 -> 2 -> 1) and PP (1 -> 2) at DP 2 in place: the group
    is split into replicas of its own layout (each gathering the slices it lacks), replicas are copied
    to new workers, and the target group is cut from them locally (``transit/regroup.py``); bit-exact
    logical state, the planner's bytes per primitive, training on as the reference run."""
    chain = LAYOUT_CHAINS[zero]
    steps = len(chain) + 1
    want = reference_states(pool, z3(zero=zero), steps)
    d = RLDriver(SPEC, W, z3(zero=zero), TASK, 4, CFG).start(pool)
    moved = {}
    try:
        d.step()
        for name, target, by_hand in chain:
            before = states(d)
            est, rep = _live(d, target)
            assert_equal(states(d), before, name)
            assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved > 0, (name, rep.summary())
            if by_hand is not None:
                assert rep.bytes_moved == by_hand, (name, rep.bytes_moved, by_hand)
            for r in rep.primitives:
                assert r.bytes_received == r.predicted_bytes, (name, r.pid, r.bytes_received, r.predicted_bytes)
            moved[name] = (int(est.bytes_moved), rep.bytes_moved)
            c, t = d.cands["actor.train"], target["actor.train"]
            assert (c.tp, c.pp, c.dp, c.zero, c.offload) == (t.tp, t.pp, t.dp, t.zero, t.offload)
            d.step()
        got = states(d)
    finally:
        d.close()
    print("predicted vs moved bytes:", moved)
    atol = 1e-2 * CFG.actor_lr  # reduction order (TP and PP change the sums' order)
    for ms in TRAIN:
        assert got[ms]["update_count"] == want[ms]["update_count"] == 2 * steps
        for n in want[ms]["params"]:
            assert torch.allclose(got[ms]["params"][n], want[ms]["params"][n], atol=atol, rtol=1e-4), (ms, n)
            assert torch.allclose(got[ms]["exp_avg"][n], want[ms]["exp_avg"][n], atol=1e-6, rtol=1e-3), (ms, n)


@pytest.mark.slow
def test_offloaded_zero3_state_restored_live_onto_new_workers(pool):
    """Colocated trainers (idle state in the host pool) with a ZeRO-3 actor at DP 2 on workers 0-1: its
    host slices are restored as a device-resident ZeRO-3 DP 4 group on workers 0-3 (each rank's
    quarter of weights and both moments from host memory: 4 x 12 B x N/4), and then offloaded back
    into the host pools of workers 0-1 at DP 2 (an Offload and a Restore of 12 B x N each); bit-exact, the planner's bytes per primitive, the
    accounted device bytes within the capacity, training on (``test_runtime_transit_zero.py``'s
    colocated case, at ZeRO-3)."""
    from test_runtime_transit_zero import COL_CFG, W_RM, _relaid, colocated

    col = _relaid(colocated(), **{"actor.train": {"zero": 3, "recompute": "full"}})
    dp4 = _relaid(col, **{"actor.train": {"dp": 4, "gpus": (0, 1, 2, 3), "offload": "none"}})
    chain = [("offloaded ZeRO-3 DP 2 -> resident DP 4 on new workers", dp4, {"restore": 12 * N_ACTOR}),
             # every rank copies its quarter to its host, the DP 2 host slices are cut from those
             # (the halves on workers 0-1 read the quarters of workers 2-3 over links)
             ("resident ZeRO-3 DP 4 -> offloaded DP 2", col, {"offload": 12 * N_ACTOR, "restore": 12 * N_ACTOR})]
    want = reference_states(pool, col, len(chain) + 1, W_RM, COL_CFG)
    d = RLDriver(SPEC, W_RM, col, TASK, 4, COL_CFG).start(pool)
    moved = {}
    try:
        d.step()
        for name, target, kinds in chain:
            before = states(d)
            est, rep = _live(d, target, W_RM)
            assert_equal(states(d), before, name)
            assert rep.bytes_moved == rep.predicted_bytes == est.bytes_moved > 0, (name, rep.summary())
            for r in rep.primitives:
                assert r.bytes_received == r.predicted_bytes, (name, r.pid, r.bytes_received, r.predicted_bytes)
            assert {r.kind: r.bytes_received for r in rep.primitives} == kinds, (name, rep.summary())
            moved[name] = (int(est.bytes_moved), rep.bytes_moved, {r.kind: r.bytes_received for r in rep.primitives})
            c, t = d.cands["actor.train"], target["actor.train"]
            assert (c.dp, c.zero, c.offload) == (t.dp, t.zero, t.offload)
            d.reset_measurements()
            d.step()
            for pw in d.measurements()["per_worker"]:
                assert pw["peak_bytes"] <= COL_CFG.device_capacity, (name, pw["worker"])
        got = states(d)
    finally:
        d.close()
    print("predicted vs moved bytes:", moved)
    for ms in TRAIN:  # the DP 4 step sums its gradients in another order: fp32 tolerance
        assert got[ms]["update_count"] == want[ms]["update_count"] == 2 * (len(chain) + 1)
        for n in want[ms]["params"]:
            assert torch.allclose(got[ms]["params"][n], want[ms]["params"][n], atol=1e-2 * CFG.actor_lr, rtol=1e-4)
            assert torch.allclose(got[ms]["exp_avg"][n], want[ms]["exp_avg"][n], atol=1e-6, rtol=1e-3), (ms, n)
