"""Transfer plans of the live executor by hand (``runtime/transit/plans.py``) and the schedule check that
runs before anything moves (``transition/verify.py``). Pure: no Ray, no process group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.runtime.model.precision import WEIGHT_KINDS, train_kinds
from nereus.runtime.model.sharding import param_shapes
from nereus.runtime.run.device_model import runtime_job
from nereus.runtime.transit.index import Region
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, plan_moves, region
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import MODEL_PRESETS
from nereus.spec.workload import WorkloadSpec
from nereus.transition.estimate import estimate_transition
from nereus.transition.schedule import Schedule
from nereus.transition.verify import ScheduleError, verify_schedule

#: the kinds of an fp32 run's training unit (weights = master, two moments)
FP32_TRAIN = train_kinds("fp32")
TINY = MODEL_PRESETS["tiny"]  # h=64, F=128, L=4, 4 heads, 2 KV heads, d=16, V=64, untied
# TP-split parameters of tiny by hand: per layer q,o 2*64*64, k,v 2*32*64, MLP 3*64*128; embed + lm_head 2*64*64
SPLIT = 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) + 2 * 64 * 64  # 155,648
REP_PER_LAYER = 2 * 64  # two RMSNorm weights


def _bytes(plan) -> dict:
    """(sender, receiver) → elements in its buffer."""
    out = {}
    for pair, pieces in plan.pairs.items():
        n = 0
        for pc in pieces:
            full = param_shapes(TINY)[pc.name][0]
            numel = full[0] * (full[1] if len(full) > 1 else 1)
            n += numel if pc.dim is None else numel // full[pc.dim] * (pc.hi - pc.lo)
        out[pair] = n
    return out


def test_regions_by_hand():
    assert region(TINY, "model.layers.0.self_attn.q_proj.weight", 2, 1) == Region(0, 32, 64, 32)
    assert region(TINY, "model.layers.0.mlp.down_proj.weight", 4, 3) == Region(1, 96, 128, 32)
    # tp=4 > 2 KV heads: ranks 2 and 3 both hold KV head 1 (rows 16..32)
    assert region(TINY, "model.layers.0.self_attn.k_proj.weight", 4, 3) == Region(0, 16, 32, 16)
    assert region(TINY, "model.norm.weight", 4, 2) == Region(None)
    odd = replace(TINY, vocab_size=15)  # padded to 16 under tp=2: rank 1 holds rows 8..15 plus one zero row
    assert region(odd, "model.embed_tokens.weight", 2, 1) == Region(0, 8, 15, 8)


def test_split_tp2_to_tp1_is_an_allgather_v_of_the_missing_halves():
    src = UnitMeta("actor.train#0", "actor.train", 2, 1, (0, 1))
    units = tuple(UnitMeta(f"actor.train#0/s{i}", "actor.train", 1, 1, (g,)) for i, g in enumerate((0, 1)))
    move = MoveSpec("split:actor.train#0", "split", "actor.train", consumes=(src.uid,), produces=units,
                    sources=(src,), local=(src,), kinds=FP32_TRAIN)
    plan = plan_moves(TINY, move)
    # each worker receives the other's half of every split tensor, once per state kind; norms stay
    assert _bytes(plan) == {(0, 1): 3 * SPLIT // 2, (1, 0): 3 * SPLIT // 2}
    assert plan.comm_workers == (0, 1)


def test_extend_sends_each_shard_once_from_its_aligned_rank():
    src = UnitMeta("actor.generate#0", "actor.generate", 2, 2, (0, 1, 2, 3))
    dst = UnitMeta("actor.generate*1", "actor.generate", 2, 2, (7, 6, 5, 4))
    plan = plan_moves(TINY, MoveSpec("extend:x", "extend", "actor.generate", produces=(dst,), sources=(src,),
                                     kinds=WEIGHT_KINDS))
    assert sorted(plan.pairs) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # pipeline rank 0 holds layers 0-1 and the embedding; TP rank holds half of each split tensor
    per_rank0 = (2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) + 64 * 64) // 2 + 2 * REP_PER_LAYER
    assert _bytes(plan)[(0, 7)] == per_rank0


def test_merge_of_aligned_units_moves_nothing_and_misaligned_moves_only_the_missing_part():
    units = tuple(UnitMeta(f"u{i}", "actor.train", 1, 1, (g,)) for i, g in enumerate((0, 1)))
    tgt = UnitMeta("t", "actor.train", 1, 2, (0, 1))
    plan = plan_moves(TINY, MoveSpec("merge:t", "merge", "actor.train", consumes=("u0", "u1"), produces=(tgt,),
                                     sources=units, local=units, kinds=FP32_TRAIN))
    assert plan.pairs == {}  # each full copy already holds its pipeline stage
    tp2 = UnitMeta("t2", "actor.train", 2, 1, (0, 1))
    one = UnitMeta("u", "actor.train", 1, 2, (0, 1))
    plan = plan_moves(TINY, MoveSpec("merge:t2", "merge", "actor.train", consumes=("u",), produces=(tp2,),
                                     sources=(one,), local=(one,), kinds=WEIGHT_KINDS))
    # (pp 2) → (tp 2) on the same GPUs: worker 0 lacks layers 2-3's first TP half and the lm_head half
    got = _bytes(plan)
    layer = (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) // 2 + REP_PER_LAYER
    assert got[(1, 0)] == 2 * layer + 64 * 64 // 2 + 64
    assert got[(0, 1)] == 2 * layer + 64 * 64 // 2


W = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)


def _est(actor_from, actor_to):
    job = runtime_job(TINY, W, 4)

    def plan(actor):
        tp, pp, dp, g = actor
        return Plan(candidates=(Candidate("actor.generate", 1, 1, 1, gpus=(3,)),
                                Candidate("actor.infer", 1, 1, 1, gpus=(3,)),
                                Candidate("reference.infer", 1, 1, 1, gpus=(2,)),
                                Candidate("actor.train", tp, pp, dp, micro_batch=1, gpus=g)))
    return estimate_transition(job, plan(actor_from), plan(actor_to), frozenset(range(4)))


def test_verify_accepts_the_planners_schedule_and_refuses_broken_ones():
    est = _est((1, 1, 1, (0,)), (1, 1, 1, (1,)))  # move actor.train: Extend then Destroy
    assert est.feasible, est.reason
    order = verify_schedule(est.dag, est.schedule)
    assert order.index("extend:actor.train*0") < order.index("destroy:actor.train#0")
    s = est.schedule
    # the Destroy first: the only copy of training state would be gone (last-copy rule / DAG edge)
    start, end = dict(s.start), dict(s.end)
    start["destroy:actor.train#0"], end["destroy:actor.train#0"] = -2.0, -1.0
    with pytest.raises(ScheduleError, match="predecessor"):
        verify_schedule(est.dag, Schedule(start, end, s.makespan))
    no_edges = replace(est.dag, edges=())
    with pytest.raises(ScheduleError, match="last copy|does not exist"):
        verify_schedule(no_edges, Schedule(start, end, s.makespan))
    # a GPU too small for the copy the Extend lands there: memory bound
    tight = replace(est.dag, capacity={g: 1000 for g in est.dag.capacity})
    with pytest.raises(ScheduleError, match="memory bound"):
        verify_schedule(tight, s)
    # a schedule missing a primitive
    with pytest.raises(ScheduleError, match="different primitives"):
        verify_schedule(est.dag, Schedule({}, {}, 0.0))
