"""A faithful checkpoint/restart of a running RL job, the baseline of ``bench_live_transition.py``.

Source: issue 26 (the benchmark's earlier "restart" kept the worker processes and the unchanged
model-stages alive, wrote to the page cache without fsync, skipped the rollout engine and the frozen
models' reload; a faithful one measured 10.0-12.5 s against its 0.14-1.8 s).

:func:`faithful_restart` does what a framework's restart does, all of it timed:

1. **checkpoint**: ``durable.save`` of every training model-stage (the job's unique state) with
   torch DCP's ``FileSystemWriter`` (``sync_files=True``: every file is fsynced before the save
   completes); then ``posix_fadvise(DONTNEED)`` on every file of the checkpoint, so the read in
   step 4 comes from the storage device, not the page cache (this process's files only; nothing
   else is evicted);
2. **stop**: the driver and every worker process end (``WorkerPool.close``: Ray kills the actors);
3. **start**: a new pool of worker processes (one less when a worker left), a new driver on the
   target plan that builds every model-stage, the rollout engine (``actor.generate``) and the frozen
   models from their initial weights included;
4. **load and sync**: every training model-stage's shards read back from the checkpoint
   (``dcp_load``), the step index and update counter restored, and the weights synced into the
   rollout and inference engines (``RLDriver._sync``).

On GPUs a restart also pays CUDA and NCCL initialisation and the rollout engine's start (vLLM
warm-up); on these CPU workers those are absent, so the faithful restart here is a lower bound.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from nereus.runtime.durable import driver_side as durable
from nereus.runtime.run.driver import RLDriver
from nereus.runtime.run.pool import WorkerPool

__all__ = ["faithful_restart", "drop_page_cache"]


def drop_page_cache(root: str) -> int:
    """``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file under ``root`` (clean pages only: the
    files were fsynced); returns the bytes of those files."""
    n = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def faithful_restart(d: RLDriver, pool: WorkerPool, target, leaves, root: str, make_driver,
                     train_stages) -> tuple[RLDriver, WorkerPool, dict]:
    """Checkpoint ``d``, stop every process, start a new job on ``target`` and restore it (module
    docstring).

    Args:
        leaves: a worker id that leaves with the restart (the new pool has one worker less), or None.
        make_driver: ``(plan, num_workers) -> RLDriver`` (not started).
        train_stages: the model-stages whose state is saved and loaded.

    Returns:
        the new driver and pool, and ``{"seconds", "save_s", "stop_s", "start_s", "load_s", "written",
        "read", "bytes"}`` (seconds; bytes written to and read from the checkpoint).
    """
    shutil.rmtree(root, ignore_errors=True)
    n = len([w for w in pool.workers if w is not None]) - (1 if leaves is not None else 0)
    timeout = pool.timeout_s
    t0 = time.perf_counter()
    s = durable.save(d, root, list(train_stages))
    drop_page_cache(root)
    t1 = time.perf_counter()
    pool.close()  # every worker process is killed (its engines go with it)
    d.workers = []
    t2 = time.perf_counter()
    new_pool = WorkerPool(n, timeout_s=timeout).start()
    new = make_driver(target, n).start(new_pool)
    t3 = time.perf_counter()
    with open(os.path.join(root, "driver.json")) as f:
        meta = json.load(f)
    stages = meta["model_stages"]
    loaders = sorted({w for m in stages for w in new.layouts[m].workers})
    res = new._get([new.workers[w].dcp_load.remote(stages, root) for w in loaders], "dcp load")
    new.step_index, new.updates = int(meta["step_index"]), int(meta["updates"])
    new._sync()
    t4 = time.perf_counter()
    read = sum(r["read"] for r in res)
    return new, new_pool, {"seconds": t4 - t0, "save_s": t1 - t0, "stop_s": t2 - t1, "start_s": t3 - t2,
                           "load_s": t4 - t3, "written": s["written"], "read": read, "bytes": s["written"] + read}
