"""``transit/sharded.schedule_fault``: the adaptive run asks the executor's own schedule check before a
live transition, so a schedule that breaks a transition rule becomes a restart from the checkpoint
(``run/adaptive.py`` ``_live``) instead of the run's end."""

from dataclasses import replace

from nereus.runtime.run.device_model import runtime_job
from nereus.runtime.transit.sharded import schedule_fault
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import MODEL_PRESETS
from nereus.spec.workload import WorkloadSpec
from nereus.transition.estimate import estimate_transition

W = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
JOB = runtime_job(MODEL_PRESETS["tiny"], W, 4)


def _plan(tp: int, gpus: tuple) -> Plan:
    return Plan(candidates=(Candidate("actor.generate", 1, 1, 1, gpus=(3,)),
                            Candidate("actor.infer", 1, 1, 1, gpus=(3,)),
                            Candidate("reference.infer", 1, 1, 1, gpus=(2,)),
                            Candidate("actor.train", tp, 1, 1, micro_batch=1, gpus=gpus)))


def test_a_schedule_breaking_an_edge_is_named_and_a_valid_one_passes():
    est = estimate_transition(JOB, _plan(1, (0,)), _plan(2, (0, 1)), frozenset(range(4)))
    assert est.feasible, est.reason
    assert schedule_fault(est) is None
    pid = est.dag.nodes[0].pid
    # a primitive left out of the schedule: the check the executor runs refuses it, naming it
    bad = replace(est.schedule, start={k: v for k, v in est.schedule.start.items() if k != pid},
                  end={k: v for k, v in est.schedule.end.items() if k != pid})
    why = schedule_fault(replace(est, schedule=bad))
    assert why is not None and why.startswith("the transition planner's schedule fails its check")
    assert pid in why
