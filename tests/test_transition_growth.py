"""Growth at the minimum bytes (``transition/growth.py``): an Extend whose copy only feeds a Merge is
fused into a remote-source Merge; the planner's bytes equal ``min_bytes`` and the hand count, and
the executor's plan of the fused primitive moves exactly those bytes and assembles the target
shards bit for bit (``transit/packing.py`` run in one process, no Ray)."""

from __future__ import annotations

from test_transit_packing import _check_exact, _run

from nereus.runtime.model.precision import train_kinds
from nereus.runtime.run.device_model import runtime_job
from nereus.runtime.transit.driver_side import move_specs
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import MODEL_PRESETS
from nereus.spec.workload import WorkloadSpec
from nereus.transition.estimate import estimate_transition
from nereus.transition.growth import fuse_growth
from nereus.transition.local_dag import build_local_dag
from nereus.transition.verify import verify_schedule

TINY = MODEL_PRESETS["tiny"]  # h=64, F=128, L=4, 4 heads, 2 KV heads, d=16, V=64, untied
W = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
JOB = runtime_job(TINY, W, 4)
B = 12  # fp32 training state per parameter: weights and two Adam moments, 4 B each
LAYER_SPLIT = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128  # q, o; k, v; gate, up, down
LAYER_NORMS = 2 * 64


def _plan(actor) -> Plan:
    tp, pp, dp, g = actor
    return Plan(candidates=(Candidate("actor.generate", 1, 1, 1, gpus=(3,)),
                            Candidate("actor.infer", 1, 1, 1, gpus=(3,)),
                            Candidate("reference.infer", 1, 1, 1, gpus=(2,)),
                            Candidate("actor.train", tp, pp, dp, micro_batch=1, gpus=g)))


def _est(a, b):
    est = estimate_transition(JOB, _plan(a), _plan(b), frozenset(range(4)))
    assert est.feasible, est.reason
    verify_schedule(est.dag, est.schedule)  # the executor's checks: order, last copy, memory, target
    return est


def test_pp_and_tp_growth_move_the_target_shard_of_the_new_gpu_only():
    # PP 1 -> 2 onto GPU 1: it receives pipeline stage 1 (layers 2-3, final norm, lm_head) and nothing else
    est = _est((1, 1, 1, (0,)), (1, 2, 1, (0, 1)))
    want = B * (2 * (LAYER_SPLIT + LAYER_NORMS) + 64 + 64 * 64)
    assert est.bytes_moved == est.min_bytes == want == 937_728
    (m,) = est.dag.nodes
    assert m.kind == "merge" and m.consumes == ("actor.train#0",) and m.recv == {1: want}
    assert m.mem_hi[1] == m.mem_net[1] == want and 1 in m.acquires
    # TP 1 -> 2: GPU 1 receives half of every split tensor and all of the norms (before: a whole replica)
    est = _est((1, 1, 1, (0,)), (2, 1, 1, (0, 1)))
    want = B * (4 * (LAYER_SPLIT // 2 + LAYER_NORMS) + 64 * 64 // 2 * 2 + 64)
    assert est.bytes_moved == est.min_bytes == want == 940_800


def test_a_merge_with_no_local_unit_reads_every_source():
    # two TP 1 replicas -> two TP 2 replicas: the second target replica is on new GPUs 2, 3
    est = _est((1, 1, 2, (0, 1)), (2, 1, 2, (0, 1, 2, 3)))
    per_gpu = B * (4 * (LAYER_SPLIT // 2 + LAYER_NORMS) + 64 * 64 + 64)
    assert est.bytes_moved == est.min_bytes == 2 * per_gpu
    fused = next(n for n in est.dag.nodes if n.reads)
    assert fused.consumes == () and set(fused.reads) == {"actor.train#0", "actor.train#1"}
    other = next(n for n in est.dag.nodes if n is not fused)
    assert (fused.pid, other.pid, "state") in est.dag.edges  # it reads what the other Merge consumes


def test_fusion_leaves_a_copy_that_is_an_extend_source_alone():
    # DP 1 -> 2: the copy is the target itself (no Merge): nothing to fuse
    job_initial = [e for e in _est((1, 1, 1, (0,)), (1, 1, 2, (0, 1))).dag.nodes]
    assert [n.kind for n in job_initial] == ["extend"]
    ld = build_local_dag("actor.train", (), (), TINY, 12)
    assert fuse_growth(ld) is ld


def test_executor_plan_of_fused_merges_moves_the_planned_bytes_bit_for_bit():
    # growth (growth.py), and same-GPU re-layouts fused into one Merge (relayout.py)
    for a, b in (((1, 1, 1, (0,)), (2, 1, 1, (0, 1))), ((1, 1, 1, (0,)), (1, 2, 1, (0, 1))),
                 ((1, 1, 2, (0, 1)), (2, 1, 2, (0, 1, 2, 3))), ((2, 1, 1, (0, 1)), (1, 2, 1, (0, 1))),
                 ((1, 2, 1, (0, 1)), (2, 1, 1, (1, 0)))):
        est = _est(a, b)
        specs = move_specs(est.dag, {"actor.train": True}, {})
        units = {}
        for pid in (n.pid for n in est.dag.nodes if n.model_stage == "actor.train"):
            move = specs[pid]
            move = type(move)(**{**move.__dict__, "kinds": train_kinds("fp32")})
            made, got, _held = _run(TINY, move)
            _check_exact(TINY, move, made)
            assert sum(got.values()) == est.dag.node(pid).bytes_moved, (a, b, pid, got)
            units.update(made)
        assert units  # every produced shard checked
        assert est.bytes_moved == est.min_bytes, (a, b)

