"""Mixed placement inside a stage (issue 13 item 1): a partition of a stage's model-stages into
blocks, each block colocated on one GPU set (times and resident bytes add, GPUs the largest),
blocks concurrent on disjoint GPUs (stage time the max over blocks, GPUs the sum).

The search is checked against the exhaustive enumerator on synthetic candidate sets (hand-built
(GPUs, time, resident, transient) rows, so small that every combination and partition is
enumerated, and chosen so that mixed placements win), on a hand-reasoned case where the mixed
plan is strictly better than both pure modes, and on a real job; the cost model's estimate of a
placed mixed plan is checked by hand."""

import math
import random

import numpy as np
import pytest

from nereus.cost.model import CostModel
from nereus.cost.step import stage_groups
from nereus.planner import exhaustive as ex_mod
from nereus.planner import partitions as parts_mod
from nereus.planner import search as search_mod
from nereus.planner.candidates import CandidateSet
from nereus.planner.exhaustive import exhaustive_optimum
from nereus.planner.partitions import set_partitions
from nereus.planner.search import NoFeasiblePlan, plan_job, search
from nereus.planner.staircase import partition_mode
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import ModelStage, Workflow

GIB = 2**30


def _rows(name: str, rows: list[tuple]) -> CandidateSet:
    """A candidate set of (GPUs, seconds, resident GiB, transient GiB) rows (tp = pp = 1, dp = GPUs)."""
    n = np.array([r[0] for r in rows], dtype=np.int64)
    one = np.ones(len(rows), dtype=np.int64)
    return CandidateSet(name, tp=one, pp=one, dp=n.copy(), b=one, rc=0 * one, c=0 * one, n=n,
                        t=np.array([float(r[1]) for r in rows]), r=np.array([r[2] * GIB for r in rows], dtype=float),
                        x=np.array([r[3] * GIB for r in rows], dtype=float))


def _synthetic(monkeypatch, sets: dict):
    """Make the search and the exhaustive enumerator read ``sets`` (model-stage -> rows)."""

    def fake(cost, ms, num_gpus, multi_node, *a, **k):
        cs = _rows(ms.name, sets[ms.name])
        return cs.take(np.nonzero(cs.n <= num_gpus)[0])

    monkeypatch.setattr(search_mod, "enumerate_candidates", fake)
    monkeypatch.setattr(ex_mod, "enumerate_candidates", fake)


def _cost(names, colocate="auto", gpus=4, headroom=0.1, asynchronous=False):
    wf = Workflow("ppo", tuple(ModelStage.parse(n) for n in names), asynchronous=asynchronous)
    job = JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 1, gpus),
                  WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=1, mini_batch_size=8,
                               reward_model=False),
                  framework=FrameworkSpec(name="t", colocate=colocate))
    # distinct memory corrections keep the search from sharing one enumeration between
    # model-stages of one model and stage (actor.infer, reference.infer), which the synthetic
    # sets make different (the fake enumeration ignores the correction)
    corr = {n: 1.0 + i * 1e-6 for i, n in enumerate(names)}
    return CostModel(job, workflow=wf, headroom=headroom, memory_correction=corr)


def test_set_partitions_are_the_bell_numbers():
    assert [len(set_partitions(k)) for k in range(1, 6)] == [1, 2, 5, 15, 52]
    for k in (3, 4):
        for p in set_partitions(k):
            assert sorted(i for b in p for i in b) == list(range(k))


INFER3 = ("actor.infer", "reference.infer", "critic.infer")


def test_mixed_plan_strictly_better_than_both_pure_modes(monkeypatch):
    """Three inference model-stages on 4 GPUs, each runnable on 2 or 4 GPUs in ``w/n + 0.5`` s:
    actor.infer and reference.infer ``w = 1``, critic.infer ``w = 2``; memory never binds.

    By hand: disjoint needs at least 2 + 2 + 2 = 6 > 4 GPUs: infeasible. Colocated (all on the 4
    GPUs, one after another): 0.75 + 0.75 + 1.0 = 2.5 s. Mixed {actor, reference} on 2 GPUs
    (1.0 + 1.0 = 2.0 s) beside {critic} on the other 2 (1.5 s): 2.0 s; the other mixed partitions
    pair critic with a w = 1 model-stage: 1.0 + 1.5 = 2.5 s. Optimum: 2.0 s, mixed."""

    def rows(w):
        return [(2, w / 2 + 0.5, 1.0, 1.0), (4, w / 4 + 0.5, 1.0, 1.0)]

    sets = {"actor.infer": rows(1), "reference.infer": rows(1), "critic.infer": rows(2)}
    _synthetic(monkeypatch, sets)
    cm = _cost(INFER3)
    res = search(cm, 4, False)
    assert res.l_step == pytest.approx(2.0, rel=1e-12)
    assert res.modes == {"infer": "mixed"}
    assert sorted(res.blocks["infer"]) == [("actor.infer", "reference.infer"), ("critic.infer",)]
    assert {n: int(fs.n[r]) for n, (fs, r) in res.choice.items()} == {n: 2 for n in INFER3}
    best, _, modes = exhaustive_optimum(cm, 4, False, with_modes=True)
    assert best == pytest.approx(2.0, rel=1e-12) and partition_mode(modes["infer"]) == "mixed"
    # the pure modes alone, as the framework allows them
    assert search(_cost(INFER3, "always"), 4, False).l_step == pytest.approx(2.5, rel=1e-12)
    with pytest.raises(NoFeasiblePlan):
        search(_cost(INFER3, "never"), 4, False)


def test_mixed_block_resident_bytes_add_and_bound_the_stage(monkeypatch):
    """The same stage where a block's resident bytes add: with 30 GiB resident each and 40 GiB of
    room (a 1.5 GiB workspace, no transient), no two model-stages may share a GPU, so no block of
    two fits and neither does colocation; disjoint is infeasible on 4 GPUs: no plan. With 5 GPUs
    disjoint runs 2 + 2 + 1... (critic.infer needs 2): still 6 > 5, no plan; with 6 GPUs disjoint
    runs 2 + 2 + 2 GPUs: max(1.0, 1.0, 1.5) = 1.5 s."""
    def rows(w):
        return [(2, w / 2 + 0.5, 30.0, 0.0), (4, w / 4 + 0.5, 30.0, 0.0)]

    sets = {"actor.infer": rows(1), "reference.infer": rows(1), "critic.infer": rows(2)}
    _synthetic(monkeypatch, sets)
    for gpus in (4, 5):
        cm = _cost(INFER3, gpus=gpus, headroom=1 - (41.5 * GIB) / get_gpu("h100").memory_bytes)
        assert cm.usable == pytest.approx(40 * GIB)
        with pytest.raises(NoFeasiblePlan):
            search(cm, gpus, False)
        assert math.isinf(exhaustive_optimum(cm, gpus, False)[0])
    cm = _cost(INFER3, gpus=6, headroom=1 - (41.5 * GIB) / get_gpu("h100").memory_bytes)
    res = search(cm, 6, False)
    assert res.l_step == pytest.approx(1.5) and res.modes == {"infer": "disjoint"}


def _random_sets(rng, names, pool):
    out = {}
    for n in names:
        k = rng.randint(1, 5)
        rows = []
        for _ in range(k):
            g = rng.choice([1, 2, 2, 3, 4, 4, 6, 8])
            if g > pool:
                g = pool
            rows.append((g, round(rng.uniform(0.5, 8.0) / g ** rng.uniform(0.3, 1.0) + rng.uniform(0, 1), 3),
                         rng.choice([2.0, 5.0, 8.0, 12.0, 20.0]), rng.choice([0.0, 3.0, 6.0, 15.0])))
        out[n] = rows
    return out


STAGES = [("actor.generate", "actor.infer", "reference.infer", "critic.infer", "reward.infer"),
          ("actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train"),
          ("actor.generate", "actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train"),
          ("actor.infer", "reference.infer", "critic.infer", "reward.infer")]


@pytest.mark.parametrize("seed", range(60))
def test_search_equals_exhaustive_with_mixed_placements(seed, monkeypatch):
    """Random synthetic jobs with 3- and 4-model-stage stages, tight GPU pools and memory, some
    asynchronous (generation on GPUs of its own, overlapping the rest): the
    search's optimum equals the exhaustive enumerator's (every partition of every stage), and
    its rows and blocks have that latency and fit."""
    rng = random.Random(seed)
    names = rng.choice(STAGES)
    pool = rng.choice([3, 4, 6, 8])
    sets = _random_sets(rng, names, pool)
    _synthetic(monkeypatch, sets)
    colocate = ["auto", "auto", "auto", "always", "never"][seed % 5]
    asyn = "actor.generate" in names and seed % 3 == 0  # generation on GPUs of its own
    cm = _cost(names, colocate=colocate, gpus=8, headroom=rng.choice([0.1, 0.5, 0.6]), asynchronous=asyn)
    best, _, modes = exhaustive_optimum(cm, pool, False, with_modes=True)
    if math.isinf(best):
        with pytest.raises(NoFeasiblePlan):
            search(cm, pool, False)
        return
    res = search(cm, pool, False)
    assert res.l_step == pytest.approx(best, rel=1e-9)
    wf = cm.workflow
    t = {n: float(fs.t[r]) for n, (fs, r) in res.choice.items()}
    g = {n: int(fs.n[r]) for n, (fs, r) in res.choice.items()}
    res_b = {n: float(fs.r[r]) for n, (fs, r) in res.choice.items()}
    x = {n: float(fs.x[r]) for n, (fs, r) in res.choice.items()}
    per, resident = {}, 0.0
    for st in wf.stages:
        blocks = res.blocks[st]
        assert sorted(n for b in blocks for n in b) == sorted(m.name for m in wf.in_stage(st))
        per[st] = max(sum(t[n] for n in b) for b in blocks)
        assert sum(max(g[n] for n in b) for b in blocks) <= pool
        if not (asyn and st == "generate"):
            resident += max(sum(res_b[n] for n in b) for b in blocks)
    if asyn:  # generation overlaps the rest on GPUs of its own
        total = max(per["generate"], sum(v for k, v in per.items() if k != "generate"))
        x = {n: v for n, v in x.items() if not n.endswith(".generate")}
    else:
        total = sum(per.values())
        if colocate == "never":
            assert all(len(b) == 1 for b in blocks)
        if colocate == "always":
            assert len(blocks) == 1
    assert total == pytest.approx(best, rel=1e-9)
    assert resident + max(x.values()) <= cm.usable * (1 + 1e-12)


def test_random_synthetic_jobs_have_mixed_optima():
    """The random jobs above are not vacuous: several optima are mixed and strictly better than the
    best plan without mixed placements."""
    mp = pytest.MonkeyPatch()
    wins = 0
    try:
        for seed in range(0, 40, 5):  # the colocate=auto ones
            for s in (seed, seed + 1, seed + 2):
                rng = random.Random(s)
                names = rng.choice(STAGES)
                pool = rng.choice([3, 4, 6, 8])
                sets = _random_sets(rng, names, pool)
                _synthetic(mp, sets)
                cm = _cost(names, gpus=8, headroom=rng.choice([0.1, 0.5, 0.6]))
                best, _, modes = exhaustive_optimum(cm, pool, False, with_modes=True)
                if math.isinf(best) or "mixed" not in {partition_mode(b) for b in modes.values()}:
                    continue
                orig = parts_mod.stage_partitions
                mp.setattr(parts_mod, "stage_partitions",
                           lambda c, st, orig=orig: [p for p in orig(c, st) if partition_mode(p) != "mixed"])
                pure = exhaustive_optimum(cm, pool, False)[0]
                mp.setattr(parts_mod, "stage_partitions", orig)
                wins += pure > best * (1 + 1e-9)
    finally:
        mp.undo()
    assert wins >= 3


def test_mixed_plan_estimate_by_hand():
    """A placed plan whose inference stage is mixed: actor.infer and reference.infer share GPUs
    0-3, critic.infer and reward.infer share 4-7. The estimate adds times inside a block and takes
    the max across blocks, and a GPU's memory holds the resident bytes of every model-stage on it
    plus the largest transient."""
    job = JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 1, 8),
                  WorkloadSpec(algorithm="ppo", prompts_per_step=16, samples_per_prompt=2, mini_batch_size=16))
    cm = CostModel(job)
    c = {
        "actor.generate": Candidate("actor.generate", 1, 1, 8, concurrency=4, gpus=tuple(range(8))),
        "actor.infer": Candidate("actor.infer", 1, 1, 4, micro_batch=2, gpus=(0, 1, 2, 3)),
        "reference.infer": Candidate("reference.infer", 1, 1, 2, micro_batch=2, gpus=(0, 1)),
        "critic.infer": Candidate("critic.infer", 2, 1, 2, micro_batch=2, gpus=(4, 5, 6, 7)),
        "reward.infer": Candidate("reward.infer", 1, 1, 4, micro_batch=2, gpus=(4, 5, 6, 7)),
        "actor.train": Candidate("actor.train", 1, 1, 4, micro_batch=2, grad_accum=2, gpus=(0, 1, 2, 3)),
        "critic.train": Candidate("critic.train", 1, 1, 4, micro_batch=2, grad_accum=2, gpus=(4, 5, 6, 7)),
    }
    plan = cm.estimate(Plan(candidates=tuple(c[m.name] for m in cm.workflow.model_stages)))
    groups = stage_groups(plan, cm.workflow)
    assert ("actor.infer", "reference.infer") in groups and ("critic.infer", "reward.infer") in groups
    e = {n: cm.estimate_candidate(cand, False) for n, cand in c.items()}
    infer = max(e["actor.infer"].time + e["reference.infer"].time, e["critic.infer"].time + e["reward.infer"].time)
    train = max(e["actor.train"].time, e["critic.train"].time)
    assert plan.l_step == pytest.approx(e["actor.generate"].time + infer + train, rel=1e-12)
    # GPU 0: generate, the actor/reference block, actor.train; GPU 5: generate, the critic/reward
    # block, critic.train (the training stage is disjoint: actor on 0-3, critic on 4-7)
    assert ("actor.train",) in groups and ("critic.train",) in groups
    on0 = ("actor.generate", "actor.infer", "reference.infer", "actor.train")
    on5 = ("actor.generate", "critic.infer", "reward.infer", "critic.train")
    for gpu, on in ((0, on0), (5, on5)):
        want = cm.workspace + sum(e[n].resident for n in on) + max(e[n].transient for n in on)
        assert plan.gpu_memory[gpu] == pytest.approx(want, rel=1e-12)


def test_real_job_where_mixed_wins():
    """Qwen3-14B PPO with the fsdp framework on one 8-GPU H100 node: the search places the
    inference stage mixed (two colocated pairs side by side), faster than the best plan without
    mixed placements; plan_job places it so that the cost model sees the same blocks and the
    same L_step."""
    job = JobSpec(get_model("qwen3-14b"), ClusterSpec(get_gpu("h100"), 1, 8), WorkloadSpec(algorithm="ppo"),
                  framework=get_framework("fsdp"))
    res = search(CostModel(job), 8, False)
    mp = pytest.MonkeyPatch()
    orig = parts_mod.stage_partitions
    mp.setattr(parts_mod, "stage_partitions",
               lambda c, st: [p for p in orig(c, st) if partition_mode(p) != "mixed"])
    try:
        pure = search(CostModel(job), 8, False)
    finally:
        mp.undo()
    if res.modes["infer"] != "mixed":
        pytest.skip("the cost model's efficiencies changed; mixed no longer wins here")
    assert res.l_step < pure.l_step
    plan = plan_job(job)
    assert plan.l_step == pytest.approx(res.l_step, rel=1e-9)
    groups = stage_groups(plan, CostModel(job).workflow)
    for b in res.blocks["infer"]:
        assert tuple(b) in groups
    assert CostModel(job).memory_ok(plan)


def test_cli_names_the_blocks_of_a_mixed_stage():
    from nereus.cli.plan_output import stage_blocks

    c = [Candidate("actor.infer", 1, 1, 2, micro_batch=1, gpus=(0, 1)),
         Candidate("reference.infer", 1, 1, 1, micro_batch=1, gpus=(4,)),
         Candidate("critic.infer", 1, 1, 1, micro_batch=1, gpus=(1,)),
         Candidate("reward.infer", 1, 1, 2, micro_batch=1, gpus=(4, 5))]
    assert stage_blocks(c) == {"infer": [("actor.infer", "critic.infer"), ("reference.infer", "reward.infer")]}
