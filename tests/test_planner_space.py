"""The widened plan space (issue 13 items 1 and 4): colocated stages, offload, ZeRO, interleaving,
any TP/PP/micro-batch/concurrency; the search against the exhaustive optimum over the same space,
placement of colocated stages, the infeasibility message."""

import math
import random

import numpy as np
import pytest

from nereus.cost.model import CostModel
from nereus.cost.step import stage_groups
from nereus.planner import candidates as cand_mod
from nereus.planner.candidates import enumerate_candidates
from nereus.planner.exhaustive import exhaustive_optimum
from nereus.planner.search import NoFeasiblePlan, plan_job, search
from nereus.planner.staircase import partition_mode
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import ModelStage, Workflow

GIB = 2**30
WORKFLOWS = [
    ("actor.generate", "actor.infer", "reference.infer"),
    ("actor.generate", "reference.infer", "actor.train"),
    ("reference.infer", "critic.infer", "critic.train"),
    ("actor.generate", "actor.train", "critic.train"),
    ("actor.infer", "reference.infer", "critic.infer"),
]
FRAMEWORKS = ["generic", "megatron", "fsdp", "deepspeed", "nereus", "always", "dropgen"]


def _framework(name: str) -> FrameworkSpec:
    if name == "always":
        return FrameworkSpec(name="always", zero_stages=(0, 1, 3), offload=("none", "host", "drop"), colocate="always")
    if name == "dropgen":  # verl-like: only the rollout engine may be dropped
        return FrameworkSpec(name="dropgen", zero_stages=(2, 3), offload=("none", "host", "drop"), colocate="auto",
                             model_parallel_train=False, drop_model_stages=("actor.generate",))
    return get_framework(name)


def _small_job(seed: int):
    """A small job (0.5B or tiny models, 1-8 GPUs) whose memory is often tight (a large headroom)."""
    rng = random.Random(seed)
    model = get_model(rng.choice(["qwen2.5-0.5b", "qwen2.5-0.5b", "small"]))
    gpus = rng.choice([1, 2, 4, 8])
    gpn = min(gpus, rng.choice([2, 4, 8]))
    wl = WorkloadSpec(algorithm="ppo", prompts_per_step=rng.choice([8, 16]), samples_per_prompt=2,
                      prompt_len=rng.choice([256, 512]), response_len=rng.choice([512, 2048, 8192]),
                      mini_batch_size=rng.choice([8, 16]), micro_batch_size=rng.choice([1, 2, 3, 4]),
                      infer_micro_batch_size=rng.choice([2, 3, 4]), reward_model=False,
                      asynchronous=rng.random() < 0.2)
    fw = _framework(FRAMEWORKS[seed % len(FRAMEWORKS)])
    names = rng.choice(WORKFLOWS)
    wf = Workflow("ppo", tuple(ModelStage.parse(n) for n in names), asynchronous=wl.asynchronous)
    job = JobSpec(model, ClusterSpec(get_gpu(rng.choice(["h100", "a100"])), max(gpus // gpn, 1), gpn), wl,
                  framework=fw)
    headroom = rng.choice([0.1, 0.6, 0.8, 0.88, 0.9])
    return job, wf, gpus, headroom


@pytest.mark.parametrize("seed", range(60))
def test_search_equals_exhaustive_in_the_widened_space(seed):
    job, wf, pool, headroom = _small_job(seed)
    cm = CostModel(job, workflow=wf, headroom=headroom)
    multi = pool > job.cluster.gpus_per_node
    best, arg, modes = exhaustive_optimum(cm, pool, multi, with_modes=True)
    if math.isinf(best):
        with pytest.raises(NoFeasiblePlan):
            search(cm, pool, multi)
        return
    res = search(cm, pool, multi)
    assert res.l_step == pytest.approx(best, rel=1e-9)
    # the chosen rows have that latency under the cost model, with the chosen modes
    mb = job.workload.mini_batch_size
    cands = {n: fs.candidate(row, mb) for n, (fs, row) in res.choice.items()}
    t = {n: cm.estimate_candidate(c, multi).time for n, c in cands.items()}
    total = 0.0
    per = {}
    for st in wf.stages:  # blocks run one after another inside, concurrently with each other
        assert sorted(n for b in res.blocks[st] for n in b) == sorted(m.name for m in wf.in_stage(st))
        per[st] = max(sum(t[n] for n in b) for b in res.blocks[st])
    total = (max(per.get("generate", 0.0), sum(v for k, v in per.items() if k != "generate"))
             if wf.asynchronous and "generate" in per else sum(per.values()))
    assert total == pytest.approx(best, rel=1e-9)
    # framework gates: no feature outside the framework
    fw = job.framework
    for n, c in cands.items():
        assert c.offload in fw.offload_modes(n)
        assert c.zero == 0 or c.zero in fw.zero_stages
        assert c.vpp <= fw.max_virtual_stages
        if ModelStage.parse(n).stage == "train":
            assert c.offload != "drop"
            if not fw.model_parallel_train:
                assert c.tp == c.pp == 1
    for st, m in res.modes.items():
        if fw.colocate == "never" or len(wf.in_stage(st)) == 1:
            assert m == "disjoint"
        elif fw.colocate == "always":
            assert m == "colocated"


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_search_with_the_cross_class_prune_equals_exhaustive(seed, monkeypatch):
    """The frontier's cross-class prune (on for large candidate sets only) keeps the search exact."""
    import nereus.planner.search as S

    monkeypatch.setattr(S, "CROSS_MIN_ROWS", 0)
    job, wf, pool, headroom = _small_job(seed)
    cm = CostModel(job, workflow=wf, headroom=headroom)
    multi = pool > job.cluster.gpus_per_node
    best = exhaustive_optimum(cm, pool, multi)[0]
    try:
        got = search(cm, pool, multi).l_step
    except NoFeasiblePlan:
        got = math.inf
    assert got == pytest.approx(best, rel=1e-9) if math.isfinite(best) else math.isinf(got)


def test_widened_jobs_cover_colocation_offload_and_zero():
    """The random jobs above are not vacuous: many are feasible, and their optima use colocation,
    offload and ZeRO somewhere."""
    feasible, used = 0, set()
    for seed in range(60):
        job, wf, pool, headroom = _small_job(seed)
        cm = CostModel(job, workflow=wf, headroom=headroom)
        best, arg, modes = exhaustive_optimum(cm, pool, pool > job.cluster.gpus_per_node, with_modes=True)
        if math.isinf(best):
            continue
        feasible += 1
        if "colocated" in {partition_mode(b) for b in modes.values()} and job.framework.colocate == "auto":
            used.add("colocated")
        for c in arg.values():
            if c.offload != "none":
                used.add(c.offload)
            if c.zero:
                used.add("zero")
    assert feasible >= 30
    assert {"colocated", "host", "drop", "zero"} <= used


@pytest.mark.parametrize("seed", range(12))
def test_tau_search_equals_level_search_without_colocation(seed, monkeypatch):
    """The two exact algorithms (resident-level branch and bound for disjoint stages, transient
    bound search for the rest) agree on jobs both can solve."""
    from test_planner import _random_job

    job, wf, pool = _random_job(seed)
    cm = CostModel(job, workflow=wf)
    multi = pool > job.cluster.gpus_per_node
    try:
        ref = search(cm, pool, multi).l_step
    except NoFeasiblePlan:
        ref = math.inf
    import nereus.planner.search as S

    monkeypatch.setattr(S, "_LEVEL_SEARCH", True)
    try:
        got = search(CostModel(job, workflow=wf), pool, multi).l_step
    except NoFeasiblePlan:
        got = math.inf
    assert got == pytest.approx(ref, rel=1e-9) if math.isfinite(ref) else math.isinf(got)


def test_generation_concurrency_reduced_per_wave_count_is_exact(monkeypatch):
    """Every integer concurrency against the smallest of each wave count: the same optimum."""
    wl = WorkloadSpec(algorithm="grpo", prompts_per_step=12, samples_per_prompt=3, prompt_len=512,
                      response_len=4096, mini_batch_size=12, reward_model=False)
    wf = Workflow("grpo", (ModelStage.parse("actor.generate"), ModelStage.parse("actor.train")))
    job = JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 1, 4), wl, framework=get_framework("generic"))
    for headroom in (0.1, 0.85, 0.9):
        cm = CostModel(job, workflow=wf, headroom=headroom)
        reduced = exhaustive_optimum(cm, 4, False)[0]
        orig = cand_mod._per_count

        def every(seqs, cap=None):
            seqs = np.asarray(seqs)
            ii = np.concatenate([np.full(int(s), i) for i, s in enumerate(seqs)])
            vv = np.concatenate([np.arange(1, int(s) + 1) for s in seqs])
            keep = vv <= (cap if cap is not None else vv.max())
            return ii[keep].astype(np.int64), vv[keep].astype(np.int64)

        monkeypatch.setattr(cand_mod, "_per_count", every)
        full = exhaustive_optimum(cm, 4, False)[0]
        monkeypatch.setattr(cand_mod, "_per_count", orig)
        assert reduced == pytest.approx(full, rel=1e-12)


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "llama-3.1-8b", "qwen3-14b"])
def test_generation_time_and_memory_monotone_in_concurrency_at_fixed_waves(model):
    """The premise of the concurrency reduction: with the wave count fixed, a larger concurrency is
    never faster and never smaller (so the smallest concurrency of each wave count dominates)."""
    job = JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), 1, 8),
                  WorkloadSpec(algorithm="ppo", prompt_len=1024, response_len=2048))
    cm = CostModel(job)
    ms = ModelStage.parse("actor.generate")
    seqs = job.workload.rollouts_per_step
    c = np.arange(1, seqs + 1)
    for tp, pp in ((1, 1), (2, 1), (4, 2), (8, 1)):
        a = cm.candidate_arrays(ms, tp, pp, np.ones_like(c), concurrency=c)
        waves = -(-seqs // c)
        same = waves[1:] == waves[:-1]
        assert np.all(np.diff(a["time"])[same] >= -1e-12 * a["time"][1:][same])
        assert np.all(np.diff(a["transient"]) >= 0) and np.all(np.diff(a["resident"]) == 0)


def test_space_has_non_power_of_two_degrees():
    # Llama-3.3-70B: 80 layers -> PP 5, 10, 20 appear; Qwen3-14B: 40 layers -> PP 5, 10
    job = JobSpec(get_model("llama-3.3-70b"), ClusterSpec(get_gpu("h100"), 8, 8), WorkloadSpec())
    cm = CostModel(job)
    cs = enumerate_candidates(cm, ModelStage.parse("actor.train"), 64, True)
    assert {5, 10, 20} <= set(cs.pp.tolist())
    assert not {3, 6, 7} & set(cs.pp.tolist())
    gen = enumerate_candidates(cm, ModelStage.parse("actor.generate"), 64, True)
    assert {3, 6, 7, 10} & set(gen.c.tolist())  # any concurrency, not only powers of two
    # uneven PP when the framework allows it
    cmu = CostModel(job.with_framework(get_framework("megatron")))
    csu = enumerate_candidates(cmu, ModelStage.parse("actor.train"), 64, True)
    assert {3, 6, 7} <= set(csu.pp.tolist())
    # Qwen2.5-0.5B: 14 heads, 2 KV heads -> TP 1, 2 (7 does not divide or multiply 2 KV heads), 14 over the cap
    cm5 = CostModel(JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 2, 8), WorkloadSpec()))
    assert set(enumerate_candidates(cm5, ModelStage.parse("actor.infer"), 16, True).tp.tolist()) == {1, 2}
    # a micro-batch of 3 where it divides the per-replica batch
    job3 = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 1, 8),
                   WorkloadSpec(mini_batch_size=48, prompts_per_step=96, micro_batch_size=4))
    tr = enumerate_candidates(CostModel(job3), ModelStage.parse("actor.train"), 8, False)
    assert 3 in set(tr.b.tolist())
    assert np.all(48 % (tr.dp * tr.b) == 0)


def test_framework_gates_the_new_dimensions():
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8), WorkloadSpec())
    ms = ModelStage.parse("actor.train")
    base = enumerate_candidates(CostModel(job), ms, 16, True)
    assert not base.z.any() and not base.o.any() and np.all(base.v == 1)
    meg = enumerate_candidates(CostModel(job.with_framework(get_framework("megatron"))), ms, 16, True)
    assert set(meg.z.tolist()) == {0, 1} and set(meg.o.tolist()) == {0, 1}  # no 'drop' for training
    assert np.all(meg.dp[meg.z > 0] > 1)
    v = meg.v > 1
    assert v.any()
    assert np.all(meg.pp[v] > 1) and np.all(32 % (meg.pp[v] * meg.v[v]) == 0)
    assert np.all((256 // (meg.dp[v] * meg.b[v])) % meg.pp[v] == 0) and meg.v.max() <= 4
    fsdp = enumerate_candidates(CostModel(job.with_framework(get_framework("fsdp"))), ms, 16, True)
    assert set(fsdp.tp.tolist()) == {1} and set(fsdp.pp.tolist()) == {1}
    assert set(fsdp.z[fsdp.dp > 1].tolist()) == {2, 3} and set(fsdp.z[fsdp.dp == 1].tolist()) == {0}
    inf = enumerate_candidates(CostModel(job.with_framework(get_framework("fsdp"))),
                               ModelStage.parse("reference.infer"), 16, True)
    assert set(inf.o.tolist()) == {0, 1, 2}
    # FSDP (stages 2 and 3) runs inference unsharded (z0, as SHARD_GRAD_OP's forward) or as ZeRO-3
    # (z3, dp > 1 only): every unsharded dp > 1 row once more with z3, nothing else
    assert set(inf.z.tolist()) == {0, 3} and np.all(inf.dp[inf.z == 3] > 1)
    key = lambda m: sorted(zip(inf.tp[m], inf.pp[m], inf.dp[m], inf.b[m], inf.o[m]))  # noqa: E731
    assert key(inf.z == 3) == key((inf.z == 0) & (inf.dp > 1))
    meg_inf = enumerate_candidates(CostModel(job.with_framework(get_framework("megatron"))),
                                   ModelStage.parse("reference.infer"), 16, True)
    assert not meg_inf.z.any()  # Megatron has no ZeRO-3: inference never sharded


def test_default_framework_plans_use_no_new_feature():
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 4, 8), WorkloadSpec())
    cm = CostModel(job)
    res = search(cm, 32, True)
    assert set(res.modes.values()) == {"disjoint"}
    plan = plan_job(job)
    for c in plan.candidates:
        assert (c.zero, c.offload, c.vpp) == (0, "none", 1)
    for st in cm.workflow.stages:
        used = [g for c in plan.candidates if ModelStage.parse(c.model_stage).stage == st for g in c.gpus]
        assert len(used) == len(set(used))


def _colocated_job():
    return JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 1, 1), WorkloadSpec(algorithm="ppo"),
                   framework=get_framework("fsdp"))


def test_one_gpu_ppo_colocates_every_stage():
    job = _colocated_job()
    with pytest.raises(NoFeasiblePlan):
        plan_job(job.with_framework(get_framework("nereus")))
    cm = CostModel(job)
    res = search(cm, 1, False)
    plan = plan_job(job)
    assert plan.l_step == pytest.approx(res.l_step, rel=1e-9)
    assert res.modes == {"generate": "disjoint", "infer": "colocated", "train": "colocated"}
    # colocation is visible only as overlapping GPU sets; the stage time is the sum
    groups = stage_groups(plan, cm.workflow)
    assert ("actor.train", "critic.train") in groups
    e = plan.estimates
    assert plan.l_step == pytest.approx(e["actor.generate"].time
                                        + sum(e[n].time for n in ("actor.infer", "critic.infer", "reference.infer",
                                                                  "reward.infer"))
                                        + e["actor.train"].time + e["critic.train"].time, rel=1e-9)
    assert cm.memory_ok(plan)


def test_colocated_placement_overlaps_from_the_same_start_and_keeps_current_gpus():
    job = JobSpec(get_model("qwen3-14b"), ClusterSpec(get_gpu("h100"), 1, 8), WorkloadSpec(algorithm="ppo"),
                  framework=get_framework("fsdp"))
    cm = CostModel(job)
    plan = plan_job(job, cost=cm)
    assert cm.memory_ok(plan)
    for grp in stage_groups(plan, cm.workflow):  # colocated blocks (one per stage, or several: mixed)
        members = [plan[n] for n in grp]
        if len(members) > 1:
            common = set.intersection(*(set(c.gpus) for c in members))
            assert min(min(c.gpus) for c in members) in common  # all start at the same GPU
    # replan on 6 of the 8 GPUs keeps the replicas whose GPUs survive and whose layout is unchanged
    pool = frozenset(range(6))
    try:
        smaller = plan_job(job, pool=pool, current=plan)
    except NoFeasiblePlan:
        return
    assert smaller.gpus_used() <= pool
    assert CostModel(job).memory_ok(smaller)


def test_colocate_always_colocates_even_when_gpus_suffice():
    fw = FrameworkSpec(name="always", colocate="always")
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 4, 8), WorkloadSpec(), framework=fw)
    cm = CostModel(job)
    res = search(cm, 32, True)
    plan = plan_job(job, cost=cm)
    assert set(m for s, m in res.modes.items() if len(cm.workflow.in_stage(s)) > 1) == {"colocated"}
    assert plan.l_step == pytest.approx(res.l_step, rel=1e-9)


def test_memory_infeasibility_names_memory_not_the_gpu_count():
    # Qwen3-14B PPO on one 8-GPU H100 node, default framework. By hand: 14.77e9 parameters (40
    # layers x 330.3M + 2 x 151,936 x 5,120 embeddings); training state 18 B/param (bf16 weight,
    # fp32 grad, 12 B Adam) = 247.6 GiB against 0.9 x 79.65 - 1.5 = 70.2 GiB usable per GPU, so
    # each *.train needs tp*pp >= 4 (3 divides neither the 40 heads nor the 40 layers, 2 gives
    # 123.8 GiB): the train stage needs 4 + 4 = 8 GPUs, which the pool has. Memory is the cause.
    job = JobSpec(get_model("qwen3-14b"), ClusterSpec(get_gpu("h100"), 1, 8), WorkloadSpec(algorithm="ppo"))
    with pytest.raises(NoFeasiblePlan) as e:
        plan_job(job)
    msg = str(e.value)
    assert "memory is the cause, not the GPU count" in msg
    assert "need 8 GPU(s), which the pool has" in msg
    assert "together they need at least" not in msg
    assert "colocation" in msg and "offload" in msg and "ZeRO" in msg and "fsdp" in msg
    # with a framework that has them, the job fits (the done-when)
    plan = plan_job(job.with_framework(get_framework("fsdp")))
    assert plan.l_step > 0
    # a GPU shortfall is named as such: Llama-3.3-70B on 32 GPUs without colocation
    job70 = JobSpec(get_model("llama-3.3-70b"), ClusterSpec(get_gpu("h100"), 4, 8), WorkloadSpec(algorithm="ppo"))
    with pytest.raises(NoFeasiblePlan) as e:
        plan_job(job70)
    assert "together they need at least" in str(e.value) and "colocation" in str(e.value)


@pytest.mark.parametrize("seed", range(6))
def test_cross_class_prune_drops_only_dominated_rows(seed, monkeypatch):
    """Against a brute-force 4-D dominance check: every dropped row is dominated; with a grid
    large enough to be exact, every dominated row is dropped."""
    from nereus.planner.candidates import _dominated_across_classes

    rng = np.random.default_rng(seed)
    k = 400
    n = rng.integers(1, 40, k)
    t = rng.integers(1, 60, k).astype(float)
    ri = rng.integers(0, 25, k)
    xi = rng.integers(0, 30, k)
    dominated = np.array([np.any((n <= n[i]) & (t <= t[i]) & (ri <= ri[i]) & (xi <= xi[i])
                                 & ((n < n[i]) | (t < t[i]) | (ri < ri[i]) | (xi < xi[i]))) for i in range(k)])
    for grid in (1 << 8, 1 << 12, 1 << 22):
        monkeypatch.setattr(cand_mod, "CROSS_CLASS_GRID", grid)
        got = _dominated_across_classes(n, t, ri, xi).astype(bool)
        assert not (got & ~dominated).any()
        if grid == 1 << 22:  # exact grid: rows equal in (class, GPUs) are left to the per-class staircase
            key = ri * 10**6 + xi * 10**3 + n
            same = np.array([np.any((key == key[i]) & (t < t[i])) for i in range(k)])
            assert np.array_equal(got | same, dominated | same)


@pytest.mark.parametrize("seed", range(10))
def test_knapsack_at_every_level_equals_the_greedy_per_level(seed):
    """The all-levels min-max knapsack against the greedy (slowest model-stage first) per level."""
    from nereus.planner.level_search import minmax_knapsack
    from nereus.planner.staircase import _minmax_levels

    rng = np.random.default_rng(seed)
    members, stairs_by_level = [], []
    L = 5
    for _ in range(rng.integers(1, 4)):
        k = 30
        fs = cand_mod.CandidateSet("m.infer", *[np.ones(k, dtype=np.int64)] * 6, n=rng.integers(1, 12, k),
                                   t=rng.random(k) * 10, r=rng.integers(0, L, k).astype(float), x=np.zeros(k))
        jj, rows = [], []
        per = []
        for j in range(L):
            ok = np.nonzero(fs.r <= j)[0]
            o = ok[np.lexsort((fs.t[ok], fs.n[ok]))]
            keep = np.ones(o.size, dtype=bool)
            keep[1:] = fs.t[o][1:] < np.minimum.accumulate(fs.t[o])[:-1]
            o = o[keep]
            jj.append(np.full(o.size, j))
            rows.append(o)
            per.append((fs.n[o], fs.t[o]))
        mult = int(rng.integers(1, 3))
        members.append((np.concatenate(jj), np.concatenate(rows), fs, mult))
        stairs_by_level.append((per, mult))
    budget = int(rng.integers(3, 30))
    got = _minmax_levels(members, budget)
    for j in range(L):
        stairs = [s[0][j] for s in stairs_by_level for _ in range(s[1])]
        ref = minmax_knapsack(stairs, budget)[0] if all(len(s[0]) for s in stairs) else math.inf
        have = dict(zip(got[0].tolist(), got[1].tolist())) if got is not None else {}
        assert have.get(j, math.inf) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("fw,model,gpus", [("nereus", "llama-3.1-8b", 64), ("megatron", "qwen2.5-0.5b", 16),
                                           ("generic", "llama-3.1-8b", 32)])
def test_generation_alone_enumerated_by_fewest_waves_is_exact(fw, model, gpus):
    """Generation alone in its stage of a synchronous job only needs its GPU count to fit the pool;
    the search's reduced enumeration (``gpus_free``) finds the optimum of the full one, and every
    dropped row is matched by a kept row of the same layout and offload that is no slower and no
    larger in resident and transient bytes."""
    job = JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), gpus // 8, 8),
                  WorkloadSpec(algorithm="ppo", prompt_len=1024, response_len=2048), framework=get_framework(fw))
    cm = CostModel(job)
    full = search(cm, gpus, True, full_frontiers=True)
    red = search(CostModel(job), gpus, True)
    assert red.l_step == pytest.approx(full.l_step, rel=1e-12)
    assert red.candidates_enumerated < full.candidates_enumerated
    ms = ModelStage.parse("actor.generate")
    a = enumerate_candidates(cm, ms, gpus, True)
    b = enumerate_candidates(cm, ms, gpus, True, gpus_free=True)
    assert 0 < len(b) < len(a)
    for i in range(len(a)):
        same = (b.tp == a.tp[i]) & (b.pp == a.pp[i]) & (b.o == a.o[i])
        ok = same & (b.t <= a.t[i] * (1 + 1e-12)) & (b.r <= a.r[i]) & (b.x <= a.x[i]) & (b.n <= gpus)
        assert ok.any(), (a.tp[i], a.pp[i], a.dp[i], a.c[i])


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "llama-3.1-8b", "llama-3.3-70b"])
def test_one_generation_wave_is_non_decreasing_in_concurrency(model):
    """The premise of the fewest-wave enumeration (``gpus_free``): one wave of ``c`` sequences
    (``c`` rollouts on one replica at concurrency ``c``) takes no less time as ``c`` grows."""
    wl = dict(algorithm="ppo", prompt_len=1024, response_len=2048, samples_per_prompt=1, reward_model=False)
    ms = ModelStage.parse("actor.generate")
    for tp, pp in ((1, 1), (2, 1), (4, 2), (8, 1), (2, 5), (1, 16)):
        ts = []
        for c in range(1, 65):
            job = JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), 2, 8),
                          WorkloadSpec(prompts_per_step=c, mini_batch_size=c, **wl),
                          framework=get_framework("generic"))
            if job.model("actor").num_layers < pp:
                continue
            cm = CostModel(job)
            a = cm.candidate_arrays(ms, tp, pp, np.ones(3, dtype=int), concurrency=c, offload=np.array([0, 1, 2]))
            ts.append(a["time"])
        ts = np.array(ts)
        assert np.all(np.diff(ts, axis=0) >= -1e-12 * ts[1:])


@pytest.mark.parametrize("fw", ["megatron", "generic"])
def test_host_offload_left_out_only_where_drop_dominates_it(fw):
    """``drop_dominated`` leaves out ``host`` rows for frozen models and generation: each has a
    ``drop`` row with the same GPUs and memory and no more time; derived inference copies keep it."""
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8),
                  WorkloadSpec(algorithm="ppo", prompt_len=1024, response_len=2048), framework=get_framework(fw))
    cm = CostModel(job)
    for name in ("actor.generate", "reference.infer", "reward.infer", "actor.infer", "critic.infer"):
        ms = ModelStage.parse(name)
        full = enumerate_candidates(cm, ms, 16, True)
        red = enumerate_candidates(cm, ms, 16, True, drop_dominated=True)
        host, drop = full.o == 1, full.o == 2
        if name in ("actor.infer", "critic.infer"):
            assert len(red) == len(full)
            continue
        assert not (red.o == 1).any() and len(red) == len(full) - host.sum()
        # rows come in the same order per offload mode: host row i and drop row i differ only in o
        h, d = np.nonzero(host)[0], np.nonzero(drop)[0]
        assert h.size == d.size > 0
        for col in ("tp", "pp", "dp", "b", "c", "n", "r", "x"):
            assert np.array_equal(getattr(full, col)[h], getattr(full, col)[d])
        assert np.all(full.t[d] <= full.t[h])
