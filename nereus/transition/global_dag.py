"""The global transition DAG: local DAGs joined by ownership and resource edges, and its greedy schedule.

Source: paper §6.1-§6.2, DESIGN.md §4.6.

1. State edges come from the local DAGs, plus one per cross-model-stage read: a Load that syncs
   weights from a ``*.train`` EMU ends before any primitive of the train model-stage consumes that
   EMU (buffer lifetime, as for Extend sources inside one model-stage).
2. Ownership edges: a primitive that acquires GPU ``g`` (Extend, Load, Restore) follows every
   Destroy or Offload of a concurrent model-stage (same stage) on ``g``, and every Split of one that
   does not materialize a unit on ``g`` (``split(keep=...)``), so two concurrent
   model-stages never own one GPU. If they close a cycle (the only Destroy that frees a GPU depends
   on the Extend waiting for it), this raises ``Infeasible(cycle=True)``; ``estimate.plan_dag``
   then tries dropping or staging a model-stage on the cycle.
3. A greedy, memory-aware list schedule: whenever a primitive ends, ready primitives start in
   priority order if their link ports are free and their peak fits every GPU they touch, counting
   running primitives at their peak (``mem_hi``) and ended ones at their net effect. Priority:
   release-before-acquire (Destroys first), then ties broken by stage (generation → inference →
   training) under ``order="stage"`` (the paper's rule); ``order="critical"`` (default) ranks by the
   longest remaining path first, keeps the best of a few priority rules (the paper's among them),
   then runs a small local search over delays a non-delay list schedule cannot make: walking the
   critical chain back to a primitive that waited for memory or a link, it tries making one of the
   primitives that held them wait for it instead, and keeps the change when the makespan drops.
   If nothing runs and no ready primitive fits, no Destroy that does not depend on them can release
   what they need (Destroys always fit), so the target is infeasible; the reason names them.
4. Resource edges make *every* execution the DAG allows fit in memory, including concurrent ones.
   With ``L`` the start order of step 3, for each primitive ``n`` and GPU ``g`` where it adds memory::

       U0[g] + Σ_{m ancestor of n} net(m, g) + Σ_{m unordered, before n in L} hi(m, g) + hi(n, g)
           <= capacity[g]

   This suffices: at any moment, let ``n`` be the latest (in ``L``) started primitive that holds
   extra bytes on ``g``; its ancestors are done, every other primitive holding extra bytes is an
   unordered one before it in ``L`` (holding at most ``hi``), and the rest hold nothing or release.
   While the bound fails, an edge ``m → n`` is added from an unordered ``m`` that ended before ``n``
   started in the schedule and whose end lowers the bound (a Destroy releasing ``g``: preferred,
   release-before-acquire; a Split or Merge dropping its buffers). With all such edges the bound is
   at most what step 3 checked, so the loop ends, the DAG stays acyclic (edges point forward in
   ``L``) and the greedy schedule remains valid for it.
5. A finished DAG: :func:`critical_path_length` (longest path, ignoring link ports: a lower bound on
   ``L_tran``) and :func:`list_schedule`, a parallel list schedule of it, which is memory-safe in
   every order the DAG allows, so only edges and ports matter (Destroy first, then longest
   remaining path, then stage order). The schedulers themselves work on primitives and predecessor
   sets (``schedule``), so that module does not depend on this one.
"""

from __future__ import annotations

import graphlib
import heapq
import random
from dataclasses import dataclass, field

from nereus.transition.emu import EMU, stage_of
from nereus.transition.local_dag import Infeasible, LocalDAG
from nereus.transition.primitives import Primitive, priority
from nereus.transition.schedule import (
    NOISE,
    NUM_NOISY_PASSES,
    WORK_BUDGET,
    Schedule,
    critical_chain,
    memory_list_schedule,
    pop_finished,
    repair_delays,
)

__all__ = ["GlobalDAG", "build_global_dag", "plan_global", "rule_dag", "tails", "critical_path_length",
           "list_schedule"]

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
        models: model-stage → ``(ModelSpec, (weights, optimizer) bytes per parameter)``, what
            ``verify`` needs to check that every produced shard is held or received (set by
            ``estimate.plan_dag``; empty: ``verify`` uses a model-free upper bound).
        exclusive: concurrent model-stages (one stage) may not share a GPU (ownership edges, the
            paper's rule); False when the job's framework colocates model-stages of one stage
            (``FrameworkSpec.colocate`` not ``never``): only memory orders them then.
        shared: model-stages that may share GPUs with each other *during* the transition (no
            ownership edges among them; ``estimate.plan_dag`` sets it for the model-stages on a
            circular wait, e.g. two training model-stages swapping GPUs, ours): the plans before
            and after stay disjoint, and the memory check counts both states on a shared GPU.
    """

    nodes: tuple[Primitive, ...]
    edges: tuple[tuple[str, str, str], ...]
    initial: tuple[EMU, ...]
    target: tuple[EMU, ...]
    capacity: dict
    local: tuple[LocalDAG, ...] = ()
    models: dict = field(default_factory=dict, compare=False, repr=False)
    exclusive: bool = True
    shared: frozenset = frozenset()

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


def _released(n: Primitive) -> tuple[int, ...]:
    """GPUs a primitive gives up: a Destroy's or Offload's, those of a Split's units it does not
    materialize (``split(keep=...)``), and those a ZeRO group's re-cut leaves (``reshard``)."""
    if n.kind == "destroy":  # a host copy's Destroy frees no GPU
        return tuple(g for g in n.gpus if n.mem_net.get(g, 0) < 0)
    if n.kind == "offload":
        return n.gpus
    if n.kind in ("split", "merge"):  # a Merge re-cutting a ZeRO group may leave some of its GPUs
        kept = {g for e in n.produces for g in e.gpus}
        return tuple(g for g in n.gpus if g not in kept)
    return ()


def _ownership_edges(locals_: list[LocalDAG], shared: frozenset = frozenset()) -> list[tuple[str, str, str]]:
    edges = []
    destroys_on: dict[tuple[str, int], list[str]] = {}
    for ld in locals_:
        for n in ld.nodes:
            for g in _released(n):
                destroys_on.setdefault((stage_of(n.model_stage), g), []).append(n.pid)
    ms_of = {n.pid: n.model_stage for ld in locals_ for n in ld.nodes}
    for ld in locals_:
        for x in ld.nodes:
            for g in x.acquires:
                for d in destroys_on.get((x.stage, g), ()):
                    if ms_of[d] != x.model_stage and not (ms_of[d] in shared and x.model_stage in shared):
                        edges.append((d, x.pid, "ownership"))
    return edges


def _read_edges(locals_: list[LocalDAG]) -> list[tuple[str, str, str]]:
    """``(reader, consumer, "state")`` for EMUs read by a primitive of another model-stage, and
    ``(m, load, "state")`` for every primitive ``m`` of the train model-stage a Load syncs from
    after its transition (``load(..., read=False)``)."""
    consumers: dict[str, list] = {}
    by_ms = {ld.model_stage: ld for ld in locals_}
    for ld in locals_:
        for n in ld.nodes:
            for uid in n.consumes:
                consumers.setdefault(uid, []).append(n)
    out = [(n.pid, c.pid, "state") for ld in locals_ for n in ld.nodes for uid in n.reads
           for c in consumers.get(uid, ()) if c.model_stage != n.model_stage]
    out += [(m.pid, n.pid, "state") for ld in locals_ for n in ld.nodes
            if n.kind == "load" and n.source in by_ms for m in by_ms[n.source].nodes]
    return out


def _tails(nodes, preds: dict[str, set[str]], dur: dict[str, float]) -> dict[str, float]:
    try:
        topo = list(graphlib.TopologicalSorter(preds).static_order())
    except graphlib.CycleError as e:
        raise Infeasible(f"circular wait between {e.args[1][:6]}: a Destroy that would release GPUs "
                         f"depends on the acquisition waiting for them", tuple(e.args[1]), cycle=True) from None
    succs: dict[str, list[str]] = {p: [] for p in nodes}
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    tail: dict[str, float] = {}
    for p in reversed(topo):
        tail[p] = dur[p] + max((tail[q] for q in succs[p]), default=0.0)
    return tail


def _resource_edges(sched: Schedule, nodes: dict[str, Primitive], preds: dict[str, set[str]],
                    u0: dict[int, int], capacity: dict) -> list[tuple[str, str, str]]:
    order = sorted(nodes, key=lambda p: (sched.start[p], sched.end[p], p))
    idx = {p: i for i, p in enumerate(order)}
    touch: dict[int, list[str]] = {}
    for p in order:
        n = nodes[p]
        for g in set(n.mem_hi) | set(n.mem_net):
            if n.mem_hi.get(g, 0) or n.mem_net.get(g, 0):
                touch.setdefault(g, []).append(p)
    anc: dict[str, int] = {}
    added: list[tuple[str, str, str]] = []
    for p in order:
        n = nodes[p]
        a = 0
        for q in preds[p]:
            a |= anc[q] | (1 << idx[q])
        anc[p] = a
        for g in [g for g, h in n.mem_hi.items() if h > 0]:
            while True:
                bound = u0.get(g, 0) + n.mem_hi[g]
                cands = []
                for m in touch[g]:
                    if idx[m] >= idx[p]:
                        break
                    mn = nodes[m]
                    net, hi = mn.mem_net.get(g, 0), mn.mem_hi.get(g, 0)
                    if anc[p] >> idx[m] & 1:
                        bound += net
                    else:
                        bound += hi
                        if hi > net and sched.end[m] <= sched.start[p] + 1e-12:
                            cands.append((0 if mn.kind == "destroy" else 1, net - hi, m))
                if bound <= capacity[g]:
                    break
                if not cands:  # cannot happen: the schedule checked this bound with all of them
                    raise AssertionError(f"{p}: GPU {g} bound fails with no candidate edge")
                m = min(cands)[-1]
                preds[p].add(m)
                anc[p] |= anc[m] | (1 << idx[m])
                added.append((m, p, "resource"))
    return added


def plan_global(locals_: list[LocalDAG], initial: tuple[EMU, ...], target: tuple[EMU, ...],
                capacity: dict[int, int], dur: dict[str, float] | None = None,
                ports: dict[str, frozenset] | None = None,
                order: str = "critical", exclusive: bool = True,
                shared: frozenset = frozenset()) -> tuple[GlobalDAG, Schedule]:
    """Join local DAGs into one DAG that is safe in every execution it allows, and schedule it.

    Args:
        locals_: one local DAG per model-stage.
        initial, target: all EMUs before and after.
        capacity: GPU → usable bytes, for every GPU any EMU or primitive touches.
        dur: seconds per pid (1 s each when None); ports: link ports per pid (none when None).
        order: ``"stage"`` (the paper's priority) or ``"critical"`` (see the module docstring).
        exclusive: add ownership edges (concurrent model-stages never share a GPU); False for a
            job whose framework colocates model-stages of one stage (:attr:`GlobalDAG.exclusive`).
        shared: model-stages exempt from ownership edges among each other (:attr:`GlobalDAG.shared`).

    Returns:
        The DAG (nodes in start order) and its greedy schedule (its makespan is ``L_tran``).

    Raises:
        ValueError: unknown ``order``.
        Infeasible: a circular wait, or a blocked acquisition no Destroy can unblock.
    """
    if order not in ("stage", "critical"):
        raise ValueError(f"order must be 'stage' or 'critical', got {order!r}")
    nodes = {n.pid: n for ld in locals_ for n in ld.nodes}
    dur = dur if dur is not None else {p: 1.0 for p in nodes}
    ports = ports if ports is not None else {p: frozenset() for p in nodes}
    edges = [(a, b, "state") for ld in locals_ for a, b in ld.edges] + _read_edges(locals_)
    edges += _ownership_edges(locals_, frozenset(shared)) if exclusive else []
    preds: dict[str, set[str]] = {p: set() for p in nodes}
    for a, b, _ in edges:
        preds[b].add(a)
    u0: dict[int, int] = {}
    for e in initial:
        for g in e.gpus:
            u0[g] = u0.get(g, 0) + e.bytes_on(g)
    tail = _tails(nodes, preds, dur)
    stage_key = {p: priority(n) for p, n in nodes.items()}
    keys = [lambda p: (stage_key[p], -tail[p])]
    if order == "critical":
        keys.insert(0, lambda p: (stage_key[p][0], -tail[p], stage_key[p]))
        for seed in range(1, 1 + NUM_NOISY_PASSES):
            rng = random.Random(seed)
            noise = {p: 1.0 + NOISE * rng.random() for p in sorted(nodes)}
            keys.append(lambda p, noise=noise: (stage_key[p][0], -tail[p] * noise[p], stage_key[p]))
    # lower bound on any schedule: the longest path, and the busiest link port
    load: dict = {}
    for p, ps in ports.items():
        for q in ps:
            load[q] = load.get(q, 0.0) + dur[p]
    bound = max([0.0, *tail.values(), *load.values()])
    best, first_error = None, None
    budget = max(2, WORK_BUDGET // max(1, len(nodes)))
    used = 0
    for i, key in enumerate(keys):
        if best is not None and best.makespan <= bound + 1e-9:
            break  # optimal already
        if i >= 2 and used >= budget:
            break
        used += 1
        try:
            s = memory_list_schedule(nodes, preds, dur, ports, u0, capacity, key)
        except Infeasible as e:
            first_error = first_error or e
            continue
        if best is None or s.makespan < best.makespan - 1e-12:
            best = s
    if best is None:
        raise first_error
    if order == "critical" and best.makespan > bound + 1e-9:
        best = repair_delays(best, nodes, preds, dur, ports, u0, capacity, keys[0], max(0, budget - used))
    res = _resource_edges(best, nodes, {p: set(s) for p, s in preds.items()}, u0, capacity)
    for a, b, _ in res:
        preds[b].add(a)
    best = Schedule(best.start, best.end, best.makespan, critical_chain(best.start, best.end, preds, ports),
                    algo=best.algo)
    seq = sorted(nodes, key=lambda p: (best.start[p], best.end[p], p))
    dag = GlobalDAG(nodes=tuple(nodes[p] for p in seq), edges=tuple(dict.fromkeys(edges + res)),
                    initial=tuple(initial), target=tuple(target), capacity=dict(capacity),
                    local=tuple(locals_), exclusive=exclusive, shared=frozenset(shared))
    return dag, best


def build_global_dag(locals_: list[LocalDAG], initial: tuple[EMU, ...], target: tuple[EMU, ...],
                     capacity: dict[int, int], dur: dict[str, float] | None = None,
                     ports: dict[str, frozenset] | None = None, order: str = "critical") -> GlobalDAG:
    """The DAG of :func:`plan_global` without its schedule."""
    return plan_global(locals_, initial, target, capacity, dur, ports, order)[0]


def rule_dag(locals_: list[LocalDAG], initial: tuple[EMU, ...], target: tuple[EMU, ...],
             capacity: dict[int, int]) -> GlobalDAG:
    """The DAG with state and ownership edges only (no greedy resource edges), nodes in local order:
    the problem an exact scheduler solves (``exact.py``), also where the greedy finds no order."""
    nodes = [n for ld in locals_ for n in ld.nodes]
    edges = [(a, b, "state") for ld in locals_ for a, b in ld.edges] + _read_edges(locals_)
    edges += _ownership_edges(locals_)
    return GlobalDAG(nodes=tuple(nodes), edges=tuple(dict.fromkeys(edges)), initial=tuple(initial),
                     target=tuple(target), capacity=dict(capacity), local=tuple(locals_))


def tails(dag: GlobalDAG, dur: dict[str, float]) -> dict[str, float]:
    """pid → seconds of the longest path from its start to the end of the DAG."""
    succ: dict[str, list[str]] = {n.pid: [] for n in dag.nodes}
    for a, b, _ in dag.edges:
        succ[a].append(b)
    out: dict[str, float] = {}
    for n in reversed(dag.nodes):  # nodes are in a topological order
        out[n.pid] = dur[n.pid] + max((out[s] for s in succ[n.pid]), default=0.0)
    return out


def critical_path_length(dag: GlobalDAG, dur: dict[str, float]) -> float:
    """Longest path through the DAG in seconds, ignoring link ports (a lower bound on ``L_tran``)."""
    return max(tails(dag, dur).values(), default=0.0)


def list_schedule(dag: GlobalDAG, dur: dict[str, float], ports: dict[str, frozenset]) -> Schedule:
    """Parallel list schedule of ``dag`` with durations ``dur`` (seconds) and ports per pid."""
    preds = dag.preds()
    succ: dict[str, list[str]] = {n.pid: [] for n in dag.nodes}
    for a, b, _ in dag.edges:
        succ[a].append(b)
    tail = tails(dag, dur)
    nodes = {n.pid: n for n in dag.nodes}

    def key(p: str) -> tuple:
        n = nodes[p]
        return (0 if n.kind == "destroy" else 1, -tail[p], priority(n))

    waiting = {p: len(ps) for p, ps in preds.items()}
    ready = [p for p, k in waiting.items() if k == 0]
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    why: dict[str, str | None] = {}
    holder: dict = {}  # port → pid holding it
    last_free: dict = {}  # port → pid that last released it
    running: list[tuple[float, str]] = []
    t = 0.0
    while ready or running:
        ready.sort(key=key)
        still = []
        for p in ready:
            if any(q in holder for q in ports[p]):
                still.append(p)
                continue
            start[p] = t
            end[p] = t + dur[p]
            pe = max(preds[p], key=lambda q: end[q], default=None)
            if pe is not None and end[pe] >= t - 1e-12:
                why[p] = pe
            else:
                why[p] = next((last_free[q] for q in ports[p] if q in last_free
                               and end[last_free[q]] >= t - 1e-12), pe)
            for q in ports[p]:
                holder[q] = p
            heapq.heappush(running, (end[p], p))
        ready = still
        if not running:
            break
        t, done = pop_finished(running)
        for p in done:
            for q in ports[p]:
                del holder[q]
                last_free[q] = p
            for s in succ[p]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
    if len(end) != len(nodes):
        raise RuntimeError("list schedule left primitives unscheduled; the DAG has a cycle")
    makespan = max(end.values(), default=0.0)
    path: list[str] = []
    p = max(end, key=lambda q: end[q]) if end else None
    while p is not None:
        path.append(p)
        p = why.get(p)
    return Schedule(start, end, makespan, tuple(reversed(path)))
