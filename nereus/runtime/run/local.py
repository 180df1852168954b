"""Run workers as plain local processes (no Ray): for multi-process checks and debugging.

:func:`run_local` hosts the job's ``TCPStore`` in the calling process, spawns ``n`` processes, builds a
:class:`WorkerCore` in each and calls ``fn(core, *args)``; each return value comes back through a
queue. A process that fails or exceeds ``timeout_s`` makes the whole run raise (the others are
terminated), so a broken collective never hangs the caller.
"""

from __future__ import annotations

import io
import os
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_local"]


def _child(i: int, port: int, group_timeout_s: float, fn, args, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from nereus.runtime.worker.core import WorkerCore

        core = WorkerCore(i, "127.0.0.1", port, timeout_s=group_timeout_s)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors would die with this process
        torch.save(fn(core, *args), buf)
        q.put((i, "ok", buf.getvalue()))
    except BaseException as e:  # report any failure to the parent, then exit non-zero
        q.put((i, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
        raise SystemExit(1) from None


def run_local(n: int, fn, args: tuple = (), timeout_s: float = 120.0, group_timeout_s: float = 20.0,
              daemon: bool = True) -> list:
    """Results of ``fn(core, *args)`` on workers ``0..n-1``, in worker order.

    ``daemon=False`` lets the workers start processes of their own (a vLLM engine does); they are
    still terminated when the run ends or fails.

    Raises:
        ValueError: ``n < 1``.
        RuntimeError: a worker raised (its traceback is in the message) or the run timed out.
    """
    if n < 1:
        raise ValueError(f"run_local: n must be >= 1, got {n}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, store.port, group_timeout_s, fn, args, q), daemon=daemon)
             for i in range(n)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < n:
            try:
                i, status, val = q.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"run_local: no result within {timeout_s:.0f}s from workers "
                                   f"{sorted(set(range(n)) - set(results))}") from None
            if status == "error":
                raise RuntimeError(f"run_local: worker {i} failed: {val}")
            results[i] = torch.load(io.BytesIO(val), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [results[i] for i in range(n)]
