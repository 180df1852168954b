"""``nereus run --adaptive`` with ZeRO-sliced state (issue 24 item 2): a worker of the actor's ZeRO-1
group dies mid-step. Its optimizer slice exists nowhere else (ZeRO-1 slices are unique; only the
weights are replicated), so no live recovery can rebuild it: the run restores the durable checkpoint
(unsliced logical state, loadable into any layout and ZeRO stage) on the survivors, re-runs the lost
steps with the same samples and ends with the weights of the fault-free run. The controller's
planner is pinned to the ZeRO plan while its workers are all alive (``CostModelPlanner.plan_fn``),
so the fault hits sliced state."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.planner.search import plan_job  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.runtime.transit.sharded import live_unsupported  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
STEPS = 3
LAYOUT = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 1, 1, (1,)),
          "critic.infer": (1, 1, 1, (3,)), "actor.train": (1, 1, 2, (0, 1)), "critic.train": (1, 1, 2, (2, 3))}


def _zplan(layout) -> Plan:
    return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=0 if ms.endswith("generate") else 1,
                                           gpus=g, zero=1 if ms == "actor.train" else 0)
                                 for ms, (tp, pp, dp, g) in layout.items()))


ZPLAN = _zplan(LAYOUT)
# after worker 1 is lost: the same degrees (so the same reduction order: two-rank sums commute) on the
# survivors, with worker 2 in worker 1's place
SURVIVORS_PLAN = _zplan({ms: (tp, pp, dp, tuple(2 if g == 1 else g for g in gs))
                         for ms, (tp, pp, dp, gs) in LAYOUT.items()})


def _pinned(job, pool, current=None, cost=None, **opts):
    """The ZeRO plan while its workers are alive, its copy on the survivors after worker 1 is lost
    (Adam turns a last-bit difference in a near-zero gradient into a step of size ``lr``, so a plan of
    other degrees would end elsewhere), else the planner's own choice."""
    for plan in (ZPLAN, SURVIVORS_PLAN):
        if plan.gpus_used() <= set(pool):
            return cost.estimate(plan, pool)
    return plan_job(job, pool=pool, current=current, cost=cost, **opts)


def _run(faults=None):
    pool = WorkerPool(4, timeout_s=30, hang_timeout_s=10).start()
    lines: list[str] = []
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30), hang_timeout_s=10,
                      faults=faults, log=lines.append, measure=False, checkpoint_every=10)
    run.planner.plan_fn = _pinned
    run.keep_final = True
    try:
        hist = run.run(STEPS, pool)
    finally:
        pool.close()
    return run, hist, lines


@pytest.mark.slow
def test_a_lost_zero_slice_is_recovered_from_the_durable_checkpoint(ray_cluster):
    ref, ref_hist, _ = _run()
    assert ref.recoveries == [] and ref.driver is not None
    run, hist, lines = _run(faults={1: ("train_fields", 1, "kill")})  # worker 1: DP rank 1 of the ZeRO group
    assert [m["update_count"] for m in ref_hist] == [2, 4, 6]
    # step 0, then (step 1's fault: back to the checkpoint taken before step 0) steps 0, 1, 2 again
    assert [m["update_count"] for m in hist] == [2, 2, 4, 6]
    rec = run.recoveries
    assert len(rec) == 1 and rec[0]["lost"] == [1] and rec[0]["source"] == "checkpoint", rec
    assert rec[0]["steps_lost"] == 1  # back to the checkpoint taken before step 0; step 0 re-runs
    assert any("actor.train lost every replica" in s for s in lines), lines[-10:]
    assert all(1 not in c.gpus for c in run.driver.cands.values())
    for ms in ref.final_state:
        a, b = run.final_state[ms], ref.final_state[ms]
        if "exp_avg" in a:
            assert a["update_count"] == b["update_count"] and a["position"] == b["position"]
        for n in a["params"]:  # same samples, same degrees and reduction order on other workers
            assert torch.equal(a["params"][n], b["params"][n]), (ms, n, (a["params"][n] - b["params"][n]).abs().max())


def _actor(**changes) -> Plan:
    from dataclasses import replace

    return Plan(candidates=tuple(replace(c, **changes) if c.model_stage == "actor.train" else c
                                 for c in ZPLAN.candidates))


def test_live_unsupported_runs_tp_changes_of_zero_groups_and_names_zero1_against_zero3():
    """The transition planner splits a ZeRO group into replicas of its own (tp, pp) first and cuts a
    target group of another TP from replicas locally, both of which the live executor runs
    (``transit/regroup.py``); a ZeRO-1 group meeting ZeRO-3 slices in one primitive (one range of the
    shard against one range per layer unit, which the planner counts as one layout) is refused:
    adaptive runs that through the checkpoint restart."""
    from nereus.runtime.run.device_model import runtime_job
    from nereus.transition.estimate import estimate_transition

    job = runtime_job(SPEC, W, 4)
    pool = frozenset(range(4))
    for ok in (_actor(zero=0), _actor(tp=2, dp=1, zero=0), _actor(tp=2, gpus=(0, 1, 2, 3))):
        est = estimate_transition(job, ZPLAN, ok, pool)
        assert est.feasible and live_unsupported(est.dag) is None, est.reason
    for zero in (2, 3):
        est = estimate_transition(job, ZPLAN, _actor(zero=zero, recompute="full" if zero == 3 else "none"), pool)
        assert est.feasible, est.reason
        why = live_unsupported(est.dag)
        assert why is not None and "ZeRO-1" in why and f"ZeRO-{zero}" in why and "merge:actor.train" in why, why
