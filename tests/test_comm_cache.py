"""Communicators kept by member set across calls, and dropped when a member leaves
(``runtime/comm/cache.py``). Three plain local worker processes on gloo (``run/local.py``)."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.comm.cache import GroupCache
from nereus.runtime.run.local import run_local


def _sum(group, me: int) -> float:
    t = torch.tensor([float(me + 1)])
    group.all_reduce(t)
    return float(t.item())


def _leave_and_rejoin(core):
    me = core.id
    cache = GroupCache(core.store, me, core.meter, 20.0)
    out = {}
    g3, s3 = cache.get((0, 1, 2), "t/a")
    out["first_all"] = _sum(g3, me)
    if me < 2:
        g2, _ = cache.get((0, 1), "t/b")
        again, setup = cache.get((0, 1), "t/b2")  # a later call with a new name: the same communicator
        out["same_object"] = again is g2 and setup == 0.0 and again.name == "t/b"
        out["first_pair"] = _sum(again, me)
    # worker 2 leaves (its communicators go with it) and a fresh worker 2 takes its place; the others
    # are told and drop what they shared with it
    if me == 2:
        cache.clear()
        cache = GroupCache(core.store, me, core.meter, 20.0)
    else:
        out["forgot"] = cache.forget(2)
        kept, setup = cache.get((0, 1), "t/c")
        out["pair_kept"] = kept.name == "t/b" and setup == 0.0
        out["pair_after"] = _sum(kept, me)
    g3b, setup = cache.get((0, 1, 2), "t/d")  # rebuilt under the new name on every member
    out["rebuilt"] = g3b.name == "t/d" and setup > 0.0
    out["all_after"] = _sum(g3b, me)
    out["stats"] = cache.stats()
    out["members"] = cache.members()
    return out


@pytest.mark.timeout(300)
def test_communicators_are_reused_and_rebuilt_after_a_member_leaves():
    res = run_local(3, _leave_and_rejoin, timeout_s=240.0)
    for r in res:
        assert r["first_all"] == 1 + 2 + 3 and r["all_after"] == 6 and r["rebuilt"]
    for r in res[:2]:
        assert r["same_object"] and r["first_pair"] == 3 and r["pair_kept"] and r["pair_after"] == 3
        assert r["forgot"] == ["t/a"]
        # built: (0,1,2) twice and (0,1) once; reused: (0,1) twice
        assert r["stats"]["built"] == 3 and r["stats"]["reused"] == 2 and r["stats"]["held"] == 2
        assert r["members"] == [(0, 1), (0, 1, 2)]
    assert res[2]["stats"]["built"] == 1 and res[2]["members"] == [(0, 1, 2)]


def test_forget_and_bad_members():
    cache = GroupCache(store=None, me=0, meter=None, timeout_s=5.0)
    g, setup = cache.get((0,), "solo")  # a group of one needs no rendezvous
    assert g.pg is None and cache.get((0,), "other")[0] is g and cache.forget(3) == []
    assert cache.forget(0) == ["solo"] and cache.stats()["held"] == 0
    with pytest.raises(ValueError, match="worker 0 is not a member"):
        cache.get((1, 2), "x")
