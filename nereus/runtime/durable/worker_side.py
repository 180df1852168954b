"""Worker side of durable checkpoints: one engine's own shards to and from a DCP checkpoint.

Each saving worker writes the pieces of its own shard (parameters; for a trainable model-stage also
the fp32 master copy and Adam's moments) and the counters as one ``torch.distributed.checkpoint``
checkpoint with ``no_dist=True`` (:func:`save_engine`, or :func:`save_engine_async`, which copies the
pieces into host memory it owns and writes them in a background thread); a reader in any layout
loads exactly the rows/columns of its new shard (:func:`load_engine`). The key format and the
driver side (which replica writes, completion, restart) are in :mod:`nereus.runtime.durable.driver_side`.
"""

from __future__ import annotations

import os
import time

import torch

from nereus.runtime.transit.plans import region

__all__ = ["save_engine", "save_engine_async", "wait_engine_save", "load_engine", "piece_key", "parse_key"]

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


def _kinds(engine, load: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Every state kind the engine holds (``Engine.state_tensors``: ``master`` too in a bf16 run); a
    ZeRO engine's sliced kinds unsliced over DP (``ZeroEngine.checkpoint_tensors``: a collective when
    saving; buffers to slice from when loading)."""
    if hasattr(engine, "checkpoint_tensors"):
        return engine.checkpoint_tensors(gather=not load)
    return engine.state_tensors()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------------------------------- worker side
def _stage_of(path: str) -> str:
    """The model-stage a rank directory belongs to: ``<directory>/<model_stage>/rank-<worker>``."""
    return os.path.basename(os.path.dirname(os.path.normpath(path)))


def _pieces(engine, contiguous: bool = True, stage: str | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``engine``'s own shards and counters as the flat DCP state dict (views of the live tensors;
    with ``contiguous`` a column piece is copied to be contiguous) and its state bytes; with
    ``stage``, the marker key ``model_stage:<stage>`` (``durable/integrity.py``: ``--resume`` refuses a
    rank directory moved under another model-stage)."""
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
    if stage:
        sd[f"model_stage:{stage}"] = torch.zeros(1, dtype=torch.int8)
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
    sd, state = _pieces(engine, stage=_stage_of(path))
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
    sd, state = _pieces(engine, contiguous=False, stage=_stage_of(path))  # the stager's copy is contiguous
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
    dest = _kinds(engine, load=True)
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
            if key.startswith("model_stage:"):  # the marker (durable/integrity.py): nothing to load
                continue
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
    if hasattr(engine, "load_checkpoint_tensors"):  # ZeRO: keep this rank's slices
        engine.load_checkpoint_tensors(dest)
    out["seconds"] = time.perf_counter() - t0
    return out
