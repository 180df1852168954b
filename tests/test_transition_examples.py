"""The paper's worked transition examples (§5.1, §6.1 Fig. 6, Fig. 1(b)) with hand-computed numbers."""

from __future__ import annotations

import pytest

from nereus.spec.hardware import ClusterSpec, GPUSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.cost import CostParams
from nereus.transition.emu import aligned_gpus, model_of, phi, sub_units
from nereus.transition.estimate import estimate_transition

# Llama-3.1-8B by hand (h=4096, F=14336, a=32, g=8, d=128, V=128256, L=32):
LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # 218,112,000
EMB = 128256 * 4096  # 525,336,576
ACTOR_PARAMS = 32 * LAYER + 2 * EMB + 4096  # 8,030,261,248 (untied lm_head + final norm)
CRITIC_PARAMS = 32 * LAYER + EMB + 4096 + 4096 + 1  # value head [1, h] + bias
H100 = get_gpu("h100")


def job(nodes=4, gpu=H100):
    return JobSpec(get_model("llama-3.1-8b"), ClusterSpec(gpu, nodes, 8), WorkloadSpec())


def test_hand_counts_match_the_published_total():
    assert ACTOR_PARAMS == 8_030_261_248


def test_actor_tp_1_to_2_and_critic_dp_2_to_4_when_the_pool_grows_16_to_32():
    """Paper §5.1 example: actor gen (1,4,2) → (2,4,2), critic train (1,4,2) → (1,4,4)."""
    j = job()
    cur = Plan((Candidate("actor.generate", 1, 4, 2, gpus=tuple(range(8))),
                Candidate("critic.train", 1, 4, 2, gpus=tuple(range(8, 16)))))
    # placement keeps the existing GPUs and puts the new TP rank next to the old one (copy-free Merge)
    actor = (0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
    critic = tuple(range(8, 16)) + tuple(range(24, 32))
    tgt = Plan((Candidate("actor.generate", 2, 4, 2, gpus=actor),
                Candidate("critic.train", 1, 4, 4, gpus=critic)))
    est = estimate_transition(j, cur, tgt, pool=frozenset(range(32)))
    assert est.feasible, est.reason
    kinds = sorted((n.kind, n.model_stage) for n in est.dag.nodes)
    # the paper's Extend + Merge of the actor, fused (transition/growth.py): each new TP rank
    # receives its half from the old replica instead of a whole copy that the Merge then halves
    assert kinds == [("extend", "critic.train")] * 2 + [("merge", "actor.generate")] * 2
    assert est.dag.local[0].t_sub == (1, 4)
    # the new GPUs need only the TP=2 half of the actor (norms replicated), all of the critic copies
    layer2 = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) // 2 + 2 * 4096
    actor_half = 32 * layer2 + EMB // 2 + EMB // 2 + 4096
    assert est.bytes_moved == est.min_bytes == 2 * actor_half * 2 + 2 * CRITIC_PARAMS * 14
    # critic Extend node1 → node3: largest shard (rank 0: 8 layers + embedding) over the NIC
    shard0 = (8 * LAYER + EMB) * 14
    critic_ext = 0.2 + shard0 / 50e9 + 10e-6
    # actor: one Merge over nodes 0 and 2; its largest receive is the last rank's half (8 layers,
    # half the lm_head, the final norm), bf16
    actor_merge = 0.2 + (8 * layer2 + EMB // 2 + 4096) * 2 / 50e9 + 10e-6
    assert est.l_tran == pytest.approx(max(critic_ext, actor_merge), rel=1e-9)
    assert est.l_tran == pytest.approx(critic_ext, rel=1e-9)
    final = sorted(e.signature() for e in est.dag.target)
    assert final == sorted(e.signature() for c in tgt.candidates for e in phi(j, c))


def test_reward_inference_tp4_pp8_to_tp8_pp2_fig6():
    """Fig. 6: (4,8) → (8,2) through T_sub = (4,2). The paper splits into four (4,2) units, destroys
    two and merges two; here the Split materializes only the two kept units (the GPUs of the other
    two send their shards to their blocks and free them), so no Destroy and fewer bytes."""
    j = job()
    cur = Plan((Candidate("reward.infer", 4, 8, 1, gpus=tuple(range(32))),))
    e = phi(j, cur.candidates[0])[0]
    units = sub_units(e, (4, 2), model_of(j, "reward.infer"), 2)
    assert len(units) == 4
    tgt = Plan((Candidate("reward.infer", 8, 2, 1, gpus=aligned_gpus(units[:2], (8, 2))),))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    kinds = [n.kind for n in est.dag.nodes]
    assert sorted(kinds) == ["merge", "split"]
    split = next(n for n in est.dag.nodes if n.kind == "split")
    assert [u.uid for u in split.produces] == [units[0].uid, units[1].uid]
    merge = next(n for n in est.dag.nodes if n.kind == "merge")
    assert len(merge.consumes) == 2 and merge.bytes_moved == 0
    freed = {g for g, v in split.mem_net.items() if v < 0}
    assert len(freed) == 16 and not freed & set(tgt.candidates[0].gpus)
    assert all(split.mem_hi[g] == 0 for g in freed)
    # Per TP=4 rank: a layer holds (2·h·h + 2·h·1024 + 3·h·F)/4 + 2h parameters; the embedding V·h/4
    # sits on the first rank, the final norm and value head (h + h + 1) on the last.
    layer4 = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) // 4 + 2 * 4096
    # the kept units sit on old PP ranks 0, 1, 4, 5 (4 layers each; rank 0 has the embedding)
    old_kept = 4 * (16 * layer4 + EMB // 4)
    new = 2 * 4 * (32 * layer4 + EMB // 4 + 4096 + 4097)  # two (4, 2) units
    assert split.bytes_moved == (new - old_kept) * 2
    assert split.mem_hi[0] == (16 * layer4 + EMB // 4) * 2  # source buffer kept: peak adds new shard
    assert split.mem_net[0] == (12 * layer4) * 2
    # Split all-gathers inside blocks of four consecutive PP ranks: they span nodes (NIC)
    # the GPU at old rank 1 lacks 12 layers and the embedding (rank 0 already has the embedding)
    gain = (12 * layer4 + EMB // 4) * 2
    t_split = 0.2 + gain / 50e9 + 3 * 10e-6
    assert est.durations[split.pid] == pytest.approx(t_split, rel=1e-9)
    assert est.l_tran == pytest.approx(t_split + 0.2, rel=1e-9)  # then Merge (setup only)
    assert est.min_bytes <= est.bytes_moved


def test_full_pool_extend_waits_for_a_concurrent_destroy():
    """Fig. 1(b): the critic's Extend onto GPUs the actor trains on waits for the actor's Destroy."""
    j = job(nodes=2)
    cur = Plan((Candidate("actor.train", 1, 2, 4, gpus=tuple(range(8))),
                Candidate("critic.train", 1, 2, 4, gpus=tuple(range(8, 16)))))
    tgt = Plan((Candidate("actor.train", 1, 2, 3, gpus=tuple(range(6))),
                Candidate("critic.train", 1, 2, 5, gpus=tuple(range(8, 16)) + (6, 7))))
    est = estimate_transition(j, cur, tgt, pool=frozenset(range(16)))
    assert est.feasible, est.reason
    edges = {(a, b): k for a, b, k in est.dag.edges}
    assert edges[("destroy:actor.train#3", "extend:critic.train*4")] == "ownership"
    s = est.schedule
    assert s.start["extend:critic.train*4"] >= s.end["destroy:actor.train#3"]
    assert est.l_tran == pytest.approx(s.end["extend:critic.train*4"])


def test_memory_bound_extend_waits_for_a_destroy_of_another_stage():
    """Different stages may share GPUs, but memory makes the Extend wait for the Destroy."""
    small = GPUSpec(name="small", peak_flops=1e15, memory_bytes=40 * 2**30, hbm_bandwidth=3e12,
                    scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    j = job(nodes=1, gpu=small)
    # actor.generate holds 16 GB per replica, critic.train (1,8) holds ~13 GB per GPU
    cur = Plan((Candidate("actor.generate", 1, 1, 2, gpus=(0, 1)),
                Candidate("critic.train", 1, 8, 1, gpus=tuple(range(8)))))
    tgt = Plan((Candidate("actor.generate", 1, 1, 1, gpus=(0,)),
                Candidate("critic.train", 1, 8, 1, gpus=tuple(range(8)))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible and est.num_primitives == 1  # only the actor Destroy
    # the other way round: grow actor.generate onto GPU 1 needs the memory it has there
    est = estimate_transition(j, tgt, cur)
    assert est.feasible, est.reason
    tight = {1: 18 * 2**30}  # workspace on GPU 1 leaves no room for a 16 GB copy
    est = estimate_transition(j, tgt, cur, reserved_bytes=tight)
    assert not est.feasible
    assert "no Destroy can release" in est.reason and "extend:actor.generate*1" in est.reason


def test_resource_edge_release_before_acquire_on_a_shared_gpu():
    small = GPUSpec(name="small", peak_flops=1e15, memory_bytes=40 * 2**30, hbm_bandwidth=3e12,
                    scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    j = job(nodes=1, gpu=small)
    # critic.train (1,8) on 0-7 (~13 GB/GPU); actor.generate replica on GPU 0 (16 GB) moves to GPU 1,
    # and reward.infer (1,1,1) on GPU 1 (15 GB) moves to GPU 0: each acquisition needs the other's
    # GPU freed first -> one must be done by Destroy before the other's Extend.
    cur = Plan((Candidate("actor.generate", 1, 1, 2, gpus=(0, 2)),
                Candidate("reward.infer", 1, 1, 1, gpus=(1,)),
                Candidate("critic.train", 1, 8, 1, gpus=tuple(range(8)))))
    tgt = Plan((Candidate("actor.generate", 1, 1, 2, gpus=(1, 2)),
                Candidate("reward.infer", 1, 1, 1, gpus=(3,)),
                Candidate("critic.train", 1, 8, 1, gpus=tuple(range(8)))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    kinds = {(a, b): k for a, b, k in est.dag.edges}
    assert kinds.get(("destroy:reward.infer#0", "extend:actor.generate*0")) == "resource"


def test_split_that_does_not_fit_in_place_is_done_on_a_copy():
    """(2,2) → (1,4) through T_sub=(1,2) doubles the shard per GPU; the source GPUs also hold other
    model-stages, so the replica is copied to the free target GPUs and split there."""
    gpu = GPUSpec(name="g90", peak_flops=1e15, memory_bytes=90 * 2**30, hbm_bandwidth=3e12,
                  scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    j = job(nodes=1, gpu=gpu)
    cur = Plan((Candidate("actor.generate", 1, 1, 4, gpus=(0, 1, 2, 3)),
                Candidate("reward.infer", 1, 1, 4, gpus=(0, 1, 2, 3)),
                Candidate("critic.train", 2, 2, 1, gpus=(0, 1, 2, 3))))
    tgt = Plan((Candidate("actor.generate", 1, 1, 4, gpus=(0, 1, 2, 3)),
                Candidate("reward.infer", 1, 1, 4, gpus=(0, 1, 2, 3)),
                Candidate("critic.train", 1, 4, 1, gpus=(4, 5, 6, 7))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    pids = [n.pid for n in est.dag.nodes]
    assert "extend:critic.train#0>" in pids and "split:critic.train#0>" in pids
    assert "split:critic.train#0" not in pids  # never split where it does not fit
    s = est.schedule
    assert s.end["extend:critic.train#0>"] <= s.start["split:critic.train#0>"]
    assert s.end["extend:critic.train#0>"] <= s.start["destroy:critic.train#0"]


def test_pool_shrink_losing_every_reference_replica_reloads_it_from_storage():
    """Node 1 (GPUs 8-15) is reclaimed with both reference.infer replicas: frozen weights come back
    from storage (read once: 2 s setup + 16.06 GB at 2 GB/s), then one NVLink Extend; the actor and
    critic keep their GPUs. Losing every actor.train replica instead stays infeasible."""
    j = job(nodes=2)
    train = (Candidate("actor.train", 2, 1, 2, gpus=(0, 1, 2, 3)), Candidate("critic.train", 2, 1, 1, gpus=(4, 5)))
    cur = Plan(train + (Candidate("reference.infer", 1, 1, 2, gpus=(14, 15)),))
    tgt = Plan(train + (Candidate("reference.infer", 1, 1, 2, gpus=(6, 7)),))
    est = estimate_transition(j, cur, tgt, pool=frozenset(range(8)))
    assert est.feasible, est.reason
    assert [n.pid for n in est.dag.nodes] == ["load:reference.infer*0", "extend:reference.infer*1"]
    assert est.reloads == {"reference.infer": "storage"}
    ref_bytes = ACTOR_PARAMS * 2  # bf16 weights, 16,060,522,496 B
    load_s = 2.0 + ref_bytes / 2e9
    ext_s = 0.05 + ref_bytes / 450e9 + 5e-6
    assert est.durations["load:reference.infer*0"] == pytest.approx(load_s, rel=1e-12)
    assert est.l_tran == pytest.approx(load_s + ext_s, rel=1e-12)  # about 10.1 s
    assert est.bytes_moved == 2 * ref_bytes == est.min_bytes
    # the same shrink with every actor.train replica on node 1: unique state, restore from checkpoint
    cur = Plan((Candidate("actor.train", 2, 1, 2, gpus=(8, 9, 10, 11)), train[1],
                Candidate("reference.infer", 1, 1, 2, gpus=(6, 7))))
    tgt = Plan((Candidate("actor.train", 2, 1, 2, gpus=(0, 1, 2, 3)), train[1],
                Candidate("reference.infer", 1, 1, 2, gpus=(6, 7))))
    est = estimate_transition(j, cur, tgt, pool=frozenset(range(8)))
    assert not est.feasible and est.reason.startswith("actor.train: every replica lost")
    assert "checkpoint" in est.reason and est.dag is None


SMALL = GPUSpec(name="small", peak_flops=1e15, memory_bytes=40 * 2**30, hbm_bandwidth=3e12,
                scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)


def _swap(a: str, b: str, fixed: Candidate) -> tuple[Plan, Plan]:
    """Single-GPU replicas of ``a`` on GPU 0 and ``b`` on GPU 1 trade places; ``fixed`` stays."""
    def plan(ga, gb):
        return Plan((Candidate(a, 1, 1, 1, gpus=(ga,)), Candidate(b, 1, 1, 1, gpus=(gb,)), fixed))
    return plan(0, 1), plan(1, 0)


def test_swap_blocked_by_memory_drops_the_frozen_copy_and_reloads_it_from_storage():
    """actor.generate moves GPU 0 → 1 while reward.infer moves 1 → 0; critic.train (1,8) holds
    ~13 GB on every GPU of a 40 GiB device, so neither GPU fits both copies and each Extend waits
    for the other's Destroy (a circular wait on memory). The frozen reward model is dropped and
    read back from storage after the swap; the derived actor.generate (no actor.train in the plan
    to sync from) is moved. By hand: Destroy 0.01 s; Extend 0.05 s setup + 16.06 GB over NVLink
    (450 GB/s) + 5 µs; Destroy 0.01 s; Load 2 s setup + 15.01 GB at 2 GB/s."""
    j = job(nodes=1, gpu=SMALL)
    cur, tgt = _swap("actor.generate", "reward.infer", Candidate("critic.train", 1, 8, 1, gpus=tuple(range(8))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    assert [n.pid for n in est.dag.nodes] == ["destroy:reward.infer#0", "extend:actor.generate*0",
                                              "destroy:actor.generate#0", "load:reward.infer*0"]
    assert est.reloads == {"reward.infer": "storage"}
    assert "dropped to make room" in est.reason and "reward.infer (from storage)" in est.reason
    s = est.schedule
    assert s.start["extend:actor.generate*0"] >= s.end["destroy:reward.infer#0"]
    assert s.start["load:reward.infer*0"] >= s.end["destroy:actor.generate#0"]
    ext = 0.05 + ACTOR_PARAMS * 2 / 450e9 + 5e-6
    load = 2.0 + CRITIC_PARAMS * 2 / 2e9
    assert est.durations["load:reward.infer*0"] == pytest.approx(load, rel=1e-12)
    assert est.l_tran == pytest.approx(0.01 + ext + 0.01 + load, rel=1e-12)  # about 9.61 s


def test_swap_prefers_dropping_a_derived_copy_synced_from_its_train_model_stage():
    """The same swap between actor.infer (derived) and reference.infer (frozen) with actor.train
    (1,8) on every GPU: both could be dropped; the derived copy is (a weight sync, not a storage
    read), and its Load follows the reference's move. GPU 1 also holds a train shard (layers 4-7),
    so the sync copies that part locally and receives the rest: the transition ends with that Load
    after the reference's Destroy (0.01 + Extend + 0.01 + sync s).
    A training model-stage is never dropped: changing actor.train to (1,4) x2 in the same swap
    doubles its shard (29.6 GiB on GPU 0, plus the 15 GiB reference copy, over the 36 GiB usable),
    so the target does not fit even when the train state is staged through host memory."""
    j = job(nodes=1, gpu=SMALL)
    cur, tgt = _swap("actor.infer", "reference.infer", Candidate("actor.train", 1, 8, 1, gpus=tuple(range(8))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    assert est.reloads == {"actor.infer": "actor.train"}
    assert [n.pid for n in est.dag.nodes] == ["destroy:actor.infer#0", "extend:reference.infer*0",
                                              "destroy:reference.infer#0", "load:actor.infer*0"]
    s = est.schedule
    assert s.start["extend:reference.infer*0"] >= s.end["destroy:actor.infer#0"]
    assert s.start["load:actor.infer*0"] >= s.end["destroy:reference.infer#0"]
    ext = 0.05 + ACTOR_PARAMS * 2 / 450e9 + 5e-6
    # GPU 1 is pipeline rank 1 of 8: it holds layers 4-7 and copies them locally (read + write at
    # 3 TB/s); the rest of the bf16 weights arrive from GPU 2 over NVLink
    local = 2 * (4 * LAYER * 2) / 3e12
    sync = 0.05 + max(local, (ACTOR_PARAMS - 4 * LAYER) * 2 / 450e9 + 5e-6)
    lo = next(n for n in est.dag.nodes if n.kind == "load")
    assert lo.bytes_moved == (ACTOR_PARAMS - 4 * LAYER) * 2 and lo.pairs == ((2, 1, lo.bytes_moved),)
    assert est.durations["load:actor.infer*0"] == pytest.approx(sync, rel=1e-12)
    assert est.l_tran == pytest.approx(0.01 + ext + 0.01 + sync, rel=1e-12)
    resharded = Plan(tgt.candidates[:2] + (Candidate("actor.train", 1, 4, 2, gpus=tuple(range(8))),))
    est = estimate_transition(j, cur, resharded)
    assert not est.feasible and "staged actor.train through host memory" in est.reason


def test_ownership_cycle_between_concurrent_copies_shares_the_gpus_during_the_swap():
    """actor.infer and reference.infer run concurrently (same stage) and swap GPUs 0 and 1, so each
    Extend would wait for the other's Destroy by GPU ownership alone: a circular wait. Memory allows
    both copies on one GPU during the transition, so the planner lets the two share GPUs 0 and 1
    (``GlobalDAG.shared``) instead of dropping one and reloading it: each copy is extended once onto
    the other's GPU and its old copy destroyed after, no Load, and the bytes are the minimum (each
    copy's whole weights, 2 B/param: GPU 0 and 1 hold nothing of the other model-stage)."""
    j = job(nodes=1)
    cur = Plan((Candidate("actor.infer", 1, 1, 1, gpus=(0,)), Candidate("reference.infer", 1, 1, 1, gpus=(1,)),
                Candidate("actor.train", 1, 4, 2, gpus=tuple(range(8)))))
    tgt = Plan((Candidate("actor.infer", 1, 1, 1, gpus=(1,)), Candidate("reference.infer", 1, 1, 1, gpus=(0,)),
                Candidate("actor.train", 1, 4, 1, gpus=tuple(range(4)))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    assert est.dag.shared == {"actor.infer", "reference.infer"} and "shared GPUs" in est.reason
    pids = {n.pid for n in est.dag.nodes}
    assert {"extend:actor.infer*0", "extend:reference.infer*0"} <= pids and not any(p.startswith("load") for p in pids)
    weights = (32 * LAYER + 2 * EMB + 4096) * 2  # untied embedding and lm_head, final norm
    infer = [n for n in est.dag.nodes if n.kind == "extend"]
    assert sorted(n.bytes_moved for n in infer) == [weights, weights]
    assert est.bytes_moved == est.min_bytes == 2 * weights
    s = est.schedule  # both extends before either old copy goes: the swap needs no third GPU
    assert s.end["extend:actor.infer*0"] <= s.start["destroy:actor.infer#0"]
    assert s.end["extend:reference.infer*0"] <= s.start["destroy:reference.infer#0"]


def test_training_split_with_no_room_anywhere_is_staged_through_host_memory():
    """critic.train (2,2) → (1,4) on the same 4 GPUs of a 90 GiB device shared with actor.generate
    and reward.infer: through T_sub = (1,2) each GPU would hold half the model's state (56 GB), which
    fits neither in place nor on free GPUs (none). Fused into one Merge on the same GPUs
    (``relayout.py``) the runtime's executor allocates the new shard beside the old one
    (``CostParams.transit_buffers``): the 31.78 GB new shard does not fit in the 26.7 GB left
    either. Staged through host memory (Offload frees the
    old shards, Restore writes the new) each GPU never holds more than its target shard. By hand (14 B/param of train state; TP splits
    everything but the two norms per layer):
    old shard on GPU 0 = ((16·(LAYER − 8192) + EMB) / 2 + 16·8192) · 14 = 28,106,817,536 B,
    new shard on GPU 0 = (8·LAYER + EMB) · 14 = 31,783,256,064 B,
    L_tran = 0.5 s setup + 28.11 GB / 25 GB/s (to host) + 31.78 GB / 25 GB/s (back) ≈ 2.90 s."""
    gpu = GPUSpec(name="g90", peak_flops=1e15, memory_bytes=90 * 2**30, hbm_bandwidth=3e12,
                  scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    j = job(nodes=1, gpu=gpu)
    co = (Candidate("actor.generate", 1, 1, 4, gpus=(0, 1, 2, 3)), Candidate("reward.infer", 1, 1, 4, gpus=(0, 1, 2, 3)))
    cur = Plan(co + (Candidate("critic.train", 2, 2, 1, gpus=(0, 1, 2, 3)),))
    tgt = Plan(co + (Candidate("critic.train", 1, 4, 1, gpus=(0, 1, 2, 3)),))
    # the paper's in-place rule: the fused Merge needs only max(received, new - old) and fits
    inplace = estimate_transition(j, cur, tgt)
    assert [n.pid for n in inplace.dag.nodes] == ["merge:critic.train*0"]
    assert inplace.bytes_moved == inplace.min_bytes
    est = estimate_transition(j, cur, tgt, params=CostParams(transit_buffers=True))
    assert est.feasible, est.reason
    weights = (32 * LAYER + 2 * EMB + 4096) * 2  # actor.generate's and reward.infer's copies per GPU
    room = int(90 * 2**30 * 0.9) - 2 * weights - 28_106_817_536
    assert 26.6e9 < room < 31_783_256_064  # the new shard alone does not fit beside the old
    assert "staged through host memory" in est.reason and "critic.train" in est.reason
    assert [n.pid for n in est.dag.nodes] == ["offload:critic.train", "restore:critic.train"]
    off, back = est.dag.nodes
    assert ("offload:critic.train", "restore:critic.train", "state") in est.dag.edges
    old0 = ((16 * (LAYER - 8192) + EMB) // 2 + 16 * 8192) * 14
    new0 = (8 * LAYER + EMB) * 14
    assert (old0, new0) == (28_106_817_536, 31_783_256_064)
    assert off.mem_hi[0] == 0 and off.mem_net[0] == -old0 and back.mem_hi[0] == back.mem_net[0] == new0
    assert est.durations["offload:critic.train"] == pytest.approx(0.5 + old0 / 25e9, rel=1e-12)
    assert est.l_tran == pytest.approx(0.5 + old0 / 25e9 + new0 / 25e9, rel=1e-12)
    assert off.consumes == ("critic.train#0",) and back.consumes == ("critic.train@host",)
    assert [e.uid for e in back.produces] == ["critic.train*0"]


def test_training_model_stages_swapping_gpus_share_them_when_memory_allows():
    """actor.train and critic.train (both (1,4)) swap GPUs 0-3 and 4-7 of 80 GiB H100s: a circular
    wait of ownership with nothing to drop. Both shards fit on one GPU (usable 0.9·80 GiB =
    77.3 GB; the largest pair, critic's first stage (8·LAYER + EMB)·14 B = 31.78 GB beside actor's
    first stage 31.78 GB = 63.57 GB), so the two share the GPUs during the swap: each is extended
    once onto the other's GPUs (no host round trip) and destroyed after, moving the minimum."""
    j = job(nodes=1)
    cur = Plan((Candidate("actor.train", 1, 4, 1, gpus=(0, 1, 2, 3)), Candidate("critic.train", 1, 4, 1, gpus=(4, 5, 6, 7))))
    tgt = Plan((Candidate("actor.train", 1, 4, 1, gpus=(4, 5, 6, 7)), Candidate("critic.train", 1, 4, 1, gpus=(0, 1, 2, 3))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    assert "staged through host memory" not in est.reason
    assert est.dag.shared == {"actor.train", "critic.train"}
    assert sorted(n.pid for n in est.dag.nodes) == ["destroy:actor.train#0", "destroy:critic.train#0",
                                                    "extend:actor.train*0", "extend:critic.train*0"]
    every = sum(e.bytes_on(g) for e in est.dag.target for g in e.gpus)  # nothing is where it is needed
    assert est.bytes_moved == est.min_bytes == every
    peak = (8 * LAYER + EMB) * 14 * 2
    assert peak == 63_566_512_128 and peak <= est.dag.capacity[0]


def test_training_model_stages_swapping_gpus_stage_one_through_host_memory():
    """actor.train and critic.train (both (1,4)) swap GPUs 0-3 and 4-7 of 60 GiB GPUs. They run
    concurrently, so each Extend waits for the other's Destroy, and each Destroy of a last copy
    waits for its own Extend: a circular wait with nothing to drop (training state). Sharing the
    GPUs does not fit (usable 0.9·60 GiB = 57.98 GB < the 63.57 GB of two first-stage shards), so
    the smaller one, critic.train (no untied lm_head), is offloaded to host memory, freeing 4-7;
    actor.train moves; critic.train is restored on 0-3. By hand (14 B/param): critic's largest
    shard (8·LAYER + EMB)·14 B, actor's (8·LAYER + EMB + 4096)·14 B (last stage: lm_head + final
    norm); L_tran = (0.5 + critic/25e9) + (0.05 + actor/450e9 + 5 µs) + 0.01 + critic/25e9 ≈ 2.97 s."""
    gpu = GPUSpec(name="g60", peak_flops=H100.peak_flops, memory_bytes=60 * 2**30, hbm_bandwidth=H100.hbm_bandwidth,
                  scaleup_bandwidth=H100.scaleup_bandwidth, scaleout_bandwidth=H100.scaleout_bandwidth)
    j = job(nodes=1, gpu=gpu)
    cur = Plan((Candidate("actor.train", 1, 4, 1, gpus=(0, 1, 2, 3)), Candidate("critic.train", 1, 4, 1, gpus=(4, 5, 6, 7))))
    tgt = Plan((Candidate("actor.train", 1, 4, 1, gpus=(4, 5, 6, 7)), Candidate("critic.train", 1, 4, 1, gpus=(0, 1, 2, 3))))
    est = estimate_transition(j, cur, tgt)
    assert est.feasible, est.reason
    assert "staged through host memory" in est.reason and "critic.train" in est.reason
    assert sorted(n.pid for n in est.dag.nodes) == ["destroy:actor.train#0", "extend:actor.train*0",
                                                    "offload:critic.train", "restore:critic.train"]
    edges = {(a, b): k for a, b, k in est.dag.edges}
    # the two share GPUs after the circular wait (GlobalDAG.shared): memory orders them
    assert edges[("offload:critic.train", "extend:actor.train*0")] == "resource"
    assert edges[("destroy:actor.train#0", "restore:critic.train")] == "resource"
    critic = (8 * LAYER + EMB) * 14
    actor = (8 * LAYER + EMB + 4096) * 14
    want = (0.5 + critic / 25e9) + (0.05 + actor / 450e9 + 5e-6) + 0.01 + critic / 25e9
    assert est.l_tran == pytest.approx(want, rel=1e-12)
