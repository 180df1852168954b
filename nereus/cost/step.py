"""The step's structure: which model-stages run one after another on shared GPUs
(:func:`stage_groups`) and the longest path through one step (:func:`critical_path`, the reference
for :meth:`nereus.cost.model.CostModel.stage_latency`'s closed form)."""

from __future__ import annotations

import math

import networkx as nx

from nereus.spec.plan import Plan
from nereus.workflow import Workflow

__all__ = ["stage_groups", "critical_path", "engine_owned"]


def stage_groups(plan: Plan, workflow: Workflow) -> list[tuple[str, ...]]:
    """Model-stages that run one after another: per stage, the connected groups of model-stages
    whose GPU sets intersect (colocated, verl's hybrid engine); a model-stage sharing no GPU with
    another of its stage is a group of its own. Model-stages without GPUs are groups of their own.

    Union-find over the GPUs (each GPU joins the model-stages that use it): ``O(Σ |gpus|)``, in
    workflow order within a group, groups in the order of their first member."""
    out: list[tuple[str, ...]] = []
    for st in workflow.stages:
        names = [m.name for m in workflow.in_stage(st) if m.name in plan]
        parent = {n: n for n in names}
        owner: dict = {}
        for n in names:
            for g in plan[n].gpus:
                o = owner.setdefault(g, n)
                if o != n:
                    ra, rb = _root(parent, o), _root(parent, n)
                    if ra != rb:
                        parent[rb] = ra
        comps: dict = {}
        for n in names:
            comps.setdefault(_root(parent, n), []).append(n)
        out += [tuple(c) for c in comps.values()]
    return out


def _root(parent: dict, n: str) -> str:
    """Union-find root of ``n`` (path halving)."""
    while parent[n] != n:
        parent[n] = parent[parent[n]]
        n = parent[n]
    return n


def critical_path(workflow: Workflow, times: dict, groups=None) -> float:
    """Longest path through the execution-overlap graph of one step, in seconds.

    Nodes are model-stages weighted by their time, or, when ``groups`` is given (see
    :func:`stage_groups`), groups of colocated model-stages weighted by the sum of their times
    (they run one after another on shared GPUs); edges are the workflow's data dependencies (every
    model-stage of a stage feeds every one of the next). In asynchronous mode generation of the next
    step does not wait for this step's training, so it is only bounded below by its own time.
    """
    node_of = {}
    for grp in groups or ():
        for n in grp:
            node_of[n] = tuple(grp)
    g = nx.DiGraph()
    for ms in workflow.model_stages:
        if ms.name in times:
            node = node_of.get(ms.name, (ms.name,))
            if node not in g:
                g.add_node(node, w=0.0)
            g.nodes[node]["w"] += float(times[ms.name])
    for u, v in workflow.dependencies():
        if workflow.asynchronous and u.stage == "generate":
            continue
        if u.name in times and v.name in times:
            a, b = node_of.get(u.name, (u.name,)), node_of.get(v.name, (v.name,))
            if a != b:
                g.add_edge(a, b)
    best: dict = {}
    for n in nx.topological_sort(g):
        best[n] = g.nodes[n]["w"] + max((best[p] for p in g.predecessors(n)), default=0.0)
    return max(best.values(), default=0.0) if not math.isnan(sum(best.values())) else float("nan")


def engine_owned(plan: Plan, fw) -> set:
    """Inference model-stages whose weights are their training engine's (``fw.shared_engine``: the
    same model's ``.train`` candidate on the same GPUs keeps its weights resident), so they add no
    resident bytes of their own; with ``fw.train_engine_generation`` also ``actor.generate`` on
    ``actor.train``'s GPUs (Hugging Face ``generate`` on the actor's DeepSpeed engine, OpenRLHF's
    non-Ray ``train_ppo``, below ZeRO-3: its KV cache and activations stay transient); with
    ``fw.ref_in_actor`` also ``reference.infer`` on ``actor.train``'s GPUs and degrees (verl's LoRA
    reference: the actor's base weights with the adapters disabled)."""
    gen = getattr(fw, "train_engine_generation", False)
    ref = getattr(fw, "ref_in_actor", False)
    if not fw.shared_engine and not gen and not ref:
        return set()
    by = {c.model_stage: c for c in plan.candidates}
    out = set()
    for name, c in by.items():
        t = by.get(name.replace(".infer", ".train")) if name.endswith(".infer") and fw.shared_engine else None
        if gen and name == "actor.generate" and "actor.train" in by and by["actor.train"].zero < 3:
            t = by["actor.train"]  # ZeRO-3 shards the weights generation needs whole: not owned
        if ref and name == "reference.infer":
            t = by.get("actor.train")
        if t is not None and set(t.gpus) == set(c.gpus) and t.offload in ("none", "cpu_adam") and t.tp == c.tp \
                and t.pp == c.pp:
            out.add(name)
    return out
