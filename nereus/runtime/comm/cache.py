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
reuse removes that cost for every member set seen before. ``ncclCommSplit`` from one job-wide
communicator needs every rank of the parent to take part in each split, in the same order; the
members of a set alone cannot split (torch 2.13's ``split_group`` requires all parent ranks, and
``new_group(use_local_synchronization=True)`` skips the non-members that a split waits for). So
:meth:`GroupCache.split` runs where every worker takes part: at a transition's start, over the
member sets the driver lists (``comm/split.py``: one parent per transition, one split per new
set); the children then serve :meth:`get` like any cached group. Gloo cannot split: its groups
are built by their members in :meth:`get`.

Setup seconds are recorded in :attr:`GroupCache.setup_s` (seconds spent building) with
:attr:`built` and :attr:`reused` counts, and returned by :meth:`get`.
"""

from __future__ import annotations

import time

from nereus.runtime.comm.groups import Group, backend_for, new_group
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.split import split_groups

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
        self._parents: list[Group] = []  # job-wide NCCL parents of split groups (comm/split.py)
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

    def split(self, pool, todo, name: str, device) -> float:
        """Split the member sets ``todo`` (the driver's ``SplitRegistry.plan``, the same list on
        every worker of ``pool``) from a job-wide NCCL communicator (``comm/split.py``) and keep the
        groups this worker is in, replacing any held for the same set; every worker of ``pool``
        calls it at the same point (a transition's start). Gloo: nothing to do (0.0).

        Returns:
            seconds spent (the parent's build and the splits), also added to :attr:`setup_s`, with
            :attr:`built` counting the groups kept.

        Raises:
            CommError: as ``split.split_groups``.
        """
        if backend_for(device) != "nccl" or not todo:
            return 0.0
        t0 = time.perf_counter()
        made, parent = split_groups(self.store, name, pool, todo, self.me, self.meter, self.timeout_s, device)
        self._parents.append(parent)
        for members, (g, _) in made.items():
            self._groups[(members, "nccl")] = g
            self.built += 1
        dt = time.perf_counter() - t0
        self.setup_s += dt
        return dt

    def forget(self, worker: int) -> list[str]:
        """Drop every communicator that has ``worker`` as a member; returns their names."""
        # ``clear`` may run meanwhile in another thread (a worker's cancel): read a copy, pop tolerantly
        gone = [k for k in list(self._groups) if int(worker) in k[0]]
        self._parents = [p for p in self._parents if int(worker) not in p.members]
        return [g.name for g in (self._groups.pop(k, None) for k in gone) if g is not None]

    def clear(self) -> None:
        """Drop every communicator (after a failure: a peer may be gone)."""
        self._groups.clear()
        self._parents.clear()

    def members(self) -> list[tuple[int, ...]]:
        """The member tuples of the communicators held, in the order they were built."""
        return [k[0] for k in list(self._groups)]

    def stats(self) -> dict:
        """``{"built", "reused", "setup_s", "held"}``: counts, seconds building, groups held."""
        return {"built": self.built, "reused": self.reused, "setup_s": self.setup_s, "held": len(self._groups)}
