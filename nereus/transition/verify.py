"""Check a transition DAG and a schedule before anything moves (DESIGN.md §4.6, §4.8).

The executor runs primitives in the schedule's start order; this replays that order on the EMU
state, with the schedule's times, and refuses it when any of the transition's safety rules breaks:

* order: every primitive starts after each DAG predecessor ended (state, ownership and resource
  edges), and its ``reads``/``consumes`` EMUs exist when it starts; no running primitive loses an
  EMU it reads; at one instant the replay ends the primitives that ran, then runs the
  instantaneous ones (start == end, e.g. a Destroy at ``teardown_s`` 0) start-then-end in a
  topological order of the edges, then starts the rest;
* last copy: a model-stage that the DAG does not reload (no ``Load`` of it) keeps at least one full
  copy at every instant (a host-staged copy counts; a ZeRO group, whose ranks hold one slice each,
  is one full copy); a frozen or derived model-stage whose target drops its idle state
  (``offload="drop"``: no target EMU) may end with none;
* sharded state (every byte accounted): every shard a Split, Merge or Extend produces on a GPU is
  either held there already by an EMU the primitive consumes or reads (``held.held_bytes``: for a
  ZeRO group, the rank's own slice) or received (``Primitive.recv``); so no primitive frees the last
  copy of a slice (an optimizer shard of a leaving rank) that its output claims to hold;
* memory: on every GPU, the state held plus the peak (``mem_hi``) of every running primitive stays
  within ``dag.capacity``;
* ownership: no acquisition of a GPU owned by a concurrent model-stage (``primitives.check_pre``),
  unless the job colocates model-stages of one stage (``dag.exclusive`` False);
* result: the EMUs at the end are exactly the target (by model-stage, layout and GPUs).

Pure: no runtime import.
"""

from __future__ import annotations

import heapq

from nereus.transition.global_dag import GlobalDAG
from nereus.transition.held import held_bytes
from nereus.transition.primitives import Primitive, TransitionState, check_pre
from nereus.transition.schedule import Schedule

__all__ = ["ScheduleError", "verify_schedule", "execution_order"]

_EPS = 1e-9
#: bytes a produced shard may lack per GPU (rounding of ``ceil`` shard sizes against held overlaps)
_SLACK = 16


class ScheduleError(ValueError):
    """A schedule that breaks a transition rule; the message names the primitive and the rule."""


def execution_order(dag: GlobalDAG, schedule: Schedule) -> list[str]:
    """pids by start time (ties: end time, then a topological order of the DAG's edges)."""
    rank = _topological_rank(dag)
    return sorted(rank, key=lambda p: (schedule.start[p], schedule.end[p], rank[p]))


def _received(p: Primitive, g: int) -> int:
    if p.recv:
        return p.recv.get(g, 0)
    # a primitive built without ``recv``: what its pairs bring, or at most its group's receive size
    return sum(b for _, d, b in p.pairs if d == g) + max((b for gs, b in p.groups if g in gs), default=0)


def check_supply(dag: GlobalDAG, p: Primitive, emus: dict) -> str | None:
    """Why a Split, Merge or Extend would produce a shard that is neither held nor received, or None.

    ``emus``: uid → EMU alive when ``p`` starts. Where a ZeRO group is involved and ``dag.models``
    is set, the held part is :func:`~nereus.transition.held.held_bytes` (a rank holds its own slice
    only); otherwise (replicas: nothing is sharded, and ``resident_bytes`` undercounts replicated KV
    heads) it is bounded by the bytes the inputs keep on the GPU.
    """
    if p.kind not in ("split", "merge", "extend"):
        return None
    inputs = [emus[u] for u in p.reads + p.consumes if u in emus]
    spec = dag.models.get(p.model_stage)
    for e in p.produces:
        for g in e.gpus:
            need = e.bytes_on(g)
            if not need:
                continue
            on_g = [x for x in inputs if g in x.gpus and not x.host]
            if spec is not None and (e.z > 1 or any(x.z > 1 for x in on_g)):
                held = max((held_bytes(spec[0], spec[1], x, g, e, g) for x in on_g), default=0)
            else:
                held = min(need, sum(x.bytes_on(g) for x in on_g))
            short = need - held - _received(p, g)
            if short > _SLACK:
                return (f"{p.pid}: GPU {g} would hold {need:,} B of {e.uid} but keeps {held:,} B and receives "
                        f"{_received(p, g):,} B; {short:,} B of {e.model_stage}'s state (e.g. a leaving rank's "
                        "optimizer shard) would be freed without a copy (last-copy rule, sharded state)")
    return None


def _topological_rank(dag: GlobalDAG) -> dict[str, int]:
    """pid → position in a topological order of ``dag.edges`` (Kahn's; ties in ``dag.nodes`` order)."""
    idx = {p.pid: i for i, p in enumerate(dag.nodes)}
    succ: dict[str, list[str]] = {p: [] for p in idx}
    indeg = dict.fromkeys(idx, 0)
    for a, b, _ in dag.edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [(i, p) for p, i in idx.items() if not indeg[p]]
    heapq.heapify(ready)
    rank: dict[str, int] = {}
    while ready:
        _, p = heapq.heappop(ready)
        rank[p] = len(rank)
        for b in succ[p]:
            indeg[b] -= 1
            if not indeg[b]:
                heapq.heappush(ready, (idx[b], b))
    if len(rank) != len(idx):
        raise ScheduleError(f"the DAG has a cycle through {sorted(set(idx) - set(rank))[:3]}")
    return rank


def _start(dag: GlobalDAG, state: TransitionState, running: set, p: Primitive, t: float) -> None:
    why = check_pre(state, p, dag.exclusive, dag.shared) or check_supply(dag, p, state.emus)
    if why:
        raise ScheduleError(f"at {t:.3f}s: {why}")
    running.add(p.pid)
    for g, b in p.mem_hi.items():
        state.used[g] = state.used.get(g, 0) + b
        cap = dag.capacity.get(g)
        if cap is not None and state.used[g] > cap:
            raise ScheduleError(f"at {t:.3f}s: {p.pid} needs {b:,} B on GPU {g}, which then holds "
                                f"{state.used[g]:,} B of its {cap:,} B usable: memory bound broken")


def _end(state: TransitionState, running: set, node: dict, reloaded: set, p: Primitive, t: float) -> None:
    running.discard(p.pid)
    for g, b in p.mem_hi.items():
        state.used[g] -= b
    for uid in p.consumes:
        state.emus.pop(uid, None)
    for e in p.produces:
        state.emus[e.uid] = e
    for g, b in p.mem_net.items():
        state.used[g] = state.used.get(g, 0) + b
    ms = p.model_stage
    if ms not in reloaded and state.copies(ms) == 0:
        raise ScheduleError(f"at {t:.3f}s: {p.pid} removes the last copy of {ms}'s state (last-copy rule)")
    for r in running:
        lost = [u for u in node[r].reads + node[r].consumes if u in p.consumes]
        if lost:
            raise ScheduleError(f"at {t:.3f}s: {p.pid} frees {lost[0]} while {r} still reads it")


def verify_schedule(dag: GlobalDAG, schedule: Schedule) -> list[str]:
    """Replay ``schedule`` on ``dag`` and return its execution order (module docstring).

    Raises:
        ScheduleError: a missing or unknown primitive, a start before a predecessor's end, an EMU
            read or consumed that does not exist, a model-stage left with no copy, a produced shard
            neither held nor received (:func:`check_supply`), a GPU over its
            capacity, a concurrent owner, or an end state other than the target.
    """
    pids = {p.pid for p in dag.nodes}
    if set(schedule.start) != pids or set(schedule.end) != pids:
        extra = sorted(set(schedule.start) ^ pids)[:3]
        raise ScheduleError(f"schedule and DAG list different primitives (e.g. {extra})")
    node = {p.pid: p for p in dag.nodes}
    for a, b, kind in dag.edges:
        if schedule.start[b] < schedule.end[a] - _EPS:
            raise ScheduleError(f"{b} starts at {schedule.start[b]:.3f}s before its {kind} predecessor {a} "
                                f"ends at {schedule.end[a]:.3f}s")
    reloaded = {p.model_stage for p in dag.nodes if p.kind == "load"}
    # frozen/derived state whose target is dropped (no target EMU): it survives in storage/its *.train
    reloaded |= {e.model_stage for e in dag.initial if not e.model_stage.endswith(".train")} - {
        e.model_stage for e in dag.target}
    state = TransitionState.of(dag.initial)
    rank = _topological_rank(dag)
    # events (time, phase, rank, pid) at one instant: ends of the primitives that ran (releasing before
    # acquiring), then the instantaneous ones (start == end, e.g. a Destroy at ``teardown_s`` 0) in DAG
    # order, each started and ended at once, then the starts of those that run on; so a primitive
    # starts before it ends and after every predecessor ended, whatever the pids' spelling
    events = []
    preds = dag.preds()
    for p in pids:
        # a start that float rounding puts a hair before a predecessor's end (checked above within
        # _EPS) happens at that end
        start = max([schedule.start[p], *(schedule.end[a] for a in preds[p])])
        end = max(start, schedule.end[p])
        if end - start <= _EPS:
            events.append((start, 1, rank[p], p))
        else:
            events.append((start, 2, rank[p], p))
            events.append((end, 0, rank[p], p))
    events.sort()
    running: set[str] = set()
    for t, phase, _, pid in events:
        p = node[pid]
        if phase:
            _start(dag, state, running, p, t)
        if phase < 2:
            _end(state, running, node, reloaded, p, t)
    want = sorted(e.signature() for e in dag.target)
    got = sorted(e.signature() for e in state.emus.values())
    if want != got:
        raise ScheduleError(f"the schedule ends in {len(got)} EMUs that are not the target's {len(want)}")
    return execution_order(dag, schedule)
