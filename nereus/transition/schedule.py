"""Greedy list scheduling of a global transition DAG; ``L_tran`` is its makespan.

Source: paper §6.2 ("a primitive is ready only after its predecessors complete and its resource
requirements are satisfied; ready primitives run concurrently across GPU groups"), DESIGN.md §4.6.

Memory and GPU ownership are already safe in every order the DAG allows (``global_dag``), so the
scheduler only respects the edges and the link ports (``cost.ports``): a parallel list schedule that,
whenever a primitive ends, starts every ready primitive whose ports are free, in the order
Destroy first (release-before-acquire), then longest remaining path, then stage order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus.transition.primitives import priority

if TYPE_CHECKING:
    from nereus.transition.global_dag import GlobalDAG

__all__ = ["Schedule", "list_schedule", "critical_path_length", "tails", "critical_chain"]


@dataclass(frozen=True)
class Schedule:
    """Start and end of every primitive, seconds from the start of the transition.

    Attributes:
        start, end: pid → seconds.
        makespan: seconds, ``L_tran``.
        critical_path: pids whose chain (edges or a freed port) sets the makespan, first to last.
        algo: ``greedy`` or ``cp-sat``.
    """

    start: dict
    end: dict
    makespan: float
    critical_path: tuple[str, ...] = ()
    algo: str = "greedy"

    def to_dict(self) -> dict:
        return {"algo": self.algo, "makespan_s": self.makespan, "critical_path": list(self.critical_path),
                "primitives": {p: {"start_s": self.start[p], "end_s": self.end[p]}
                               for p in sorted(self.start, key=lambda p: (self.start[p], p))}}


def critical_chain(start: dict, end: dict, preds: dict[str, set[str]], ports: dict[str, frozenset]) -> tuple[str, ...]:
    """The chain that sets the makespan, first to last: from the last primitive to end, step back to
    the predecessor (an edge, else a primitive that freed one of its ports, else any primitive) that
    ended when it started."""
    if not end:
        return ()
    p = max(end, key=lambda q: (end[q], q))
    path = [p]
    while start[p] > 1e-12:
        at = [q for q in end if abs(end[q] - start[p]) <= 1e-9 and q not in path]
        nxt = (next((q for q in at if q in preds[p]), None)
               or next((q for q in at if ports.get(q, frozenset()) & ports.get(p, frozenset())), None)
               or (at[0] if at else None))
        if nxt is None:
            break
        path.append(nxt)
        p = nxt
    return tuple(reversed(path))


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
        t, p = heapq.heappop(running)
        done = [p]
        while running and running[0][0] <= t + 1e-12:
            done.append(heapq.heappop(running)[1])
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
