"""Placement: concrete GPU sets for the chosen candidates (DESIGN.md §4.4 step 4).

Rules, in order:

1. Model-stages of one stage get disjoint GPUs; every stage fills the pool from the same end
   (aligned, the layout the search's memory bound assumes). In asynchronous mode generation takes
   GPUs from the other end so that it never shares GPUs with inference or training.
2. Keep the current plan's GPUs: a model-stage whose layout (tp, pp) is unchanged keeps the replicas
   it has whose GPUs are all still in the pool and free (as many as the new DP needs); this turns
   a DP change into Extend/Destroy of replicas and makes the transition cheaper.
3. New replicas go node-aligned: a whole replica inside the node with the fewest free GPUs that
   still holds it (best fit); otherwise TP groups inside nodes; otherwise any free GPUs.
4. Within a stage, larger model-stages are placed first.

The GPU order inside a candidate follows :mod:`nereus.planner.plan` (replica, pp rank, tp rank).
"""

from __future__ import annotations

from nereus.planner.plan import Candidate, Plan
from nereus.spec.hardware import ClusterSpec
from nereus.workflow import Workflow

__all__ = ["place", "PlacementError"]


class PlacementError(ValueError):
    """The pool cannot hold a stage's model-stages."""


def _take_replica(free: list[int], k: int, tp: int, cluster: ClusterSpec) -> list[int] | None:
    """Pick ``k`` GPUs from ``free`` (sorted) for one replica, keeping TP groups inside nodes."""
    by_node: dict[int, list[int]] = {}
    for g in free:
        by_node.setdefault(cluster.node_of(g), []).append(g)
    fitting = [(len(gs), n) for n, gs in by_node.items() if len(gs) >= k]
    if fitting:
        _, node = min(fitting)
        return by_node[node][:k]
    picked: list[int] = []
    for _ in range(k // tp):  # TP groups inside nodes
        fit = [(len(gs), n) for n, gs in by_node.items() if len(gs) >= tp]
        if not fit:
            break
        _, node = min(fit)
        grp, by_node[node] = by_node[node][:tp], by_node[node][tp:]
        picked += grp
    if len(picked) == k:
        return picked
    picked_set = set(picked)
    rest = [g for g in free if g not in picked_set]
    if len(picked) + len(rest) < k:
        return None
    return picked + rest[: k - len(picked)]


def _place_stage(cands: list[Candidate], free: list[int], cluster: ClusterSpec,
                 current: Plan | None) -> list[Candidate]:
    out: dict[str, Candidate] = {}
    order = sorted(cands, key=lambda c: -c.num_gpus)
    kept: dict[str, list[int]] = {}
    free_set = set(free)
    # Keep current replicas first, for every model-stage of the stage.
    if current is not None:
        for c in order:
            if c.model_stage not in current:
                continue
            cur = current[c.model_stage]
            if cur.layout != c.layout or not cur.gpus:
                continue
            keep: list[int] = []
            for d in range(cur.dp):
                rg = list(cur.replica_gpus(d))
                if len(keep) // (c.tp * c.pp) >= c.dp:
                    break
                if all(g in free_set for g in rg):
                    keep += rg
                    free_set -= set(rg)
            kept[c.model_stage] = keep
    remaining = sorted(free_set)
    for c in order:
        gpus = list(kept.get(c.model_stage, []))
        k = c.tp * c.pp
        while len(gpus) < c.num_gpus:
            rep = _take_replica(remaining, k, c.tp, cluster)
            if rep is None:
                raise PlacementError(f"stage cannot place {c.model_stage} ({c.short()}): "
                                     f"{len(remaining)} GPU(s) left, {c.num_gpus - len(gpus)} needed")
            gpus += rep
            taken = set(rep)
            remaining = [g for g in remaining if g not in taken]
        out[c.model_stage] = c.with_gpus(gpus)
    return [out[c.model_stage] for c in cands]


def place(cands: list[Candidate], pool, cluster: ClusterSpec, workflow: Workflow,
          current: Plan | None = None) -> list[Candidate]:
    """GPU sets for ``cands`` (one per model-stage, in workflow order) from ``pool``.

    Raises:
        PlacementError: a stage needs more GPUs than the pool has.
    """
    pool_sorted = sorted(pool)
    by_name = {c.model_stage: c for c in cands}
    placed: dict[str, Candidate] = {}
    gen_gpus: set[int] = set()
    if workflow.asynchronous:
        gen = [by_name[m.name] for m in workflow.in_stage("generate") if m.name in by_name]
        n_gen = sum(c.num_gpus for c in gen)
        gen_pool = pool_sorted[len(pool_sorted) - n_gen:]
        for c in _place_stage(gen, gen_pool, cluster, current):
            placed[c.model_stage] = c
            gen_gpus |= set(c.gpus)
    for stage in workflow.stages:
        if workflow.asynchronous and stage == "generate":
            continue
        members = [by_name[m.name] for m in workflow.in_stage(stage) if m.name in by_name]
        free = [g for g in pool_sorted if g not in gen_gpus]
        for c in _place_stage(members, free, cluster, current):
            placed[c.model_stage] = c
    return [placed[c.model_stage] for c in cands]
