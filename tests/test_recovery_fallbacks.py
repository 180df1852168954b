"""The fallbacks of a recovery (``run/recovery.py``), hand-built without Ray: a real
:class:`~nereus.runtime.run.adaptive.AdaptiveRun` and :class:`~nereus.runtime.run.driver.RLDriver` whose
workers are stand-ins recording every call.

* A worker lost before the first durable checkpoint exists (issue 30): at step 0 every model-stage is
  rebuilt from its seed in the target layout, exactly as at start-up (``run/fresh_start.py``); past
  step 0 the run ends with one line naming the lost workers and the model-stage whose only copy went.
* A recovery whose transition the live executor cannot run (``transit/sharded.live_unsupported``
  gives a reason) restores the durable checkpoint instead of raising.
* A decision that must restart (``AdaptiveRun._apply``) with no checkpoint written yet (the first save
  abandoned): it read ``current`` unconditionally and crashed; now the live state is re-laid out through
  the driver while every training model-stage has an intact replica, step 0 is rebuilt from the seeds
  otherwise, and past step 0 the run ends with one line (``fresh_start.restore_or_rebuild``).
"""

from __future__ import annotations

import os
import types

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.durable import driver_side as durable  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run import recovery  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.fresh_start import NoCheckpoint  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.runtime.worker.failures import WorkerLost  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
# actor.train (tp 2) on workers 0 and 1 only: losing both leaves it no replica
BOUNDARY = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
            "critic.infer": (1, 1, 1), "actor.train": (2, 1, 1), "critic.train": (1, 2, 2)}
TARGET = dict.fromkeys(BOUNDARY, (1, 1, 1))  # every model-stage on one survivor


class _Worker:
    """A worker stand-in: ``w.<method>.remote(*a, **k)`` records ``(id, method, a, k)``."""

    def __init__(self, i: int, calls: list) -> None:
        self.i, self.calls = i, calls

    def __getattr__(self, method: str):
        def remote(*a, **k):
            self.calls.append((self.i, method, a, k))
            return (0, 0, 0) if method == "build" else None

        return types.SimpleNamespace(remote=remote, options=lambda **_: types.SimpleNamespace(remote=remote))


def _driver(plan: Plan, calls: list) -> RLDriver:
    d = RLDriver(SPEC, W, plan, TASK, 4, RLConfig(timeout_s=30))
    d.pool = types.SimpleNamespace(get=lambda futures, what, timeout_s: list(futures))
    d.workers = [_Worker(i, calls) for i in range(4)]
    return d


def _run(tmp_path, lost: list[int], step_index: int, updates: int, on: int | None = None):
    """A run at a boundary of step ``step_index`` whose workers ``lost`` are gone; its controller's
    decision is :data:`TARGET` on worker ``on`` (default: the first survivor)."""
    calls: list = []
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(timeout_s=30), measure=False, checkpoint_dir=str(tmp_path))
    d = run.driver = _driver(simple_plan(W, BOUNDARY, 4, micro_batch=1), calls)
    assert d.cands["actor.train"].gpus == (0, 1)
    for i in lost:
        d.workers[i] = None
    d.step_index, d.updates = step_index + 1, updates + 2  # mid-step: the rollback goes back to the boundary
    run._bnd = {"plan": Plan(candidates=tuple(d.cands.values())), "step_index": step_index, "updates": updates}
    survivors = [i for i in range(4) if i not in lost]
    target = simple_plan(W, TARGET, 1, micro_batch=1)
    target = Plan(candidates=tuple(c.with_gpus([survivors[0] if on is None else on]) for c in target.candidates))
    run.ctl = types.SimpleNamespace(observe=lambda rep: types.SimpleNamespace(plan=target, kind="replan"),
                                    resume=lambda est: None)
    run.planner = types.SimpleNamespace(estimate=lambda *a: None)
    lines: list[str] = []
    run.log = lines.append
    return run, calls, lines, run._legal(d, target)  # the plan the recovery takes (grad_accum set)


def test_a_training_stage_lost_before_the_first_checkpoint_restarts_from_the_seeds_at_step_0(tmp_path):
    run, calls, lines, target = _run(tmp_path, lost=[0, 1], step_index=0, updates=0)
    d = run.driver
    run._recover(WorkerLost("lost in dcp_save", [0, 1], 0.5), -1, "checkpoint save")
    ev = run.recoveries[-1]
    assert (ev["source"], ev["steps_lost"], d.step_index, d.updates) == ("initial", 0, 0, 0), ev
    stages = [ms.name for ms in d.wf.model_stages]
    # every engine on the survivors is torn down, and none on the lost workers is called
    assert {(i, a[0]) for i, m, a, _ in calls if m == "destroy"} == {(i, s) for i in (2, 3) for s in stages}
    assert not any(i in (0, 1) for i, *_ in calls)
    # the rebuild makes exactly the calls of a start-up in the target layout (RLDriver.build_engines)
    ref_calls: list = []
    ref = _driver(target, ref_calls)
    ref.build_engines()

    def builds(cs, tag):
        return [(i, a[:-1] + (a[-1] == tag,), k) for i, m, a, k in cs if m == "build"]

    assert builds(calls, d.tag) == builds(ref_calls, ref.tag) and len(builds(calls, d.tag)) == len(stages)
    # the seeds are those of RLDriver.seed_of with seed 0: actor and reference 0, critic 1
    assert {a[0]: a[3] for _, m, a, _ in calls if m == "build"} == {
        "actor.generate": 0, "actor.infer": 0, "reference.infer": 0, "actor.train": 0,
        "critic.infer": 1, "critic.train": 1}
    assert any("rebuilt every model-stage from its seed at step 0" in s for s in lines), lines


def test_the_recovery_names_every_worker_the_pool_lost_since_the_boundary(tmp_path):
    # bench_faults seed 9001: worker 1 died in a checkpoint save and worker 4 a second later, found by
    # the abandoned save's wait (which swallows its WorkerLost); the recovery named worker 1 only
    run, calls, lines, target = _run(tmp_path, lost=[0, 1], step_index=0, updates=0)
    run.driver.pool.lost_ids = [5, 1, 0]  # worker 5 was lost before this boundary
    run._bnd["lost_at"] = 1
    run._recover(WorkerLost("lost in dcp_save", [0], 0.5), -1, "checkpoint save")
    assert run.recoveries[-1]["lost"] == [0, 1], run.recoveries[-1]
    assert any("lost worker(s) 0-1 during the checkpoint save" in s for s in lines), lines


def test_a_training_stage_lost_past_step_0_without_a_checkpoint_ends_with_one_line(tmp_path):
    run, calls, lines, _ = _run(tmp_path, lost=[0, 1], step_index=3, updates=3)
    with pytest.raises(NoCheckpoint) as err:
        run._recover(WorkerLost("lost in train", [0, 1], 0.5), 3, "step")
    msg = str(err.value)
    assert msg == ("worker(s) [0, 1] lost before the first checkpoint was written; the only copy of actor.train "
                   "is gone"), msg
    assert not any(m == "build" for _, m, _, _ in calls)  # nothing rebuilt from the seeds
    assert len(run.recoveries) == 0


def test_a_lost_stage_with_a_checkpoint_still_restores_it(tmp_path, monkeypatch):
    run, calls, lines, target = _run(tmp_path, lost=[0, 1], step_index=3, updates=3)
    os.makedirs(tmp_path / "current")
    (tmp_path / "current" / "driver.json").write_text("{}")
    restored = []

    def restart(d, path, plan):
        restored.append((path, plan))
        d.step_index, d.updates = 2, 2
        return {"seconds": 0.25}

    monkeypatch.setattr(durable, "restart", restart)
    run._recover(WorkerLost("lost in train", [0, 1], 0.5), 3, "step")
    assert restored == [(str(tmp_path / "current"), target)]
    ev = run.recoveries[-1]
    assert (ev["source"], ev["steps_lost"]) == ("checkpoint", 1), ev


def test_a_recovery_the_live_executor_cannot_run_restores_the_checkpoint(tmp_path, monkeypatch):
    # worker 3 lost: every training model-stage keeps a replica, so the live path is tried first
    run, calls, lines, target = _run(tmp_path, lost=[3], step_index=3, updates=3)
    os.makedirs(tmp_path / "current")
    (tmp_path / "current" / "driver.json").write_text("{}")
    why = "actor.train: ZeRO-3 slices cannot move between these layouts"
    est = types.SimpleNamespace(feasible=True, dag=object(), reason="")
    seen = []
    monkeypatch.setattr(recovery, "estimate_transition", lambda *a, **k: est)
    monkeypatch.setattr(recovery, "live_unsupported", lambda dag, *plans: seen.append((dag, plans)) or why)

    def executor(_d):
        raise AssertionError("the live executor must not run a DAG it cannot execute")

    monkeypatch.setattr(recovery, "TransitionExecutor", executor)
    restored = []

    def restart(d, path, plan):
        restored.append(plan)
        d.step_index, d.updates = 0, 0
        return {"seconds": 0.25}

    monkeypatch.setattr(durable, "restart", restart)
    run._recover(WorkerLost("lost in train", [3], 0.5), 3, "step")
    assert seen and seen[0][0] is est.dag and seen[0][1][1] == target
    assert restored == [target]
    ev = run.recoveries[-1]
    assert (ev["source"], ev["steps_lost"]) == ("checkpoint", 3), ev
    assert any(s.startswith(f"  {why}: restored the durable checkpoint of step 0") for s in lines), lines
    # the units moved to the target live are dropped on every survivor before the restore
    assert {i for i, m, a, _ in calls if m == "transition_end"} == {0, 1, 2}


def test_a_worker_lost_in_the_first_save_is_recovered_and_the_first_checkpoint_taken_again(tmp_path, monkeypatch):
    from nereus.runtime.durable import scheduling, store
    from nereus.runtime.run.fresh_start import has_checkpoint

    run, calls, lines, target = _run(tmp_path, lost=[], step_index=0, updates=0, on=2)
    d = run.driver
    d.step_index = d.updates = 0
    began = []

    def begin_save(driver, directory, model_stages=None, background=False):
        began.append(directory)
        if len(began) == 1:  # workers 0 and 1 die inside the first dcp_save: actor.train has no replica left
            driver.workers[0] = driver.workers[1] = None
            raise WorkerLost("lost in dcp_save", [0, 1], 0.5)
        os.makedirs(directory)
        meta = {"step_index": driver.step_index, "updates": driver.updates, "model_stages": []}
        return durable.PendingSave(directory, [], meta, False, 0.0, {})

    monkeypatch.setattr(scheduling.durable, "begin_save", begin_save)
    run._save(force=True)
    assert len(began) == 2 and [ev["source"] for ev in run.recoveries] == ["initial"]
    assert [c["step"] for c in run.checkpoints] == [0] and has_checkpoint(store.current_dir(str(tmp_path)))
    assert not os.path.exists(began[0])  # the abandoned slot is removed


def _restart_decision(run, target):
    """A ``Restart``-like decision (not Keep, not Transition) onto ``target``."""
    return types.SimpleNamespace(kind="restart", reason="test", plan=target)


def _failing_first_save(monkeypatch):
    """Every checkpoint write fails (a full disk): the save is abandoned and no checkpoint exists."""
    from nereus.runtime.durable import scheduling

    def begin_save(driver, directory, model_stages=None, background=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(scheduling.durable, "begin_save", begin_save)


def test_a_restart_decision_without_any_checkpoint_relays_out_the_live_state(tmp_path, monkeypatch):
    # no worker lost, no live DAG (e.g. from the time-shared plan), and the save the restart path takes
    # first fails: the engines still hold the state, so it is re-laid out through the driver (exact)
    from nereus.runtime.run import relayout as relayout_mod

    run, calls, lines, target = _run(tmp_path, lost=[], step_index=3, updates=6)
    d = run.driver
    d.step_index, d.updates = 4, 8  # after step 3
    monkeypatch.setattr(run, "_live", lambda *a, **k: (None, "no live path"))
    _failing_first_save(monkeypatch)
    moved = []

    def relayout(driver, plan, ckpt=None):
        moved.append((plan, ckpt))
        return {"seconds": 0.5, "source": "live", "steps_lost": 0}

    monkeypatch.setattr(relayout_mod, "relayout", relayout)
    monkeypatch.setattr(durable, "restart", lambda *a: pytest.fail("there is no checkpoint to restore"))
    ev = run._apply(_restart_decision(run, target), 3, "after step")
    assert moved == [(target, None)]
    assert (ev["source"], ev["steps_lost"], d.step_index, d.updates) == ("relayout", 0, 4, 8), ev
    assert any("abandoned (write failed: No space left on device)" in s for s in lines), lines
    assert any(s.startswith("  restart (after step) from the live state (no checkpoint written yet)") for s in lines)


def test_a_restart_decision_at_step_0_without_a_checkpoint_rebuilds_from_the_seeds(tmp_path, monkeypatch):
    # a departure without notice before step 0 took both workers of actor.train and the first save
    # had failed: nothing to restore, nothing live to re-lay out, but step 0's state is the seeds'
    run, calls, lines, target = _run(tmp_path, lost=[0, 1], step_index=0, updates=0)
    d = run.driver
    d.step_index = d.updates = 0
    monkeypatch.setattr(durable, "restart", lambda *a: pytest.fail("there is no checkpoint to restore"))
    ev = run._apply(_restart_decision(run, target), 0, "pool change")
    assert (ev["source"], ev["steps_lost"], d.step_index, d.updates) == ("initial", 0, 0, 0), ev
    built = {(i, a[0]) for i, m, a, _ in calls if m == "build"}
    assert built == {(2, ms.name) for ms in d.wf.model_stages}  # every model-stage on survivor 2, from its seed


def test_a_restart_decision_past_step_0_without_a_checkpoint_or_a_replica_ends_with_one_line(tmp_path, monkeypatch):
    run, calls, lines, target = _run(tmp_path, lost=[0, 1], step_index=3, updates=6)
    run.driver.step_index, run.driver.updates = 3, 6
    with pytest.raises(NoCheckpoint) as err:
        run._apply(_restart_decision(run, target), 3, "pool change")
    assert str(err.value) == "step 3: a restart was needed, and no checkpoint was written to restore", err.value
    assert not any(m == "build" for _, m, _, _ in calls)
