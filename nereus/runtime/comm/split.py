"""NCCL communicators split from one job-wide communicator (``ncclCommSplit``), every worker taking part.

Source: issue 26 (on NCCL, communicator creation is the expensive part: a rendezvous and
``ncclCommInitRank``, seconds per communicator at scale; splitting a job-wide communicator avoids
a fresh init per member set). NCCL's ``ncclCommSplit(comm, color, key, &newcomm, config)`` is a
collective over the *parent* communicator: every rank of the parent calls it, in the same order
as its other splits and collectives on the parent; ranks that pass the same ``color`` form one new
communicator, ranked by ``key``; a rank that passes ``NCCL_SPLIT_NOCOLOR`` gets none (NCCL user
guide, "Creating a communicator with options: ncclCommSplit"). torch 2.13 exposes it as
``torch.distributed.split_group`` (all ranks of the parent group must enter it, it needs
``init_process_group`` with a bound ``device_id``) and, below that, as
``ProcessGroupNCCL.Options.split_from`` / ``split_color`` (the new group's communicator is split
from the parent's when it is initialised, ``Backend.eager_connect_single_device`` initialises it
now) with ``ProcessGroupNCCL.perform_nocolor_split(device)`` for the ranks outside it.
``new_group(..., use_local_synchronization=True)`` lets non-members skip the call, but with a
split source the members' ``ncclCommSplit`` then waits for ranks that never come: the members alone
cannot split.

So the split runs where every worker of the pool takes part anyway: at a transition's start, when
the driver sends ``transition_begin`` to every live worker and waits for all of them before any
primitive runs (``runtime/transit/driver_side.py``), and the driver knows every member set the
transition's primitives will use. The driver-side :class:`SplitRegistry` gives the ordered list of
member sets to split (:func:`split_order`: the sets no worker holds yet, in one canonical order,
the same list for every worker); each worker then runs :func:`split_groups`: one job-wide parent
among the live workers (``new_group`` over the sorted pool: one ``ncclCommInitRank`` per transition
instead of one per member set), one ``ncclCommSplit`` per listed set (members with color 0 and
their group rank as key, every other worker ``NCCL_SPLIT_NOCOLOR``); the worker's cache keeps the
parent until a worker of its pool leaves (children split with shared resources,
``NCCL_COMM_SPLIT_SHARE_RESOURCES``, must not outlive it), but never splits from it again. The children go into the worker's
``GroupCache`` by member set (``comm/cache.py``), so later primitives and weight syncs find them.
Gloo has no split: the cache builds its groups among the members (``GroupCache.get``).

A parent kept across transitions would save that one init too, but every worker would then have to
agree on whether it holds a parent of the current pool; a worker that cleared its communicators
after a failure (``worker/fault_tolerant.py``) would leave the others blocked in a split it never
enters. A parent per transition needs no such agreement.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nereus.runtime.comm.groups import CommError, Group, backend_for, new_group

__all__ = ["canonical_sets", "split_order", "split_role", "SplitRegistry", "split_groups", "SPLIT_COLOR"]

#: the color members pass: one split call makes one communicator, so one color is enough
SPLIT_COLOR = 0


def canonical_sets(sets) -> list[tuple[int, ...]]:
    """Member sets (worker ids in group-rank order) as one list every worker computes alike: groups
    of two or more, each once, sorted by ``(size, members)``.

    Raises:
        ValueError: a set with a repeated worker.
    """
    out = set()
    for s in sets:
        t = tuple(int(w) for w in s)
        if len(set(t)) != len(t):
            raise ValueError(f"member set {t} repeats a worker")
        if len(t) >= 2:
            out.add(t)
    return sorted(out, key=lambda t: (len(t), t))


def split_order(sets, held) -> list[tuple[int, ...]]:
    """The member sets of ``sets`` to split now, in order (:func:`canonical_sets`): those not in
    ``held`` (the sets the workers' caches already hold)."""
    held = {tuple(int(w) for w in s) for s in held}
    return [s for s in canonical_sets(sets) if s not in held]


def split_role(members: tuple[int, ...], me: int) -> int | None:
    """``me``'s group rank in ``members`` (its ``key``, with :data:`SPLIT_COLOR`), or None: not a
    member, it passes ``NCCL_SPLIT_NOCOLOR``."""
    return members.index(me) if me in members else None


class SplitRegistry:
    """The driver's record of the member sets split so far (what every member's cache holds).

    ``plan(pool, sets)`` gives the sets to split at a transition's start; ``done(sets)`` records them
    once every worker reported success; ``forget(worker)`` drops the sets a leaving worker was in
    (as ``GroupCache.forget`` does on every remaining worker); ``reset()`` after a failure that
    cleared the workers' caches.
    """

    def __init__(self) -> None:
        self.held: set[tuple[int, ...]] = set()
        self.calls = 0  # transitions that split: a unique name per split round
        self.processes: dict[int, str] = {}

    def sync(self, pool: dict) -> None:
        """Forget the sets of every worker that left or whose process changed since the last call
        (``pool``: worker id → an id of its process, e.g. the Ray actor id): a respawned worker in
        the same slot holds none of its predecessor's communicators."""
        for w, pid in self.processes.items():
            if pool.get(w) != pid:
                self.forget(w)
        self.processes = dict(pool)

    def plan(self, pool, sets) -> list[tuple[int, ...]]:
        """The ordered sets to split among the live workers ``pool``.

        Raises:
            ValueError: a set with a worker outside ``pool`` (it could not take part).
        """
        live = {int(w) for w in pool}
        todo = split_order(sets, self.held)
        bad = [s for s in todo if not set(s) <= live]
        if bad:
            raise ValueError(f"member sets {bad[:3]} name workers outside the pool {sorted(live)}")
        self.calls += bool(todo)
        return todo

    def done(self, sets) -> None:
        self.held |= {tuple(int(w) for w in s) for s in sets}

    def forget(self, worker: int) -> None:
        self.held = {s for s in self.held if int(worker) not in s}

    def reset(self) -> None:
        self.held.clear()


def _child(parent: Group, store, name: str, members: tuple[int, ...], me: int, meter, timeout_s: float,
           device) -> Group:
    import datetime

    rank = members.index(me)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts.split_from = parent.pg
    opts.split_color = SPLIT_COLOR
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, len(members), opts)
    pg.eager_connect_single_device(torch.device(device))  # the ncclCommSplit runs now, with the others
    return Group(name=name, members=members, rank=rank, pg=pg, meter=meter, timeout_s=timeout_s,
                 backend="nccl", device=str(torch.device(device)))


def split_groups(store, name: str, pool, todo, me: int, meter, timeout_s: float, device) -> dict:
    """This worker's part of splitting ``todo`` (:meth:`SplitRegistry.plan`) from a parent among
    ``pool`` (module docstring); every worker of ``pool`` calls it with the same arguments but ``me``.

    Returns:
        ``({members: (Group, seconds)}, parent)``: the groups of the sets ``me`` is in (the parent's
        build seconds charged to the first of them, each split's to its own) and the parent Group
        (None when ``todo`` is empty).

    Raises:
        ValueError: ``device`` is not a CUDA device with NCCL (gloo cannot split; use ``GroupCache.get``).
        CommError: the parent could not be built or a split failed.
    """
    if backend_for(device) != "nccl":
        raise ValueError(f"split_groups: device {device!r} does not use NCCL; gloo groups are built by "
                         f"their members (GroupCache.get)")
    if not todo:
        return {}, None
    ranks = tuple(sorted(int(w) for w in pool))
    t0 = time.perf_counter()
    parent = new_group(store, f"{name}/parent", ranks, me, meter, timeout_s, device)
    if not getattr(parent.pg, "supports_splitting", False):  # NCCL < 2.18 has no ncclCommSplit
        raise CommError(f"the NCCL communicator of {name!r} cannot split (NCCL >= 2.18 needed)")
    parent.pg.eager_connect_single_device(torch.device(device))
    carry = time.perf_counter() - t0
    out = {}
    try:
        for i, members in enumerate(todo):
            t1 = time.perf_counter()
            if split_role(members, me) is None:
                parent.pg.perform_nocolor_split(torch.device(device))
                continue
            g = _child(parent, store, f"{name}/s{i}", members, me, meter, timeout_s, device)
            out[members] = (g, time.perf_counter() - t1 + carry)
            carry = 0.0
    except RuntimeError as e:
        raise CommError(f"ncclCommSplit of {name!r} over workers {list(ranks)} failed: {str(e)[:300]}") from e
    return out, parent
