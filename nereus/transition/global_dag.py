"""The global transition DAG: local DAGs joined by ownership and resource edges.

Source: paper §6.1-§6.2, DESIGN.md §4.6.

1. State edges come from the local DAGs.
2. Ownership edges: an Extend onto GPU ``g`` follows every Destroy of a concurrent model-stage (same
   stage) whose unit sits on ``g``, so two concurrent model-stages never own one GPU.
3. A greedy symbolic execution orders the primitives: release-before-acquire (ready Destroys first),
   ties broken by stage (generation → inference → training), then Split → Extend → Merge. A ready
   primitive runs only if its peak fits on every GPU it touches. When every ready primitive is
   blocked, no Destroy that does not depend on them can release what they need (Destroys never
   block), so the target is infeasible: the reason names the blocked acquisitions.
4. Resource edges make *every* execution the DAG allows fit in memory, including concurrent ones.
   For each primitive ``n`` (in the order of step 3) and GPU ``g`` where it adds memory, the worst
   usage while it runs is bounded by::

       U0[g] + Σ_{m ancestor} net(m, g) + Σ_{m unordered} hi(m, g) + hi(n, g)   <= capacity[g]

   While the bound fails, an edge is added from an unordered Destroy that releases memory on ``g``
   (release-before-acquire), else between ``n`` and an unordered acquisition on ``g`` in the order of
   step 3. Edges only point forward in that order, so the DAG stays acyclic; fully serialized it is
   exactly the order of step 3, which fits, so the loop always ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.transition.emu import EMU, STAGE_ORDER, stage_of
from nereus.transition.local_dag import Infeasible, LocalDAG
from nereus.transition.primitives import KINDS, Primitive

__all__ = ["GlobalDAG", "build_global_dag", "priority"]


def priority(p: Primitive) -> tuple:
    """Greedy order: Destroy first, then generation → inference → training, then Split, Extend, Merge."""
    return (0 if p.kind == "destroy" else 1, STAGE_ORDER[p.stage], KINDS.index(p.kind), p.pid)


@dataclass(frozen=True)
class GlobalDAG:
    """All primitives of a transition and the edges that order them.

    Attributes:
        nodes: primitives in the greedy order (a topological order of ``edges``).
        edges: ``(before_pid, after_pid, kind)``, kind ``state``, ``ownership`` or ``resource``.
        initial: EMUs before the transition.
        target: EMUs after it.
        capacity: GPU → usable bytes (capacity minus headroom minus reserved bytes).
        local: the local DAGs it was built from.
    """

    nodes: tuple[Primitive, ...]
    edges: tuple[tuple[str, str, str], ...]
    initial: tuple[EMU, ...]
    target: tuple[EMU, ...]
    capacity: dict
    local: tuple[LocalDAG, ...] = ()

    def node(self, pid: str) -> Primitive:
        for n in self.nodes:
            if n.pid == pid:
                return n
        raise KeyError(pid)

    def preds(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {n.pid: set() for n in self.nodes}
        for a, b, _ in self.edges:
            out[b].add(a)
        return out

    def initial_usage(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for e in self.initial:
            for g in e.gpus:
                used[g] = used.get(g, 0) + e.bytes_on(g)
        return used

    @property
    def bytes_moved(self) -> int:
        return sum(n.bytes_moved for n in self.nodes)

    def to_dict(self) -> dict:
        return {"nodes": [n.to_dict() for n in self.nodes],
                "edges": [list(e) for e in self.edges],
                "initial": [e.to_dict() for e in self.initial],
                "target": [e.to_dict() for e in self.target],
                "capacity": {str(g): c for g, c in sorted(self.capacity.items())},
                "local": [d.to_dict() for d in self.local]}


def _ownership_edges(locals_: list[LocalDAG]) -> list[tuple[str, str, str]]:
    edges = []
    destroys_on: dict[tuple[str, int], list[str]] = {}
    for ld in locals_:
        for n in ld.nodes:
            if n.kind == "destroy":
                for g in n.gpus:
                    destroys_on.setdefault((stage_of(n.model_stage), g), []).append(n.pid)
    ms_of = {n.pid: n.model_stage for ld in locals_ for n in ld.nodes}
    for ld in locals_:
        for x in ld.nodes:
            for g in x.acquires:
                for d in destroys_on.get((x.stage, g), ()):
                    if ms_of[d] != x.model_stage:
                        edges.append((d, x.pid, "ownership"))
    return edges


def _symbolic_order(nodes: dict[str, Primitive], preds: dict[str, set[str]], used: dict[int, int],
                    capacity: dict, owners: dict[int, dict[str, int]]) -> list[str]:
    waiting = {p: len(preds[p]) for p in nodes}
    succs: dict[str, list[str]] = {p: [] for p in nodes}
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    ready = sorted((p for p, k in waiting.items() if k == 0), key=lambda p: priority(nodes[p]))
    order: list[str] = []

    def fits(n: Primitive) -> bool:
        for g, h in n.mem_hi.items():
            if h > 0 and used.get(g, 0) + h > capacity[g]:
                return False
        for g in n.acquires:
            for ms, c in owners.get(g, {}).items():
                if c and ms != n.model_stage and stage_of(ms) == n.stage:
                    return False
        return True

    while ready:
        pid = next((p for p in ready if fits(nodes[p])), None)
        if pid is None:
            raise Infeasible(_blocked_reason([nodes[p] for p in ready], used, capacity, owners))
        n = nodes[pid]
        ready.remove(pid)
        order.append(pid)
        for g, d in n.mem_net.items():
            used[g] = used.get(g, 0) + d
        for e in n.produces:
            for g in e.gpus:
                owners.setdefault(g, {})[e.model_stage] = owners.get(g, {}).get(e.model_stage, 0) + 1
        for g in _consumed_gpus(n):
            owners[g][n.model_stage] -= 1
        for s in succs[pid]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
        ready.sort(key=lambda p: priority(nodes[p]))
    if len(order) < len(nodes):
        stuck = sorted(p for p in nodes if p not in set(order))
        raise Infeasible(f"circular wait between primitives {stuck[:6]}: a Destroy that would release "
                         f"the GPUs depends on the acquisition waiting for them")
    return order


def _consumed_gpus(n: Primitive) -> list[int]:
    # Split, Merge and Destroy consume EMUs covering exactly n.gpus; Extend consumes nothing
    return [] if n.kind == "extend" else list(n.gpus)


def _blocked_reason(blocked: list[Primitive], used, capacity, owners) -> str:
    parts = []
    for n in blocked[:4]:
        for g, h in sorted(n.mem_hi.items()):
            if h > 0 and used.get(g, 0) + h > capacity[g]:
                parts.append(f"{n.pid} needs {h / 2**30:.2f} GiB on GPU {g} where "
                             f"{max(capacity[g] - used.get(g, 0), 0) / 2**30:.2f} GiB are free")
                break
        else:
            for g in n.acquires:
                own = [ms for ms, c in owners.get(g, {}).items() if c and ms != n.model_stage
                       and stage_of(ms) == n.stage]
                if own:
                    parts.append(f"{n.pid} needs GPU {g} owned by concurrent {own[0]}")
                    break
    return ("no Destroy can release what a blocked acquisition needs: " + "; ".join(parts)
            if parts else f"primitives {[n.pid for n in blocked]} are blocked")


def _resource_edges(order: list[str], nodes: dict[str, Primitive], preds: dict[str, set[str]],
                    u0: dict[int, int], capacity: dict) -> list[tuple[str, str, str]]:
    idx = {p: i for i, p in enumerate(order)}
    succs: dict[str, set[str]] = {p: set() for p in order}
    for b, ps in preds.items():
        for a in ps:
            succs[a].add(b)
    touch: dict[int, list[str]] = {}
    for p in order:
        n = nodes[p]
        for g in set(n.mem_hi) | set(n.mem_net):
            if n.mem_hi.get(g, 0) or n.mem_net.get(g, 0):
                touch.setdefault(g, []).append(p)
    anc: dict[str, int] = {}
    added: list[tuple[str, str, str]] = []

    def descendants(p: str) -> int:
        seen, stack = 0, [p]
        while stack:
            for s in succs[stack.pop()]:
                b = 1 << idx[s]
                if not seen & b:
                    seen |= b
                    stack.append(s)
        return seen

    for p in order:
        n = nodes[p]
        a = 0
        for q in preds[p]:
            a |= anc[q] | (1 << idx[q])
        anc[p] = a
        gpus = [g for g, h in n.mem_hi.items() if h > 0]
        if not gpus:
            continue
        desc = descendants(p)
        for g in gpus:
            while True:
                bound = u0.get(g, 0) + n.mem_hi[g]
                cands = []
                for m in touch[g]:
                    if m == p:
                        continue
                    b = 1 << idx[m]
                    mn = nodes[m]
                    net, hi = mn.mem_net.get(g, 0), mn.mem_hi.get(g, 0)
                    if anc[p] & b:
                        bound += net
                    elif not desc & b:
                        bound += hi
                        if idx[m] < idx[p] and hi - net > 0:
                            cands.append(((0 if mn.kind == "destroy" else 1), -(hi - net), m, True))
                        elif idx[m] > idx[p] and hi > 0:
                            cands.append((1, -hi, m, False))
                if bound <= capacity[g]:
                    break
                if not cands:  # cannot happen when the symbolic order fits; kept as a guard
                    raise Infeasible(f"{p}: GPU {g} would exceed its memory in every order")
                _, _, m, before = min(cands)
                if before:
                    preds[p].add(m)
                    succs[m].add(p)
                    anc[p] |= anc[m] | (1 << idx[m])
                    added.append((m, p, "resource"))
                else:
                    preds[m].add(p)
                    succs[p].add(m)
                    desc |= (1 << idx[m]) | descendants(m)
                    added.append((p, m, "resource"))
    return added


def build_global_dag(locals_: list[LocalDAG], initial: tuple[EMU, ...], target: tuple[EMU, ...],
                     capacity: dict[int, int]) -> GlobalDAG:
    """Join local DAGs into one DAG that is safe in every execution it allows.

    Args:
        locals_: one local DAG per model-stage.
        initial, target: all EMUs before and after.
        capacity: GPU → usable bytes, for every GPU any EMU or primitive touches.

    Raises:
        Infeasible: the greedy order gets stuck (a blocked acquisition no Destroy can unblock, or a
            circular wait); the message names what is blocked and why.
    """
    nodes = {n.pid: n for ld in locals_ for n in ld.nodes}
    edges = [(a, b, "state") for ld in locals_ for a, b in ld.edges]
    edges += _ownership_edges(locals_)
    preds: dict[str, set[str]] = {p: set() for p in nodes}
    for a, b, _ in edges:
        preds[b].add(a)
    u0: dict[int, int] = {}
    owners: dict[int, dict[str, int]] = {}
    for e in initial:
        for g in e.gpus:
            u0[g] = u0.get(g, 0) + e.bytes_on(g)
            owners.setdefault(g, {})[e.model_stage] = owners.get(g, {}).get(e.model_stage, 0) + 1
    order = _symbolic_order(nodes, preds, dict(u0), capacity, owners)
    edges += _resource_edges(order, nodes, {p: set(s) for p, s in preds.items()}, u0, capacity)
    return GlobalDAG(nodes=tuple(nodes[p] for p in order), edges=tuple(dict.fromkeys(edges)),
                     initial=tuple(initial), target=tuple(target), capacity=dict(capacity),
                     local=tuple(locals_))
