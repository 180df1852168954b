"""Memory sized at the response-length distribution and a user-set memory fraction (issue 13, item 5)."""

import json

import pytest

from nereus.cli import main
from nereus.cost.memory import stage_memory
from nereus.cost.model import CostModel
from nereus.planner.search import plan_job
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec, read_response_lengths, response_len_stats

GIB = 2**30
M8 = get_model("llama-3.1-8b")


def _job(**wl):
    return JobSpec(M8, ClusterSpec(get_gpu("h100"), 2, 8), WorkloadSpec(**wl))


def test_memory_uses_response_len_max_and_time_the_mean():
    # prompt 1024 + max 3072 = 4096 tokens: 34·s·b·h per layer (Korthikanti, Llama at t=1), 32 layers,
    # and logits 4·s·b·(h+V); the mean of 1024 does not enter memory.
    wl = WorkloadSpec(prompt_len=1024, response_len=1024, response_len_max=3072, micro_batch_size=1)
    mem = stage_memory("train", M8, wl, tp=1, pp=1, micro_batch=1, inflight=1)
    assert mem["activations"] == 32 * 34 * 4096 * 4096
    assert mem["logits"] == 4 * 4096 * (4096 + 128256)
    # KV cache of 64 sequences at TP 2: 64 · 4096 tokens · 2·32 layers·4 KV heads·128·2 B = 65,536 B/token
    gen = stage_memory("generate", M8, wl, tp=2, pp=1, concurrency=64)
    assert gen["kv_cache"] == 64 * 4096 * 65_536
    # time: identical to the job without a max
    with_max, mean_only = CostModel(_job(response_len=1024, response_len_max=3072)), CostModel(_job(response_len=1024))
    for name in ("actor.train", "actor.generate", "critic.infer"):
        ms = with_max.workflow.get(name)
        kw = {"concurrency": 64} if name.endswith("generate") else {"micro_batch": 2}
        assert with_max.candidate_arrays(ms, 2, 1, 4, **kw)["time"][0] == mean_only.candidate_arrays(ms, 2, 1, 4, **kw)["time"][0]


def test_readme_plan_does_not_fit_when_a_micro_batch_holds_4096_token_responses():
    mean = _job(prompt_len=1024, response_len=2048)
    plan = plan_job(mean)
    assert max(plan.gpu_memory.values()) <= plan.capacity
    at_max = CostModel(mean.with_workload(WorkloadSpec(prompt_len=1024, response_len=2048, response_len_max=4096)))
    assert not at_max.memory_ok(Plan(candidates=plan.candidates))
    replanned = plan_job(at_max.job, cost=at_max)
    assert max(replanned.gpu_memory.values()) <= replanned.capacity


def test_memory_fraction_replaces_the_fixed_headroom():
    # A layout measured at 74 of 80 GiB: refused at the default 10% headroom (0.9 x 79.6 = 71.7 GiB),
    # accepted at memory_fraction 0.95 (75.7 GiB).
    dev = get_gpu("h100").memory_bytes
    peak = Plan(candidates=(), gpu_memory={0: 74 * GIB})
    default, frac = CostModel(_job()), CostModel(_job(memory_fraction=0.95))
    assert default.capacity == pytest.approx(0.9 * dev) and frac.capacity == pytest.approx(0.95 * dev)
    assert not default.memory_ok(peak) and frac.memory_ok(peak)
    assert CostModel(_job(memory_fraction=0.95), headroom=0.2).capacity == pytest.approx(0.8 * dev)  # explicit wins


def test_workload_fields_validate_and_round_trip():
    with pytest.raises(ValueError, match=r"'response_len_max' must be an integer >= response_len \(2048\).*got 1000"):
        WorkloadSpec(response_len_max=1000)
    with pytest.raises(ValueError, match=r"'memory_fraction' must be a number in \(0, 1\].*got 1.5"):
        WorkloadSpec(memory_fraction=1.5)
    w = WorkloadSpec(response_len_max=4096, memory_fraction=0.95)
    assert WorkloadSpec.from_dict(w.to_dict()) == w
    assert "response_len_max" not in WorkloadSpec().to_dict()  # unset fields stay out of job documents
    assert w.with_response_len(5000).response_len_max == 5000 and w.with_response_len(3000).response_len_max == 4096


def test_percentile_of_a_length_file(tmp_path):
    f = tmp_path / "lens.csv"
    f.write_text("step,response_length\n" + "".join(f"0,{i}\n" for i in range(1, 101)))
    xs = read_response_lengths(f)
    assert xs == list(range(1, 101))
    assert response_len_stats(xs, 90) == (51, 90)   # mean 50.5 rounds to 51; nearest rank ceil(0.9·100) = 90
    assert response_len_stats(xs) == (51, 100)
    bad = tmp_path / "bad.txt"
    bad.write_text("100\nabc\n")
    with pytest.raises(ValueError, match=r"bad.txt' line 2: response length 'abc' must be an integer >= 1"):
        read_response_lengths(bad)


def test_cli_options_reach_the_job_and_its_json(capsys, tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("\n".join(str(x) for x in [1000, 2000, 3000, 6000]) + "\n")
    rc = main(["plan", "--nodes", "2", "--response-lens", str(f), "--response-len-percentile", "75",
               "--memory-fraction", "0.95", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    wl = doc["job"]["workload"]
    assert (wl["response_len"], wl["response_len_max"], wl["memory_fraction"]) == (3000, 3000, 0.95)
    assert doc["plan"]["capacity"] == pytest.approx(0.95 * get_gpu("h100").memory_bytes)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(doc))
    assert main(["plan", "--job", str(job_file), "--json"]) == 0  # the file carries both fields
    again = json.loads(capsys.readouterr().out)
    assert again["job"]["workload"] == wl and again["plan"]["capacity"] == doc["plan"]["capacity"]


@pytest.mark.parametrize("argv, words", [
    (["--response-len-percentile", "90"], ["--response-len-percentile=90 needs --response-lens"]),
    (["--memory-fraction", "1.5"], ["memory_fraction", "1.5", "(0, 1]"]),
    (["--memory-fraction", "0.9", "--headroom", "0.1"], ["--headroom=0.1 and --memory-fraction=0.9 are exclusive"]),
    (["--response-len-max", "100"], ["response_len_max", "100", ">= response_len (2048)"]),
])
def test_cli_errors_are_one_line(capsys, argv, words):
    rc = main(["plan", "--nodes", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
