"""A worker that dies or hangs in the middle of a step, a weight sync, a transition or a checkpoint
save: the run detects it, rolls back to the boundary, replans on the survivors, moves state live and
re-runs the step with the same samples, ending with the weights of a fault-free run (DESIGN.md §4.9).
Also: resuming a run killed as a whole from its durable checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.durable.integrity import job_identity, verify_checkpoint  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.runtime.run.schedules import parse_pool_schedule  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
STEPS = 4


def _run(faults=None, schedule=None, steps=STEPS, workers=4, precision="fp32", recovery_faults=None, timeout_s=15,
         **kw):
    kw.setdefault("framework", "nereus")  # the disjoint space, where every recovery runs live (docs/faults.md)
    pool = WorkerPool(workers, timeout_s=timeout_s, hang_timeout_s=3).start()
    lines: list[str] = []
    cfg = RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=timeout_s, precision=precision)
    run = AdaptiveRun(SPEC, W, TASK, workers, cfg,
                      schedule=parse_pool_schedule(schedule), notice=True, hang_timeout_s=3, faults=faults,
                      log=lines.append, measure=False, **kw)
    run.keep_final = True
    run.recovery_faults = dict(recovery_faults or {})
    try:
        hist = run.run(steps, pool)
    finally:
        pool.close()
    return run, hist, lines


@pytest.fixture(scope="module")
def reference(ray_cluster):
    """The fault-free run every faulty one must match (same samples, same pool schedule)."""
    return _run()[0].final_state


def _same_weights(a: dict, b: dict) -> None:
    for ms in a:  # every model-stage; the counters of the trained ones (a frozen copy's are not state)
        if "exp_avg" in a[ms]:
            assert a[ms]["update_count"] == b[ms]["update_count"] and a[ms]["position"] == b[ms]["position"]
        for n in a[ms]["params"]:
            assert torch.allclose(a[ms]["params"][n], b[ms]["params"][n], atol=1e-5, rtol=1e-4), (ms, n)


@pytest.mark.slow
@pytest.mark.parametrize("point,worker,how", [
    ("logprobs", 0, "kill"),        # mid-forward (inference log-probs)
    ("train_fields", 3, "kill"),    # mid forward/backward/optimizer step
    ("sync_weights", 1, "stop"),    # mid weight sync, hung by SIGSTOP
    ("train_fields", 2, "slow:40"),  # slow but alive: asleep in a training step, answering heartbeats
])
def test_a_worker_lost_mid_step_is_recovered_live_and_training_continues(reference, point, worker, how):
    run, hist, lines = _run(faults={1: (point, worker, how)})
    assert len(hist) == STEPS
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8]  # no update lost or repeated
    rec = run.recoveries
    assert len(rec) == 1 and rec[0]["lost"] == [worker] and rec[0]["source"] == "live"
    # a stopped process answers nothing: Ray may report it dead or the heartbeat finds it silent
    assert rec[0]["steps_lost"] == 0 and set(rec[0]["hung"]) <= {worker}
    if how.startswith("slow"):  # no progress for the bound (4x the step time at least): well before it wakes
        assert rec[0]["slow"] == [worker] and rec[0]["detect_s"] < 40, rec[0]
        assert any("slow (no progress)" in s for s in lines)
    else:
        assert rec[0]["detect_s"] < 15  # well before any group timeout (heartbeats, not timeouts)
    assert any("rolling back" in s for s in lines) and any("re-runs" in s for s in lines)
    assert all(worker not in c.gpus for c in run.driver.cands.values())
    _same_weights(run.final_state, reference)


@pytest.mark.slow
def test_a_worker_lost_mid_transition_is_recovered(reference):
    # of 5 workers, worker 4 announces it leaves before step 2 and worker 0 dies inside a primitive of
    # the transition that moves state off worker 4: PPO still fits the 3 survivors
    run, hist, lines = _run(faults={2: ("transition_run", 0, "kill")}, schedule="2:-1", workers=5)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8]
    rec = run.recoveries
    assert rec and rec[0]["lost"] == [0] and rec[0]["steps_lost"] == 0 and rec[0]["source"] == "live", rec
    assert all(g in (1, 2, 3) for c in run.driver.cands.values() for g in c.gpus)
    _same_weights(run.final_state, reference)


@pytest.mark.slow
def test_a_worker_lost_during_the_recovery_is_recovered_again(reference):
    # issue 30: a second fault inside the first one's recovery transition ended the run. Worker 3 dies
    # in a training step of step 1; worker 0 dies inside the recovery's live transition: the recovery
    # starts over on the 3 survivors and the run ends at the fault-free weights
    run, hist, lines = _run(faults={1: ("train_fields", 3, "kill")}, recovery_faults={1: ("transition_run", 0, "kill")},
                            workers=5)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8], lines
    lost = sorted(w for ev in run.recoveries for w in ev["lost"])
    assert lost == [0, 3], (run.recoveries, lines)
    assert any("during the recovery: recovering again" in s for s in lines)
    assert all(g in (1, 2, 4) for c in run.driver.cands.values() for g in c.gpus)
    _same_weights(run.final_state, reference)


#: the communicator (and call) timeout of the rendezvous test: a release that waited for it would
#: make the recovery's calls end after at least this long
LONG_TIMEOUT_S = 120


@pytest.mark.slow
def test_peers_waiting_in_a_rendezvous_for_a_lost_worker_are_released_before_the_group_timeout(reference):
    # issue 30: peers of a lost worker sat in group rendezvous until the communicator timeout. After
    # the rollback of step 1 (worker 3 killed in training) every communicator is new, so the
    # recovery's live transition builds its groups; worker 0 exits 5 s into its first primitive
    # (late:5, before it reaches the rendezvous), while its peers of that primitive wait for it there
    # (killed at once, they could still be on their way: a cancelled call is not a released one;
    # asleep that long it may also be found slow first: released alike). The driver detects the loss and
    # releases them (FaultTolerantWorker.cancel -> comm/rendezvous.py), so the second recovery starts
    # with the group timeout (LONG_TIMEOUT_S) far away, and the run still ends at the fault-free weights
    run, hist, lines = _run(faults={1: ("train_fields", 3, "kill")}, recovery_faults={1: ("transition_run", 0, "late:5")},
                            workers=5, timeout_s=LONG_TIMEOUT_S)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8], lines
    again = run.recoveries[-1]  # the recovery that started over (its event names both lost workers)
    assert again["lost"] == [0, 3] and again["attempt"].startswith("recovery (attempt 2)"), run.recoveries
    assert again["released"] >= 1, again  # peers' calls ended by the release, not by a timeout
    # the order of events: the lost worker's peers' calls ended (and the recovery began) before the
    # configured group timeout could have fired for the rendezvous they were in
    assert again["wait_s"] is not None and again["wait_s"] < LONG_TIMEOUT_S, again
    _same_weights(run.final_state, reference)


@pytest.mark.slow
def test_a_worker_slow_inside_a_transition_primitive_is_declared_lost_by_the_progress_check(reference):
    # issue 30: progress detection covered compute calls only. Worker 0 sleeps 60 s inside the first
    # primitive of the announced departure's transition (still answering heartbeats): busy in
    # transition_run with no op timed for the bound, it is declared lost and recovered from (a wake-up
    # after 60 s would have finished the transition with no loss at all)
    run, hist, lines = _run(faults={2: ("transition_run", 0, "slow:60")}, schedule="2:-1", workers=5)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8]
    rec = run.recoveries
    assert rec and rec[0]["lost"] == [0] and rec[0]["slow"] == [0] and rec[0]["source"] == "live", rec
    assert rec[0]["slow_in"] and all(p.startswith("transition_run:") for p in rec[0]["slow_in"]), rec
    assert any("slow (no progress)" in s for s in lines)
    _same_weights(run.final_state, reference)


@pytest.mark.slow
def test_a_worker_slow_inside_a_checkpoint_write_is_declared_lost_and_the_checkpoint_dropped(reference, tmp_path):
    # the same for a synchronous checkpoint write: worker 0 sleeps 60 s in the middle of writing its
    # shards of step 1's checkpoint (data written, metadata not): declared lost in dcp_save, the
    # checkpoint is abandoned (the previous one kept) and the run goes on to the fault-free weights
    ckpt = str(tmp_path / "ckpt")
    run, hist, lines = _run(faults={1: ("dcp_save", 0, "slow:60")}, checkpoint_dir=ckpt, checkpoint_every=1,
                            checkpoint_sync=True)
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8]
    rec = run.recoveries
    assert rec and rec[0]["lost"] == [0] and rec[0]["slow"] == [0], rec
    assert rec[0]["slow_in"] == ["dcp_save"], rec
    _same_weights(run.final_state, reference)
    assert verify_checkpoint(os.path.join(ckpt, "current"), job_identity(SPEC, W))["step_index"] == 4


@pytest.mark.slow
def test_resume_continues_a_run_killed_as_a_whole(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first, hist, _ = _run(steps=2, checkpoint_dir=ckpt, checkpoint_every=1)
    assert [m["update_count"] for m in hist] == [2, 4]
    ident = job_identity(SPEC, W)  # written by the workers: manifest, identity, markers, counters all check
    assert verify_checkpoint(os.path.join(ckpt, "current"), ident)["step_index"] == 2
    # the first run is gone (driver and workers); a new one resumes from the checkpoint of step 2
    run, hist, lines = _run(steps=2, checkpoint_dir=ckpt, checkpoint_every=5, resume=True)
    assert [m["step"] for m in hist] == [2, 3] and [m["update_count"] for m in hist] == [6, 8]
    assert any(s.startswith("resumed from") and "running 2 more steps, to step 4" in s for s in lines)
    _same_weights(run.final_state, reference)
    # no checkpoint was due (every 5 steps): the final one is taken at the end of the run
    assert verify_checkpoint(os.path.join(ckpt, "current"), ident)["step_index"] == 4
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == ["current", os.readlink(
        os.path.join(ckpt, "current"))]  # one slot: the previous ones went once it was current



@pytest.mark.slow
def test_bf16_run_recovers_with_its_fp32_master_weights(ray_cluster):
    """Mixed precision: the rollback point and the live recovery carry the fp32 master weights too,
    so a bf16 run killed mid-step ends at the bf16 fault-free run's weights and master weights."""
    ref = _run(precision="bf16")[0].final_state
    run, hist, _ = _run(faults={1: ("train_fields", 3, "kill")}, precision="bf16")
    assert [m["update_count"] for m in hist] == [2, 4, 6, 8] and run.recoveries[0]["source"] == "live"
    for ms in ref:
        for kind in ("params", "master"):
            for n, t in ref[ms][kind].items():
                assert torch.allclose(run.final_state[ms][kind][n].float(), t.float(), atol=1e-5, rtol=1e-3), (ms, kind, n)


@pytest.mark.slow
def test_announced_departure_onto_a_time_shared_plan_excludes_the_leaver(ray_cluster):
    """PPO on 3 workers, one announced to leave before step 1: in the paper's disjoint space no plan
    fits 2 workers, so the run restarts (nothing lost: a checkpoint is taken first) on the time-shared
    fallback over the two that stay, never the leaver, and goes on. (In the default `runtime` space a
    colocated plan fits the two and the departure moves live.)"""
    pool = WorkerPool(3, timeout_s=15, hang_timeout_s=3).start()
    run = AdaptiveRun(SPEC, W, TASK, 3, RLConfig(timeout_s=15), schedule=parse_pool_schedule("1:-1"), notice=True,
                      hang_timeout_s=3, measure=False, framework="nereus")
    try:
        hist = run.run(3, pool)
    finally:
        pool.close()
    assert [m["update_count"] for m in hist] == [2, 4, 6]
    ev = [e for e in run.events if e["when"] == "pool change"]
    assert ev and ev[0]["source"] == "checkpoint" and ev[0]["steps_lost"] == 0, run.events
    assert all(g in (0, 1) for c in run.driver.cands.values() for g in c.gpus)


@pytest.mark.slow
def test_a_training_stage_lost_in_the_first_save_restarts_from_its_seeds_bit_for_bit(ray_cluster):
    # issue 30: worker 0 dies inside the first checkpoint save (before step 0, no checkpoint yet) and
    # worker 1 inside that recovery's transition, so actor.train (dp2 on workers 0-1) has no replica
    # left: every model-stage is rebuilt from its seed on workers 2-3 (run/fresh_start.py), the first
    # checkpoint is taken again, and the run ends bit for bit at a fault-free run started on 2 workers
    run, _, lines = _run(faults={-1: ("dcp_save", 0, "kill")}, recovery_faults={-1: ("transition_run", 1, "kill")},
                         steps=2)
    assert [(r["source"], r["lost"], r["steps_lost"]) for r in run.recoveries] == [("initial", [0, 1], 0)], lines
    assert [c["step"] for c in run.checkpoints] == [0], lines
    ref = _run(steps=2, workers=2)[0].final_state
    for ms in ref:
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            for n in ref[ms].get(kind, {}):
                assert torch.equal(run.final_state[ms][kind][n], ref[ms][kind][n]), (ms, kind, n)
        assert [run.final_state[ms][c] for c in ("update_count", "position")] == [ref[ms][c] for c in
                                                                                  ("update_count", "position")]
