"""The runtime executor's transient memory in the planner's memory check, and the fused same-GPU
re-layout (nereus/transition/buffers.py, relayout.py), on the ``tiny`` model by hand.

tiny: h = 64, 4 layers, V = 64, untied; a layer has 36,992 parameters of which 128 are the two
replicated norms; the embedding and the lm_head 64·64 = 4,096 each, the final norm 64. actor.generate
holds 2 B/param.

* TP 2 rank t: 4·(36,864/2 + 128) + 2,048 (embedding rows) + 2,048 (head rows) + 64 = 78,400
  params = 156,800 B; the whole model (TP 1): 4·36,992 + 4,096 + 4,096 + 64 = 156,224 params =
  312,448 B.
* PP 2 stage 0: 2·36,992 + 4,096 = 78,080 params = 156,160 B; stage 1: 2·36,992 + 64 + 4,096 =
  78,144 params = 156,288 B.
* TP 2 → PP 2 on the same GPUs 0, 1: GPU 0 (TP rank 0) holds of stage 0 its half of layers 0-1 and
  of the embedding: 2·18,560 + 2,048 = 39,168 params = 78,336 B, so it lacks 77,824 B; GPU 1 holds
  of stage 1 2·18,560 + 64 + 2,048 = 39,232 params = 78,464 B and lacks 77,824 B too.
"""

from __future__ import annotations

import pytest

from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.buffers import sent_bound, with_buffers
from nereus.transition.cost import CostParams
from nereus.transition.emu import EMU, phi
from nereus.transition.estimate import estimate_transition
from nereus.transition.primitives import extend, merge, split

TINY = get_model("tiny")
JOB = JobSpec(TINY, ClusterSpec(get_gpu("h100"), 1, 4), WorkloadSpec())
HALF, FULL = 156_800, 312_448
STAGE0, STAGE1, LACK = 156_160, 156_288, 77_824


def emu(uid, tp, pp, gpus, ms="actor.generate"):
    e = phi(JOB, Candidate(ms, tp, pp, 1, gpus=tuple(gpus)))[0]
    return EMU(uid, ms, tp, pp, e.gpus, e.shard_bytes)


def test_shard_sizes_by_hand():
    a, b, c = emu("a", 2, 1, (0, 1)), emu("b", 1, 1, (0,)), emu("c", 1, 2, (0, 1))
    assert (a.bytes_on(0), a.bytes_on(1), b.bytes_on(0)) == (HALF, HALF, FULL)
    assert (c.bytes_on(0), c.bytes_on(1)) == (STAGE0, STAGE1)


def test_sent_bound():
    # 0 holds 10 B, 1 and 2 receive 4 and 7 B: at most 10 to each taker, 11 in all
    assert sent_bound({0: 10, 1: 0, 2: 0}, {1: 4, 2: 7}, [(0, 1, 2)]) == {0: 11}
    assert sent_bound({0: 3, 1: 3}, {0: 3, 1: 3}, [(0, 1)]) == {0: 3, 1: 3}  # a pair swapping halves
    assert sent_bound({0: 5}, {}, [(0, 1)]) == {}  # nobody receives
    with pytest.raises(ValueError, match="negative"):
        sent_bound({0: -1}, {}, [(0,)])


def test_extend_counts_the_send_and_receive_buffers():
    a, b = emu("a", 1, 2, (0, 1)), emu("b", 1, 2, (4, 5))
    x = extend(a, b)
    assert x.mem_hi == {4: STAGE0, 5: STAGE1}  # the paper's rule: the new shard
    assert with_buffers(x).mem_hi == {0: STAGE0, 1: STAGE1, 4: 2 * STAGE0, 5: 2 * STAGE1}
    assert with_buffers(x).mem_net == x.mem_net == {4: STAGE0, 5: STAGE1}


def test_split_counts_the_new_replica_beside_the_old_shard_and_both_buffers():
    s = split(emu("a", 2, 1, (0, 1)), (1, 1), TINY, 2)
    # each GPU sends the other what it lacks, FULL - HALF (the other half less the shared norms)
    assert s.sent == {0: FULL - HALF, 1: FULL - HALF}
    assert with_buffers(s).mem_hi == {0: FULL + 2 * (FULL - HALF), 1: FULL + 2 * (FULL - HALF)}
    assert FULL + 2 * (FULL - HALF) == 623_744


def test_same_gpu_relayout_is_one_merge_at_the_minimum_bytes():
    cur = Plan((Candidate("actor.generate", 2, 1, 1, gpus=(0, 1)),))
    tgt = Plan((Candidate("actor.generate", 1, 2, 1, gpus=(0, 1)),))
    est = estimate_transition(JOB, cur, tgt)
    assert [n.pid for n in est.dag.nodes] == ["merge:actor.generate*0"]
    assert est.bytes_moved == est.min_bytes == 2 * LACK == 155_648  # unfused: 2·(FULL - HALF) = 311,296
    m = est.dag.nodes[0]
    assert m.recv == {0: LACK, 1: LACK} and m.mem_hi == {0: LACK, 1: LACK}  # the paper's in-place rule
    # the executor: the new stage allocated beside the old half, the lacking part received, and
    # sent to the other GPU (each holds what the other lacks)
    ex = estimate_transition(JOB, cur, tgt, params=CostParams(transit_buffers=True)).dag.nodes[0]
    assert ex.mem_hi == {0: STAGE0 + 2 * LACK, 1: STAGE1 + 2 * LACK}
    assert ex.mem_net == {0: STAGE0 - HALF, 1: STAGE1 - HALF}


def test_merge_of_aligned_replicas_into_a_tp_layout_allocates_the_narrower_shard():
    t = emu("t", 2, 1, (4, 5))
    m = merge([emu("u0", 1, 1, (4,)), emu("u1", 1, 1, (5,))], t, TINY, 2)
    assert m.bytes_moved == 0 and m.mem_hi == {4: 0, 5: 0}
    assert with_buffers(m).mem_hi == {4: HALF, 5: HALF}  # another TP slicing: no tensor reused
    pp = emu("p", 1, 2, (4, 5))  # the same TP slicing: every tensor of the stage is reused
    assert with_buffers(merge([emu("u0", 1, 1, (4,)), emu("u1", 1, 1, (5,))], pp, TINY, 2)).mem_hi == {4: 0, 5: 0}


def test_copy_bytes_count_sends_and_every_new_shard_byte():
    """``cost.copy_bytes``: the busiest GPU's sends plus the new-shard bytes it writes. TP 1 -> 2
    growth (a remote-source Merge): GPU 0 sends GPU 1 its half (HALF) and re-slices its own half
    (HALF) locally, GPU 1 writes HALF: K = 2·HALF, twice the received bytes. The fused TP 2 -> PP 2:
    GPU 1 sends LACK and writes its new stage 1: K = LACK + STAGE1. Duration = setup + recv / B + α +
    K / C (cost.py)."""
    from nereus.transition.cost import copy_bytes, duration

    grow = estimate_transition(JOB, Plan((Candidate("actor.generate", 1, 1, 1, gpus=(0,)),)),
                               Plan((Candidate("actor.generate", 2, 1, 1, gpus=(0, 1)),))).dag.nodes
    m = next(n for n in grow if n.kind == "merge")
    assert m.recv == {1: HALF} and m.sent == {0: HALF} and m.alloc == {0: HALF, 1: HALF}
    assert copy_bytes(m) == 2 * HALF
    cur = Plan((Candidate("actor.generate", 2, 1, 1, gpus=(0, 1)),))
    tgt = Plan((Candidate("actor.generate", 1, 2, 1, gpus=(0, 1)),))
    f = estimate_transition(JOB, cur, tgt).dag.nodes[0]
    assert copy_bytes(f) == LACK + STAGE1 == 234_112
    bw, lat, _ = JOB.cluster.link_of((0, 1))
    p = CostParams(comm_setup_intra_s=0.1, copy_bandwidth=1e9)
    assert duration(f, JOB.cluster, p) == pytest.approx(0.1 + LACK / bw + lat + 234_112 / 1e9)
