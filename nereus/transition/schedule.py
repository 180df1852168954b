"""Greedy list scheduling of transition primitives; ``L_tran`` is the makespan.

Source: paper §6.2 ("a primitive is ready only after its predecessors complete and its resource
requirements are satisfied; ready primitives run concurrently across GPU groups"), DESIGN.md §4.6.

* :func:`memory_list_schedule`: the greedy of the global DAG (``global_dag``): whenever a primitive
  ends, start every ready primitive, in priority order, whose link ports (``cost.ports``) are free
  and whose peak memory fits every GPU it touches (running primitives counted at their peak, ended
  ones at their net effect). Raises ``Infeasible`` when nothing runs and nothing ready fits.
* :func:`repair_delays`: a local search over delays that a non-delay list schedule cannot make.

Both work on primitives and predecessor sets, not on a :class:`~nereus.transition.global_dag.GlobalDAG`;
what schedules or measures a finished global DAG (``list_schedule``, ``critical_path_length``) lives
with it in ``global_dag``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from nereus.transition.local_dag import Infeasible
from nereus.transition.primitives import Primitive

__all__ = ["Schedule", "critical_chain", "memory_list_schedule", "repair_delays", "pop_finished"]

#: Extra list-schedule passes with seeded noise on the path-length priority (``order="critical"``);
#: each costs about a millisecond at 64 GPUs and the best pass is kept.
NUM_NOISY_PASSES = 4
NOISE = 1.0
#: Rounds of the delay local search (``repair_delays``); each tries up to ``REPAIR_TRIES`` passes.
REPAIR_ROUNDS = 8
REPAIR_TRIES = 3
#: Primitive-passes one greedy may spend (passes x primitives); bounds time on very large DAGs
#: (at 800 primitives about ten passes), leaving small ones unbounded in practice.
WORK_BUDGET = 8000


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



def pop_finished(running: list) -> tuple[float, list[int]]:
    """Pop the earliest end time and every primitive ending at it from the ``(end, id)`` heap."""
    t, p = heapq.heappop(running)
    done = [p]
    while running and running[0][0] <= t + 1e-12:
        done.append(heapq.heappop(running)[1])
    return t, done

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


def blocked_reason(blocked: list[Primitive], used: dict, capacity: dict) -> str:
    parts = []
    for n in blocked[:4]:
        for g, h in sorted(n.mem_hi.items()):
            if h > 0 and used.get(g, 0) + h > capacity[g]:
                parts.append(f"{n.pid} needs {h / 2**30:.2f} GiB on GPU {g} where "
                             f"{max(capacity[g] - used.get(g, 0), 0) / 2**30:.2f} GiB are free")
                break
    return "no Destroy can release what a blocked acquisition needs: " + "; ".join(parts)


_MEM_CACHE: dict = {}


def _mem_items(nodes: dict[str, Primitive]) -> tuple[dict, dict]:
    """Per pid: (GPU, bytes added at start) and (GPU, bytes changed at end); cached per node set."""
    k = id(nodes)
    hit = _MEM_CACHE.get(k)
    if hit is not None and hit[0] is nodes:
        return hit[1], hit[2]
    hi_items = {p: [(g, h) for g, h in n.mem_hi.items() if h > 0] for p, n in nodes.items()}
    end_delta = {p: [(g, d) for g in set(n.mem_hi) | set(n.mem_net)
                     if (d := n.mem_net.get(g, 0) - n.mem_hi.get(g, 0))] for p, n in nodes.items()}
    _MEM_CACHE.clear()
    _MEM_CACHE[k] = (nodes, hi_items, end_delta)
    return hi_items, end_delta


def memory_list_schedule(nodes: dict[str, Primitive], preds: dict[str, set[str]], dur: dict[str, float],
                 ports: dict[str, frozenset], u0: dict[int, int], capacity: dict, key) -> Schedule:
    succs: dict[str, list[str]] = {p: [] for p in nodes}
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    rank = {p: key(p) for p in nodes}
    hi_items, end_delta = _mem_items(nodes)
    waiting = {p: len(ps) for p, ps in preds.items()}
    ready = [p for p, k in waiting.items() if k == 0]
    used = dict(u0)  # ended primitives at their net, running ones at their peak
    holder: set = set()
    running: list[tuple[float, str]] = []
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    t = 0.0
    while ready or running:
        ready.sort(key=rank.__getitem__)
        still = []
        for p in ready:
            if ports[p] and not holder.isdisjoint(ports[p]):
                still.append(p)
                continue
            his = hi_items[p]
            if any(used.get(g, 0) + h > capacity[g] for g, h in his):
                still.append(p)
                continue
            start[p] = t
            end[p] = e = t + dur[p]
            holder |= ports[p]
            for g, h in his:
                used[g] = used.get(g, 0) + h
            heapq.heappush(running, (e, p))
        ready = still
        if not running:
            if ready:
                raise Infeasible(blocked_reason([nodes[p] for p in ready], used, capacity), tuple(ready))
            break
        t, done = pop_finished(running)
        for p in done:
            holder -= ports[p]
            for g, d in end_delta[p]:
                used[g] = used.get(g, 0) + d
            for s in succs[p]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
    return Schedule(start, end, max(end.values(), default=0.0), algo="greedy")


def _ancestors(p: str, preds: dict[str, set[str]]) -> set[str]:
    seen, stack = set(), [p]
    while stack:
        for q in preds[stack.pop()]:
            if q not in seen:
                seen.add(q)
                stack.append(q)
    return seen


def repair_delays(best: Schedule, nodes, preds, dur, ports, u0, capacity, key,
                  max_passes: int = REPAIR_ROUNDS * REPAIR_TRIES) -> Schedule:
    """Local search over delay decisions a non-delay list schedule cannot make.

    Walk the critical chain back to a primitive that waited for memory or a port after its
    predecessors ended; try making each primitive that held those resources when it became ready
    wait for it instead (a temporary edge), and keep the schedule when the makespan drops. At most
    ``max_passes`` list-schedule passes.
    """
    extra: dict[str, set[str]] = {p: set(ps) for p, ps in preds.items()}
    passes = 0
    for _ in range(REPAIR_ROUNDS):
        chain = critical_chain(best.start, best.end, extra, ports)
        improved = False
        for c in reversed(chain):
            ready_at = max((best.end[q] for q in extra[c]), default=0.0)
            if best.start[c] <= ready_at + 1e-9:
                continue
            n = nodes[c]
            mine = {g for g, h in n.mem_hi.items() if h > 0}
            anc = _ancestors(c, extra)
            blockers = [b for b in nodes if b != c and b not in anc and best.start[b] < best.start[c]
                        and best.end[b] > ready_at
                        and (ports[b] & ports[c] or mine & {g for g, h in nodes[b].mem_hi.items() if h > 0})]
            blockers.sort(key=lambda b: -best.start[b])
            for b in blockers[:REPAIR_TRIES]:
                if passes >= max_passes:
                    return best
                passes += 1
                extra[b].add(c)
                try:
                    s = memory_list_schedule(nodes, extra, dur, ports, u0, capacity, key)
                except Infeasible:
                    s = None
                if s is not None and s.makespan < best.makespan - 1e-9:
                    best, improved = s, True
                    break
                extra[b].discard(c)
            if improved:
                break
        if not improved:
            break
    return best
