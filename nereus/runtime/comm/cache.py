"""Communicators kept by member set across transitions and weight syncs (DESIGN.md §4.7-§4.8).

Source: issue 26 (every transition built new communicators, TP 1->2: 3, the multi-model-stage case:
15, and the weight sync's were dropped at the end of each transition; a cache keyed by member set
cut TP 1->2 by 28% and the multi-model-stage case by 46% on gloo).

A :class:`GroupCache` lives on one worker. :meth:`GroupCache.get` returns the communicator among
``members`` (in group-rank order) built earlier, or builds it (``groups.new_group``) under the
caller's unique ``name``. Every member of a communicator keeps it until :meth:`GroupCache.forget`
names a worker that left (the driver tells every remaining worker, ``run/pool.py``) or
:meth:`GroupCache.clear`; so a member set's communicator exists on all its members or on none,
and all members agree, without talking, on whether ``get`` builds. A rebuilt communicator always
gets the new caller's name (a ``PrefixStore`` prefix is never reused).

Rules the callers keep: every member calls ``get`` for a member set in the same order relative to
its other collectives on that set (the executor's submission order; Ray runs an actor's calls in
order), and a communicator is only used by one call at a time (a worker runs one call at a time).

NCCL: building a communicator costs a rendezvous and ``ncclCommInitRank`` (seconds at scale);
reuse removes that cost for every member set seen before. Splitting one job-wide communicator
(``ncclCommSplit``) needs every rank of the parent to take part in each split, which the runtime's
groups among a subset of workers (only the members build) do not do; it is not used here.

Setup seconds are recorded in :attr:`GroupCache.setup_s` (seconds spent building) with
:attr:`built` and :attr:`reused` counts, and returned by :meth:`get`.
"""

from __future__ import annotations

import time

from nereus.runtime.comm.groups import Group, backend_for, new_group
from nereus.runtime.comm.instrument import Meter

__all__ = ["GroupCache"]


class GroupCache:
    """Communicators of one worker by ``(member tuple, backend)``.

    Args:
        store: the job's TCPStore client.
        me: this worker's id.
        meter: where the groups' collectives record.
        timeout_s: timeout of every group it builds, seconds.
    """

    def __init__(self, store, me: int, meter: Meter, timeout_s: float) -> None:
        self.store, self.me, self.meter, self.timeout_s = store, int(me), meter, float(timeout_s)
        self._groups: dict[tuple, Group] = {}
        self.built = 0
        self.reused = 0
        self.setup_s = 0.0

    def get(self, members: tuple[int, ...], name: str, device=None) -> tuple[Group, float]:
        """The communicator among ``members`` (group rank = position), and the seconds spent
        building it now (0.0 when reused).

        Args:
            name: a prefix unique to this call (used only when it builds).
            device: the tensors' device (``groups.backend_for``: CUDA gives NCCL).

        Raises:
            ValueError: as ``groups.new_group`` (``me`` not a member, repeated members).
            CommError: the rendezvous failed or timed out.
        """
        key = (tuple(int(m) for m in members), backend_for(device))
        g = self._groups.get(key)
        if g is not None:
            self.reused += 1
            return g, 0.0
        t0 = time.perf_counter()
        g = new_group(self.store, name, key[0], self.me, self.meter, self.timeout_s, device)
        dt = time.perf_counter() - t0
        self._groups[key] = g
        self.built += 1
        self.setup_s += dt
        return g, dt

    def forget(self, worker: int) -> list[str]:
        """Drop every communicator that has ``worker`` as a member; returns their names."""
        # ``clear`` may run meanwhile in another thread (a worker's cancel): read a copy, pop tolerantly
        gone = [k for k in list(self._groups) if int(worker) in k[0]]
        return [g.name for g in (self._groups.pop(k, None) for k in gone) if g is not None]

    def clear(self) -> None:
        """Drop every communicator (after a failure: a peer may be gone)."""
        self._groups.clear()

    def members(self) -> list[tuple[int, ...]]:
        """The member tuples of the communicators held, in the order they were built."""
        return [k[0] for k in list(self._groups)]

    def stats(self) -> dict:
        """``{"built", "reused", "setup_s", "held"}``: counts, seconds building, groups held."""
        return {"built": self.built, "reused": self.reused, "setup_s": self.setup_s, "held": len(self._groups)}
