"""Exact scheduling of a transition with OR-Tools CP-SAT: the reference for the greedy schedule.

Source: paper §6.2 ("a classic resource-constrained project scheduling problem"), §7.4.3 (greedy
vs an off-the-shelf solver); DESIGN.md §4.6.

The same problem the greedy solves, without its resource edges:

* precedence: the local DAGs' state edges and the ownership edges (fixed by the rules);
* memory: per GPU a reservoir starting at ``U0[g]`` that must stay within ``capacity[g]``; each
  primitive adds ``mem_hi[g]`` at its start and ``mem_net[g] - mem_hi[g]`` at its end;
* links: primitives holding one port (``cost.ports``) never overlap;
* objective: minimize the makespan.

Times are integer microseconds; memory is integer bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from nereus.transition.global_dag import GlobalDAG
from nereus.transition.schedule import Schedule

__all__ = ["ExactResult", "exact_schedule"]

US = 1_000_000  # ticks per second


@dataclass(frozen=True)
class ExactResult:
    """Outcome of the CP-SAT model.

    Attributes:
        status: ``OPTIMAL``, ``FEASIBLE`` (time limit hit with a solution), ``INFEASIBLE`` or ``UNKNOWN``.
        schedule: the best schedule found (None without one).
        lower_bound: proven lower bound on the makespan, seconds.
        solve_s: wall-clock seconds spent in the solver.
    """

    status: str
    schedule: Schedule | None
    lower_bound: float
    solve_s: float

    @property
    def optimal(self) -> bool:
        return self.status == "OPTIMAL"


def exact_schedule(dag: GlobalDAG, dur: dict[str, float], ports: dict[str, frozenset],
                   time_limit_s: float = 60.0, num_workers: int = 1, hint: Schedule | None = None) -> ExactResult:
    """Minimize the makespan of ``dag``'s primitives under precedence, memory and link constraints.

    Args:
        dag: its state and ownership edges are used; its resource edges are ignored.
        dur: seconds per pid; ports: ports per pid.
        time_limit_s: solver wall-clock limit.
        num_workers: CP-SAT search workers.
        hint: a feasible schedule (e.g. the greedy one) given as a solution hint.
    """
    m = cp_model.CpModel()
    d = {p: max(1, round(dur[p] * US)) for p in dur}
    horizon = sum(d.values())
    start, end, iv = {}, {}, {}
    for n in dag.nodes:
        p = n.pid
        start[p] = m.new_int_var(0, horizon, f"s[{p}]")
        end[p] = m.new_int_var(0, horizon, f"e[{p}]")
        iv[p] = m.new_interval_var(start[p], d[p], end[p], f"i[{p}]")
    for a, b, kind in dag.edges:
        if kind != "resource":
            m.add(end[a] <= start[b])
    by_port: dict = {}
    for p, ps in ports.items():
        for q in ps:
            by_port.setdefault(q, []).append(iv[p])
    for ivs in by_port.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    u0 = dag.initial_usage()
    events: dict[int, tuple[list, list]] = {}
    for n in dag.nodes:
        for g in set(n.mem_hi) | set(n.mem_net):
            hi, net = n.mem_hi.get(g, 0), n.mem_net.get(g, 0)
            ts, ch = events.setdefault(g, ([], []))
            if hi:
                ts.append(start[n.pid])
                ch.append(hi)
            if net - hi:
                ts.append(end[n.pid])
                ch.append(net - hi)
    for g, (ts, ch) in events.items():
        if any(c > 0 for c in ch):
            m.add_reservoir_constraint(ts, ch, -(10**15), dag.capacity[g] - u0.get(g, 0))
    mk = m.new_int_var(0, horizon, "makespan")
    for p in end:
        m.add(mk >= end[p])
    m.minimize(mk)
    if hint is not None:
        for p in start:
            m.add_hint(start[p], round(hint.start[p] * US))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    t0 = time.perf_counter()
    st = solver.solve(m)
    solve_s = time.perf_counter() - t0
    name = solver.status_name(st)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ExactResult(name, None, 0.0, solve_s)
    s = {p: solver.value(start[p]) / US for p in start}
    e = {p: solver.value(end[p]) / US for p in end}
    sched = Schedule(s, e, solver.value(mk) / US, (), algo="cp-sat")
    return ExactResult(name, sched, solver.best_objective_bound / US, solve_s)
