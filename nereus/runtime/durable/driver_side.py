"""Checkpoint/restart through ``torch.distributed.checkpoint`` (DCP): the baseline a live transition
is measured against (``benchmarks/bench_live_transition.py``, ``docs/live-transition.md``).

A restart into a new layout goes through storage instead of moving shards between workers:

1. :func:`save`: every worker of the first intact DP replica of each saved model-stage writes its OWN shards
   (parameters; for a trainable model-stage also Adam's ``exp_avg`` and ``exp_avg_sq``) and the
   counters with ``dcp.save(..., no_dist=True)``; the other replicas hold the same state and write
   nothing. Nothing is gathered: the driver receives byte counts only.
2. :func:`restart`: the engines of the saved model-stages are torn down (``WorkerCore.destroy``) on
   every worker, the driver takes the target plan (``RLDriver.set_plan``, a fresh group tag) and
   rebuilds those engines in their target layouts (from their seeds, as at start-up), then every
   rank of every replica of the new layout reads with ``dcp.load`` exactly the rows/columns of its new
   shard (:func:`~nereus.runtime.transit.plans.region`) from the saved pieces that cover them, and takes
   the counters. Engines of model-stages that were not saved are left as they are (their layout
   must not change).

**Asynchronous saves.** :func:`begin_save` with ``background=True``: every writer copies its shards
and counters into host memory of the save's own (a stager for ``dcp.async_save``, which takes
``no_dist`` and needs no process group) and returns at once; ``dcp.async_save`` writes the files
from that copy in a background thread of the worker while training changes the engines in place.
:func:`finish_save` waits for the writers (``WorkerCore.dcp_wait``) and only then writes
``driver.json`` and, last, ``manifest.json`` (every file's size and SHA-256, ``durable/integrity.py``),
so a checkpoint directory without the manifest is incomplete. :func:`save` is both at once.

**Format.** ``<directory>/<model_stage>/rank-<worker>/`` is one DCP checkpoint (``.metadata`` plus
``__0_0.distcp``) per saving worker, holding flat keys:

===========================================  ====================================================
key                                          tensor
===========================================  ====================================================
``<kind>/<name>/<dim>:<lo>:<hi>``            rows (dim 0) or columns (dim 1) ``[lo, hi)`` of the
                                             full tensor ``<name>`` (Hugging Face Llama name) for
                                             ``<kind>`` in ``params`` (the engine's dtype:
                                             bf16 in a bf16 run), ``master`` (fp32, bf16 runs
                                             only), ``exp_avg``, ``exp_avg_sq``;
                                             vocab padding rows are not saved
``<kind>/<name>/full``                       the whole tensor (replicated: norms, value head)
``counters``                                 int64 ``[step, update_count, version,
                                             policy_version, position]``
``model_stage:<name>``                       int8 ``[0]``: the model-stage it belongs to
                                             (``durable/integrity.py``)
===========================================  ====================================================

The key alone says which part of which full tensor a piece is, so a reader in any layout finds the
pieces it needs from each rank directory's DCP metadata (``FileSystemReader.read_metadata``) without
knowing the layout that wrote them. ``<directory>/driver.json`` holds the driver's ``step_index``,
``updates``, the saved model-stages with the layout each was saved in, and the job identity
(``integrity.job_identity``); ``<directory>/manifest.json`` every other file's size and SHA-256.

**Partial reads.** A custom :class:`~torch.distributed.checkpoint.planner.LoadPlanner` asks DCP for
the overlap of a saved piece with the new shard only (a ``ReadItem`` per overlap); DCP's file reader
still reads the whole saved item from the file before narrowing it, so :func:`restart` reports both
``read`` (bytes of file items and metadata read) and ``loaded`` (bytes copied into shards).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field

__all__ = ["save", "begin_save", "finish_save", "PendingSave", "restart", "saved_stages"]

# ---------------------------------------------------------------------------------------- driver side
def _live(driver) -> list[int]:
    return [i for i, w in enumerate(driver.workers) if w is not None]


def saved_stages(directory: str) -> list[str]:
    """Model-stages saved under ``directory`` (from ``driver.json``)."""
    with open(os.path.join(directory, "driver.json")) as f:
        return list(json.load(f)["model_stages"])


@dataclass
class PendingSave:
    """A save whose writers have returned (:func:`begin_save`); :func:`finish_save` completes it.

    Attributes:
        directory: where it is written.
        writers: the workers that write (one DP replica of each saved model-stage).
        meta: the content of ``driver.json`` (the boundary's step index and update counter, the saved
            model-stages and their layouts), fixed when the save began.
        background: the files are written in the workers' background threads.
        blocking_s: driver seconds from the start until every writer had returned (synchronous: the
            whole write; asynchronous: the snapshot).
        per_worker: what each writer returned.
    """

    directory: str
    writers: list[int]
    meta: dict
    background: bool
    blocking_s: float
    per_worker: dict = field(default_factory=dict)

    @property
    def step_index(self) -> int:
        return int(self.meta["step_index"])


def begin_save(driver, directory: str, model_stages: list[str] | None = None, background: bool = False) -> PendingSave:
    """Start saving ``model_stages`` (default: all) of a started driver under ``directory`` (module
    docstring).

    Each model-stage is written by the workers of its first DP replica whose workers are all in the
    pool. A frozen or derived model-stage with no intact replica is skipped (a restart re-creates it
    from its initial weights or by the weight sync); a training one makes the save fail.

    Synchronous (``background=False``): every writer writes its files before it returns.
    Asynchronous: every writer copies its shards and counters into host memory of its own (the
    snapshot) and returns; the files are written in its background thread
    (``dcp.async_save``) while training goes on. Nothing is complete, and ``driver.json`` is not
    written, before :func:`finish_save`.

    Raises:
        ValueError: an unknown model-stage, or a training model-stage without an intact replica.
        WorkerLost: a writer was lost (``run/faults.py``).
    """
    t0 = time.perf_counter()
    names = [ms.name for ms in driver.wf.model_stages]
    trainable = {ms.name for ms in driver.wf.model_stages if ms.trainable}
    stages = list(model_stages) if model_stages is not None else names
    bad = [m for m in stages if m not in names]
    if bad:
        raise ValueError(f"save: unknown model-stages {bad}; the workflow has {names}")
    replica: dict[str, int] = {}
    for m in stages:
        lay = driver.layouts[m]
        d = next((d for d in range(lay.dp) if all(w < len(driver.workers) and driver.workers[w] is not None
                                                    for w in lay.replica(d))), None)
        if d is None:
            if m in trainable:
                raise ValueError(f"save: every replica of {m} lost a worker; its state cannot be saved")
            continue
        replica[m] = d
    stages = [m for m in stages if m in replica]
    writers = sorted({w for m in stages for w in driver.layouts[m].replica(replica[m])})
    for m in stages:  # pieces of an earlier save in another layout must not be read back
        shutil.rmtree(os.path.join(directory, m), ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    from nereus.runtime.durable.integrity import job_identity

    meta = {"step_index": driver.step_index, "updates": driver.updates, "model_stages": stages,
            "identity": job_identity(driver.spec, driver.workload),
            "layouts": {m: {"tp": driver.layouts[m].tp, "pp": driver.layouts[m].pp, "dp": driver.layouts[m].dp,
                            "workers": list(driver.layouts[m].workers), "replica": replica[m]} for m in stages}}
    what = "dcp save (snapshot)" if background else "dcp save"
    # a ZeRO group's writing replica all-gathers the optimizer slices over DP: its other replicas join
    # (``ZeroEngine.join_checkpoint``), so every worker of a ZeRO model-stage takes the call
    joiners = sorted({w for m in stages if getattr(driver.cands.get(m), "zero", 0) for w in driver.layouts[m].workers}
                     - set(writers))
    calls = writers + joiners
    res = driver._get([driver.workers[w].dcp_save.remote(replica, directory, background) for w in calls], what)
    return PendingSave(directory, writers, meta, bool(background), time.perf_counter() - t0,
                       dict(zip(writers, res[:len(writers)])))


def finish_save(driver, pending: PendingSave) -> dict:
    """Complete a save: wait for the writers' background writes (asynchronous), then write
    ``driver.json``. Only then is the checkpoint in ``pending.directory`` complete.

    Returns:
        ``{"seconds": blocking_s + wait_s (what the run waited for), "blocking_s", "wait_s": driver
        seconds spent here waiting for the background writes, "background_s": the longest
        writer's background write (0 when synchronous), "snapshot_s": the longest writer's
        snapshot, "written": bytes of every file, "state": state bytes, "per_worker", "saved",
        "background"}``.

    Raises:
        WorkerLost: a writer (or any worker) was lost while waiting (``run/faults.py``).
        WorkerFailure: a writer left the pool before its write was complete, or a write failed.
    """
    from nereus.runtime.worker.failures import WorkerFailure

    t0 = time.perf_counter()
    res = pending.per_worker
    if pending.background:
        gone = [w for w in pending.writers if w >= len(driver.workers) or driver.workers[w] is None]
        if gone:
            raise WorkerFailure(f"save: writer(s) {gone} left before their background write was complete")
        done = driver._get([driver.workers[w].dcp_wait.remote() for w in pending.writers],
                           "dcp save (background write)")
        res = dict(zip(pending.writers, done))
    from nereus.runtime.durable.integrity import MANIFEST, write_manifest

    path = os.path.join(pending.directory, "driver.json")
    with open(path, "w") as f:
        json.dump(pending.meta, f)
    write_manifest(pending.directory)  # last: a checkpoint without it is incomplete
    wait_s = time.perf_counter() - t0 if pending.background else 0.0
    written = (sum(r["written"] for r in res.values()) + os.path.getsize(path)
               + os.path.getsize(os.path.join(pending.directory, MANIFEST)))
    return {"seconds": pending.blocking_s + wait_s, "blocking_s": pending.blocking_s, "wait_s": wait_s,
            "background_s": max((r["write_s"] for r in res.values()), default=0.0) if pending.background else 0.0,
            "snapshot_s": max((r["snapshot_s"] for r in res.values()), default=0.0),
            "written": written, "state": sum(r["state"] for r in res.values()), "per_worker": res,
            "saved": list(pending.meta["model_stages"]), "background": pending.background}


def save(driver, directory: str, model_stages: list[str] | None = None, background: bool = False) -> dict:
    """Save ``model_stages`` (default: all) of a started driver under ``directory`` and complete it
    (:func:`begin_save` then :func:`finish_save`; with ``background`` the step between them is
    empty, so the call still returns only once the files are written).

    Returns:
        :func:`finish_save`'s dict.

    Raises:
        ValueError: an unknown model-stage, or a training model-stage without an intact replica.
    """
    return finish_save(driver, begin_save(driver, directory, model_stages, background))


def restart(driver, directory: str, target) -> dict:
    """Tear down the saved model-stages' engines, rebuild them in ``target``'s layouts and load their
    state from ``directory`` (module docstring); the driver's step index and update counter come from
    the checkpoint.

    Returns:
        ``{"seconds", "teardown_s", "build_s", "load_s", "read", "loaded", "per_worker"}``.

    Raises:
        ValueError: ``target`` is invalid, uses workers that left, or changes the layout of a
            model-stage that was not saved (nothing is torn down then).
    """
    from nereus.runtime.comm.parallel import Layout

    t0 = time.perf_counter()
    with open(os.path.join(directory, "driver.json")) as f:
        meta = json.load(f)
    stages = meta["model_stages"]
    gone = sorted({g for c in target.candidates for g in c.gpus if g >= len(driver.workers)
                   or driver.workers[g] is None})
    if gone:
        raise ValueError(f"restart: target uses workers {gone} that are not in the pool")
    old = (driver.cands, driver.layouts, driver.tag)
    driver.set_plan(target)  # validates first: on ValueError nothing has changed
    trainable = {ms.name for ms in driver.wf.model_stages if ms.trainable}
    moved = [m for m, lay in driver.layouts.items() if m not in stages and lay != old[1][m]]
    if any(m in trainable for m in moved):
        driver.cands, driver.layouts, driver.tag = old
        raise ValueError(f"restart: {moved} change layout but were not saved in {directory}")
    rebuilt = set(stages) | set(moved)  # frozen/derived not saved: from their initial weights, then synced
    live = _live(driver)
    driver._get([driver.workers[i].destroy.remote(m) for m in rebuilt for i in live], "restart teardown")
    t1 = time.perf_counter()
    for ms in driver.wf.model_stages:
        if ms.name not in rebuilt:
            continue
        lay: Layout = driver.layouts[ms.name]
        adam = driver.adam_config(ms.name) if ms.trainable else None
        driver._get([driver.workers[i].build.remote(ms.name, driver._spec_of(ms.model), lay,
                                                    driver.seed_of(ms.model), ms.trainable, adam, driver.tag,
                                                    recompute=driver.recompute_of(ms.name),
                                                    precision=driver.cfg.precision)
                     for i in lay.workers], f"restart: building {ms.name}")
    t2 = time.perf_counter()
    loaders = sorted({w for m in stages for w in driver.layouts[m].workers})
    res = driver._get([driver.workers[w].dcp_load.remote(stages, directory) for w in loaders], "dcp load")
    driver.step_index, driver.updates = int(meta["step_index"]), int(meta["updates"])
    if moved:  # derived copies rebuilt from initial weights take the restored training weights
        driver._sync()
    t3 = time.perf_counter()
    return {"seconds": t3 - t0, "teardown_s": t1 - t0, "build_s": t2 - t1, "load_s": t3 - t2,
            "read": sum(r["read"] for r in res), "loaded": sum(r["loaded"] for r in res),
            "per_worker": dict(zip(loaders, res))}
