"""plan_job takes the chosen rows' estimates from the search's arrays (CandidateSet.estimate_of);
they must be exactly what CostModel.estimate_candidate computes for each placed candidate."""

import pytest

from nereus.cost.model import CostModel
from nereus.planner.candidates import enumerate_candidates
from nereus.planner.search import plan_job
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec


@pytest.mark.parametrize("model,nodes,fw,wl", [
    ("llama-3.1-8b", 2, "nereus", {}),
    ("llama-3.1-8b", 2, "megatron", {}),
    ("qwen3-14b", 1, "fsdp", {}),
    ("llama-3.1-8b", 1, "deepspeed", {}),
    ("qwen2.5-0.5b", 1, "generic", {"algorithm": "grpo"}),
    ("llama-3.1-8b", 4, "generic", {"asynchronous": True}),
])
def test_plan_job_estimates_equal_a_fresh_estimate(model, nodes, fw, wl):
    job = JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), nodes, 8), WorkloadSpec(**wl),
                  framework=get_framework(fw))
    plan = plan_job(job)
    cost = CostModel(job)
    fresh = cost.estimate(Plan(candidates=plan.candidates), job.cluster.all_gpus())
    assert plan.estimates == fresh.estimates  # bit for bit: time, breakdown, memory terms
    assert plan.l_step == fresh.l_step and plan.gpu_memory == fresh.gpu_memory


def test_estimate_of_is_none_for_a_row_the_enumeration_does_not_have():
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 1, 8), WorkloadSpec())
    cost = CostModel(job)
    ms = cost.workflow.get("actor.infer")
    cs = enumerate_candidates(cost, ms, 8, False)
    other = enumerate_candidates(cost, ms, 8, False)
    assert cs.estimate_of(other, 3) == cost.estimate_candidate(other.candidate(3, job.workload.mini_batch_size))
    other.tp[3] = 99  # no such layout among the enumerated rows
    assert cs.estimate_of(other, 3) is None
    assert cs.take([0, 1]).estimate_of(other, 0) is None  # a subset carries no detail


def test_reused_estimates_carry_the_memory_correction_and_calibration():
    from nereus.cost.efficiency import EfficiencyTable

    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 2, 8), WorkloadSpec(),
                  framework=get_framework("fsdp"))
    eff = EfficiencyTable()
    eff.update("gemm", measured_s=1.3, predicted_s=1.0, gpu=job.cluster.gpu)
    cost = CostModel(job, eff, {"actor.train": 1.2, "reference.infer": 0.9})
    plan = plan_job(job, cost=cost)
    fresh = cost.estimate(Plan(candidates=plan.candidates), job.cluster.all_gpus())
    assert plan.estimates == fresh.estimates
    # the correction scales every memory term of the reused estimate
    plain = CostModel(job, eff).estimate_candidate(plan["actor.train"], True)
    e = plan.estimates["actor.train"]
    assert e.memory["weights"] == pytest.approx(1.2 * plain.memory["weights"], rel=1e-12)
    assert e.transient == pytest.approx(1.2 * plain.transient, rel=1e-12)
