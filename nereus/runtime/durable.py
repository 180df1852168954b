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
   shard (:func:`~nereus.runtime.shards.region`) from the saved pieces that cover them, and takes
   the counters. Engines of model-stages that were not saved are left as they are (their layout
   must not change).

**Asynchronous saves.** :func:`begin_save` with ``background=True``: every writer copies its shards
and counters into host memory of the save's own (a stager for ``dcp.async_save``, which takes
``no_dist`` and needs no process group) and returns at once; ``dcp.async_save`` writes the files
from that copy in a background thread of the worker while training changes the engines in place.
:func:`finish_save` waits for the writers (``WorkerCore.dcp_wait``) and only then writes
``driver.json``, so a checkpoint directory without it is incomplete. :func:`save` is both at once.

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
===========================================  ====================================================

The key alone says which part of which full tensor a piece is, so a reader in any layout finds the
pieces it needs from each rank directory's DCP metadata (``FileSystemReader.read_metadata``) without
knowing the layout that wrote them. ``<directory>/driver.json`` holds the driver's ``step_index``,
``updates`` and the saved model-stages with the layout each was saved in.

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

import torch

from nereus.runtime.shards import region

__all__ = ["save", "begin_save", "finish_save", "PendingSave", "restart", "save_engine", "save_engine_async",
           "wait_engine_save", "load_engine", "piece_key", "parse_key", "saved_stages"]

_COUNTERS = ("step", "update_count", "version", "policy_version", "position")


def piece_key(kind: str, name: str, dim: int | None, lo: int = 0, hi: int = 0) -> str:
    """The DCP key of a piece (module docstring)."""
    return f"{kind}/{name}/full" if dim is None else f"{kind}/{name}/{dim}:{lo}:{hi}"


def parse_key(key: str) -> tuple[str, str, int | None, int, int]:
    """``(kind, name, dim, lo, hi)`` of a piece key (``dim`` None for a whole tensor).

    Raises:
        ValueError: not a piece key.
    """
    kind, _, rest = key.partition("/")
    name, _, where = rest.rpartition("/")
    if not kind or not name:
        raise ValueError(f"not a piece key: {key!r}")
    if where == "full":
        return kind, name, None, 0, 0
    try:
        dim, lo, hi = (int(x) for x in where.split(":"))
    except ValueError:
        raise ValueError(f"not a piece key: {key!r}") from None
    return kind, name, dim, lo, hi


def _kinds(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every state kind the engine holds (``Engine.state_tensors``: ``master`` too in a bf16 run)."""
    return engine.state_tensors()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------------------------------- worker side
def _pieces(engine, contiguous: bool = True) -> tuple[dict[str, torch.Tensor], int]:
    """``engine``'s own shards and counters as the flat DCP state dict (views of the live tensors;
    with ``contiguous`` a column piece is copied to be contiguous) and its state bytes."""
    spec, ctx = engine.spec, engine.ctx
    sd: dict[str, torch.Tensor] = {}
    state = 0
    for kind, tensors in _kinds(engine).items():
        for name in engine.model.names:
            r = region(spec, name, ctx.tp, ctx.t)
            t = tensors[name].detach()
            if r.dim is not None:
                t = t.narrow(r.dim, 0, r.hi - r.lo)  # vocab padding is not state
            sd[piece_key(kind, name, r.dim, r.lo, r.hi)] = t.contiguous() if contiguous else t
            state += t.numel() * t.element_size()
    sd["counters"] = torch.tensor([int(getattr(engine, k)) for k in _COUNTERS], dtype=torch.int64)
    return sd, state


def _writer(path: str, hook=None):
    """DCP's ``FileSystemWriter`` for ``path`` that calls ``hook("data")`` before it writes the data
    file and ``hook("metadata")`` before the ``.metadata`` that makes the checkpoint readable (fault
    injection fires there: in the middle of the write). Inside the call for a synchronous save, in
    the background thread for an asynchronous one."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            if hook is not None:
                hook("data")
            return super().write_data(plan, planner)

        def finish(self, metadata, results):
            if hook is not None:
                hook("metadata")
            return super().finish(metadata, results)

    return Writer(path)


def _snapshot_stager():
    """The ``AsyncStager`` of :func:`save_engine_async`: ``stage`` copies every tensor into new host
    memory the save owns (pinned when CUDA is present), so training may change the engine's
    tensors in place as soon as ``dcp.async_save`` returns."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class Snapshot(AsyncStager):
        _synchronize_after_execute = False  # stage() copies before async_save returns

        def stage(self, state_dict):
            pin = torch.cuda.is_available()
            out = {}
            for k, t in state_dict.items():
                c = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                c.copy_(t.detach())
                out[k] = c
            return out

        def close(self) -> None:
            pass

    return Snapshot()


def save_engine(engine, path: str, hook=None) -> dict:
    """Write ``engine``'s own shards and counters as one DCP checkpoint at ``path`` (synchronously;
    ``hook``: see :func:`_writer`).

    Returns:
        ``{"written": bytes of the files, "state": state bytes, "seconds", "snapshot_s": 0,
        "write_s"}``.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    sd, state = _pieces(engine)
    os.makedirs(path, exist_ok=True)
    dcp.save(sd, storage_writer=_writer(path, hook), no_dist=True)
    dt = time.perf_counter() - t0
    return {"written": _dir_bytes(path), "state": state, "seconds": dt, "snapshot_s": 0.0, "write_s": dt}


def save_engine_async(engine, path: str, hook=None) -> dict:
    """Start writing ``engine``'s own shards and counters as one DCP checkpoint at ``path`` with
    ``dcp.async_save`` (``no_dist``; no process group needed): the tensors are first copied into
    host memory of the save's own (the snapshot; the call blocks for it), then DCP writes the
    files in a background thread (``hook``: see :func:`_writer`). Finish with :func:`wait_engine_save`.

    Returns:
        a handle: ``{"future", "path", "state", "snapshot_s", "t0", "done"}``.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    sd, state = _pieces(engine, contiguous=False)  # the stager's copy is contiguous
    os.makedirs(path, exist_ok=True)
    fut = dcp.async_save(sd, storage_writer=_writer(path, hook), async_stager=_snapshot_stager(),
                         no_dist=True)
    t1 = time.perf_counter()
    done: list[float] = []
    fut.add_done_callback(lambda _f: done.append(time.perf_counter()))
    return {"future": fut, "path": path, "state": state, "snapshot_s": t1 - t0, "t0": t1, "done": done}


def wait_engine_save(handle: dict, timeout_s: float | None = None) -> dict:
    """Wait for the background write of :func:`save_engine_async`.

    Returns:
        ``{"written", "state", "snapshot_s", "write_s"}`` (``write_s``: from the end of the snapshot to
        the end of the write).

    Raises:
        RuntimeError: the write failed (DCP's ``CheckpointException`` is a ``BaseException``).
        TimeoutError: not done within ``timeout_s``.
    """
    try:
        handle["future"].result(timeout=timeout_s)
    except TimeoutError:
        raise
    except BaseException as e:  # noqa: BLE001  (CheckpointException derives from BaseException)
        raise RuntimeError(f"background write of {handle['path']} failed: {str(e)[-400:]}") from None
    end = handle["done"][0] if handle["done"] else time.perf_counter()
    return {"written": _dir_bytes(handle["path"]), "state": handle["state"], "snapshot_s": handle["snapshot_s"],
            "write_s": end - handle["t0"]}


def _planner_class():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class PiecePlanner(LoadPlanner):
        """Reads, for each saved key, only the chunks ``requests[key]`` names: ``[(offsets in the saved
        piece, destination view)]``; counts the bytes of the file items it makes DCP read."""

        def __init__(self, requests: dict) -> None:
            self.requests = requests
            self.item_bytes = 0

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self):
            items = []
            for key, reqs in self.requests.items():
                md = self.metadata.state_dict_metadata[key]
                chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape) for off, view in reqs]
                items += create_read_items_for_chunk_list(key, md, chunks)
            self.item_bytes = sum(self.metadata.storage_data[i.storage_index].length for i in items)
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value) -> None:  # every saved value is a tensor
            raise ValueError(f"unexpected non-tensor item {read_item.dest_index.fqn}")

        def resolve_tensor(self, read_item):
            _, view = self.requests[read_item.dest_index.fqn][read_item.dest_index.index]
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(d, o, n)
            return view

        def commit_tensor(self, read_item, tensor) -> None:
            pass

    return PiecePlanner


def _rank_dirs(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise ValueError(f"no checkpoint at {path}")
    ranks = sorted((int(n.split("-", 1)[1]), n) for n in os.listdir(path) if n.startswith("rank-"))
    return [os.path.join(path, n) for _, n in ranks]


@torch.no_grad()
def load_engine(engine, path: str) -> dict:
    """Fill ``engine``'s shards and counters from the model-stage checkpoint at ``path``
    (``<directory>/<model_stage>``): from each saved rank, exactly the rows/columns of this rank's
    shard that its pieces cover (first saved rank first).

    Returns:
        ``{"read": bytes of file items and metadata read, "loaded": bytes copied into shards,
        "seconds"}``.

    Raises:
        ValueError: no checkpoint there, or some rows of this rank's shard are in no saved piece.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    t0 = time.perf_counter()
    spec, ctx = engine.spec, engine.ctx
    dest = _kinds(engine)
    want = {n: region(spec, n, ctx.tp, ctx.t) for n in engine.model.names}
    need = {(k, n): [(w.lo, w.hi)] if w.dim is not None else [(0, 1)] for k in dest for n, w in want.items()}
    for tensors in dest.values():
        for n in want:
            tensors[n].zero_()  # vocab padding rows stay zero
    planner_cls = _planner_class()
    out = {"read": 0, "loaded": 0}
    counters = None
    for rank_dir in _rank_dirs(path):
        md_path = os.path.join(rank_dir, ".metadata")
        md = FileSystemReader(rank_dir).read_metadata()
        out["read"] += os.path.getsize(md_path)
        requests: dict[str, list] = {}
        for key in md.state_dict_metadata:
            if key == "counters":
                if counters is None:
                    counters = torch.zeros(len(_COUNTERS), dtype=torch.int64)
                    requests[key] = [((0,), counters)]
                continue
            kind, name, dim, lo, hi = parse_key(key)
            if (kind, name) not in need or not need[(kind, name)]:
                continue
            w, t = want[name], dest[kind][name]
            if dim is None:
                requests[key] = [((0,) * t.dim(), t)]
                need[(kind, name)] = []
                continue
            if dim != w.dim:
                raise ValueError(f"{rank_dir}: {key} splits dim {dim}, this rank's shard of {name} dim {w.dim}")
            rest = []
            for a, b in need[(kind, name)]:
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    rest.append((a, b))
                    continue
                off = [0] * t.dim()
                off[dim] = x - lo
                requests.setdefault(key, []).append((tuple(off), t.narrow(dim, x - w.lo, y - x)))
                rest += [iv for iv in ((a, x), (y, b)) if iv[1] > iv[0]]
            need[(kind, name)] = rest
        if not requests:
            continue
        planner = planner_cls(requests)
        dcp.load({k: v[0][1] for k, v in requests.items()}, checkpoint_id=rank_dir, planner=planner, no_dist=True)
        out["read"] += planner.item_bytes + os.path.getsize(md_path)  # dcp.load reads the metadata again
        out["loaded"] += sum(v.numel() * v.element_size() for k, rs in requests.items() if k != "counters"
                             for _, v in rs)
    missing = [(k, n, iv) for (k, n), iv in need.items() if iv]
    if missing:
        raise ValueError(f"{path}: no saved piece covers {missing[:3]} of this rank (tp={ctx.tp} t={ctx.t} "
                         f"p={ctx.p})")
    if counters is None:
        raise ValueError(f"{path}: no counters saved")
    for k, v in zip(_COUNTERS, counters.tolist()):
        setattr(engine, k, int(v))
    out["seconds"] = time.perf_counter() - t0
    return out


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
        WorkerLost: a writer was lost (``faults.py``).
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
    meta = {"step_index": driver.step_index, "updates": driver.updates, "model_stages": stages,
            "layouts": {m: {"tp": driver.layouts[m].tp, "pp": driver.layouts[m].pp, "dp": driver.layouts[m].dp,
                            "workers": list(driver.layouts[m].workers), "replica": replica[m]} for m in stages}}
    what = "dcp save (snapshot)" if background else "dcp save"
    res = driver._get([driver.workers[w].dcp_save.remote(replica, directory, background) for w in writers], what)
    return PendingSave(directory, writers, meta, bool(background), time.perf_counter() - t0, dict(zip(writers, res)))


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
        WorkerLost: a writer (or any worker) was lost while waiting (``faults.py``).
        WorkerFailure: a writer left the pool before its write was complete, or a write failed.
    """
    from nereus.runtime.pool import WorkerFailure

    t0 = time.perf_counter()
    res = pending.per_worker
    if pending.background:
        gone = [w for w in pending.writers if w >= len(driver.workers) or driver.workers[w] is None]
        if gone:
            raise WorkerFailure(f"save: writer(s) {gone} left before their background write was complete")
        done = driver._get([driver.workers[w].dcp_wait.remote() for w in pending.writers],
                           "dcp save (background write)")
        res = dict(zip(pending.writers, done))
    path = os.path.join(pending.directory, "driver.json")
    with open(path, "w") as f:
        json.dump(pending.meta, f)
    wait_s = time.perf_counter() - t0 if pending.background else 0.0
    written = sum(r["written"] for r in res.values()) + os.path.getsize(path)
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
    from nereus.runtime.parallel import Layout

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
