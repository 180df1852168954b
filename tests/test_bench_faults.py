"""The fault benchmark (``benchmarks/bench_faults.py``), in-process. Its quick sample: about six
workers killed or hung (SIGSTOP) in a step, a transition and a checkpoint save of a PPO run on Ray
CPU workers; every fault is survived, no run hangs, and the run ends at the weights of its replay
(the fault-free run of the same samples on the same per-step plans). And its check itself: a PPO run
recovered onto other layouts ends bit for bit at its replay (issue 11); how far the fault-free run
on the reference's own layouts drifts depends on the CPU's kernels and is not asserted (issue 30)."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_faults.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_faults", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_fault_sample_survives_every_fault_and_ends_at_the_weights_of_its_replay():
    pytest.importorskip("ray")
    out = _bench().run_benchmark(quick=True, seed=0)
    s = out["summary"]
    assert s["runs_hung"] == 0 and s["reference_runs_hung"] == 0, s
    assert s["runs_failed"] == 0, [r["error"] for r in out["runs"]]
    assert s["faults_injected"] >= 4, s
    assert s["faults_survived"] == s["faults_injected"], s
    assert s["steps_lost_full_copy_max"] == 0 and s["steps_lost_bound_violations"] == 0, s
    assert s["detect_s_max"] < 15, s  # heartbeats, well before any communicator timeout
    for r in out["runs"]:  # steps lost to a checkpoint restore re-run with the same samples
        assert r["completed"]
        assert r["weights_equal"], (r["max_abs_diff"], r["replay_error"], r["log"][-20:])



@pytest.mark.timeout(400)
def test_a_ppo_run_recovered_onto_other_layouts_ends_bit_for_bit_at_its_replay(ray_cluster):
    # issue 11: PPO runs ended 7e-4 to 3e-3 away from the fault-free run of the same workload. The
    # recoveries were exact; the reference was wrong: after a fault the steps run on other layouts
    # (here actor.train dp=2 becomes one replica of pp=2), which sum the same gradients in another
    # fp32 order, and Adam (eps 1e-8, lr 1e-2) grows those last bits past the tolerance within eight
    # steps. The benchmark now checks each run against its replay: the fault-free run of the same
    # samples on the plan each step last ran on (here after a live recovery at step 0 and a
    # durable-checkpoint restore at step 4). About 100 s on 2 cores (three runs, three pools).
    bench = _bench()
    from fault_run import (  # the benchmark's run machinery (bench_faults put its folder on sys.path)
        Fault,
        RunSpec,
    )

    faults = [Fault(step=0, point="sync_weights", how="kill"),
              Fault(step=4, point="train_fields", how="kill")]
    spec = RunSpec("ppo", 4, 8, "", 2, faults)
    ref = bench.reference_run(spec, 0, 240)
    assert ref["final_state"] is not None, ref["error"]
    r = bench.check_run(spec, ref, 3, 240)
    bench.close_replay_pool()
    assert r["completed"], (r["error"], r["log"][-20:])
    assert [f["state"] for f in r["faults"]] == ["fired", "fired"], r["faults"]
    assert {ev["source"] for ev in r["recoveries"]} == {"live", "checkpoint"}, r["recoveries"]
    assert not r["layouts_as_reference"]  # steps ran on other layouts than the fault-free run's
    assert r["weights_equal"] and r["max_abs_diff"] == 0.0, (r["max_abs_diff"], r["replay_error"])
    # How far the fault-free run on the reference's own layouts drifted (other fp32 summation orders
    # grown by Adam) depends on the CPU's kernels (issue 30: 0 on some machines), so it is reported,
    # not asserted; only bit-exact equality with the replay is machine-independent.
    assert r["layout_drift"] >= 0.0 and math.isfinite(r["layout_drift"]), r["layout_drift"]


def test_per_kind_figures_count_each_fault_under_every_kind_it_is():
    _bench()  # puts benchmarks/ on sys.path
    from fault_report import by_kind

    def fault(step, how, phase, fired, second=""):
        return {"step": step, "how": how, "phase": phase, "fired": fired, "second_how": second, "state": "fired"}

    run = {"schedule": "2:-1,4:+1", "completed": True, "weights_equal": True,
           "faults": [fault(1, "kill", "step", [3, 1], "late:1"), fault(2, "slow:60", "transition", [0]),
                      fault(4, "stop", "transition", [2]), fault(1, "kill", "recovery", [0]),
                      {**fault(5, "kill", "step", [4]), "state": "not fired"}],
           "recoveries": [{"step": 1, "lost": [0, 1, 3], "source": "live", "recovery_s": 2.0},
                          {"step": 2, "lost": [0], "source": "checkpoint", "recovery_s": 5.0},
                          {"step": 4, "lost": [2], "source": "live", "recovery_s": 1.0}]}
    k = by_kind([run, {**run, "weights_equal": False, "faults": [fault(2, "slow:60", "transition", [0])]}])
    assert k["killed"] == {"faults": 2, "live": 2, "checkpoint": 0, "initial": 0, "lost_state": 0,
                           "recovery_s_median": 2.0, "recovery_s_max": 2.0}
    assert k["second failure a second later (late:1)"]["faults"] == 1
    assert k["killed inside a recovery's transition"]["live"] == 1
    assert k["in a growth's transition"] == {"faults": 1, "live": 1, "checkpoint": 0, "initial": 0, "lost_state": 0,
                                             "recovery_s_median": 1.0, "recovery_s_max": 1.0}
    # the second run's final state differs from its replay: its fault counts as state lost
    assert k["slow but alive"] == {"faults": 2, "live": 0, "checkpoint": 2, "initial": 0, "lost_state": 1,
                                   "recovery_s_median": 5.0, "recovery_s_max": 5.0}
    assert k["in a departure's transition"]["faults"] == 2 and "hung (SIGSTOP)" in k


def test_the_benchmark_run_plans_in_the_space_and_precision_it_was_given():
    # the regression of merge 03458f0: FaultBenchRun re-sized its job for the replacement workers
    # without the framework, so after the commands' default became the `runtime` space its runs
    # planned ZeRO-1/offloaded layouts, and their recoveries went through the durable checkpoint
    _bench()
    from fault_run import SPEC, TASK, FaultBenchRun, config, workload

    from nereus.spec.framework import get_framework

    run = FaultBenchRun(SPEC, workload("ppo"), TASK, 4, config(), framework="nereus", measure=False,
                        bench_faults=[], rng=None, capacity=9)
    assert run.job.framework == get_framework("nereus") and run.job.cluster.gpus_per_node == 9
    assert config().precision == "fp32"  # fp32 weights (the Adam master) and two fp32 moments per parameter
    assert (run.job.workload.param_bytes, run.job.workload.optimizer_bytes) == (4, 8), run.job.workload


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_second_failure_a_second_later_and_a_fault_in_a_growth_transition_both_fire_and_are_survived(ray_cluster):
    # issue 30's two kinds the unseen seeds never fired: the second worker of a `late:1` double fault
    # goes off during the first one's recovery (or, when its call was refused, a second after the
    # cancel: FaultTolerantWorker.arm) and is counted once found; and with grow the join before step 1
    # replans onto the joining worker, so its transition runs and a worker is killed inside it
    bench = _bench()
    from fault_report import by_kind
    from fault_run import Fault, RunSpec

    faults = [Fault(step=0, point="train_fields", how="kill", count=2, second_how="late:1"),
              Fault(step=1, point="transition_run", how="kill")]
    spec = RunSpec("ppo", 5, 2, "1:+1", 1, faults, grow=True)
    no_ref = {"final_state": None, "plans": {}, "seconds": 0.0}  # layout drift not wanted here
    r = bench.check_run(spec, no_ref, 3, 400)
    bench.close_replay_pool()
    assert r["completed"], (r["error"], r["log"][-30:])
    assert [f["state"] for f in r["faults"]] == ["fired", "fired"], r["faults"]
    assert len(r["faults"][0]["fired"]) == 2 and r["faults"][1]["phase"] == "transition", r["faults"]
    for f in r["faults"]:  # every worker lost to them appears in a recovery
        assert all(any(w in ev["lost"] for ev in r["recoveries"]) for w in f["fired"]), (f, r["recoveries"])
    k = by_kind([r])
    assert k["second failure a second later (late:1)"]["faults"] == 1, k
    assert k["in a growth's transition"]["faults"] == 1, k
    assert r["weights_equal"], (r["max_abs_diff"], r["replay_error"])


def test_slow_detected_counts_the_recoveries_that_caught_a_slow_worker():
    # regression: `_events` dropped the recoveries' `slow` field, so the summary's slow_detected was 0
    import argparse
    import types

    bench = _bench()
    from fault_report import summarize

    def ev(step, lost, hung, slow):  # the fields `RecoveryMixin._recover_once` and `FaultBenchRun` record
        return {"step": step, "when": "recovery", "kind": "recovery", "lost": lost, "detect_s": 1.0, "hung": hung,
                "slow": slow, "source": "live", "steps_lost": 0, "recovery_s": 2.0, "plan": "p",
                "full_copy": True, "since_checkpoint": 0, "phase": "step"}

    run = types.SimpleNamespace(recoveries=[ev(1, [2], [2], [2]),  # slow but alive: caught by the progress check
                                            ev(3, [0], [0], []),   # hung (SIGSTOP): caught by the heartbeats
                                            ev(4, [1], [], [])])   # killed
    events = bench._events(run)
    assert [e["slow"] for e in events] == [[2], [], []]
    rec = {"faults": [], "recoveries": events, "completed": True, "hung": False, "error": None,
           "weights_equal": True, "max_abs_diff": 0.0, "reference_equal": True, "layout_drift": 0.0,
           "layouts_as_reference": True, "schedule": ""}
    s = summarize([rec], {}, 1.0, argparse.Namespace(seed=0, quick=True), 10.0)
    assert s["slow_detected"] == 1 and s["recoveries"] == 3, s


def _record(recoveries, faults=(), problem=None):
    """A run record as ``check_run`` returns it (the fields ``summarize`` and ``by_kind`` read)."""
    return {"faults": list(faults), "recoveries": recoveries, "completed": True, "hung": False, "error": None,
            "weights_equal": True, "max_abs_diff": 0.0, "reference_equal": True, "layout_drift": 0.0,
            "layouts_as_reference": True, "schedule": "", "checkpoint_problem": problem}


def test_recoveries_rebuilt_from_the_seeds_are_counted_apart_from_live_and_checkpoint_ones():
    # regression: a recovery with source "initial" (lost before the first checkpoint, rebuilt from the
    # seeds at step 0: run/fresh_start.py) was counted under neither live nor checkpoint
    import argparse

    _bench()
    from fault_report import by_kind, summarize

    def ev(step, lost, source):
        return {"step": step, "lost": lost, "hung": [], "slow": [], "detect_s": 0.5, "source": source,
                "steps_lost": 0, "recovery_s": 3.0, "full_copy": source == "live", "since_checkpoint": 0}

    fault = {"step": -1, "how": "kill", "phase": "checkpoint", "fired": [0, 1], "second_how": "", "state": "fired",
             "point": "dcp_save", "workers": [0, 1]}
    rec = _record([ev(-1, [0, 1], "initial"), ev(2, [3], "live"), ev(4, [2], "checkpoint")], [fault])
    s = summarize([rec], {}, 1.0, argparse.Namespace(seed=0, quick=False), 3.0)
    assert (s["recoveries"], s["recoveries_live"], s["recoveries_checkpoint"], s["recoveries_initial"],
            s["recoveries_other_source"]) == (3, 1, 1, 1, 0), s
    assert s["faults_survived"] == s["faults_injected"] == 2, s
    k = by_kind([rec])
    assert (k["killed"]["initial"], k["killed"]["live"], k["killed"]["checkpoint"]) == (1, 0, 0), k
    assert k["two at once"]["initial"] == 1, k


def _checkpoint_writer():
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent / "test_checkpoint_integrity.py"
    spec = importlib.util.spec_from_file_location("_ckpt_integrity", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_checkpoint_check_names_a_missing_corrupted_or_stale_last_checkpoint(tmp_path):
    # "no checkpoint lost" (issue 30's done-when): the last checkpoint a run completed must still be
    # current and pass --resume's checks at the run's end
    import types

    _bench()
    from fault_checks import checkpoint_problem, restores_past_checkpoint

    from nereus.runtime.durable import store
    from nereus.runtime.durable.integrity import job_identity

    ck = _checkpoint_writer()  # a real DCP checkpoint of a PPO job at step ck.STEP (3)
    root = str(tmp_path / "run")
    slot = store.new_slot(root, ck.STEP)
    ck._write_checkpoint(slot)
    store.commit(root, slot)
    ident = job_identity(ck.SPEC, ck.W)

    def run(ckpt_step, checkpoints=1):
        return types.SimpleNamespace(ckpt_dir=root, ckpt_step=ckpt_step, checkpoints=[{}] * checkpoints)

    assert checkpoint_problem(run(3), ident) is None
    assert checkpoint_problem(run(4), ident) == "current holds step 3, the last checkpoint completed was step 4"
    assert checkpoint_problem(run(3, checkpoints=0), ident) == "no checkpoint was completed"
    other = job_identity(ck.SPEC, ck.W.__class__(**{**ck.W.__dict__, "algorithm": "grpo"}))
    assert "written by a PPO run" in checkpoint_problem(run(3), other)
    shard = next(p for p in pathlib.Path(slot).rglob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    msg = checkpoint_problem(run(3), ident)
    assert msg.startswith("the checkpoint of step 3 is not usable: ") and "SHA-256" in msg, msg
    import shutil

    shutil.rmtree(root)  # e.g. a failed run's temporary directory removed: the only copy gone
    assert checkpoint_problem(run(3), ident).startswith("the checkpoint of step 3 is not usable: no checkpoint at")
    # a restore that lost more steps than since the last complete checkpoint went back past it
    evs = [{"source": "checkpoint", "steps_lost": 2, "since_checkpoint": 1},
           {"source": "checkpoint", "steps_lost": 1, "since_checkpoint": 1},
           {"source": "live", "steps_lost": 0, "since_checkpoint": 3}]
    assert restores_past_checkpoint(evs) == 1


def test_the_summary_counts_lost_checkpoints_and_the_benchmark_fails_on_one():
    import argparse

    _bench()
    from fault_report import summarize

    ok = _record([])
    stale = _record([], problem="current holds step 3, the last checkpoint completed was step 4")
    past = _record([{"step": 5, "lost": [1], "hung": [], "detect_s": 0.1, "source": "checkpoint", "steps_lost": 3,
                     "recovery_s": 1.0, "full_copy": False, "since_checkpoint": 1}])
    ns = argparse.Namespace(seed=0, quick=False)
    assert summarize([ok], {}, 1.0, ns, 3.0)["checkpoints_lost"] == 0
    assert summarize([ok, stale, past], {}, 1.0, ns, 3.0)["checkpoints_lost"] == 2


def test_a_replay_step_renumbers_its_workers_in_order_keeping_every_rank_order():
    # the replay runs each step on 0..n-1 (fault_pools.replay_pool): a step's plan on workers 3, 6, 7, 9
    # becomes 0, 1, 2, 3 with each candidate's ranks in the same order, colocations kept
    bench = _bench()
    from fault_run import workload

    from nereus.runtime.run.plans import simple_plan

    layout = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
              "critic.infer": (1, 1, 1), "actor.train": (2, 1, 1), "critic.train": (1, 2, 1)}
    plan = simple_plan(workload("ppo"), layout, 4, micro_batch=1)
    to = {0: 9, 1: 3, 2: 7, 3: 6}  # a permutation onto sparse ids: rank order must survive the renumbering
    plan = type(plan)(candidates=tuple(c.with_gpus([to[g] for g in c.gpus]) for c in plan.candidates))
    out = bench._renumbered(plan)
    back = {3: 0, 6: 1, 7: 2, 9: 3}
    for a, b in zip(plan.candidates, out.candidates):
        assert b.gpus == tuple(back[g] for g in a.gpus), (a, b)
        assert (b.tp, b.pp, b.dp, b.model_stage) == (a.tp, a.pp, a.dp, a.model_stage)
    assert out.gpus_used() == frozenset(range(4))


@pytest.mark.timeout(300)
def test_spare_workers_started_ahead_join_under_the_next_ids(ray_cluster):
    import ray

    _bench()
    from fault_pools import SparePool

    pool = SparePool(2, timeout_s=15, hang_timeout_s=3, spares=2).start()
    try:
        assert [i for i, _ in pool._ahead] == [2, 3] and len(pool.workers) == 2
        spare = dict(pool._ahead)[2]
        assert pool.add(1) == [2] and pool.workers[2] is spare  # the one started ahead, not a new process
        assert [i for i, _ in pool._ahead] == [3, 4]
        assert pool.add(3) == [3, 4, 5] and [i for i, _ in pool._ahead] == [6, 7]
        assert ray.get([w.ping.remote() for w in pool.workers]) == list(range(6))  # each knows its own id
        assert len(set(pool.pids)) == 6
        ahead = [w for _, w in pool._ahead]
    finally:
        pool.close()
    assert pool._ahead == [] and all(w is None for w in pool.workers)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ahead[0].ping.remote(), timeout=60)  # the spares were stopped too


def test_a_late_fault_cut_to_one_worker_or_pending_at_the_run_end_is_counted():
    # seed 4242's --faults 100 printed 99 faults for 102 workers lost: three `late:1` faults at the last
    # step whose count the guard had lowered to one waited for a second worker that did not exist, so no
    # later settle marked them fired and the summary left them out (all three were survived)
    import types

    _bench()
    from fault_run import SPEC, TASK, Fault, FaultBenchRun, config, workload

    run = FaultBenchRun(SPEC, workload("ppo"), TASK, 4, config(), framework="nereus", measure=False,
                        bench_faults=[], rng=None, capacity=9)
    arm = types.SimpleNamespace(options=lambda **_: types.SimpleNamespace(remote=lambda *a: None))
    alive = types.SimpleNamespace(arm=arm)
    run.driver = types.SimpleNamespace(workers=[alive] * 7 + [None], _get=lambda futures, what: None)
    one = Fault(step=9, point="logprobs", how="slow:60", count=1, second_how="late:1", workers=[7], state="armed")
    two = Fault(step=9, point="train_fields", how="kill", count=2, second_how="late:1", workers=[7, 5],
                state="armed")
    run.bench = [one, two]
    run._settle()
    assert (one.state, one.fired) == ("fired", [7])  # no second worker to wait for
    assert two.state == "armed"  # its second worker (5, alive) may still go off a second later
    run._settle(final=True)  # the run's end: nothing left pending
    assert (two.state, two.fired) == ("fired", [7])


def test_a_fault_counts_as_survived_only_when_its_run_ends_at_its_replay_after_a_recovery_naming_it():
    # issue 30's done-when: survived = the run went on (live or from a checkpoint), finished and ended
    # at its replay's state; a run on a wrong state, or a worker no recovery named, did not survive
    import argparse

    _bench()
    from fault_report import summarize

    def ev(lost, source):
        return {"step": 2, "lost": lost, "hung": [], "slow": [], "detect_s": 0.5, "source": source,
                "steps_lost": 0, "recovery_s": 1.0, "full_copy": True, "since_checkpoint": 0}

    def fault(fired):
        return {"step": 2, "how": "kill", "phase": "step", "fired": fired, "second_how": "", "state": "fired",
                "point": "generate", "workers": fired}

    ok = _record([ev([0, 1], "live")], [fault([0, 1])])  # 2 survived
    ckpt = _record([ev([3], "checkpoint")], [fault([3])])  # 1 survived (fell back to the checkpoint)
    wrong = {**_record([ev([2], "live")], [fault([2])]), "weights_equal": False}  # 0: differs from the replay
    unnamed = _record([ev([4], "live")], [fault([4, 5])])  # 0: no recovery named worker 5
    s = summarize([ok, ckpt, wrong, unnamed], {}, 1.0, argparse.Namespace(seed=0, quick=False), 3.0)
    assert (s["faults_injected"], s["faults_survived"]) == (6, 3), s
