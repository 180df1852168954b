"""``FrameworkSpec.even_dp`` (the runtime's even split of a batch's rows over DP): the planner offers
only dp degrees that divide the rows, and a plan file breaking the rule is refused by name."""

import pytest

from nereus.cost.model import CostModel
from nereus.planner.candidates import enumerate_candidates, even_dp_rows
from nereus.planner.validate import check_plan
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import ModelStage, workflow_for

# ReMax, 6 prompts x 2 samples: global batch 12, rollouts 18 (one greedy baseline per prompt)
WL = WorkloadSpec(algorithm="remax", prompts_per_step=6, samples_per_prompt=2, prompt_len=64, response_len=64,
                  mini_batch_size=12, micro_batch_size=2, infer_micro_batch_size=2)


def _job(even: bool) -> JobSpec:
    fw = FrameworkSpec(name="t", even_dp=even)
    return JobSpec(get_model("small"), ClusterSpec(get_gpu("h100"), 1, 8), WL, framework=fw)


def _dps(job: JobSpec, name: str) -> set[int]:
    cm = CostModel(job, workflow=workflow_for(job.workload))
    return set(int(d) for d in enumerate_candidates(cm, ModelStage.parse(name), 8, False).dp)


def test_rows_each_model_stage_must_divide():
    assert even_dp_rows(WL, "actor.generate") == 6  # gcd(prompts 6, global batch 12)
    assert even_dp_rows(WL, "reward.infer") == 6  # ReMax scores the 6 greedy baselines too
    assert even_dp_rows(WL, "reference.infer") == 12
    assert get_framework("runtime").even_dp and not get_framework("nereus").even_dp


def test_the_planner_offers_only_dividing_dp_under_even_dp():
    # divisors of 6 and of 12 up to 8 GPUs
    assert _dps(_job(True), "actor.generate") == {1, 2, 3, 6}
    assert _dps(_job(True), "reward.infer") == {1, 2, 3, 6}
    assert _dps(_job(True), "reference.infer") == {1, 2, 3, 4, 6}
    # without it: the smallest dp of each load ceil(18/dp) = 18, 9, 6, 5, 4, 3 (dp 7, 8: 3 again)
    assert _dps(_job(False), "actor.generate") == {1, 2, 3, 4, 5, 6}
    # ceil(12/dp) = 12, 6, 4, 3, 3, 2, 2, 2: dp 1, 2, 3, 4, 6
    assert _dps(_job(False), "reference.infer") == {1, 2, 3, 4, 6}


def test_a_plan_file_breaking_even_dp_is_refused_by_name():
    job = _job(True)
    cands = []
    for ms in workflow_for(WL).model_stages:
        if ms.stage == "train":
            cands.append(Candidate(ms.name, 1, 1, 1, micro_batch=2, grad_accum=6))
        elif ms.stage == "infer":
            cands.append(Candidate(ms.name, 1, 1, 1, micro_batch=2))
        else:
            cands.append(Candidate(ms.name, 1, 1, 4, concurrency=5))
    cands = [Candidate(c.model_stage, c.tp, c.pp, c.dp, micro_batch=c.micro_batch, grad_accum=c.grad_accum,
                       concurrency=c.concurrency, gpus=tuple(range(c.dp))) for c in cands]
    with pytest.raises(ValueError, match=r"actor.generate: dp=4 must divide 6"):
        check_plan(Plan(candidates=tuple(cands)), job)
    check_plan(Plan(candidates=tuple(cands)), _job(False))  # the same plan is legal without the rule


def test_the_controllers_extend_only_and_destroy_only_keep_even_dp():
    # the controller's cheaper targets re-derive dp themselves: under even_dp a generation replica
    # count must divide the 6 rows (2 -> 3 is allowed, 3 -> 4 is not; destroy-only from 4 on 3 GPUs
    # drops to 3, which divides 6, and from 6 on 5 GPUs to 3, since 5 and 4 do not)
    from nereus.controller.alternatives import destroy_only, extend_only
    from nereus.spec.hardware import ClusterSpec, get_gpu

    rows = {"actor.generate": even_dp_rows(WL, "actor.generate")}
    cl = ClusterSpec(get_gpu("h100"), 1, 8)

    def gen(dp):
        return Plan(candidates=(Candidate("actor.generate", 1, 1, dp, concurrency=1, gpus=tuple(range(dp))),))

    assert extend_only(gen(2), frozenset(range(3)), 12, cl, {}, rows).candidates[0].dp == 3
    assert extend_only(gen(3), frozenset(range(4)), 12, cl, {}, rows) is None
    assert extend_only(gen(3), frozenset(range(4)), 12, cl, {}).candidates[0].dp == 4  # without the rule
    assert destroy_only(gen(6), frozenset(range(5)), 12, rows).candidates[0].dp == 3
    assert destroy_only(gen(6), frozenset(range(5)), 12).candidates[0].dp == 5
