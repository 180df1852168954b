"""The coordination of NCCL communicator splits (``runtime/comm/split.py``): every worker computes
the same ordered list of member sets; non-members pass no color; gloo keeps the members-only cache.
The NCCL calls themselves need GPUs (``benchmarks/gpu_check.py``)."""

import itertools

import pytest

from nereus.runtime.comm.cache import GroupCache
from nereus.runtime.comm.split import SplitRegistry, canonical_sets, split_groups, split_order, split_role

SETS = [(0, 1), (2, 3), (0, 1, 2, 3), (1, 0), (0, 1), (3,), (2, 3)]


def test_every_worker_computes_the_same_order():
    want = [(0, 1), (1, 0), (2, 3), (0, 1, 2, 3)]  # by size, then members; group-rank order kept
    assert canonical_sets(SETS) == want
    # each worker may collect the sets in another order (its own primitives first): same list
    for perm in itertools.islice(itertools.permutations(SETS), 0, 5040, 97):
        assert canonical_sets(perm) == want
    assert split_order(SETS, held=[(2, 3)]) == [(0, 1), (1, 0), (0, 1, 2, 3)]
    with pytest.raises(ValueError, match="repeats"):
        canonical_sets([(0, 0)])


def test_members_take_a_rank_and_the_others_no_color():
    assert [split_role((2, 0, 3), w) for w in range(4)] == [1, None, 0, 2]


def test_registry_plans_only_new_sets_and_forgets_a_leaving_worker():
    reg = SplitRegistry()
    first = reg.plan(range(4), SETS)
    assert first == [(0, 1), (1, 0), (2, 3), (0, 1, 2, 3)]
    reg.done(first)
    assert reg.plan(range(4), SETS + [(1, 2)]) == [(1, 2)]  # the next transition: only the new set
    reg.forget(3)  # worker 3 leaves: its sets must be split again among a new pool
    assert reg.plan((0, 1, 2), [(0, 1), (1, 2)]) == [(1, 2)]
    with pytest.raises(ValueError, match="outside the pool"):
        reg.plan((0, 1, 2), [(2, 3)])
    reg.reset()
    assert reg.plan(range(4), [(0, 1)]) == [(0, 1)]


def test_gloo_keeps_the_members_only_cache():
    cache = GroupCache(None, 0, None, 1.0)
    assert cache.split(range(4), [(0, 1)], "t0", None) == 0.0
    assert cache.stats() == {"built": 0, "reused": 0, "setup_s": 0.0, "held": 0}
    with pytest.raises(ValueError, match="does not use NCCL"):
        split_groups(None, "t0", range(2), [(0, 1)], 0, None, 1.0, "cpu")


def test_registry_forgets_a_respawned_worker():
    reg = SplitRegistry()
    reg.sync({0: "a", 1: "b", 2: "c"})
    reg.done([(0, 1), (1, 2), (0, 2)])
    reg.sync({0: "a", 1: "b2", 2: "c"})  # worker 1 is a new process in the same slot
    assert reg.held == {(0, 2)}
    reg.sync({0: "a", 1: "b2"})  # worker 2 left
    assert reg.held == set()
    assert reg.calls == 0 and reg.plan((0, 1), [(0, 1)]) == [(0, 1)] and reg.calls == 1


class _FakeNCCL:
    """Stands in for ``ProcessGroupNCCL``: records each worker's calls on the parent communicator
    (``ncclCommSplit`` is collective over it: every worker must make the same calls in order)."""

    log: dict = {}

    class Options:
        def __init__(self):
            self.split_from, self.split_color, self._timeout = None, None, None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.opts, self.supports_splitting = rank, size, opts, True

    def eager_connect_single_device(self, device):
        if self.opts.split_from is not None:  # a child: its split call on the parent, color and key
            parent = self.opts.split_from
            _FakeNCCL.log.setdefault(parent.me, []).append(("split", self.opts.split_color, self.rank))

    def perform_nocolor_split(self, device):
        _FakeNCCL.log.setdefault(self.me, []).append(("nocolor",))


def test_every_worker_takes_part_in_each_split_in_the_same_order(monkeypatch):
    from nereus.runtime.comm import cache as cache_mod
    from nereus.runtime.comm import split as split_mod
    from nereus.runtime.comm.groups import Group

    def fake_new_group(store, name, members, me, meter, timeout_s, device):
        pg = _FakeNCCL(store, members.index(me), len(members), _FakeNCCL.Options())
        pg.me = me
        return Group(name=name, members=members, rank=members.index(me), pg=pg, meter=meter,
                     timeout_s=timeout_s, backend="nccl", device="cuda:0")

    monkeypatch.setattr(split_mod.dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)  # CPU builds lack it
    monkeypatch.setattr(split_mod, "new_group", fake_new_group)
    monkeypatch.setattr(split_mod, "backend_for", lambda device: "nccl")
    monkeypatch.setattr(cache_mod, "backend_for", lambda device: "nccl")
    _FakeNCCL.log = {}
    todo = SplitRegistry().plan(range(4), SETS)  # [(0, 1), (1, 0), (2, 3), (0, 1, 2, 3)]
    import torch.distributed as dist

    store = dist.HashStore()
    caches = {w: GroupCache(store, w, None, 1.0) for w in range(4)}
    for c in caches.values():
        c.split(range(4), todo, "t/split1", "cuda:0")
    # one call on the parent per set on every worker: members split with color 0, key = group rank
    assert _FakeNCCL.log == {
        0: [("split", 0, 0), ("split", 0, 1), ("nocolor",), ("split", 0, 0)],
        1: [("split", 0, 1), ("split", 0, 0), ("nocolor",), ("split", 0, 1)],
        2: [("nocolor",), ("nocolor",), ("split", 0, 0), ("split", 0, 2)],
        3: [("nocolor",), ("nocolor",), ("split", 0, 1), ("split", 0, 3)],
    }
    # the children serve get() (reused, no setup), keyed by member set; each member counts them built
    g, dt = caches[2].get((0, 1, 2, 3), "unused", "cuda:0")
    assert (g.rank, dt, caches[2].reused, caches[2].built) == (2, 0.0, 1, 2)
    assert caches[0].built == 3 and caches[0].setup_s > 0
    caches[0].forget(3)  # a worker of the parent's pool leaves: the parent and its sets go
    assert caches[0].members() == [(0, 1), (1, 0)] and caches[0]._parents == []
