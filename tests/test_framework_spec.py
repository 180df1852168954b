"""FrameworkSpec: presets, job-file round trip, and one clear error per malformed field."""

import json
from dataclasses import replace

import pytest

from nereus.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORK_PRESETS, FrameworkSpec, get_framework
from nereus.spec.job import JobSpec

BASE = {"model": "tiny", "cluster": {"gpu": "h100", "num_nodes": 1, "gpus_per_node": 8}}


def test_default_is_what_the_runtime_executes():
    """A job file without a framework gets the runtime's plan space (issue 24: ZeRO-1, offload,
    colocation); the library's ``FrameworkSpec()`` stays the paper's disjoint space."""
    fw = JobSpec.from_dict(BASE).framework
    assert DEFAULT_FRAMEWORK == "runtime" and fw == get_framework("runtime")
    assert fw.zero_stages == (0, 1, 2, 3) and fw.offload == ("none", "host", "drop") and fw.colocate == "auto"
    assert FrameworkSpec() == get_framework("nereus") and FrameworkSpec().colocate == "never"
    assert "framework" not in JobSpec.from_dict(BASE).to_dict()  # default job files stay unchanged
    paper = JobSpec.from_dict(BASE | {"framework": "nereus"})
    assert paper.to_dict()["framework"]["name"] == "nereus"  # written out: it is no longer the default


@pytest.mark.parametrize("name", sorted(FRAMEWORK_PRESETS))
def test_presets_round_trip_through_a_job_file(name, tmp_path):
    job = JobSpec.from_dict(BASE | {"framework": name})
    assert job.framework == get_framework(name)
    p = tmp_path / "job.json"
    p.write_text(json.dumps(job.to_dict()))
    assert JobSpec.from_file(p).framework == job.framework


def test_preset_with_overrides():
    fw = FrameworkSpec.from_dict({"preset": "fsdp", "offload": ["none"], "colocate": "always"})
    assert fw.zero_stages == (2, 3) and fw.offload == ("none",) and fw.colocate == "always"
    assert fw.name == "fsdp+custom"


@pytest.mark.parametrize("doc, words", [
    ("megatronn", ["unknown framework 'megatronn'", "valid:"]),
    ({"zero_stages": [4]}, ["'zero_stages'", "subset of [0, 1, 2, 3]", "[4]"]),
    ({"zero_stages": 1}, ["'zero_stages' must be a list"]),
    ({"offload": ["disk"]}, ["'offload'", "['none', 'host', 'drop', 'cpu_adam']"]),
    ({"colocate": "yes"}, ["'colocate'", "['never', 'auto', 'always']"]),
    ({"max_virtual_stages": 0}, ["'max_virtual_stages'", ">= 1", "0"]),
    ({"grad_reduce_bytes": 3}, ["'grad_reduce_bytes'", "2 (bf16), 4 (fp32)"]),
    ({"sequence_parallel": "true"}, ["'sequence_parallel' must be true or false"]),
    ({"zero": [1]}, ["unknown framework field(s) ['zero']"]),
    (5, ["job section 'framework' must be a preset name"]),
])
def test_bad_framework_fields_are_named(doc, words):
    with pytest.raises(ValueError) as e:
        JobSpec.from_dict(BASE | {"framework": doc})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_offload_modes_per_model_stage():
    fw = FrameworkSpec.from_dict({"preset": "megatron", "drop_model_stages": ["actor.generate"]})
    assert fw.offload_modes("actor.generate") == ("none", "host", "drop")
    assert fw.offload_modes("reference.infer") == ("none", "host")   # not listed
    assert fw.offload_modes("actor.train") == ("none", "host")       # training state is never dropped
    assert get_framework("generic").offload_modes("reference.infer") == ("none", "host", "drop")
    assert get_framework("nereus").offload_modes("actor.generate") == ("none",)
    assert FrameworkSpec.from_dict(fw.to_dict()) == fw
    with pytest.raises(ValueError, match="'drop_model_stages'"):
        FrameworkSpec(drop_model_stages=("actor.train",))


def test_runtime_preset_is_what_nereus_run_executes_and_plans_the_jobs_users_run():
    """The ``runtime`` preset equals the runtime's feature set (``run/features.py``), and finds plans
    for the jobs the disjoint default cannot place: Qwen2.5-0.5B PPO on 1 H100, Qwen3-14B PPO on 8,
    Llama-3.3-70B PPO on 32, each of whose candidates the runtime accepts."""
    from nereus.planner.search import NoFeasiblePlan, plan_job
    from nereus.runtime.run.features import RUNTIME_OFFLOAD, RUNTIME_ZERO, check_runtime_features
    from nereus.spec.hardware import ClusterSpec, get_gpu
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    fw = get_framework("runtime")
    assert fw.zero_stages == RUNTIME_ZERO and fw.offload == RUNTIME_OFFLOAD and fw.max_virtual_stages == 1
    for model, nodes, gpn in (("qwen2.5-0.5b", 1, 1), ("qwen3-14b", 1, 8), ("llama-3.3-70b", 4, 8)):
        job = JobSpec(actor=get_model(model), cluster=ClusterSpec(get_gpu("h100"), nodes, gpn),
                      workload=WorkloadSpec(algorithm="ppo", samples_per_prompt=4), framework=fw)
        with pytest.raises(NoFeasiblePlan):
            plan_job(replace(job, framework=FrameworkSpec()))
        plan = plan_job(job)
        for c in plan.candidates:
            check_runtime_features(c.model_stage, c)
        assert plan.l_step > 0
