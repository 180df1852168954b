"""``verify_schedule`` on instantaneous primitives (issue 26: valid schedules refused).

A Destroy costs ``teardown_s``, which calibration may set to 0: it then starts and ends at the
instant its predecessor ends. The checker used to replay events sorted by (time, end-before-start,
pid), so such a Destroy's end ran before its own start and before the end of an Extend it follows
(``"destroy:…" < "extend:…"``). Each of the three messages that refused valid schedules has a
hand-built case here; the property test runs the planner with calibrated-like cost parameters.
"""

from __future__ import annotations

import random

import pytest

from nereus.transition.cost import CostParams
from nereus.transition.emu import EMU
from nereus.transition.estimate import estimate_transition
from nereus.transition.global_dag import GlobalDAG
from nereus.transition.instances import random_instance
from nereus.transition.primitives import destroy, extend
from nereus.transition.schedule import Schedule
from nereus.transition.verify import ScheduleError, execution_order, verify_schedule

B = 1000
CAP = {g: 10**9 for g in range(4)}


def _emu(uid: str, gpu: int, ms: str = "critic.train") -> EMU:
    return EMU(uid, ms, 1, 1, (gpu,), (B,))


def _sched(times: dict) -> Schedule:
    return Schedule({p: a for p, (a, _) in times.items()}, {p: b for p, (_, b) in times.items()},
                    max(b for _, b in times.values()))


def test_instant_destroy_after_extend_of_the_only_copy_passes():
    """Extend critic.train#0 (GPU 0) → *0 (GPU 1) over [0, 1], then a 0 s Destroy of #0 at 1: *0 is
    a full copy when #0 goes (was: 'removes the last copy of critic.train's state')."""
    src, dst = _emu("critic.train#0", 0), _emu("critic.train*0", 1)
    e, d = extend(src, dst), destroy(src)
    dag = GlobalDAG((e, d), ((e.pid, d.pid, "state"),), (src,), (dst,), CAP)
    assert verify_schedule(dag, _sched({e.pid: (0.0, 1.0), d.pid: (1.0, 1.0)})) == [e.pid, d.pid]
    with pytest.raises(ScheduleError, match="last copy"):  # the Destroy without its edge is still refused
        bad = GlobalDAG((d, e), (), (src,), (dst,), CAP)
        verify_schedule(bad, _sched({d.pid: (0.0, 0.0), e.pid: (0.0, 1.0)}))


def test_instant_destroy_after_extend_with_another_replica_passes():
    """Two replicas; the Destroy of the Extend's source ends with the Extend (was: 'frees
    critic.train#0 while extend:critic.train*0 still reads it')."""
    a, b, dst = _emu("critic.train#0", 0), _emu("critic.train#1", 2), _emu("critic.train*0", 1)
    e, d = extend(a, dst), destroy(a)
    dag = GlobalDAG((e, d), ((e.pid, d.pid, "state"),), (a, b), (b, dst), CAP)
    verify_schedule(dag, _sched({e.pid: (0.0, 1.0), d.pid: (1.0, 1.0)}))
    unordered = GlobalDAG((e, d), (), (a, b), (b, dst), CAP)  # a Destroy during the Extend is refused
    with pytest.raises(ScheduleError, match="frees critic.train#0 while extend:critic.train\\*0 still reads"):
        verify_schedule(unordered, _sched({e.pid: (0.0, 1.0), d.pid: (0.5, 0.5)}))


def test_instant_destroy_of_a_spare_replica_passes():
    """A lone 0 s Destroy of one of two replicas (was: 'EMU actor.infer#1 does not exist': its end
    replayed before its start)."""
    a, b = _emu("actor.infer#0", 0, "actor.infer"), _emu("actor.infer#1", 1, "actor.infer")
    d = destroy(b)
    dag = GlobalDAG((d,), (), (a, b), (a,), CAP)
    verify_schedule(dag, _sched({d.pid: (0.0, 0.0)}))


def test_instant_chain_runs_in_dag_order_whatever_the_pids():
    """Two 0 s primitives at one instant, the second depending on the first, with pids that sort
    the other way: the replay and the executor's order follow the edge."""
    src, dst = _emu("critic.train#0", 0), _emu("critic.train*0", 1)
    e, d = extend(src, dst), destroy(src)
    dag = GlobalDAG((e, d), ((e.pid, d.pid, "state"),), (src,), (dst,), CAP)
    assert d.pid < e.pid
    s = _sched({e.pid: (0.0, 0.0), d.pid: (0.0, 0.0)})
    assert verify_schedule(dag, s) == execution_order(dag, s) == [e.pid, d.pid]


def test_every_feasible_estimate_verifies_under_calibrated_parameters():
    """Seeded plan pairs with cost parameters drawn as calibration sets them (``teardown_s`` 0
    included, which makes every Destroy instantaneous): each feasible estimate passes the checker.
    At the old replay order 7 of the 31 feasible ones were refused."""
    rng = random.Random(26)
    checked = 0
    for _ in range(60):
        inst = random_instance(rng, num_nodes=rng.randint(1, 2), planner_like=rng.random() < 0.5)
        if inst is None:
            continue
        params = CostParams(transit_buffers=rng.random() < 0.5, copy_bandwidth=rng.choice([0.3e9, 1e9, 3e9]),
                            comm_setup_intra_s=rng.choice([0.001, 0.02, 0.2]),
                            teardown_s=rng.choice([0.0, 0.0, 0.01, 0.1]))
        est = estimate_transition(inst.job, inst.current, inst.target, pool=inst.pool, params=params)
        if est.feasible:
            verify_schedule(est.dag, est.schedule)
            checked += 1
    assert checked >= 20


def test_instant_producer_before_its_instant_consumer_leaves_the_target():
    """A 0 s Extend of critic.train*0 and a 0 s Destroy of it at one instant: the end state is the
    target {critic.train#0} (was: 'the schedule ends in 2 EMUs that are not the target's 1': the
    Destroy's end replayed first, then the Extend's end left *0 behind; the message that ended the
    README's elastic run, '14 EMUs that are not the target's 8', has this form)."""
    src, dst = _emu("critic.train#0", 0), _emu("critic.train*0", 1)
    e, d = extend(src, dst), destroy(dst)
    dag = GlobalDAG((e, d), ((e.pid, d.pid, "state"),), (src,), (src,), CAP)
    verify_schedule(dag, _sched({e.pid: (0.0, 0.0), d.pid: (0.0, 0.0)}))
