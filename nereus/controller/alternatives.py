"""Cheaper targets for admission: keep every layout and only drop or add DP replicas.

When the planner's fastest target ``S*`` fails feasibility (its DAG needs memory that no Destroy can
free) or admission, the controller tries "slightly slower plans with cheaper transitions" (paper
§4.3). The cheapest transitions are those built from Destroy and Extend alone (no Split/Merge, so
no intermediate units):

* :func:`destroy_only`: keep the DP replicas (EMUs) whose GPUs are all still in the pool — the
  urgent path's first resort after a GPU loss;
* :func:`extend_only`: give free GPUs of each stage, one replica at a time, to that stage's slowest
  model-stage (same layout, TP groups inside one node).

DP changes keep the global batch: a training candidate's ``dp·b·a = mini_batch`` is re-solved with the
same micro-batch ``b`` when possible, else the largest ``b' < b`` that divides (DESIGN.md §4.4); under
a framework with ``even_dp`` an inference or generation dp must divide its rows (``rows``, from
:func:`nereus.planner.candidates.even_dp_rows`), as the planner's own candidates do.
These functions only build candidates; the caller estimates them and checks memory.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.spec.hardware import ClusterSpec
from nereus.spec.plan import Candidate, Plan

__all__ = ["resize", "destroy_only", "extend_only"]


def resize(c: Candidate, gpus: tuple[int, ...], mini_batch: int, rows: dict | None = None) -> Candidate | None:
    """``c`` with the GPU set ``gpus`` (whole replicas) and DP re-derived; None if the batch cannot split
    (``rows``: model-stage → the count its dp must divide, where the framework splits rows evenly)."""
    k = c.tp * c.pp
    dp = len(gpus) // k
    if dp <= 0 or dp * k != len(gpus) or (rows and rows.get(c.model_stage, dp) % dp):
        return None
    if c.model_stage.endswith(".train") and c.grad_accum:
        if mini_batch % dp:
            return None
        per = mini_batch // dp
        b = next((b for b in range(max(c.micro_batch, 1), 0, -1) if per % b == 0), None)
        if b is None:
            return None
        return replace(c, dp=dp, micro_batch=b, grad_accum=per // b, gpus=tuple(gpus))
    return replace(c, dp=dp, gpus=tuple(gpus))


def destroy_only(plan: Plan, pool: frozenset, mini_batch: int, rows: dict | None = None) -> Plan | None:
    """Drop the replicas that touch GPUs outside ``pool``; None if a model-stage loses all of them."""
    out = []
    for c in plan.candidates:
        keep = [c.replica_gpus(d) for d in range(c.dp) if set(c.replica_gpus(d)) <= pool]
        while keep:
            r = resize(c, tuple(g for rep in keep for g in rep), mini_batch, rows)
            if r is not None:
                break
            keep.pop()  # the batch does not split over this many replicas: drop one more
        if not keep:
            return None
        out.append(r)
    return Plan(candidates=tuple(out))


def _take_replica(free: list[int], tp: int, pp: int, cluster: ClusterSpec) -> list[int] | None:
    """``tp·pp`` free GPUs whose TP groups each sit in one node (None when impossible)."""
    by_node: dict[int, list[int]] = {}
    for g in sorted(free):
        by_node.setdefault(cluster.node_of(g), []).append(g)
    chunks = []
    for gs in by_node.values():
        for i in range(0, len(gs) - tp + 1, tp):
            chunks.append(gs[i:i + tp])
    if len(chunks) < pp:
        return None
    return [g for ch in chunks[:pp] for g in ch]


def extend_only(plan: Plan, pool: frozenset, mini_batch: int, cluster: ClusterSpec, times: dict,
                rows: dict | None = None) -> Plan | None:
    """Add replicas on GPUs each stage does not use; ``times`` is model-stage → seconds (for greed).

    Returns None when no replica can be added.
    """
    cands = {c.model_stage: c for c in plan.candidates}
    added = False
    stages = {}
    for name in cands:
        stages.setdefault(name.rsplit(".", 1)[1], []).append(name)
    for names in stages.values():
        used = {g for n in names for g in cands[n].gpus}
        free = sorted(set(pool) - used)
        # one pass per stage: the slowest model-stage first, estimated time shrinks with dp
        load = {n: times.get(n, 0.0) for n in names}
        while free:
            grown = False
            for n in sorted(names, key=lambda n: -load[n]):
                c = cands[n]
                rep = _take_replica(free, c.tp, c.pp, cluster)
                if rep is None:
                    continue
                r = resize(c, c.gpus + tuple(rep), mini_batch, rows)
                if r is None:
                    continue
                load[n] *= c.dp / r.dp
                cands[n] = r
                free = [g for g in free if g not in rep]
                grown = added = True
                break
            if not grown:
                break
    if not added:
        return None
    return Plan(candidates=tuple(cands[c.model_stage] for c in plan.candidates))
