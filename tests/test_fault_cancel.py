"""The cancel a survivor gets when a peer is lost (``FaultTolerantWorker.cancel``; issue 30).

Found by ``bench_faults.py --faults 10 --seed 5151``: a worker killed inside a recovery's live
transition was detected in 1.00 s, but the recovery's calls ended only after 15.07 s, the group
timeout. A survivor was blocked in a collective with another survivor whose own part of it the
cancel refused (its call came after the cancel): the abort releases a *rendezvous*, not a
collective, and the refused peer, alive, kept its communicator's sockets open. The cancel now drops
every communicator held outside the engines, so the idle communicator's sockets close and the
blocked peer's collective fails at once.

In-process (two workers, one process, no Ray): a few seconds."""

from __future__ import annotations

import datetime
import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nereus.runtime.comm.groups import CommError  # noqa: E402
from nereus.runtime.worker.fault_tolerant import FaultTolerantWorker  # noqa: E402


def test_a_peer_blocked_in_a_collective_with_a_cancelled_worker_fails_at_once_not_at_the_timeout():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    # the group timeout is two minutes; distinct timeouts give the two in-process members distinct
    # helper store clients (comm/rendezvous.py caches one per process, host, port and timeout)
    ws = [FaultTolerantWorker(i, "127.0.0.1", master.port, 120.0 - i) for i in (0, 1)]
    groups = {}

    def build(i):
        groups[i] = ws[i].transit.comms.get((0, 1), "t/cancel")[0]  # a transition's cached communicator

    ts = [threading.Thread(target=build, args=(i,), daemon=True) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(groups) == [0, 1]
    mine = groups.pop(0)
    groups.clear()  # worker 1 holds its communicator only in its cache, as between two primitives
    out = {}

    def all_reduce():  # worker 0 enters a collective worker 1 will never join (its call is refused)
        try:
            mine.all_reduce(torch.ones(3))
            out["done"] = True
        except CommError as e:
            out["error"] = str(e)

    t = threading.Thread(target=all_reduce, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # blocked: worker 1 has not joined
    ws[1].cancel()  # a peer was lost: worker 1 refuses its queued calls from now
    t.join(60)  # at the group timeout (120 s) it would still be blocked
    assert not t.is_alive() and "Connection closed by peer" in out.get("error", ""), out
    assert ws[1].transit.comms.members() == []
    ws[1].restore([])  # the rollback clears the cancel: calls are accepted again
    assert not ws[1]._cancelled and not ws[1].meter.abort.is_set()


def test_forget_worker_tolerates_a_cancel_clearing_the_cache_meanwhile():
    # seen in bench_faults seed 4242 after the change above: forget_worker (the worker's main thread)
    # listed the communicators with a lost worker, the cancel (its control thread) cleared the cache,
    # and the pops raised KeyError ((6, 8), 'gloo') in a call nobody awaits
    import types

    from nereus.runtime.comm.cache import GroupCache
    from nereus.runtime.comm.instrument import Meter

    class Racing(dict):
        def pop(self, key, *default):
            self.clear()  # the cancel's clear lands between forget's listing and its first pop
            return super().pop(key, *default)

    cache = GroupCache(None, 2, Meter(), 60.0)
    cache._groups = Racing({((0, 2), "gloo"): types.SimpleNamespace(name="a"),
                            ((1, 2), "gloo"): types.SimpleNamespace(name="b")})
    assert cache.forget(2) == [] and cache.members() == []
    cache._groups = {((0, 2), "gloo"): types.SimpleNamespace(name="a"), ((0, 1), "gloo"): types.SimpleNamespace(name="c")}
    assert cache.forget(2) == ["a"] and cache.members() == [(0, 1)]  # without a race: as before
