"""Check a transition DAG and a schedule before anything moves (DESIGN.md §4.6, §4.8).

The executor runs primitives in the schedule's start order; this replays that order on the EMU
state, with the schedule's times, and refuses it when any of the transition's safety rules breaks:

* order: every primitive starts after each DAG predecessor ended (state, ownership and resource
  edges), and its ``reads``/``consumes`` EMUs exist when it starts; no running primitive loses an
  EMU it reads;
* last copy: a model-stage that the DAG does not reload (no ``Load`` of it) keeps at least one full
  copy at every instant (a host-staged copy counts);
* memory: on every GPU, the state held plus the peak (``mem_hi``) of every running primitive stays
  within ``dag.capacity``;
* ownership: no acquisition of a GPU owned by a concurrent model-stage (``primitives.check_pre``);
* result: the EMUs at the end are exactly the target (by model-stage, layout and GPUs).

Pure: no runtime import.
"""

from __future__ import annotations

from nereus.transition.global_dag import GlobalDAG
from nereus.transition.primitives import TransitionState, check_pre
from nereus.transition.schedule import Schedule

__all__ = ["ScheduleError", "verify_schedule", "execution_order"]

_EPS = 1e-9


class ScheduleError(ValueError):
    """A schedule that breaks a transition rule; the message names the primitive and the rule."""


def execution_order(dag: GlobalDAG, schedule: Schedule) -> list[str]:
    """pids by start time (ties: end time, then the DAG's order)."""
    idx = {p.pid: i for i, p in enumerate(dag.nodes)}
    return sorted(idx, key=lambda p: (schedule.start[p], schedule.end[p], idx[p]))


def verify_schedule(dag: GlobalDAG, schedule: Schedule) -> list[str]:
    """Replay ``schedule`` on ``dag`` and return its execution order (module docstring).

    Raises:
        ScheduleError: a missing or unknown primitive, a start before a predecessor's end, an EMU
            read or consumed that does not exist, a model-stage left with no copy, a GPU over its
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
    state = TransitionState.of(dag.initial)
    events = []  # (time, 0 end / 1 start, pid): ends first at equal times, releasing before acquiring
    for p in pids:
        events.append((schedule.start[p], 1, p))
        events.append((schedule.end[p], 0, p))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    running: set[str] = set()
    for t, is_start, pid in events:
        p = node[pid]
        if is_start:
            why = check_pre(state, p)
            if why:
                raise ScheduleError(f"at {t:.3f}s: {why}")
            running.add(pid)
            for g, b in p.mem_hi.items():
                state.used[g] = state.used.get(g, 0) + b
                cap = dag.capacity.get(g)
                if cap is not None and state.used[g] > cap:
                    raise ScheduleError(f"at {t:.3f}s: {pid} needs {b:,} B on GPU {g}, which then holds "
                                        f"{state.used[g]:,} B of its {cap:,} B usable: memory bound broken")
            continue
        running.discard(pid)
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
            raise ScheduleError(f"at {t:.3f}s: {pid} removes the last copy of {ms}'s state (last-copy rule)")
        for r in running:
            lost = [u for u in node[r].reads + node[r].consumes if u in p.consumes]
            if lost:
                raise ScheduleError(f"at {t:.3f}s: {pid} frees {lost[0]} while {r} still reads it")
    want = sorted(e.signature() for e in dag.target)
    got = sorted(e.signature() for e in state.emus.values())
    if want != got:
        raise ScheduleError(f"the schedule ends in {len(got)} EMUs that are not the target's {len(want)}")
    return execution_order(dag, schedule)
