"""The driver's progress check (``run/faults.Progress``, issue 30) on heartbeats given by hand: a
worker busy in a watched call (a compute call, a transition primitive, a checkpoint write) that times
no op for longer than the bound is stalled; one waiting for peers, idle, or whose op count or phase
moves is not. The clock is passed in (no wall-clock)."""

from __future__ import annotations

from nereus.runtime.run.faults import Progress


def _hb(busy, ops, waiting=None):
    return {"busy": busy, "ops": ops, "waiting": waiting}


def test_a_worker_stuck_inside_a_transition_primitive_is_stalled_after_the_bound():
    p = Progress(10.0)
    prim = "transition_run:reshard:p3"
    assert p.stalled({0: _hb(prim, 5), 1: _hb(prim, 7, waiting="p2p")}, 0.0) == {}
    assert p.stalled({0: _hb(prim, 5), 1: _hb(prim, 7, waiting="p2p")}, 10.0) == {}  # not past the bound
    # worker 0: 10.5 s busy with no op; worker 1 waits for it in a receive (the peer, not the slow one)
    assert p.stalled({0: _hb(prim, 5), 1: _hb(prim, 7, waiting="p2p")}, 10.5) == {0: 10.5}
    assert p.phase[0] == prim


def test_a_checkpoint_write_is_watched_and_progress_or_a_new_phase_restarts_the_clock():
    p = Progress(4.0)
    p.stalled({2: _hb("dcp_save", 3)}, 0.0)
    assert p.stalled({2: _hb("dcp_save", 4)}, 3.0) == {}  # an op: progress
    assert p.stalled({2: _hb("dcp_save", 4)}, 6.0) == {}  # 3 s since it
    assert p.stalled({2: _hb("dcp_wait", 4)}, 8.0) == {}  # another call: its own clock
    assert p.stalled({2: _hb("dcp_wait", 4)}, 12.5) == {2: 4.5}
    assert p.stalled({2: _hb(None, 4)}, 20.0) == {}  # idle between calls: not stalled
    assert p.stalled({2: _hb("dcp_wait", 4)}, 21.0) == {}  # a new stretch starts from zero


def test_no_bound_no_check():
    assert Progress(None).stalled({0: _hb("train_fields", 0)}, 1e9) == {}


def test_a_checkpoint_write_gets_its_own_longer_bound():
    p = Progress(2.0, {"dcp_save": 15.0})
    p.stalled({0: _hb("dcp_save", 1), 1: _hb("train_fields", 1)}, 0.0)
    assert p.stalled({0: _hb("dcp_save", 1), 1: _hb("train_fields", 1)}, 3.0) == {1: 3.0}  # past 2 s
    assert p.stalled({0: _hb("dcp_save", 1)}, 15.5) == {0: 15.5}  # past its own 15 s
