"""nereus plan --layout: what-if of the user's own layout next to the best plan (issue 13, item 6)."""

import json

import pytest

from nereus.cli import main
from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.planner.search import plan_job
from nereus.planner.whatif import parse_layout, whatif
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

GIB = 2**30


def _job(nodes=2, **wl):
    return JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), nodes, 8), WorkloadSpec(**wl))


def _spec(c: Candidate) -> str:
    s = f"{c.model_stage}={c.tp},{c.pp},{c.dp}"
    if c.concurrency:
        return s + f",c={c.concurrency}"
    return s + f",b={c.micro_batch}" + (f",rc={c.recompute}" if c.model_stage.endswith(".train") else "")


def test_the_best_plan_as_a_layout_evaluates_to_the_best_plan():
    job = _job()
    best = plan_job(job)
    rep, ev = whatif(job, [_spec(c) for c in best.candidates], best=best)
    assert rep["layout"]["from_nereus"] == []
    assert ev.fits and ev.l_step == pytest.approx(best.l_step, rel=1e-12)
    assert rep["speedup"] == pytest.approx(1.0, rel=1e-12)
    assert sorted(c.key() for c in ev.plan.candidates) == sorted(c.key() for c in best.candidates)


def test_left_out_model_stages_come_from_the_best_plan_and_defaults_follow_the_frameworks():
    job = _job(micro_batch_size=3)
    cost = CostModel(job)
    best = plan_job(job, cost=cost)
    cands, from_best = parse_layout(cost, ["actor.train=2,1,2", "actor.infer=1,1,4"], best)
    by = {c.model_stage: c for c in cands}
    # mini 256 / dp 2 = 128 per replica; the largest b <= 3 dividing 128 is 2, so a = 64
    assert (by["actor.train"].micro_batch, by["actor.train"].grad_accum) == (2, 64)
    assert by["actor.infer"].micro_batch == 8  # min(infer_micro_batch_size 8, ceil(1024 / 4))
    assert set(from_best) == {m for m in best.model_stages if m not in ("actor.train", "actor.infer")}
    for m in from_best:
        assert by[m].key() == best[m].key()


def test_overflow_names_the_gpu_the_bytes_over_and_the_terms():
    # actor.train at tp1 pp1 dp8 b4 without recompute on GPUs shared with the other stages: the fullest
    # GPU holds workspace + every resident state placed there + the largest transient.
    job = _job(recompute="none")
    cost = CostModel(job)
    rep, ev = whatif(job, ["actor.train=1,1,8,b=4"], cost=cost)
    assert not ev.fits
    train = ev.plan["actor.train"]
    g = max(train.gpus, key=lambda x: ev.plan.gpu_memory[x])
    on_g = [c for c in ev.plan.candidates if g in c.gpus]
    ests = {c.model_stage: cost.estimate_candidate(c) for c in on_g}
    want = WORKSPACE_BYTES + sum(e.resident for e in ests.values()) + max(e.transient for e in ests.values())
    assert ev.plan.gpu_memory[g] == pytest.approx(want, rel=1e-12)
    over = want - 0.9 * job.cluster.gpu.memory_bytes
    m = rep["layout"]["model_stages"]["actor.train"]
    assert m["over_gib"] == pytest.approx(over / GIB, rel=1e-9)
    assert f"GPU {g} needs {want / GIB:.1f} GiB, {over / GIB:.1f} GiB over" in m["overflow"]
    n = get_model("llama-3.1-8b").num_params
    assert m["memory_gib"]["optimizer"] == pytest.approx(12 * n / GIB) and m["memory_gib"]["weights"] == pytest.approx(2 * n / GIB)


def test_generation_concurrency_fills_what_the_placed_state_leaves():
    job = _job()
    cost = CostModel(job)
    rep, ev = whatif(job, ["actor.generate=2,1,8"], cost=cost)
    gen = ev.plan["actor.generate"]
    ms = cost.workflow.get("actor.generate")
    resident = {g: sum(ev.plan.estimates[c.model_stage].resident for c in ev.plan.candidates if g in c.gpus)
                for g in gen.gpus}
    room = min(cost.capacity - cost.workspace - r for r in resident.values())

    def transient(c):
        return float(cost.candidate_arrays(ms, 2, 1, [8], concurrency=c)["transient"][0])

    assert transient(gen.concurrency) <= room
    assert gen.concurrency == 128 or transient(gen.concurrency + 1) > room  # 128 = 1024 rollouts / dp 8


def test_cli_layout_table_and_json(capsys):
    assert main(["plan", "--nodes", "2", "--layout", "actor.train=4,1,2", "critic.train=2,2,2"]) == 0
    out = capsys.readouterr().out
    assert "your layout (--layout):" in out and "(from Nereus's plan)" in out and "Nereus's best plan" in out
    assert "predicted L_step" in out
    assert main(["plan", "--nodes", "2", "--json", "--layout", "actor.train=4,1,2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] and doc["layout"]["model_stages"]["actor.train"]["tp"] == 4 and "plan" in doc


@pytest.mark.parametrize("layout, words", [
    ("actor.train", ["expected MODEL_STAGE=TP,PP,DP"]),
    ("actor.fly=1,1,1", ["model-stage 'actor.fly' is not in the job's workflow", "valid:"]),
    ("actor.train=3,1,1", ["tp=3 does not divide num_attention_heads=32"]),
    ("actor.train=1,1,3", ["dp=3 does not divide the job's mini_batch_size 256"]),
    ("actor.train=1,1,2,b=3", ["b=3 does not divide the 128 sequences per replica"]),
    ("actor.train=1,1,x", ["degree dp = 'x' must be an integer >= 1"]),
    ("actor.generate=1,1,2,b=2", ["option(s) ['b'] do not apply to a generate model-stage", "valid: ['c', 'off']"]),
    ("actor.train=1,1,2,rc=some", ["rc = 'some' must be one of"]),
    # the default (runtime) space colocates: the stage needs its largest model-stage, 8x4x1 = 32
    ("actor.train=8,4,1 critic.train=8,4,1", ["stage 'train' needs 32 GPUs", "largest counts", "the pool has 16"]),
])
def test_cli_layout_errors_are_one_line(capsys, layout, words):
    rc = main(["plan", "--nodes", "2", "--layout", *layout.split()])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def test_whatif_colocates_under_a_colocating_framework_and_adds_the_times():
    from nereus.cost.model import CostModel
    from nereus.planner.whatif import whatif
    from nereus.spec.framework import get_framework
    from nereus.spec.hardware import ClusterSpec, get_gpu
    from nereus.spec.job import JobSpec
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    job = JobSpec(get_model("qwen2.5-0.5b"), ClusterSpec(get_gpu("h100"), 1, 1),
                  WorkloadSpec(prompts_per_step=64, mini_batch_size=64, prompt_len=512, response_len=512),
                  framework=get_framework("fsdp"))
    specs = ["actor.train=1,1,1,off=host", "critic.train=1,1,1,off=host", "actor.generate=1,1,1,c=64,off=drop",
             "actor.infer=1,1,1,off=drop", "reference.infer=1,1,1,off=drop", "critic.infer=1,1,1,off=drop",
             "reward.infer=1,1,1,off=drop"]
    out, ev = whatif(job, specs)
    assert all(c.gpus == (0,) for c in ev.plan.candidates)
    cm = CostModel(job)
    total = sum(cm.estimate_candidate(c).time for c in ev.plan.candidates)
    assert ev.l_step == pytest.approx(total)  # one GPU: every model-stage runs in turn
    assert ev.fits
    # with every state resident the same layout needs the sum of all weights and optimizer states at once
    assert out["layout"]["model_stages"]["actor.train"]["offload"] == "host"
