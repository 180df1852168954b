"""Placement: concrete GPU sets for the chosen candidates (DESIGN.md §4.4 step 4).

Rules, in order:

1. Model-stages of one stage get disjoint GPUs; every stage fills the pool from the same end
   (aligned, the layout the search's memory bound assumes). In asynchronous mode generation takes
   GPUs from the other end so that it never shares GPUs with inference or training.
   A *colocated* stage (named in ``colocated``, or one whose model-stages need more GPUs together
   than the pool has) places each of its model-stages on its own from the same free GPUs, so their
   GPU sets overlap from the same start and they run one after another (verl's hybrid engine;
   :func:`nereus.cost.model.stage_groups`). A *mixed* stage (``blocks``) gives each block of
   model-stages its own consecutive free GPUs (as many as its largest member needs) and places
   the block colocated there. The per-GPU memory bound of the search holds for any such
   placement: a GPU hosts at most one replica of each model-stage, and only of one block's.
2. Keep the current plan's GPUs: a model-stage whose layout (tp, pp) is unchanged keeps the replicas
   it has whose GPUs are all still in the pool and free (as many as the new DP needs); this turns
   a DP change into Extend/Destroy of replicas and makes the transition cheaper.
3. New replicas go node-aligned: a whole replica inside the node with the fewest free GPUs that
   still holds it (best fit); otherwise TP groups inside nodes; otherwise any free GPUs.
4. Within a stage, larger model-stages are placed first.
5. Model-stages named in ``spread`` (the ``*.train`` ones when the search requires redundant
   training state) put each replica on nodes no other replica of theirs uses, when the free GPUs
   allow it (a node is the unit a spot provider reclaims); kept replicas follow the same rule.

The GPU order inside a candidate follows :mod:`nereus.spec.plan` (replica, pp rank, tp rank).
"""

from __future__ import annotations

import heapq

from nereus.spec.hardware import ClusterSpec
from nereus.spec.plan import Candidate, Plan
from nereus.workflow import Workflow

__all__ = ["place", "PlacementError"]


class PlacementError(ValueError):
    """The pool cannot hold a stage's model-stages."""


class _FreeGPUs:
    """Free GPUs grouped by node, in id order, with the nodes bucketed by their free count.

    Best fit ("the node with the fewest free GPUs that still holds ``need``, lowest id on ties") is a
    walk over at most ``gpus_per_node`` buckets, each a heap of node ids with lazy deletion (a node's
    count only falls, so it enters each bucket at most once and a stale entry is one whose node has
    since left that count). Placing ``R`` replicas on ``N`` nodes costs ``O((R + N) log N)`` instead
    of the ``O(R·N)`` of scanning every node per replica.
    """

    def __init__(self, gpus, cluster: ClusterSpec):
        self.by_node: dict[int, list[int]] = {}
        for g in sorted(gpus):
            self.by_node.setdefault(cluster.node_of(g), []).append(g)
        self.n = sum(len(v) for v in self.by_node.values())
        top = max((len(v) for v in self.by_node.values()), default=0)
        self.buckets: list[list[int]] = [[] for _ in range(top + 1)]
        for node, v in self.by_node.items():
            self.buckets[len(v)].append(node)
        for b in self.buckets:
            heapq.heapify(b)

    def count(self) -> int:
        return self.n

    def _pop(self, node: int, k: int) -> list[int]:
        out, self.by_node[node] = self.by_node[node][:k], self.by_node[node][k:]
        self.n -= len(out)
        left = len(self.by_node[node])
        if not left:
            del self.by_node[node]
        else:
            heapq.heappush(self.buckets[left], node)
        return out

    def _best_fit(self, need: int, avoid: frozenset) -> int | None:
        """Node with the fewest free GPUs >= ``need`` (lowest id on ties), skipping ``avoid``."""
        for c in range(max(need, 1), len(self.buckets)):
            heap, skipped, found = self.buckets[c], [], None
            while heap:
                node = heap[0]
                if len(self.by_node.get(node, ())) != c:
                    heapq.heappop(heap)  # stale: the node has fewer free GPUs now
                    continue
                if node in avoid:
                    skipped.append(heapq.heappop(heap))
                    continue
                found = node
                break
            for node in skipped:
                heapq.heappush(heap, node)
            if found is not None:
                return found
        return None

    def take_replica(self, k: int, tp: int, avoid: frozenset = frozenset()) -> list[int] | None:
        """``k`` GPUs for one replica: one node if any holds it (best fit), else TP groups inside
        nodes, else any free GPUs; None when fewer than ``k`` are free. With ``avoid`` (nodes), the
        replica is taken from the other nodes when they hold ``k`` free GPUs."""
        if self.count() < k:
            return None
        avoid = frozenset(n for n in avoid if n in self.by_node)
        if self.n - sum(len(self.by_node[n]) for n in avoid) < k:
            avoid = frozenset()
        if (n := self._best_fit(k, avoid)) is not None:
            return self._pop(n, k)
        picked: list[int] = []
        while len(picked) < k and (n := self._best_fit(tp, avoid)) is not None:
            picked += self._pop(n, tp)
        for n in sorted(n for n in self.by_node if n not in avoid):
            if len(picked) >= k:
                break
            picked += self._pop(n, k - len(picked))
        return picked


def _place_stage(cands: list[Candidate], free: list[int], cluster: ClusterSpec,
                 current: Plan | None, spread: frozenset = frozenset()) -> list[Candidate]:
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
            used_nodes: set[int] = set()
            for d in range(cur.dp):
                rg = list(cur.replica_gpus(d))
                if len(keep) // (c.tp * c.pp) >= c.dp:
                    break
                nodes = {cluster.node_of(g) for g in rg}
                if c.model_stage in spread and nodes & used_nodes:
                    continue
                if all(g in free_set for g in rg):
                    keep += rg
                    used_nodes |= nodes
                    free_set -= set(rg)
            kept[c.model_stage] = keep
    pool = _FreeGPUs(free_set, cluster)
    for c in order:
        gpus = list(kept.get(c.model_stage, []))
        k = c.tp * c.pp
        while len(gpus) < c.num_gpus:
            avoid = frozenset(cluster.node_of(g) for g in gpus) if c.model_stage in spread else frozenset()
            rep = pool.take_replica(k, c.tp, avoid)
            if rep is None:
                raise PlacementError(f"stage cannot place {c.model_stage} ({c.short()}): "
                                     f"{pool.count()} GPU(s) left, {c.num_gpus - len(gpus)} needed")
            gpus += rep
        out[c.model_stage] = c.with_gpus(gpus)
    return [out[c.model_stage] for c in cands]


def _place_colocated(cands: list[Candidate], free: list[int], cluster: ClusterSpec,
                     current: Plan | None, spread: frozenset) -> list[Candidate]:
    """Each model-stage placed alone on ``free`` (same start, overlapping GPU sets)."""
    return [_place_stage([c], free, cluster, current, spread)[0] for c in cands]


def _place_mixed(cands: list[Candidate], blocks, free: list[int], cluster: ClusterSpec,
                 current: Plan | None, spread: frozenset) -> list[Candidate]:
    """A mixed stage: each block (model-stage names) gets its own ``g`` free GPUs, ``g`` the
    largest GPU count of its members, in pool order, larger blocks first; inside them its members
    are placed colocated (the member with ``g`` GPUs covers them all, so the block's GPU sets are
    connected and :func:`nereus.cost.model.stage_groups` finds the block)."""
    by = {c.model_stage: c for c in cands}
    out: dict[str, Candidate] = {}
    left = list(free)
    for blk in sorted(blocks, key=lambda b: -max(by[n].num_gpus for n in b)):
        g = max(by[n].num_gpus for n in blk)
        if g > len(left):
            raise PlacementError(f"stage cannot place block {', '.join(blk)}: {len(left)} GPU(s) left, {g} needed")
        region, left = left[:g], left[g:]
        members = [by[n] for n in blk]
        placed = _place_colocated(members, region, cluster, current, spread) if len(members) > 1 else \
            _place_stage(members, region, cluster, current, spread)
        for c in placed:
            out[c.model_stage] = c
    return [out[c.model_stage] for c in cands]


def place(cands: list[Candidate], pool, cluster: ClusterSpec, workflow: Workflow,
          current: Plan | None = None, spread: frozenset = frozenset(),
          colocated: frozenset = frozenset(), blocks: dict | None = None) -> list[Candidate]:
    """GPU sets for ``cands`` (one per model-stage, in workflow order) from ``pool``; the
    model-stages in ``spread`` get their replicas on distinct nodes where possible (rule 5); the
    stages in ``colocated`` share GPUs (rule 1; so does a stage whose model-stages need more GPUs
    together than the pool has); ``blocks`` maps a stage with mixed placement to its blocks
    (tuples of model-stage names): each block colocated on GPUs of its own (:func:`_place_mixed`).

    Raises:
        PlacementError: one model-stage needs more GPUs than the pool has.
    """
    pool_sorted = sorted(pool)
    by_name = {c.model_stage: c for c in cands}
    placed: dict[str, Candidate] = {}
    gen_gpus: set[int] = set()
    if workflow.asynchronous:
        gen = [by_name[m.name] for m in workflow.in_stage("generate") if m.name in by_name]
        n_gen = sum(c.num_gpus for c in gen)
        gen_pool = pool_sorted[len(pool_sorted) - n_gen:]
        for c in _place_stage(gen, gen_pool, cluster, current, spread):
            placed[c.model_stage] = c
            gen_gpus |= set(c.gpus)
    for stage in workflow.stages:
        if workflow.asynchronous and stage == "generate":
            continue
        members = [by_name[m.name] for m in workflow.in_stage(stage) if m.name in by_name]
        free = [g for g in pool_sorted if g not in gen_gpus]
        if blocks and stage in blocks:
            for c in _place_mixed(members, blocks[stage], free, cluster, current, spread):
                placed[c.model_stage] = c
            continue
        share = stage in colocated or sum(c.num_gpus for c in members) > len(free)
        fn = _place_colocated if share and len(members) > 1 else _place_stage
        for c in fn(members, free, cluster, current, spread):
            placed[c.model_stage] = c
    return [placed[c.model_stage] for c in cands]
