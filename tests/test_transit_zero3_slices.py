"""ZeRO-2/3 slices in live transitions, run in one process (``transit/flat.py``, ``transit/plans.py``,
``transit/packing.py``): the transition planner's DAG for a ZeRO-3 (or ZeRO-2) change of the tiny
actor is executed primitive by primitive on in-process units (every worker's send buffers built,
handed to their receivers as the wire would, assembled), and every target slot is compared bit for
bit with the slices a ``worker/zero3.py`` engine of the target layout holds (the reference below
cuts them from the full tensors by that module's rule: units ``embed``, ``layer<i>``, ``head``, each
flattened, zero-padded to ``z·k_u``, rank ``r`` holding ``[r·k_u, (r+1)·k_u)``); the bytes each
primitive received equal the planner's ``bytes_moved`` of it and the figure derived by hand. Pure:
no Ray, no process group (the multi-process runs are ``tests/test_runtime_transit_zero3.py``)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nereus.runtime.model.precision import train_kinds
from nereus.runtime.model.sharding import init_full_params, names_of_stage, param_shapes, shard
from nereus.runtime.transit.driver_side import move_specs
from nereus.runtime.transit.flat import FLAT, flat_numel, spans, zero_units
from nereus.runtime.transit.index import shapes, stage_names, stage_regions
from nereus.runtime.transit.packing import COUNTERS, HEADER_BYTES, assemble, pack, recv_sizes
from nereus.runtime.transit.plans import UnitMeta, kind_dtype, kinds_for, plan_moves
from nereus.runtime.transit.sharded import live_unsupported
from nereus.runtime.transit.worker_side import Unit
from nereus.runtime.worker.zero3 import unit_names
from nereus.spec.plan import Plan
from nereus.transition.estimate import estimate_transition
from nereus.transition.verify import verify_schedule

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_transit_zero import SPEC, _job, _relaid, plan  # noqa: E402

KINDS = train_kinds("bf16")  # every kind a unit can hold (an fp32 run has no separate master)
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
N = flat_numel(SPEC, 1, 1, 0, 0)
FULL = init_full_params(SPEC, 7)


def _value(name: str, kind: str) -> torch.Tensor:
    """A distinct full tensor per (parameter, state kind)."""
    return FULL[name] * (1 + KINDS.index(kind))


def _shards(meta: UnitMeta, worker: int, kind: str, dtype=torch.float32) -> dict[str, torch.Tensor]:
    p, t = meta.position(worker)
    return {n: shard(_value(n, kind), param_shapes(SPEC)[n][1], SPEC, meta.tp, t).to(kind_dtype(kind, dtype))
            for n in names_of_stage(SPEC, meta.pp, p)}


def _reference(meta: UnitMeta, worker: int, kind: str, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """What an engine of ``meta``'s layout holds of ``kind`` on ``worker``: per-name shards, a ZeRO-1
    ``{"flat": slice}`` (``worker/zero.py``) or ZeRO-2/3 ``{unit: slice}`` (``worker/zero3.py``)."""
    per_name = _shards(meta, worker, kind, dtype)
    sliced = meta.z > 1 and (kind != "params" or meta.zero == 3)
    if not sliced:
        return per_name
    z, r = meta.z, meta.rank(worker)
    groups = [(FLAT, list(per_name))] if meta.zero == 1 else unit_names(list(per_name))
    out = {}
    for key, names in groups:
        flat = torch.cat([per_name[n].reshape(-1) for n in names])
        k = -(-flat.numel() // z)
        flat = torch.cat([flat, flat.new_zeros(z * k - flat.numel())])
        out[key] = flat[r * k:(r + 1) * k].clone()
    return out


def _execute(cur: Plan, target: Plan, precision: str = "fp32"):
    """Plan the transition of the actor's state, run it on in-process units: (estimate, units by
    worker, bytes received per primitive)."""
    est = estimate_transition(_job(), cur, target, frozenset(range(4)))
    assert est.feasible, est.reason
    assert live_unsupported(est.dag, cur, target) is None
    dag, dt = est.dag, DTYPE[precision]
    units: dict[int, dict[str, Unit]] = {w: {} for w in range(4)}
    for e in dag.initial:
        if e.model_stage != "actor.train":
            continue
        meta = UnitMeta.of(e)
        for w in meta.gpus:
            units[w][meta.uid] = Unit(meta, {k: _reference(meta, w, k, dt) for k in train_kinds(precision)},
                                      {c: 10 * i + 1 for i, c in enumerate(COUNTERS)})
    specs = move_specs(dag, {"actor.train": True}, {})
    got = {}
    for pid in verify_schedule(dag, est.schedule):
        move = replace(specs[pid], kinds=kinds_for(specs[pid].kinds, precision))
        assert move.model_stage == "actor.train", move
        if move.kind == "destroy":
            for w in move.workers:
                for uid in move.consumes:
                    units[w].pop(uid, None)
            got[pid] = 0
            continue
        if move.kind == "offload":  # as Transit._offload: the host copy (bytes: what it copies)
            staged, got[pid] = move.produces[0], 0
            for w in move.workers:
                for uid in move.consumes:
                    u = units[w].pop(uid)
                    units[w][staged.uid] = Unit(staged, u.tensors, u.counters)
                    got[pid] += u.nbytes
            continue
        sent = {w: pack(SPEC, plan_moves(SPEC, move, w), w, units[w].__getitem__, dt, "cpu")
                for w in move.workers}
        made, got[pid] = {}, 0
        for w in move.workers:
            pl = plan_moves(SPEC, move, w)
            recv = {}
            for s, n in recv_sizes(SPEC, pl, w, dt).items():
                buf, payload = sent[s][w]
                assert payload == n and buf.numel() == HEADER_BYTES + n
                recv[s] = (buf[HEADER_BYTES:], dict(zip(COUNTERS, buf[:HEADER_BYTES].view(torch.int64).tolist())))
                got[pid] += n
            made[w] = assemble(SPEC, pl, move, w, recv, units[w].__getitem__, dt, "cpu")
        for w in move.workers:
            for uid in move.consumes:
                units[w].pop(uid, None)
            for uid, (tensors, counters) in made[w].items():
                units[w][uid] = Unit(next(m for m in move.produces if m.uid == uid), tensors, counters)
        if move.kind == "restore":  # as Transit.run: every produced byte came from host memory
            got[pid] = sum(units[w][m.uid].nbytes for m in move.produces for w in m.gpus)
    return est, units, got


def _check_target(est, units, precision: str = "fp32") -> None:
    """Every worker holds one unit per target EMU that includes it, of its layout and GPUs (how
    ``Transit.take`` finds it), equal to the target engine's reference."""
    want = [UnitMeta.of(e) for e in est.dag.target if e.model_stage == "actor.train"]
    for w, held in units.items():
        assert sorted((u.meta.tp, u.meta.pp, u.meta.gpus, u.meta.z) for u in held.values()) == sorted(
            (m.tp, m.pp, m.gpus, m.z) for m in want if w in m.gpus), (w, sorted(held))
        for uid, u in held.items():
            assert u.counters == {c: 10 * i + 1 for i, c in enumerate(COUNTERS)}
            for k in train_kinds(precision):
                ref = _reference(u.meta, w, k, DTYPE[precision])
                assert sorted(u.tensors[k], key=str) == sorted(ref, key=str), (uid, w, k)
                for key, x in ref.items():
                    assert torch.equal(u.tensors[k][key], x), (uid, w, k, key)


def z3(zero: int = 3, **changes) -> Plan:
    """``plan`` with the actor at ZeRO ``zero`` (full recompute for ZeRO-3, as ``--zero 3`` sets)."""
    p = plan(zero=zero, **changes)
    return Plan(candidates=tuple(replace(c, recompute="full") if c.zero == 3 else c for c in p.candidates))


DP4 = {"actor_train": (1, 1, 4, (0, 1, 2, 3))}
TP2 = {"actor_train": (2, 1, 2, (0, 1, 2, 3))}
PP2 = {"actor_train": (1, 2, 2, (0, 1, 2, 3))}
#: the tiny model's norm weights (2 per layer and the final one, hidden 64): replicated on every TP rank
R = (2 * SPEC.num_layers + 1) * SPEC.hidden_size
#: (name, current, target, bytes every primitive together must receive, by hand: fp32 weights and two
#: fp32 moments, 12 B per element; every unit of the tiny shard divides by 4, so a rank's slice of
#: each unit is exactly N_u/z)
CASES = [
    # ranks 0, 1 on workers 0, 1 become ranks 0, 2 of 4 (transition/group_ranks.py) and keep their
    # quarter of every unit; the new ranks on workers 2 and 3 receive their quarter of all three kinds
    ("ZeRO-3 DP 2->4", z3(), z3(**DP4), 2 * 12 * N // 4),
    # onto workers 0 and 1 (ranks 0, 1 of 4 there): rank 0 lacks rank 1's quarter, rank 1 the quarters
    # of ranks 2 and 3 (its own quarter is not in its new half)
    ("ZeRO-3 DP 4->2", z3(**DP4), z3(), 3 * 12 * N // 4),
    # each replica all-gathers the other half of every unit, all three kinds
    ("ZeRO-3 -> plain DP", z3(), z3(zero=0), 2 * 12 * N // 2),
    # the replica on worker 0 keeps its half, worker 1 receives the other half
    ("plain DP 1 -> ZeRO-3 DP 2", z3(zero=0, actor_train=(1, 1, 1, (0,))), z3(), 12 * N // 2),
    # ZeRO-2 -> ZeRO-3: the slices of the moments coincide (same units); the weights are cut locally
    ("ZeRO-2 -> ZeRO-3", z3(zero=2), z3(), 0),
    # ZeRO-3 -> ZeRO-2: each rank all-gathers the other half of the weights
    ("ZeRO-3 -> ZeRO-2", z3(), z3(zero=2), 2 * 4 * N // 2),
    # ZeRO-1 slices across TP/PP changes (transit/regroup.py). TP 1 -> 2 at DP 2: the group splits into
    # replicas (each gathers the other half of both moments: 2 x 8 B x N/2), two replicas are copied
    # whole to workers 2, 3 (2 x 12 B x N), and the TP-2 group is cut from them locally (0 B)
    ("ZeRO-1 TP 1 -> 2", z3(zero=1), z3(zero=1, **TP2), 2 * 8 * N // 2 + 2 * 12 * N),
    # TP 2 -> 1: each TP-1 replica on worker 0 / 1 gathers what its TP-2 rank lacks: the other TP half of
    # the weights and 3/4 of both moments, less the R norm weights both TP halves hold (8N - 4R bytes)
    ("ZeRO-1 TP 2 -> 1", z3(zero=1, **TP2), z3(zero=1), 2 * (8 * N - 4 * R)),
    # PP 1 -> 2: the same split, copies and local cut as TP 1 -> 2
    ("ZeRO-1 PP 1 -> 2", z3(zero=1), z3(zero=1, **PP2), 2 * 8 * N // 2 + 2 * 12 * N),
    ("ZeRO-1 PP 2 -> 1", z3(zero=1, **PP2), z3(zero=1), None),
    # ZeRO-3 TP 1 -> 2: as ZeRO-1's, the weights gathered with the moments (2 x 12 B x N/2 + 2 x 12 B x N)
    ("ZeRO-3 TP 1 -> 2", z3(), z3(**TP2), 2 * 12 * N // 2 + 2 * 12 * N),
    # ZeRO-3 TP 2 -> 1: each TP-1 replica holds its rank's half of one TP half of all three kinds,
    # (N + R)/4 elements, and gathers the rest, 12 B x (N - (N + R)/4); then the group is cut locally
    ("ZeRO-3 TP 2 -> 1", z3(**TP2), z3(), 2 * (9 * N - 3 * R)),
    ("ZeRO-3 PP 2 -> plain DP 2 PP 1", z3(**PP2), z3(zero=0), None),
    # targets finer than the ZeRO source (transit/regroup.py: rows, or one range per row of columns)
    ("ZeRO-1 DP 2 -> plain TP 2 DP 2", z3(zero=1), z3(zero=0, **TP2), None),
    ("ZeRO-3 DP 2 -> plain TP 2 DP 2", z3(), z3(zero=0, **TP2), None),
    ("ZeRO-3 DP 2 -> plain PP 2 DP 2", z3(), z3(zero=0, **PP2), None),
    # the README's elastic scenario at step 10: the group is offloaded (2 ranks x (4 + 8/2) B x N) and
    # its host slices restored as TP 2 replicas idle in host memory (4 workers x 12 B x (N + R)/2)
    ("ZeRO-1 DP 2 -> TP 2 DP 2 offloaded", z3(zero=1), _relaid(z3(zero=0, **TP2), **{"actor.train": {"offload": "host"}}),
     2 * 8 * N + 4 * 12 * (N + R) // 2),
    # PP 2 slices restored into TP 2 host replicas: every target shard gathers from both PP positions
    ("ZeRO-1 PP 2 -> TP 2 DP 2 offloaded", z3(zero=1, **PP2), _relaid(z3(zero=0, **TP2), **{"actor.train": {"offload": "host"}}),
     None),
    ("ZeRO-3 PP 2 -> TP 2 DP 2 offloaded", z3(**PP2), _relaid(z3(zero=0, **TP2), **{"actor.train": {"offload": "host"}}),
     None),
]


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_transit_units_are_the_engines_units(tp, pp):
    """``flat.zero_units`` groups a shard as ``worker/zero3.py: unit_names`` does (names and sizes)."""
    tied = replace(SPEC, tie_word_embeddings=True)
    for spec in (SPEC, tied, SPEC.value_head()):
        for p in range(pp):
            for t in range(tp):
                numel = {n: r.length * (torch.Size(shapes(spec)[n][0]).numel() // shapes(spec)[n][0][r.dim])
                         if r.dim is not None else torch.Size(shapes(spec)[n][0]).numel()
                         for n, r in stage_regions(spec, tp, pp, p, t).items()}
                want = [(u, sum(numel[n] for n in ns)) for u, ns in unit_names(list(stage_names(spec, pp, p)))]
                assert [(u, n) for u, _o, n in zero_units(spec, tp, pp, p, t)] == want, (spec.name, tp, pp, p, t)


def test_units_of_the_tiny_shard_divide_by_four_and_tile_the_flat_vector():
    units = zero_units(SPEC, 1, 1, 0, 0)
    assert [u for u, _o, _n in units] == [u for u, _ in unit_names(list(stage_names(SPEC, 1, 0)))]
    assert all(n % 4 == 0 for _u, _o, n in units)
    assert [o for _u, o, _n in units] == [sum(n for _u, _o, n in units[:i]) for i in range(len(units))]
    assert sum(n for _u, _o, n in units) == N == sum(
        torch.Size(s).numel() for s, _r in shapes(SPEC).values())  # no vocab padding at tp 1


@pytest.mark.parametrize("name, cur, target, moved", CASES, ids=[c[0] for c in CASES])
def test_zero3_transition_moves_the_planned_bytes_and_yields_the_target_slices(name, cur, target, moved):
    est, units, got = _execute(cur, target)
    _check_target(est, units)
    for p in est.dag.nodes:
        assert got[p.pid] == p.bytes_moved, (name, p.pid, got[p.pid], p.bytes_moved)
    assert sum(got.values()) == est.bytes_moved, (name, sum(got.values()), est.bytes_moved)
    if moved is not None:
        assert est.bytes_moved == moved, (name, est.bytes_moved, moved)


def test_a_zero3_rank_holds_one_span_per_unit():
    """Rank 1 of 2 holds the second half of every unit (offsets by hand from the unit sizes)."""
    meta = UnitMeta("a#0", "actor.train", 1, 1, (0, 1), z=2, zero=3)
    got = spans(SPEC, meta, 1, "exp_avg")
    units = zero_units(SPEC, 1, 1, 0, 0)
    assert [(s.lo, s.hi, s.key, s.off) for s in got] == [(o + n // 2, o + n, u, 0) for u, o, n in units]
    assert spans(SPEC, replace(meta, zero=2), 1, "params") == ((0, N, None, 0),)  # ZeRO-2 weights whole


@pytest.mark.parametrize("name", ["ZeRO-3 DP 2->4", "ZeRO-3 DP 4->2", "ZeRO-3 -> plain DP", "ZeRO-3 TP 2 -> 1",
                                  "ZeRO-1 TP 1 -> 2"])
def test_bf16_slices_move_bit_exact(name):
    """A bf16 run: ZeRO-3 weights travel as bf16 slices, the fp32 master as a fourth sliced kind."""
    _, cur, target, _ = next(c for c in CASES if c[0] == name)
    est, units, _got = _execute(cur, target, "bf16")
    _check_target(est, units, "bf16")
