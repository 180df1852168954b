"""Random transition instances (plan pairs on random pools) for property tests and the benchmark.

Plans follow the planner's invariants: power-of-two TP (inside a node) and PP, model-stages of one
stage on disjoint GPUs, GPU sets in the plan convention. Placements mix the planner's habits (keep
the current GPUs, contiguous blocks) with arbitrary ones, so both easy and infeasible targets occur.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from nereus.spec.hardware import ClusterSpec, GPUSpec
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.transition.emu import phi, stage_of

__all__ = ["Instance", "random_instance", "MODEL_STAGES"]

MODEL_STAGES = ("actor.generate", "reference.infer", "reward.infer", "critic.infer", "actor.train",
                "critic.train")


@dataclass(frozen=True)
class Instance:
    """One transition problem: a job, two placed plans and the pool."""

    job: JobSpec
    current: Plan
    target: Plan
    pool: frozenset[int]


def _place(rng: random.Random, free: list[int], n: int, keep: tuple[int, ...] = (),
           contiguous: float = 0.6) -> tuple[int, ...] | None:
    if n > len(free):
        return None
    kept = [g for g in keep if g in free][:n]
    rest = [g for g in free if g not in kept]
    style = rng.random()
    if style < contiguous:  # contiguous block of the remaining GPUs
        i = rng.randrange(0, len(rest) - (n - len(kept)) + 1)
        pick = kept + rest[i:i + n - len(kept)]
    else:
        pick = kept + rng.sample(rest, n - len(kept))
    return tuple(pick)


def _candidate(rng: random.Random, ms: str, used: dict[str, set[int]], gpus: list[int], gpn: int,
               prev: Candidate | None = None, max_gpus: int = 64, max_dp: int = 4,
               planner_like: bool = False) -> Candidate | None:
    stage = stage_of(ms)
    free = [g for g in gpus if g not in used.setdefault(stage, set())]
    for _ in range(20):
        if prev is not None and rng.random() < 0.3:
            tp, pp = prev.tp, prev.pp
        else:
            tp = rng.choice([t for t in (1, 2, 4, 8) if t <= gpn])
            pp = rng.choice((1, 2, 4))
        k = tp * pp
        if k > len(free):
            continue
        dp = rng.randint(max(1, min(max_dp, len(free) // k, max_gpus // k) // 2),
                         max(1, min(max_dp, len(free) // k, max_gpus // k)))
        keep = prev.gpus if prev is not None and rng.random() < (0.9 if planner_like else 0.6) else ()
        pick = _place(rng, free, k * dp, keep, contiguous=1.0 if planner_like else 0.6)
        if pick is None:
            continue
        used[stage] |= set(pick)
        return Candidate(ms, tp, pp, dp, gpus=pick)
    return None


def random_instance(rng: random.Random, num_nodes: int | None = None, gpus_per_node: int = 8,
                    memory_gib: float | None = None, num_model_stages: int | None = None,
                    max_gpus_per_stage: int = 64, max_dp: int = 4, planner_like: bool = False) -> Instance | None:
    """A random plan pair; None when the draw cannot place every model-stage.

    Args:
        rng: the source of randomness (seeded by the caller).
        num_nodes: nodes in the cluster (random 1..4 when None).
        gpus_per_node: GPUs per node.
        memory_gib: device memory (random 40..141 GiB when None; small values make memory binding).
        num_model_stages: how many model-stages (random 1..4 when None).
        max_gpus_per_stage: cap on one model-stage's GPUs (keeps instances small).
        max_dp: cap on DP degrees (DP is drawn in ``[max_dp // 2, max_dp]`` where GPUs allow).
        planner_like: placements as the planner makes them (contiguous blocks, existing GPUs kept
            with probability 0.9) instead of a mix with arbitrary GPU sets.
    """
    nodes = num_nodes or rng.randint(1, 4)
    mem = memory_gib if memory_gib is not None else rng.choice((40, 64, 80, 141))
    gpu = GPUSpec(name=f"gpu{mem}g", peak_flops=1e15, memory_bytes=int(mem * 2**30), hbm_bandwidth=3e12,
                  scaleup_bandwidth=450e9, scaleout_bandwidth=50e9)
    cluster = ClusterSpec(gpu, nodes, gpus_per_node)
    job = JobSpec(get_model("llama-3.1-8b"), cluster, WorkloadSpec())
    n = num_model_stages or rng.randint(1, 4)
    stages = sorted(rng.sample(MODEL_STAGES, min(n, len(MODEL_STAGES))), key=MODEL_STAGES.index)
    all_gpus = list(range(cluster.num_gpus))
    lost = set(rng.sample(all_gpus, rng.randint(0, max(0, len(all_gpus) // 8)))) if rng.random() < 0.3 else set()
    pool = [g for g in all_gpus if g not in lost]
    cur_used: dict[str, set[int]] = {}
    tgt_used: dict[str, set[int]] = {}
    cur, tgt = [], []
    for ms in stages:
        c = _candidate(rng, ms, cur_used, all_gpus, gpus_per_node, max_gpus=max_gpus_per_stage, max_dp=max_dp,
                       planner_like=planner_like)
        if c is None:
            return None
        t = _candidate(rng, ms, tgt_used, pool, gpus_per_node, prev=c, max_gpus=max_gpus_per_stage, max_dp=max_dp,
                       planner_like=planner_like)
        if t is None:
            return None
        cur.append(c)
        tgt.append(t)
    cap = gpu.memory_bytes * 0.9
    for plan in (cur, tgt):
        used: dict[int, int] = {}
        for c in plan:
            for e in phi(job, c):
                for g in e.gpus:
                    used[g] = used.get(g, 0) + e.bytes_on(g)
        if max(used.values()) > cap:
            return None  # the planner would never produce a plan that does not fit
    return Instance(job, Plan(tuple(cur)), Plan(tuple(tgt)), frozenset(pool))
