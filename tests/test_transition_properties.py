"""Property tests over random plan pairs on random pools (DESIGN.md §4.6 invariants).

Every execution the global DAG allows, sequential or concurrent, must keep a full copy of every
model-stage's state (for frozen weights storage is that copy, for derived weight copies a live EMU of
the model's ``*.train``; a ``*.train`` needs one of its own EMUs), fit every GPU's memory, never let two concurrent model-stages own one GPU, and
end in exactly the target EMUs. Infeasible targets are reported, never scheduled.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.transition.cost import CostParams
from nereus.transition.emu import stage_of
from nereus.transition.estimate import estimate_transition
from nereus.transition.instances import random_instance
from nereus.transition.primitives import STORAGE


def _simulate(dag, rng: random.Random) -> None:
    """Run the DAG with a random interleaving of starts and ends; assert the invariants throughout."""
    nodes = {n.pid: n for n in dag.nodes}
    preds = dag.preds()
    alive = {e.uid: e for e in dag.initial}
    used = Counter()
    for e in dag.initial:
        for g in e.gpus:
            used[g] += e.bytes_on(g)
    model_stages = {e.model_stage for e in dag.initial} | {e.model_stage for e in dag.target}
    reloads = {n.model_stage: n.source for n in dag.nodes if n.kind == "load"}
    for ms in reloads:
        assert not ms.endswith(".train"), f"{ms}: training state is never reloaded"

    def has_copy(ms: str) -> bool:
        if any(e.model_stage == ms for e in alive.values()):
            return True
        if ms.endswith(".train") or ms not in reloads:
            return False
        if reloads[ms] == STORAGE:
            return True  # frozen weights: the model files the job started from
        return any(e.model_stage == ms.partition(".")[0] + ".train" for e in alive.values())
    pending, running, ended = set(nodes), set(), set()

    def owners(g):
        own = {e.model_stage for e in alive.values() if g in e.gpus and not e.host}  # host copies own no GPU
        own |= {nodes[p].model_stage for p in running if g in nodes[p].acquires}
        return own

    while pending or running:
        ready = sorted(p for p in pending if preds[p] <= ended)
        if ready and (not running or rng.random() < 0.6):
            p = rng.choice(ready)
            n = nodes[p]
            for uid in n.reads + n.consumes:
                assert uid in alive, f"{p} starts without {uid}"
            pending.remove(p)
            running.add(p)
            for g, h in n.mem_hi.items():
                used[g] += h
        else:
            p = rng.choice(sorted(running))
            n = nodes[p]
            running.remove(p)
            ended.add(p)
            for uid in n.consumes:
                del alive[uid]
            for e in n.produces:
                alive[e.uid] = e
            for g in set(n.mem_hi) | set(n.mem_net):
                used[g] += n.mem_net.get(g, 0) - n.mem_hi.get(g, 0)
        for g, b in used.items():
            assert b <= dag.capacity[g], f"GPU {g} holds {b} B > {dag.capacity[g]} B"
        for ms in model_stages:
            assert has_copy(ms), f"{ms} has no full copy left"
        for g in dag.capacity:
            # model-stages the planner let share GPUs during a swap (GlobalDAG.shared) count as one
            own = owners(g)
            by_stage = Counter(stage_of(ms) for ms in own - dag.shared)
            by_stage.update({stage_of(ms) for ms in own & dag.shared})
            assert max(by_stage.values(), default=0) <= 1, f"GPU {g} owned by concurrent {owners(g)}"
    assert not pending, "the DAG deadlocks"
    got = sorted(e.signature() for e in alive.values())
    assert got == sorted(e.signature() for e in dag.target)


def _check_schedule(est) -> None:
    dag, s = est.dag, est.schedule
    for a, b, _ in dag.edges:
        assert s.end[a] <= s.start[b] + 1e-9
    assert math.isclose(est.l_tran, max(s.end.values(), default=0.0))
    assert est.l_tran >= est.critical_path_s - 1e-9
    assert est.bytes_moved >= est.min_bytes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_transitions_are_safe_in_every_order(seed):
    rng = random.Random(seed)
    inst = random_instance(rng, planner_like=rng.random() < 0.3)
    if inst is None:
        return
    reserved = None
    if rng.random() < 0.3:  # workspace kept during the transition tightens memory
        reserved = {g: rng.uniform(0, 16 * 2**30) for g in range(inst.job.cluster.num_gpus)}
    # the runtime executor's buffers in the memory check (CostParams.transit_buffers) half of the time
    params = CostParams(transit_buffers=rng.random() < 0.5)
    est = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool, reserved_bytes=reserved,
                              params=params)
    if not est.feasible:
        assert est.dag is None and est.schedule is None and math.isinf(est.l_tran) and est.reason
        return
    g = nx.DiGraph()
    g.add_nodes_from(n.pid for n in est.dag.nodes)
    g.add_edges_from((a, b) for a, b, _ in est.dag.edges)
    assert nx.is_directed_acyclic_graph(g)
    _check_schedule(est)
    for k in range(3):
        _simulate(est.dag, random.Random(seed * 7 + k))


def test_enough_random_instances_are_feasible_and_some_are_not():
    rng = random.Random(1)
    res = []
    for _ in range(150):
        inst = random_instance(rng)
        if inst is not None:
            res.append(estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool).feasible)
    assert 0.3 < sum(res) / len(res) < 1.0


def test_random_losses_of_every_replica_reload_or_stay_infeasible():
    """Pools that take every replica of some model-stage: frozen and derived ones are reloaded and
    the result is safe in every order; a lost ``*.train`` is always infeasible."""
    rng = random.Random(5)
    reloaded = lost_train = 0
    for _ in range(400):
        inst = random_instance(rng, num_nodes=2, max_dp=2, planner_like=True)
        if inst is None:
            continue
        lost = {c.model_stage for c in inst.current.candidates
                if not any(set(c.replica_gpus(d)) <= inst.pool for d in range(c.dp))}
        if not lost:
            continue
        est = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool)
        if any(ms.endswith(".train") for ms in lost):
            lost_train += 1
            assert not est.feasible and "checkpoint" in est.reason
            continue
        if est.feasible:
            assert set(est.reloads) == lost
            reloaded += 1
            _check_schedule(est)
            for k in range(3):
                _simulate(est.dag, random.Random(k))
    assert reloaded >= 5 and lost_train >= 5
