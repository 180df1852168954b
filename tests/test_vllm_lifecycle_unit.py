"""The no-orphan machinery of ``--rollout vllm`` without vLLM: the reaper's watchdog (``worker/vllm_reaper.py``)
on plain processes, and the driver side's keep/stop/start decisions (``run/vllm_driver.py``) on fakes.

The reaper test runs a stand-in worker process that spawns a stand-in engine process (``sleep``) and owns
a directory and a shared-memory file through a :class:`Reaper`; the worker is SIGKILLed (what ``ray.kill``
does) and the test checks, by pid and by listing the directories, that the engine process and the paths are
gone. The driver tests check which replicas a layout change keeps (same TP, workers and replica index),
that every live worker is asked to close (not only the current layout's), and that a failed start closes
the engines that did start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from nereus.runtime.comm.parallel import Layout
from nereus.spec.plan import Candidate

psutil = pytest.importorskip("psutil")

WORKER = r"""
import os, subprocess, sys, time, multiprocessing.shared_memory as shm
sys.path.insert(0, sys.argv[1])
from nereus.runtime.worker.vllm_reaper import Reaper, engine_processes
d = sys.argv[2]
os.makedirs(d)
seg = shm.SharedMemory(create=True, size=4096)
eng = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(0.2)
r = Reaper()
procs = engine_processes()
r.track("actor.generate", procs, [d, "/dev/shm/" + seg.name])
print(eng.pid, r.watchdog_pid(), r.manifest, seg.name, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(cond, seconds: float = 20.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < seconds:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_killed_worker_takes_its_engine_processes_and_files_with_it(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__import__("nereus").__file__)))
    d = str(tmp_path / "handoff")
    w = subprocess.Popen([sys.executable, "-c", WORKER, root, d], stdout=subprocess.PIPE, text=True)
    try:
        eng, dog, manifest, seg = w.stdout.readline().split()
        eng, dog = int(eng), int(dog)
        assert not _gone(eng) and not _gone(dog) and os.path.isdir(d) and os.path.exists(manifest)
        assert os.path.exists(f"/dev/shm/{seg}")
        w.send_signal(signal.SIGKILL)
        w.wait()
        assert _wait(lambda: _gone(eng) and not os.path.exists(d) and not os.path.exists(manifest)), \
            (eng, os.path.exists(d), os.path.exists(manifest))
        assert not os.path.exists(f"/dev/shm/{seg}")
        assert _wait(lambda: _gone(dog))  # the watchdog exits after reaping
    finally:
        if w.poll() is None:
            w.kill()


def test_release_kills_what_is_left_and_a_clean_close_stops_the_watchdog(tmp_path):
    from nereus.runtime.worker.vllm_reaper import Reaper, engine_processes

    r = Reaper()
    eng = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        d = tmp_path / "cfg"
        d.mkdir()
        procs = [p for p in engine_processes() if p[0] == eng.pid]
        # a pid recorded with another start time is a recycled pid: never signalled
        r.track("other", [[eng.pid, procs[0][1] - 100.0]], [])
        r.track("gen", procs, [str(d)])
        assert r.release("other") == {"killed": [], "removed": []} and eng.poll() is None
        out = r.release("gen")
        assert out["killed"] == [eng.pid] and out["removed"] == [str(d)]
        assert eng.wait(timeout=10) is not None and not d.exists()
        assert not os.path.exists(r.manifest)  # nothing owned: the manifest goes, and the watchdog exits
        assert _wait(lambda: _gone(r.watchdog), 10)
        assert r.watchdog not in {c.pid for c in psutil.Process().children(recursive=True)}  # not our child
    finally:
        if eng.poll() is None:
            eng.kill()


# ---------------------------------------------------------------------- driver side, on fakes
class _Call:
    def __init__(self, log, wid, name):
        self.log, self.wid, self.name = log, wid, name

    def remote(self, *args):
        self.log.append((self.wid, self.name, args))
        return (self.wid, self.name)


class _Worker:
    def __init__(self, wid, log):
        self.wid, self.log = wid, log

    def __getattr__(self, name):
        return _Call(self.log, self.wid, name)


def _driver(gen: Layout, n: int = 4, fail: str | None = None):
    log: list = []

    def get(calls, what, timeout=None):
        if fail and fail in what:
            raise RuntimeError(f"{what} failed")
        return [{"start_s": 1.0, "kv": [], "push": {}, "waited_s": 1.0} if c[1] == "build_vllm" else {} for c in calls]

    return SimpleNamespace(cfg=SimpleNamespace(rollout="vllm", vllm={}, timeout_s=1.0),
                           workers=[_Worker(i, log) for i in range(n)], layouts={"actor.generate": gen},
                           tag="t", _get=get), log


def _cand(tp, dp, gpus):
    return {"actor.generate": Candidate("actor.generate", tp, 1, dp, gpus=tuple(gpus))}


def test_a_layout_change_keeps_only_replicas_of_the_same_tp_workers_and_index():
    from nereus.runtime.run import vllm_driver as vd

    # dp 1 -> 2 on (0,) -> (0, 1): replica 0 keeps its engine, replica 1 is new
    assert vd._new_replicas(_cand(1, 1, [0]), _cand(1, 2, [0, 1])) == [(1, (1,), 1)]
    # the same workers in another order: replica 0 moves to worker 1 (its index, seed and hand-off change)
    assert vd._new_replicas(_cand(1, 2, [0, 1]), _cand(1, 2, [1, 0])) == [(1, (1,), 0), (1, (0,), 1)]
    # TP 1 -> 2 on the same workers: a new engine
    assert vd._new_replicas(_cand(1, 2, [0, 1]), _cand(2, 1, [0, 1])) == [(2, (0, 1), 0)]
    assert not vd._gen_changes(_cand(1, 2, [0, 1]), _cand(1, 1, [0]))  # dp 2 -> 1: nothing to start


def test_stop_asks_every_live_worker_but_the_kept_replicas():
    from nereus.runtime.run import vllm_driver as vd

    d, log = _driver(Layout(1, 1, 2, (0, 1)))
    d.workers[3] = None  # lost
    keep = vd.stop_changed(d, _cand(1, 2, [0, 1]), _cand(1, 1, [0]))
    assert keep == {(1, (0,), 0)}
    # worker 2 holds no engine in the current layout but is asked too (a restart may have left one there)
    assert sorted((w, n) for w, n, _ in log) == [(1, "close_vllm"), (2, "close_vllm")]


def test_start_pushes_into_kept_replicas_and_a_failed_start_closes_every_engine():
    from nereus.runtime.run import vllm_driver as vd

    # the guard installs itself over the default handler only: start from it whatever earlier tests left
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        d, log = _driver(Layout(1, 1, 2, (0, 1)))
        info = vd.start_vllm_engines(d, keep=frozenset({(1, (0,), 0)}))
        assert sorted((w, n) for w, n, _ in log) == [(0, "vllm_push"), (1, "build_vllm")]
        assert info["kept"] == [0] and info["start_s"] == [1.0]
        # while engines run, SIGTERM to the driver is a SystemExit (the finally blocks close the engines);
        # the installed handler is called directly, so a missing guard fails the test, not the test process
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler) and handler is not signal.SIG_DFL
        with pytest.raises(SystemExit) as e:
            handler(signal.SIGTERM, None)
        assert e.value.code == 143
        vd.stop_vllm_engines(d, everything=True)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored at the teardown
    finally:
        signal.signal(signal.SIGTERM, before)
    d, log = _driver(Layout(1, 1, 2, (0, 1)), fail="starting")
    with pytest.raises(RuntimeError, match="starting vLLM engines failed"):
        vd.start_vllm_engines(d)
    closes = sorted(w for w, n, _ in log if n == "close_all_vllm")
    assert closes == [0, 1, 2, 3]  # every live worker, prestarted engines included


def test_a_planner_plan_with_pipelined_generation_is_folded_to_pp1_for_vllm():
    from dataclasses import replace

    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run import vllm_driver as vd
    from nereus.runtime.run.config import RLConfig
    from nereus.runtime.run.driver import RLDriver
    from nereus.runtime.run.plans import simple_plan
    from nereus.spec.presets import MODEL_PRESETS
    from nereus.spec.workload import WorkloadSpec

    w = WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=2, prompt_len=4, response_len=3,
                     mini_batch_size=16, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
    stages = ("actor.generate", "actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train")
    plan = simple_plan(w, {k: (1, 1, 1) for k in stages}, 4, micro_batch=8)
    pp2 = replace(plan, candidates=tuple(Candidate("actor.generate", 1, 2, 1, gpus=(2, 3)) if c.model_stage ==
                                         "actor.generate" else c for c in plan.candidates))
    spec = MODEL_PRESETS["tiny-d64"]  # 4 query heads, 2 KV heads: TP 2 is valid
    d = RLDriver(spec, w, plan, DigitTask("reverse", 2), 4, RLConfig(rollout="vllm"))
    g = vd.vllm_legal(d, pp2)["actor.generate"]
    assert (g.tp, g.pp, g.dp, tuple(g.gpus)) == (2, 1, 1, (2, 3))  # PP 2 -> TP 2 on the same workers
    # PP 3: TP 3 does not divide the 4 heads, 3 replicas do not divide the 8 prompts: PP 1 on its first worker
    pp3 = replace(plan, candidates=tuple(Candidate("actor.generate", 1, 3, 1, gpus=(1, 2, 3)) if c.model_stage ==
                                         "actor.generate" else c for c in plan.candidates))
    g = vd.vllm_legal(d, pp3)["actor.generate"]
    assert (g.tp, g.pp, g.dp, tuple(g.gpus)) == (1, 1, 1, (1,))
    d.cfg = RLConfig()  # the built-in engine pipelines generation: unchanged
    assert vd.vllm_legal(d, pp2) is pp2


def test_orphan_segments_are_the_new_unmapped_ones():
    from multiprocessing import shared_memory

    from nereus.runtime.worker.vllm_reaper import orphan_segments, shm_segments

    before = shm_segments()
    held = shared_memory.SharedMemory(create=True, size=4096)  # still mapped here
    left = shared_memory.SharedMemory(create=True, size=4096)
    name = left.name
    left.close()  # unmapped, not unlinked: what a failed engine start left
    try:
        found = orphan_segments(before)
        assert f"/dev/shm/{name}" in found and f"/dev/shm/{held.name}" not in found, found
    finally:
        held.close()
        held.unlink()
        shared_memory.SharedMemory(name=name).unlink()
