"""The checkpoint calls a worker answers (DESIGN.md §4.9): save its engines' own shards, wait for a background
save, load the pieces of its new shards from a checkpoint written in any layout.

:class:`CheckpointCallsMixin` is the part of :class:`~nereus.runtime.worker.core.WorkerCore` the driver's
checkpoint code (:mod:`nereus.runtime.durable.driver_side`) calls; the per-engine reading and writing is in
:mod:`nereus.runtime.durable.worker_side`.
"""

from __future__ import annotations

import os

__all__ = ["CheckpointCallsMixin"]


class CheckpointCallsMixin:
    """``dcp_save`` / ``dcp_busy`` / ``dcp_wait`` / ``dcp_load`` of a worker (it supplies ``id``, ``engines``,
    ``pools``, ``meter``, ``timeout_s``, ``_saving`` and ``_waited``)."""

    # ------------------------------------------------------------------ checkpoint/restart (durable.py)
    def dcp_save(self, model_stages, directory: str, background: bool = False) -> dict:
        """Write this worker's shards of ``model_stages`` with DCP, each under
        ``<directory>/<model_stage>/rank-<worker>`` (``durable.worker_side.save_engine``); returns byte counts.
        ``model_stages`` is a list (DP replica 0 writes) or ``{model_stage: replica}``.

        With ``background``: copy the shards and counters into memory of the save's own and return
        (``durable.worker_side.save_engine_async``); the files are written in a background thread while this
        worker goes on (training may change its tensors in place). :meth:`dcp_wait` waits for them.
        A background save still in flight is awaited first.
        """
        return self._dcp_save(model_stages, directory, background, None)

    def _dcp_save(self, model_stages, directory: str, background: bool, hook) -> dict:
        from nereus.runtime.durable.worker_side import save_engine, save_engine_async

        self.dcp_wait(ignore_errors=True)  # one save in flight per worker
        self._waited = None
        replica = model_stages if isinstance(model_stages, dict) else dict.fromkeys(model_stages, 0)
        out = {"written": 0, "state": 0, "seconds": 0.0, "snapshot_s": 0.0, "write_s": 0.0}
        pending = []
        for ms, d in replica.items():
            e = self.engines.get(ms)
            if e is not None:
                self.pools.activate(self.engines, {ms})
            if e is None or e.ctx.d != d:
                if e is not None and hasattr(e, "join_checkpoint"):
                    e.join_checkpoint()  # ZeRO: the DP all-gather the writing replica runs
                continue
            write_hook, hook = hook, None  # a fault fires in the first write only
            path = os.path.join(directory, ms, f"rank-{self.id}")
            with self.meter.stage(ms):
                if background:
                    h = save_engine_async(e, path, write_hook)
                    pending.append(h)
                    out["state"] += h["state"]
                    out["snapshot_s"] += h["snapshot_s"]
                    out["seconds"] += h["snapshot_s"]
                else:
                    r = save_engine(e, path, write_hook)
                    for k in out:
                        out[k] += r[k]
        self._saving = pending
        return out

    def dcp_busy(self) -> bool:
        """Whether a background save of this worker is still writing (:meth:`dcp_save`)."""
        return any(not h["future"].done() for h in getattr(self, "_saving", []))

    def dcp_wait(self, ignore_errors: bool = False) -> dict:
        """Wait for this worker's background save (:meth:`dcp_save` with ``background``), if any.
        Asked again before the next save, it answers the same (a driver whose wait was cut short by
        another worker's loss asks again).

        Returns:
            ``{"written", "state", "snapshot_s", "write_s"}`` (``write_s``: the background write, from
            the end of the snapshot until the last file of this worker was written).

        Raises:
            RuntimeError: a write failed (unless ``ignore_errors``: the files are then left as they are,
                and the caller discards the checkpoint).
        """
        from nereus.runtime.durable.worker_side import wait_engine_save

        pending, self._saving = getattr(self, "_saving", []), []
        if pending:
            out = {"written": 0, "state": 0, "snapshot_s": 0.0, "write_s": 0.0}
            err = None
            for h in pending:
                try:
                    r = wait_engine_save(h, self.timeout_s)
                except (RuntimeError, TimeoutError) as e:
                    err = err or e
                    continue
                out["written"] += r["written"]
                out["state"] += r["state"]
                out["snapshot_s"] += r["snapshot_s"]
                out["write_s"] = max(out["write_s"], r["write_s"])  # the stages' writes run side by side
            self._waited = (out, err)
        out, err = getattr(self, "_waited", None) or ({"written": 0, "state": 0, "snapshot_s": 0.0, "write_s": 0.0},
                                                      None)
        if err is not None and not ignore_errors:
            raise RuntimeError(f"worker {self.id}: {err}")
        return dict(out)

    def dcp_load(self, model_stages: list[str], directory: str) -> dict:
        """Fill this worker's engines of ``model_stages`` from ``<directory>/<model_stage>`` with DCP
        (``durable.worker_side.load_engine``: only the pieces of its own shard); returns byte counts."""
        from nereus.runtime.durable.worker_side import load_engine

        out = {"read": 0, "loaded": 0, "seconds": 0.0}
        for ms in model_stages:
            e = self.engines.get(ms)
            if e is None:
                continue
            self.pools.activate(self.engines, {ms})
            with self.meter.stage(ms):
                r = load_engine(e, os.path.join(directory, ms))
            for k in out:
                out[k] += r[k]
        return out
