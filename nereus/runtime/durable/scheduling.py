"""Durable checkpoints of an adaptive run: when they are taken, completed and swapped.

:class:`CheckpointingMixin` is the part of :class:`~nereus.runtime.run.adaptive.AdaptiveRun` that owns
the checkpoint directory: every save is written into a fresh slot of ``<checkpoint_dir>`` by the
workers (``durable.begin_save``, asynchronously unless ``checkpoint_sync``) and made ``current`` with
one rename only once every writer is done and its manifest is written (:meth:`_complete_save`,
``durable/store.py``); a writer lost mid-write, or a write that fails (disk full, permissions),
abandons that save with one line, and the previous complete checkpoint stays current. The run supplies ``driver``, ``log``, ``_inject``,
``_mark`` and ``_recover`` (fault injection, snapshots and recovery live in ``run/recovery.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from nereus.planner.notation import format_gpus
from nereus.runtime.durable import driver_side as durable
from nereus.runtime.durable import store
from nereus.runtime.durable.integrity import job_identity, verify_checkpoint
from nereus.runtime.durable.store import write_error
from nereus.runtime.worker.failures import WorkerFailure, WorkerLost

__all__ = ["CheckpointingMixin"]


class CheckpointingMixin:
    """Checkpoint scheduling of an adaptive run (module docstring)."""

    def _setup_checkpoints(self) -> None:
        """Make the checkpoint directory (a temporary one without ``checkpoint_dir``), check it can be
        written, remove what an interrupted save left (``store.cleanup``) and, with ``resume``, verify
        the current checkpoint against this job (``integrity.verify_checkpoint``).

        Raises:
            ValueError: one line: the directory cannot be written, or (``CheckpointRefused``) the
                checkpoint to resume from is missing, incomplete, corrupted or another job's.
        """
        if self.ckpt_dir is None:
            self.ckpt_dir = tempfile.mkdtemp(prefix="nereus-ckpt-")
        store.check_writable(self.ckpt_dir)
        store.cleanup(self.ckpt_dir)
        if self.resume:
            verify_checkpoint(store.current_dir(self.ckpt_dir), job_identity(self.spec, self.workload))

    def _save(self, force: bool = False, k: int = -1, sync: bool = False, attempt: int = 0) -> None:
        """A durable checkpoint of every model-stage at this boundary (``durable.begin_save``), written
        into ``<checkpoint_dir>/next`` and swapped with ``current`` only once complete
        (:meth:`_complete_save`; at once with ``checkpoint_sync``, else later, while training goes on).
        An earlier save still in flight is completed first. A worker lost while saving is recovered
        from (the checkpoint is then taken at the next boundary; the previous one stays valid), except
        the first one (``force``), taken again at once after the recovery (up to 4 attempts): until it
        exists, a lost model-stage can only go back to step 0 (``run/fresh_start.py``)."""
        if self.resume and force:
            return  # the checkpoint we resumed from is this boundary's
        nxt = store.new_slot(self.ckpt_dir, self.driver.step_index)
        began = False
        try:
            self._inject(k, "checkpoint")
            self._mark()
            self._complete_save(k)
            began = True
            background = not (self.ckpt_sync or force or sync)  # the first one is complete before step 0
            self._pending = p = durable.begin_save(self.driver, nxt, background=background)
            if not background:
                self._complete_save(k)
            else:
                self.log(f"  checkpoint: step {p.step_index}: {len(p.writers)} writers took their snapshots in "
                         f"{p.blocking_s:.2f}s; writing in the background")
        except WorkerLost as e:
            if began and self._pending is None:  # lost while it began: some writers may be writing
                self._abandon_save(durable.PendingSave(nxt, [], {"step_index": self.driver.step_index}, True, 0.0),
                                   "a worker was lost while it began")
            self._recover(e, k, "checkpoint save")
            if force and not self.checkpoints and attempt < 3 and self.driver.step_index == 0:
                self._save(force=True, k=k, attempt=attempt + 1)
            return
        except (WorkerFailure, OSError) as e:  # a write failed (disk full, permissions): the run goes on
            if self._pending is None:
                self._abandon_save(durable.PendingSave(nxt, [], {"step_index": self.driver.step_index}, True, 0.0),
                                   f"write failed: {write_error(e)}")

    def _complete_save(self, k: int = -1) -> None:
        """Complete the save in flight, if any: wait for its writers' background writes
        (``durable.finish_save``, a monitored wait: a writer that dies or hangs is detected), write
        ``driver.json`` and the manifest, then make it ``current`` with one rename (``store.commit``). If
        a writer is lost before its files are complete, or a write fails (disk full, permissions: one
        line in the log), the save is abandoned and ``current`` (the previous complete checkpoint)
        stays.

        Called before the next save, before a transition or a restore, at the start of a recovery
        and at the end of the run.

        Raises:
            WorkerLost: a worker was lost while waiting (after the save was completed, if its writers
                all survived, or abandoned); the caller recovers.
        """
        p, self._pending = self._pending, None
        if p is None:
            return
        d = self.driver
        gone = [w for w in p.writers if w >= len(d.workers) or d.workers[w] is None]
        if gone:
            self._abandon_save(p, f"writer(s) {format_gpus(gone)} lost before it was complete")
            return
        lost = None
        for _attempt in range(2):
            try:
                info = durable.finish_save(d, p)
                break
            except WorkerLost as e:
                lost = lost or e
                if set(e.lost) & set(p.writers):
                    self._abandon_save(p, f"writer(s) {format_gpus(sorted(set(e.lost) & set(p.writers)))} "
                                          "lost before it was complete")
                    raise
                # a worker that writes nothing was lost: the writers are still there, wait again
            except (OSError, WorkerFailure) as e:  # a write failed: keep the previous checkpoint
                self._abandon_save(p, f"write failed: {write_error(e)}")
                return
        else:
            self._abandon_save(p, "workers kept failing while it completed")
            raise lost
        try:
            store.commit(self.ckpt_dir, p.directory)  # one rename: current -> the new slot
        except OSError as e:
            self._abandon_save(p, f"could not make it current: {write_error(e)}")
            return
        self.ckpt_step = p.step_index
        self.checkpoints.append({"step": p.step_index, "background": info["background"],
                                 "blocking_s": info["blocking_s"], "snapshot_s": info["snapshot_s"],
                                 "background_s": info["background_s"], "wait_s": info["wait_s"],
                                 "seconds": info["seconds"], "written": info["written"], "state": info["state"]})
        if info["background"]:
            self.log(f"  checkpoint: step {p.step_index} complete, {info['written'] / 1e6:.1f} MB written by the "
                     f"workers to {self.ckpt_dir}: blocking {info['blocking_s']:.2f}s (snapshot), background "
                     f"{info['background_s']:.2f}s (write), waited {info['wait_s']:.2f}s for it")
        else:
            self.log(f"  checkpoint: step {p.step_index}, {info['written'] / 1e6:.1f} MB written by the workers to "
                     f"{self.ckpt_dir} in {info['seconds']:.2f}s (synchronous)")
        if lost is not None:
            raise lost

    def _poll_save(self, k: int) -> None:
        """At a boundary (after its snapshot): complete the save in flight if every writer has
        finished its files, so the newest checkpoint becomes current as early as possible."""
        p, d = self._pending, self.driver
        if p is None:
            return
        if all(w < len(d.workers) and d.workers[w] is not None for w in p.writers):
            busy = d._get([d.workers[w].dcp_busy.remote() for w in p.writers], "dcp save (poll)")
            if any(busy):
                return
        self._complete_save(k)

    def _complete_before(self, k: int, leaving) -> None:
        """Complete the save in flight before workers among its writers leave the pool, at a
        boundary of its own (a loss meanwhile is recovered from there)."""
        if self._pending is None or not set(leaving) & set(self._pending.writers):
            return
        self._mark()
        try:
            self._complete_save(k)
        except WorkerLost as e:
            self._recover(e, k, "checkpoint save")

    def _abandon_save(self, p: durable.PendingSave, why: str) -> None:
        """Drop a save that cannot complete: let every live worker's background write end (so no file
        lands in its slot later), then remove the slot. ``current`` is untouched."""
        d = self.driver
        live = [w for w in d.workers if w is not None]
        try:
            d._get([w.dcp_wait.remote(True) for w in live], "dcp save (abandoned)")
        except WorkerFailure:  # WorkerLost too: monitored_get raises it only after every other call ended
            pass
        shutil.rmtree(p.directory, ignore_errors=True)
        self.log(f"  checkpoint of step {p.meta.get('step_index')} abandoned ({why}); the checkpoint of step "
                 f"{self.ckpt_step} stays current")

    def _end_save(self) -> None:
        """Complete the last save before the run ends, at a boundary of its own (a loss recovers
        from there; a restore from the checkpoint re-runs the steps since)."""
        k = self.driver.step_index
        self._mark()
        try:
            self._complete_save(k)
        except WorkerLost as e:
            self._recover(e, k, "checkpoint save")

    def _ckpt_path(self) -> str:
        """The last complete durable checkpoint (``<checkpoint_dir>/current``, a link to its slot)."""
        return store.current_dir(self.ckpt_dir)

    def _drop_own_checkpoints(self, completed: bool) -> None:
        """At the end of a run without ``checkpoint_dir``: remove the temporary checkpoint directory
        when the run completed; when an error ended it, keep it (it is the only copy of the state
        since the last checkpoint) and say how to resume from it."""
        if not (self._own_ckpt and self.ckpt_dir):
            return
        if completed or not os.path.islink(store.current_dir(self.ckpt_dir)):
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            return
        self.log(f"the run ended early; its last checkpoint (step {self.ckpt_step}) is kept in {self.ckpt_dir}: "
                 f"continue with --checkpoint-dir {self.ckpt_dir} --resume")
