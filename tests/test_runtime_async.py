"""One-step-off asynchronous RL (``nereus/runtime/run/async_driver.py``, ``nereus run --async``).

Reference values are derived independently: a synchronous :class:`RLDriver` run on the same pool
(staleness 0 must reproduce its weights), and hand-computed weight versions (batch ``k`` of a
staleness-``N`` run is generated with ``v(max(0, k-N))``; one step is ``U`` optimizer updates).
One local Ray cluster and one pool of 4 CPU workers serve every Ray test of this module.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.async_driver import AsyncRLDriver, async_plan, overlap_of  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.workflow import workflow_for  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)


def workload(algo: str, **kw) -> WorkloadSpec:
    base = dict(algorithm=algo, prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
    base.update(kw)
    return WorkloadSpec(**base)


def layouts(w: WorkloadSpec, gen=(1, 1, 2), rest=(1, 1, 2)) -> dict:
    return {ms.name: (gen if ms.name == "actor.generate" else rest) for ms in workflow_for(w).model_stages}


def plan_for(w: WorkloadSpec, gen=(1, 1, 2), rest=(1, 1, 2)) -> Plan:
    """Generation on workers 2-3, every other model-stage on workers 0-1."""
    return async_plan(w, layouts(w, gen, rest), 4, micro_batch=1)



def _run(driver, pool, steps: int):
    driver.start(pool)
    try:
        hist = [driver.step() for _ in range(steps)]
        state = driver.gather_logical_state("actor.train")
        crit = driver.gather_logical_state("critic.train") if "critic.train" in driver.layouts else None
    finally:
        driver.close()
    return hist, state, crit


def _max_diff(a: dict, b: dict) -> float:
    ta, tb = a["params"], b["params"]
    assert ta.keys() == tb.keys()
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


# ---------------------------------------------------------------------- no Ray
def test_async_plan_separates_generation_and_refuses_too_few_workers():
    w = workload("ppo")
    p = plan_for(w)
    assert p["actor.generate"].gpus == (2, 3)
    assert all(set(c.gpus) <= {0, 1} for c in p.candidates if c.model_stage != "actor.generate")
    lay = {c.model_stage: Layout(c.tp, c.pp, c.dp, c.gpus) for c in p.candidates}
    assert overlap_of(lay) == []
    shared = simple_plan(w, layouts(w), 4, micro_batch=1)
    lay = {c.model_stage: Layout(c.tp, c.pp, c.dp, c.gpus) for c in shared.candidates}
    assert overlap_of(lay) == [0, 1]
    with pytest.raises(ValueError, match="workers of its own"):
        async_plan(w, layouts(w, gen=(1, 1, 2), rest=(1, 1, 4)), 4)


def test_bad_staleness_and_overlap_refused_before_workers_start():
    w = workload("grpo")
    with pytest.raises(ValueError, match="staleness"):
        AsyncRLDriver(SPEC, w, plan_for(w), TASK, 4, staleness=-1)
    d = AsyncRLDriver(SPEC, w, simple_plan(w, layouts(w), 4, micro_batch=1), TASK, 4, staleness=1)
    with pytest.raises(ValueError, match=r"actor.generate runs on workers \[0, 1\].*--staleness 0"):
        d.start(object())  # refused before the pool is touched
    # staleness 0 is synchronous: sharing is fine
    AsyncRLDriver(SPEC, w, simple_plan(w, layouts(w), 4, micro_batch=1), TASK, 4, staleness=0)


# ---------------------------------------------------------------------- Ray
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo", "remax"])
def test_staleness_zero_reproduces_sync_weights(pool, algo):
    w = workload(algo)
    cfg = RLConfig(seed=3, kl_coef=0.05)
    p = plan_for(w)
    sync_hist, sync_state, sync_crit = _run(RLDriver(SPEC, w, p, TASK, 4, cfg), pool, 3)
    hist, state, crit = _run(AsyncRLDriver(SPEC, w, p, TASK, 4, cfg, staleness=0), pool, 3)
    assert _max_diff(state, sync_state) <= 1e-6
    if algo == "ppo":
        assert _max_diff(crit, sync_crit) <= 1e-6
    for a, b in zip(hist, sync_hist):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
        assert a["staleness"] == 0 and a["mode"] == "sync"


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo", "remax"])
def test_staleness_one_versions_exactly_one_behind(pool, algo):
    w = workload(algo)
    U = w.ppo_epochs * w.global_batch // w.mini_batch_size  # optimizer updates per step
    d = AsyncRLDriver(SPEC, w, plan_for(w), TASK, 4, RLConfig(seed=1), staleness=1)
    hist, _, _ = _run(d, pool, 4)
    assert [m["mode"] for m in hist] == ["async"] * 4
    Pn, n = w.prompts_per_step, w.samples_per_prompt
    assert len(d.sample_log) == 4 * Pn * n
    for rec in d.sample_log:
        k = rec["step"]
        assert rec["train_version"] == k and rec["train_policy_version"] == k * U
        want = max(k - 1, 0)  # step 0 trains on v(0): no older weights exist
        assert rec["gen_version"] == want
        assert rec["gen_policy_version"] == want * U  # reported by the generation engine itself
    # every prompt of steps 0..3 trained exactly once per sample, in order
    assert [(r["prompt"], r["sample"]) for r in d.sample_log] == [(i, s) for i in range(4 * Pn) for s in range(n)]
    for m in hist[1:]:
        assert m["staleness"] == 1 and 0 < m["is_weight_mean"] <= d.is_cap
    assert "is_weight_mean" not in hist[0]


@pytest.mark.slow
def test_staleness_two_bounded_and_transition_at_sync_boundary(pool):
    """Staleness 2, and a live transition (the transition executor, state moved between the workers)
    after the sync of step 1 while batches 2 and 3 wait on the driver: no sample skipped or repeated,
    versions as computed by hand, the training state unchanged by the transition, and the run ends
    with finite weights."""
    from nereus.runtime.run.device_model import runtime_job
    from nereus.runtime.transit.driver_side import TransitionExecutor
    from nereus.spec.plan import Candidate
    from nereus.transition.estimate import estimate_transition

    def explicit(gen, train):  # concurrent model-stages on disjoint workers (the DAG planner's rule)
        return Plan(candidates=(Candidate("actor.generate", *gen, gpus=(2, 3)),
                                Candidate("actor.infer", 1, 1, 1, micro_batch=1, gpus=(0,)),
                                Candidate("reference.infer", 1, 1, 1, micro_batch=1, gpus=(1,)),
                                Candidate("actor.train", *train, micro_batch=1, gpus=(0, 1))))

    w = workload("grpo")
    d = AsyncRLDriver(SPEC, w, explicit((1, 1, 2), (1, 2, 1)), TASK, 4, RLConfig(seed=2),
                      staleness=2)
    d.start(pool)
    try:
        hist = [d.step(), d.step()]
        assert sorted(d.queue) == [2, 3] and all(b.ready for b in d.queue.values())
        # the boundary: generation dp 2 -> tp 2 on its workers, training pp 2 -> tp 2 on 0-1
        target = explicit((2, 1, 1), (2, 1, 1))
        before = d.gather_logical_state("actor.train")
        current = Plan(candidates=tuple(d.cands.values()))
        est = estimate_transition(runtime_job(SPEC, w, 4), current, target, frozenset(range(4)))
        assert est.feasible, est.reason
        rep = TransitionExecutor(d).execute(est, target)
        assert rep.bytes_moved == rep.predicted_bytes > 0 and rep.driver_bytes < 64 * 1024
        after = d.gather_logical_state("actor.train")
        assert all(torch.equal(after["params"][k], before["params"][k]) for k in before["params"])
        assert d.asynchronous and d.overlap == []
        hist += [d.step() for _ in range(3)]
        state = d.gather_logical_state("actor.train")
    finally:
        d.close()
    assert [m["gen_version"] for m in hist] == [0, 0, 0, 1, 2]
    assert [m["staleness"] for m in hist] == [0, 1, 2, 2, 2]
    Pn, n = w.prompts_per_step, w.samples_per_prompt
    assert [(r["prompt"], r["sample"]) for r in d.sample_log] == [(i, s) for i in range(5 * Pn) for s in range(n)]
    assert all(torch.isfinite(t).all() for t in state["params"].values())


def test_cli_async_options_checked_before_ray():
    from nereus.cli import main

    assert main(["run", "--staleness", "2", "--steps", "1"]) == 2  # --staleness needs --async
    assert main(["run", "--async", "--staleness", "-1", "--steps", "1"]) == 2
    # generation needs workers of its own: 4 for training + 2 for generation > 4 workers
    assert main(["run", "--async", "--workers", "4", "--layout", "actor.train=1,1,4", "--steps", "1"]) == 2


def test_default_async_layouts_fit_the_batches():
    from nereus.cli.run_async import default_async_layouts

    w = workload("ppo")
    lay = default_async_layouts(w, 4)
    assert lay["actor.generate"] == (1, 1, 2) and lay["actor.train"] == (1, 1, 2)
    lay = default_async_layouts(w, 3)
    assert lay["actor.generate"] == (1, 1, 1) and lay["actor.train"] == (1, 1, 2)
    assert async_plan(w, lay, 3)["actor.generate"].gpus == (2,)
