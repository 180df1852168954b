"""Destroy-only and extend-only alternatives, hand-computed."""

from nereus.controller.alternatives import destroy_only, extend_only, resize
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.plan import Candidate, Plan

CLUSTER = ClusterSpec(get_gpu("h100"), 2, 4)   # GPUs 0-3 on node 0, 4-7 on node 1


def test_resize_keeps_the_mini_batch():
    c = Candidate("actor.train", 2, 1, 2, micro_batch=4, grad_accum=8, gpus=(0, 1, 2, 3))  # 2*4*8 = 64
    r = resize(c, (0, 1, 2, 3, 4, 5), 64)           # dp 3 does not divide 64
    assert r is None
    r = resize(c, (0, 1), 64)                       # dp 1: b 4, a 16
    assert (r.dp, r.micro_batch, r.grad_accum) == (1, 4, 16)
    r = resize(c, tuple(range(8)), 64)              # dp 4: b 4, a 4
    assert (r.dp, r.micro_batch, r.grad_accum) == (4, 4, 4)
    c = Candidate("actor.train", 1, 1, 1, micro_batch=4, grad_accum=16, gpus=(0,))
    r = resize(c, tuple(range(8)), 24)              # dp 8: 3 per replica, b 4 -> 3, a 1
    assert (r.dp, r.micro_batch, r.grad_accum) == (8, 3, 1)


def test_destroy_only_drops_replicas_on_lost_gpus():
    p = Plan(candidates=(Candidate("actor.generate", 2, 1, 4, concurrency=64, gpus=tuple(range(8))),
                         Candidate("actor.train", 4, 1, 2, micro_batch=2, grad_accum=16, gpus=tuple(range(8)))))
    d = destroy_only(p, frozenset(range(7)), 64)    # GPU 7 lost
    assert d["actor.generate"].gpus == (0, 1, 2, 3, 4, 5) and d["actor.generate"].dp == 3
    assert d["actor.train"].gpus == (0, 1, 2, 3) and d["actor.train"].grad_accum == 32
    assert destroy_only(p, frozenset({0, 1, 2, 4, 5, 6}), 64) is None   # both train replicas hit


def test_extend_only_gives_free_gpus_to_the_slowest_model_stage_with_node_local_tp():
    p = Plan(candidates=(Candidate("actor.generate", 2, 1, 1, concurrency=64, gpus=(0, 1)),
                         Candidate("reference.infer", 1, 1, 1, micro_batch=4, gpus=(0,)),
                         Candidate("actor.infer", 1, 1, 1, micro_batch=4, gpus=(1,)),
                         Candidate("actor.train", 2, 1, 1, micro_batch=4, grad_accum=16, gpus=(0, 1))))
    times = {"actor.generate": 10.0, "reference.infer": 1.0, "actor.infer": 3.0, "actor.train": 5.0}
    e = extend_only(p, frozenset({0, 1, 2, 4, 5}), 64, CLUSTER, times)
    # generation: TP pairs must stay in a node: (4, 5) fits, (2, ?) does not
    assert e["actor.generate"].gpus == (0, 1, 4, 5)
    # inference, free 2, 4, 5: actor.infer (3 s) takes 2 (-> 1.5 s), still slowest takes 4 (-> 1 s);
    # at the 1 s tie the plan order picks reference.infer, which takes 5
    assert e["actor.infer"].gpus == (1, 2, 4) and e["reference.infer"].gpus == (0, 5)
    assert e["actor.train"].gpus == (0, 1, 4, 5) and e["actor.train"].grad_accum == 8
    assert extend_only(p, frozenset({0, 1}), 64, CLUSTER, times) is None
