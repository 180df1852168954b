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
