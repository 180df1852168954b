"""The rendezvous barrier the driver can release (``comm/rendezvous.py``, issue 30): members that all
arrive pass; one waiting for a member that never comes is released by the abort event (not by the
group timeout) or, without an abort, fails at the timeout naming the missing rank. In-process, on a
``HashStore`` under a ``PrefixStore`` as the workers use it; no Ray."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from nereus.runtime.comm.groups import CommError, new_group
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.rendezvous import RendezvousAborted, RendezvousTimeout, arrive


def test_every_member_arriving_passes_the_barrier():
    store = dist.PrefixStore("g", dist.HashStore())
    done = []
    ts = [threading.Thread(target=lambda r=r: done.append(arrive(store, r, 3, 60.0))) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(done) == 3 and all(s >= 0 for s in done)


def test_a_member_waiting_for_a_lost_one_is_released_by_the_abort_not_the_timeout():
    store = dist.PrefixStore("g", dist.HashStore())
    abort = threading.Event()
    box = {}

    def wait():
        try:
            arrive(store, 0, 2, 3600.0, abort)  # rank 1 never arrives; the group timeout is an hour
        except RendezvousAborted as e:
            box["aborted"] = str(e)

    t = threading.Thread(target=wait)
    t.start()
    while not store.check(["arrived/0"]):  # it is waiting now
        t.join(0.01)
    abort.set()
    t.join(60)  # a wait for the timeout would still be running
    assert not t.is_alive() and "a member was lost" in box["aborted"]


def test_without_an_abort_a_missing_member_fails_at_the_timeout_naming_its_rank():
    store = dist.PrefixStore("g", dist.HashStore())
    store.set("arrived/2", b"1")  # rank 2 came, rank 1 did not
    with pytest.raises(RendezvousTimeout, match=r"ranks \[1\] did not arrive within 0s"):
        arrive(store, 0, 3, 0.05)
    with pytest.raises(ValueError, match="rank must be in"):
        arrive(store, 3, 3, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        arrive(store, 0, 3, 0.0)


def test_a_workers_group_build_is_aborted_as_a_comm_error():
    meter = Meter()
    meter.abort = threading.Event()
    meter.abort.set()  # the driver already released this worker: a member is lost
    with pytest.raises(CommError, match="aborted: released by the driver"):
        new_group(dist.HashStore(), "t/lost", (0, 1), 0, meter, timeout_s=3600.0)
    assert meter.waiting is None  # the wait is over


def test_a_member_lost_after_arriving_releases_its_peer_from_the_groups_own_build():
    # the window the presence barrier leaves (issue 30): rank 1 arrived, then died before publishing its
    # gloo address, so rank 0 passes the barrier and blocks in ProcessGroupGloo's own store wait; the
    # abort releases that wait too (build_released), not the group timeout of an hour
    import datetime

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=60))
    master.set("t/late/arrived/1", b"1")  # rank 1's arrival, and nothing after it
    meter = Meter()
    meter.abort = threading.Event()
    box = {}

    def build():
        try:
            new_group(client, "t/late", (0, 1), 0, meter, timeout_s=3600.0)
        except CommError as e:
            box["error"] = str(e)

    t = threading.Thread(target=build, daemon=True)
    t.start()
    while not master.check(["t/late/arrived/0"]):  # rank 0 passed the barrier: it is in the build now
        t.join(0.01)
    t.join(0.2)
    assert t.is_alive()  # blocked in the build (rank 1's address never comes)
    meter.abort.set()
    t.join(60)  # a wait for the group timeout would still be running
    assert not t.is_alive() and "released by the driver" in box["error"], box
    assert "while the group was being built" in box["error"]  # released in the build, not in the barrier
    client.set("after", b"ok")  # the worker's own client is free: the abandoned build holds a client of its own
    assert master.get("after") == b"ok"
    # and the next group builds at once (the blocked helper's client is not reused): an all-reduce over it
    meter.abort.clear()
    other = Meter()
    other.abort = threading.Event()
    groups = {}

    def member(me, m):  # both members in this one process: distinct helper clients (cached by timeout)
        groups[me] = new_group(client if me == 0 else master, "t/next", (0, 1), me, m, timeout_s=60.0 - me)

    ts = [threading.Thread(target=member, args=(0, meter), daemon=True),
          threading.Thread(target=member, args=(1, other), daemon=True)]
    for x in ts:
        x.start()
    for x in ts:
        x.join(60)
    assert sorted(groups) == [0, 1], groups
    import torch

    ones = [torch.ones(3), torch.full((3,), 2.0)]
    ws = [threading.Thread(target=groups[i].all_reduce, args=(ones[i],), daemon=True) for i in (0, 1)]
    for x in ws:
        x.start()
    for x in ws:
        x.join(60)
    assert ones[0].tolist() == [3.0, 3.0, 3.0] == ones[1].tolist()  # 1 + 2 on both ranks


def test_the_abandoned_build_helper_ends_at_the_release_not_at_the_group_timeout():
    # issue 30's known gap: after the release, the helper thread building the gloo group stayed blocked
    # in the store (a thread and a half-built gloo context) until the group timeout; its store is now a
    # _Releasable whose blocking reads give up once the build is abandoned
    import datetime

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=60))
    master.set("t/gone/arrived/1", b"1")  # rank 1 arrived, then died before publishing its address
    meter = Meter()
    meter.abort = threading.Event()
    before = {t for t in threading.enumerate() if t.name == "group-build"}
    box = {}

    def build():
        try:
            new_group(client, "t/gone", (0, 1), 0, meter, timeout_s=3600.0)
        except CommError as e:
            box["error"] = str(e)

    t = threading.Thread(target=build, daemon=True)
    t.start()
    while not master.check(["t/gone/arrived/0"]):
        t.join(0.01)
    t.join(0.2)
    helpers = [h for h in threading.enumerate() if h.name == "group-build" and h not in before]
    assert t.is_alive() and len(helpers) == 1 and helpers[0].is_alive()  # blocked in the build
    meter.abort.set()
    t.join(60)
    assert "while the group was being built" in box["error"], box
    helpers[0].join(60)  # blocked until the group timeout, it would still be running (an hour)
    assert not helpers[0].is_alive()
