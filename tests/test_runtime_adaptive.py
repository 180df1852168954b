"""The adaptive run: state-preserving re-layout between steps, and the controller driving Ray workers.

One local Ray cluster serves the module: a pool of 4 workers for the re-layout test, and a second
pool of 4 for the adaptive run (which removes two of its workers).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.controller.planning import CostModelPlanner  # noqa: E402
from nereus.planner.notation import format_plan  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.device_model import cpu_gpu_spec, runtime_job  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.runtime.run.relayout import checkpoint, relayout  # noqa: E402
from nereus.runtime.run.schedules import (
    parse_digits_schedule,  # noqa: E402
    parse_pool_schedule,  # noqa: E402
)
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
LAYOUTS = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
           "critic.infer": (1, 1, 1), "actor.train": (2, 1, 1), "critic.train": (1, 2, 2)}
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)


def _plan(actor_train):
    return simple_plan(W, {**LAYOUTS, "actor.train": actor_train}, 4, micro_batch=1)


def _assert_same_state(a: dict, b: dict) -> None:
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert a[kind].keys() == b[kind].keys()
        for n in a[kind]:
            assert torch.equal(a[kind][n], b[kind][n]), (kind, n)
    for k in ("step", "update_count", "version", "policy_version", "position"):
        assert a[k] == b[k], k


@pytest.mark.slow
def test_relayout_keeps_state_bit_for_bit_and_training_continues(ray_cluster):
    pool = WorkerPool(4, timeout_s=30).start()
    d = RLDriver(SPEC, W, _plan((2, 1, 1)), TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30))
    try:
        d.start(pool)
        d.step()
        ck = checkpoint(d)                       # after one step: Adam moments are non-zero
        assert ck["states"]["actor.train"]["update_count"] == 2
        d.step()
        ref = d.gather_logical_state("actor.train")  # the next step without any re-layout
        for target in ((1, 1, 2), (1, 2, 1)):
            info = relayout(d, _plan((2, 1, 1)), ckpt=ck)  # back to the checkpoint (a restart)
            assert info["source"] == "checkpoint" and info["steps_lost"] == 1 and d.step_index == 1
            _assert_same_state(d.gather_logical_state("actor.train"), ck["states"]["actor.train"])
            before = d.gather_logical_state("actor.train")
            info = relayout(d, _plan(target))       # the live re-layout under test
            assert info["source"] == "live" and d.layouts["actor.train"].dp == target[2]
            assert (d.layouts["actor.train"].tp, d.layouts["actor.train"].pp) == target[:2]
            _assert_same_state(d.gather_logical_state("actor.train"), before)
            if target[2] == 2:  # every replica holds the same state
                _assert_same_state(d.gather_logical_state("actor.train", 1), before)
            d.step()                                 # same samples, same update up to reduction order
            after = d.gather_logical_state("actor.train")
            assert (after["update_count"], after["position"], after["step"]) == (4, 4, 4)
            for n in ref["params"]:
                assert torch.allclose(after["params"][n], ref["params"][n], atol=2e-5, rtol=1e-4), (target, n)
                assert torch.allclose(after["exp_avg"][n], ref["exp_avg"][n], atol=1e-6, rtol=1e-3), (target, n)
    finally:
        d.close()
        pool.close()


@pytest.mark.slow
def test_adaptive_run_survives_losing_two_workers(ray_cluster):
    """Workers 2 and 3 vanish without notice before step 2, taking every replica of critic.train:
    the run restores the durable checkpoint taken before step 0 (on the 2 workers left, time-sharing:
    PPO's three inference model-stages do not fit 2 workers otherwise), reports 2 steps lost and
    re-runs them with the same samples."""
    pool = WorkerPool(4, timeout_s=30).start()
    lines: list[str] = []
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(timeout_s=30), parse_pool_schedule("2:-2"),
                      log=lines.append, measure=False)
    try:
        hist = run.run(5, pool)
    finally:
        pool.close()
    assert all(math.isfinite(m["reward"]) for m in hist)
    ev = [e for e in run.events if e["when"] == "pool change"]
    assert ev and ev[0]["source"] == "checkpoint" and ev[0]["steps_lost"] == 2, run.events
    assert all(g in (0, 1) for c in run.driver.cands.values() for g in c.gpus)
    assert [m["step"] for m in hist] == [0, 1, 0, 1, 2, 3, 4]
    assert [m["update_count"] for m in hist] == [2, 4, 2, 4, 6, 8, 10]  # restored, then continued
    assert hist[2]["reward"] == hist[0]["reward"]  # the same samples and weights as the first time
    assert any("left" in s for s in lines) and any(s.startswith("step 4:") for s in lines)


def test_pool_schedule_parsing():
    assert parse_pool_schedule("3:-2, 5:+1") == {3: -2, 5: 1}
    assert parse_pool_schedule("") == {}
    with pytest.raises(ValueError, match="3:-2"):
        parse_pool_schedule("3-2")


@pytest.mark.slow
def test_adaptive_run_moves_state_live_off_workers_that_announce_leaving(ray_cluster):
    """With notice, the controller replans without the leaving worker while it is still alive: the
    transition runs live (no restart), moves exactly the planner's bytes, and training goes on
    with every update counted once.

    The planners see a preset device, not one measured at start-up (issue 30): 100 GFLOP/s and the
    ``cpu`` preset's 0.5 GB/s gloo link. On it the plan of 4 workers puts a pipeline stage of
    critic.train, its only copy, on worker 3 (the one that leaves: the highest id), so the
    transition must move that state over a link, whatever plan the controller picks for the 3 that
    stay (at the preset's 20 GFLOP/s worker 3 holds a second DP replica instead, dropped without a
    byte moved). The premise is checked first."""
    gpu = replace(cpu_gpu_spec(measure=False), peak_flops=100e9)  # preset speed; scale-up link 0.5 GB/s
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(timeout_s=30), parse_pool_schedule("2:-1"), notice=True,
                      digits=parse_digits_schedule("3:4"), measure=False)
    run.job = runtime_job(SPEC, W, run.max_workers, gpu)
    first = CostModelPlanner().plan(run.job, frozenset(range(4)), None, False)
    assert any(3 in c.gpus and c.dp == 1 and c.model_stage.endswith(".train") for c in first.candidates), \
        format_plan(first)
    pool = WorkerPool(4, timeout_s=30).start()
    try:
        hist = run.run(4, pool)
    finally:
        pool.close()
    ev = [e for e in run.events if e["when"] == "pool change"]
    assert ev and ev[0].get("source") == "live", run.events
    t = ev[0]["transition"]
    assert t["bytes_moved"] == t["predicted_bytes"] and t["driver_bytes"] < 64 * 1024
    assert not any(e["kind"] == "restart" for e in run.events)
    assert all(g in (0, 1, 2) for c in run.driver.cands.values() for g in c.gpus)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8]
    assert hist[3]["response_len"] <= TASK.target_len + 1 and run.driver.task.num_digits == 4
    assert run.calib.bandwidth is not None and run.calib.bandwidth > 0  # measured primitives calibrate


def test_digits_schedule_and_scenario_options():
    import argparse

    from nereus.cli.run import SCENARIOS, add_arguments, apply_scenario

    assert parse_digits_schedule("4:5, 8:7") == {4: 5, 8: 7}
    assert parse_digits_schedule(None) == {}
    for bad in ("4-5", "4:9", "-1:3"):
        with pytest.raises(ValueError, match="digits-schedule"):
            parse_digits_schedule(bad)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--scenario", "elastic", "--steps", "6"])
    apply_scenario(args)
    assert args.steps == 6  # given on the command line: kept
    assert args.adaptive and args.notice and args.model == "small"
    assert args.pool_schedule == SCENARIOS["elastic"]["pool_schedule"]


def test_a_transition_whose_legal_target_is_the_current_plan_moves_nothing_and_resyncs_the_controller():
    """The planner may pick a dp the runtime's batch rules refuse (dp=3 for 8 prompts); lowered to a
    legal dp the target can equal the current plan. Then nothing moves, the run says so, and the
    controller is told the plan in effect is the current one (it had taken the target as running)."""
    from types import SimpleNamespace

    from nereus.controller.decisions import Transition, TransitionCost
    from nereus.spec.plan import Candidate, Plan

    current = Plan(candidates=(Candidate("actor.train", 1, 1, 2, micro_batch=1, grad_accum=2, gpus=(0, 1)),))
    wider = Plan(candidates=(Candidate("actor.train", 1, 1, 3, micro_batch=1, grad_accum=1, gpus=(0, 1, 2)),))
    resumed, lines = [], []
    run = SimpleNamespace(
        driver=SimpleNamespace(cands={c.model_stage: c for c in current.candidates}, workers=[object()] * 3),
        log=lines.append, _announced=frozenset(), workload=None, last_len=4.0, events=[],
        _legal=lambda d, plan: current,  # dp 3 lowered to 2: the current plan
        ctl=SimpleNamespace(resume=resumed.append),
        planner=SimpleNamespace(estimate=lambda job, plan, alive: ("estimated", plan, alive)),
        job_at=lambda n: ("job", n))
    dec = Transition(plan=wider, estimate=TransitionCost(l_tran=0.1, feasible=True, bytes_moved=0, source="dag",
                                                         reason=""), reason="payback")
    ev = AdaptiveRun._apply(run, dec, 10, "step")
    assert ev["source"] == "unchanged" and ev["kind"] == "transition"
    assert resumed == [("estimated", current, frozenset({0, 1, 2}))]
    assert any("no transition" in s and "current plan" in s for s in lines), lines
