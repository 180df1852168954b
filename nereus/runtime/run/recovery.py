"""Recovering an adaptive run from lost workers (DESIGN.md §4.9): rollback points, fault injection, re-run steps.

:class:`RecoveryMixin` is the part of :class:`~nereus.runtime.run.adaptive.AdaptiveRun` that survives a
worker dying or hanging in the middle of anything. At every boundary each worker snapshots its state
(:meth:`~RecoveryMixin._mark`; the worker side is :mod:`nereus.runtime.worker.fault_tolerant`); a
:class:`~nereus.runtime.worker.failures.WorkerLost` from any call makes every survivor roll back to that
snapshot, the controller replans on the survivors (urgent path), and the live executor builds the target
from the intact units (:meth:`~RecoveryMixin._recover`); the step then re-runs from its start with the
same samples (:meth:`~RecoveryMixin._step`). Only a training model-stage that lost every replica falls
back to the last durable checkpoint (:func:`nereus.runtime.durable.driver_side.restart`); before the first
one exists, to step 0's initial state rebuilt from the seeds (``run/fresh_start.py``), or, past step 0,
the run ends with a one-line :class:`~nereus.runtime.run.fresh_start.NoCheckpoint`.
"""

from __future__ import annotations

import time

from nereus.controller.decisions import Keep
from nereus.controller.monitor import StepReport
from nereus.planner.notation import format_gpus, format_plan
from nereus.runtime.run import vllm_driver as vd
from nereus.runtime.run.fresh_start import (
    NoCheckpoint,
    has_checkpoint,
    initial_state_reproducible,
    restore_or_rebuild,
)
from nereus.runtime.run.relayout import train_stages
from nereus.runtime.transit.driver_side import TransitionExecutor
from nereus.runtime.transit.sharded import live_unsupported
from nereus.runtime.worker.failures import AllWorkersLost, WorkerFailure, WorkerLost
from nereus.spec.plan import Plan
from nereus.transition.emu import phi
from nereus.transition.estimate import estimate_transition

__all__ = ["RecoveryMixin"]


class RecoveryMixin:
    """Rollback, replanning around lost workers and re-running the step, for :class:`~nereus.runtime.run.adaptive.AdaptiveRun`
    (which supplies ``driver``, ``ctl``, ``planner``, ``calib``, ``job``, ``faults``, ``log``,
    ``events``, ``recoveries``, ``_announced``, ``_first_plan``, ``_legal``, ``job_at`` and the
    checkpointing methods)."""

    # ------------------------------------------------------------------ checkpoints and faults
    def _mark(self) -> None:
        """The rollback point of the next step or transition: every worker snapshots its state. A
        worker found lost here (e.g. its node went away between steps) is recovered from at once:
        the survivors' snapshots just taken are the rollback point, so no step is redone."""
        d = self.driver
        for _attempt in range(4):
            self._bnd = {"plan": Plan(candidates=tuple(d.cands.values())), "step_index": d.step_index,
                         "updates": d.updates, "lost_at": len(getattr(d.pool, "lost_ids", None) or [])}
            try:
                d._get([w.snapshot.remote() for w in d.workers if w is not None], "snapshot")
                return
            except WorkerLost as e:
                self._recover(e, d.step_index, "boundary")
        raise WorkerFailure("workers kept failing at a boundary; gave up after 4 attempts")

    def _inject(self, k: int, phase: str) -> None:
        """Arm the fault ``faults[k] = (point, worker, how)`` once, just before the ``phase``
        (``step``, ``transition`` or ``checkpoint``) whose calls contain its point."""
        f = self.faults.get(k)
        if not f or len(f) > 3:
            return
        point, worker, how = f
        want = {"transition_run": "transition", "dcp_save": "checkpoint"}.get(point, "step")
        w = self.driver.workers[worker] if worker < len(self.driver.workers) else None
        if want != phase or w is None:
            return
        self.faults[k] = (point, worker, how, "armed")
        self.driver._get([w.arm.options(concurrency_group="control").remote(point, how)], "arm a fault")
        self._log_armed(worker, how, point, f"the {phase} of step {k}")

    def _log_armed(self, worker: int, how: str, point: str, where: str) -> None:
        what = {"stop": "stopped (SIGSTOP)", "kill": "killed"}.get(how, f"slowed ({how.split(':', 1)[-1]}s asleep, "
                                                                     "answering heartbeats)")
        self.log(f"  [fault armed: worker {worker} will be {what} inside {point} during {where}]")

    def _inject_in_recovery(self, k: int) -> None:
        """Arm ``recovery_faults[k] = (point, worker, how)`` once, at the start of the first recovery in
        step ``k`` (a fault during a recovery: tests and ``bench_faults.py``)."""
        f = getattr(self, "recovery_faults", {}).get(k)
        if not f or len(f) > 3:
            return
        point, worker, how = f
        w = self.driver.workers[worker] if worker < len(self.driver.workers) else None
        if w is None:
            return
        self.recovery_faults[k] = (point, worker, how, "armed")
        self.driver._get([w.arm.options(concurrency_group="control").remote(point, how)], "arm a fault")
        self._log_armed(worker, how, point, f"the recovery in step {k}")

    def _set_progress_bound(self, measured_s: float = 0.0) -> None:
        """The pool's progress bound (``run/faults.py``, "Slow peers"): ``max(hang_timeout_s, 4 ×
        max(predicted step seconds, measured_s))``, the predicted ``l_step`` being the cost model's for
        the plan in effect (the controller's estimate). A compute call that times no op for that long
        is stalled: no single op of a step takes longer than the whole step. A checkpoint write's
        bound (``pool.phase_bounds_s``) is ``max(communicator timeout, 4 × the longest checkpoint so
        far)``."""
        predicted = float(getattr(getattr(self, "ctl", None) and self.ctl.plan, "l_step", 0.0) or 0.0)
        pool = self.driver.pool
        pool.progress_bound_s = max(self.hang_timeout_s, 4.0 * max(predicted, float(measured_s)))
        longest = max((float(c.get("seconds", 0.0)) for c in getattr(self, "checkpoints", [])), default=0.0)
        pool.phase_bounds_s = dict.fromkeys(("dcp_save", "dcp_wait"), max(pool.timeout_s, 4.0 * longest))

    def _step(self, k: int) -> dict:
        """Step ``k``, re-run from its start after a lost worker (same samples, same counters)."""
        d = self.driver
        for _attempt in range(4):
            self._mark()
            try:  # a worker may be lost in any call here (e.g. one dying in a background checkpoint write)
                d.reset_measurements()
                self._poll_save(k)
                self._inject(k, "step")
                m = d.step()
                self._set_progress_bound(m.get("seconds", 0.0))
                return m
            except WorkerFailure as fail:  # lost, or a communicator failure a lost worker explains
                e = self._classified(fail)
                if e is None:
                    raise
                self._recover(e, k, "step")
                k = d.step_index  # a restore from the durable checkpoint goes back further
        raise WorkerFailure(f"step {k}: workers kept failing; gave up after 4 attempts")

    def _classified(self, fail: WorkerFailure) -> WorkerLost | None:
        """A failure that is not a detected loss (a communicator error or timeout, a failed call),
        classified: the workers now dead or silent are killed and returned as a ``WorkerLost``
        (``faults.probe``); None when every worker answers (the failure is not a lost worker's)."""
        from nereus.runtime.run.faults import probe

        if isinstance(fail, WorkerLost):
            return fail
        pool = self.driver.pool
        dead, silent = probe(pool.workers, self.hang_timeout_s)
        if not dead and not silent:
            return None
        for i in dead + silent:
            pool.remove(i, force=True)
        lost = WorkerLost(f"{str(fail)[:200]}: worker(s) {sorted(dead + silent)} lost", sorted(dead + silent),
                          0.0, sorted(silent))
        lost.wait_s = None
        return lost

    def _recover(self, e: WorkerLost, k: int, when: str) -> None:
        """Recover from ``e`` (:meth:`_recover_once`); a fault during the recovery itself (a worker
        lost, or a communicator failure or timeout, classified by :meth:`_classified`) starts it over
        from the same boundary on the survivors; after two live attempts, or a failure no worker
        explains, it restores the last durable checkpoint.

        Raises:
            WorkerFailure: still failing after 4 attempts (the durable checkpoint is kept).
            AllWorkersLost: no worker is left (the durable checkpoint, if any, is kept; ``--resume`` continues).
            NoCheckpoint: the state must be restored but no checkpoint was written yet and the
                boundary is past step 0 (``run/fresh_start.py``).
        """
        force = False
        for attempt in range(4):
            try:
                self._recover_once(e, k, when if attempt == 0 else f"recovery (attempt {attempt + 1}) of the {when}",
                                   force_checkpoint=force)
                return
            except (NoCheckpoint, AllWorkersLost):  # nothing to restore or rebuild onto: no attempt can help
                raise
            except WorkerFailure as fail:
                again = self._classified(fail)
                if again is None:
                    self.log(f"  the recovery failed ({str(fail)[:160]}); no worker was lost: restoring the durable "
                             "checkpoint")
                    force = True
                    e = WorkerLost(str(fail)[:200], [], 0.0)
                    continue
                self.log(f"  lost worker(s) {format_gpus(again.lost)} during the recovery: recovering again")
                again.lost = sorted(set(again.lost) | set(e.lost))  # the event names every worker lost since
                again.hung = sorted(set(again.hung) | set(e.hung))
                again.slow = sorted(set(getattr(again, "slow", []) or []) | set(getattr(e, "slow", []) or []))
                e, force = again, force or attempt >= 1
        raise WorkerFailure(f"step {k}: the recovery kept failing; gave up after 4 attempts (the durable checkpoint "
                            f"of step {self.ckpt_step} is kept)")

    def _name_all_lost(self, e: WorkerLost) -> None:
        """Add to ``e.lost`` every worker the pool removed as lost since the boundary
        (``WorkerPool.lost_ids``), also those found by a wait whose ``WorkerLost`` was not raised here
        (the writers' wait of an abandoned checkpoint, ``durable/scheduling.py``): the recovery event
        names every worker lost (issue 30: bench_faults seed 9001 lost one unnamed)."""
        since = (getattr(self.driver.pool, "lost_ids", None) or [])[self._bnd.get("lost_at", 0):]
        e.lost = sorted(set(e.lost) | set(since))

    def _recover_once(self, e: WorkerLost, k: int, when: str, force_checkpoint: bool = False) -> None:
        """Roll back to the boundary, replan on the survivors and move state there live (module
        docstring); a training model-stage with no intact replica (or ``force_checkpoint``) restores
        the last durable checkpoint."""
        d, t0 = self.driver, time.perf_counter()
        if not e.lost:
            self.log(f"  recovering from a failure during the {when} of step {k} ({str(e)[:160]})")
        self._inject_in_recovery(k)
        self._name_all_lost(e)
        how = ("slow (no progress)" if getattr(e, "slow", None) else "hung") if e.hung else "died"
        waited = getattr(e, "wait_s", None)
        self.log(f"  lost worker(s) {format_gpus(e.lost)} during the {when} of step {k} ({how}; detected in "
                 f"{e.detect_s:.2f}s" + (f", its calls ended after {waited:.2f}s" if waited is not None else "")
                 + "): rolling back to the boundary")
        try:  # a save in flight: complete it if its writers survived (a restore may read it), else drop it
            self._complete_save(k)
        except WorkerLost as again:
            self.log(f"  lost worker(s) {format_gpus(again.lost)} too, while completing the checkpoint")
        alive = frozenset(i for i, w in enumerate(d.workers) if w is not None)
        if not alive:  # nothing to roll back onto; the durable checkpoint is intact on disk
            then = (f"the durable checkpoint of step {self.ckpt_step} is kept: start the run again with --resume to "
                    "continue from it" if has_checkpoint(self._ckpt_path()) else
                    "no checkpoint was written yet: start the run again from the beginning")
            raise AllWorkersLost(f"step {k}: every worker was lost (worker(s) {sorted(e.lost)}); nothing is left to "
                                 f"recover onto; {then}")
        bplan = self._bnd["plan"]
        d.set_plan(bplan)
        d.step_index, d.updates = self._bnd["step_index"], self._bnd["updates"]
        intact = [x.uid for c in bplan.candidates for x in phi(self.job, c) if set(x.gpus) <= alive]
        d._get([d.workers[i].restore.remote(intact) for i in sorted(alive)], "rollback")
        lost_train = [n for n in train_stages(d) if not any(u.startswith(f"{n}#") for u in intact)]
        usable = alive - self._announced  # workers announced to leave hold state but get none
        rep = StepReport(step=max(k - 1, 0), response_len=self.last_len, pool=usable, alive=alive)
        dec = self.ctl.observe(rep)
        target = None if isinstance(dec, Keep) else dec.plan
        if target is None or not target.gpus_used() <= usable:
            # the controller already saw this pool (e.g. a loss during the transition it chose):
            # plan on the survivors directly, then tell it with resume
            target = self._first_plan(usable)
        target = self._legal(d, target)
        keep = vd.stop_changed(d, bplan, target)  # --rollout vllm: engines of changed replicas stop, restart below
        self._name_all_lost(e)  # (and any lost while the save in flight was completed)
        ev = {"step": k, "when": "recovery", "kind": "recovery", "reason": str(e), "lost": e.lost,
              "detect_s": e.detect_s, "hung": e.hung, "slow": list(getattr(e, "slow", []) or []),
              "attempt": when, "wait_s": waited, "slow_in": list(getattr(e, "slow_in", []) or []),
              "released": getattr(e, "released", 0)}
        est = None
        if not lost_train and not force_checkpoint:
            try:
                est = estimate_transition(self.calib.apply(self.job_at(self.last_len)), bplan, target, alive,
                                          params=self.calib.params())
            except ValueError:
                est = None
        # a DAG the live executor cannot run (e.g. ZeRO-2/3 state, transit/sharded.py): the checkpoint
        # restart below holds the unsliced state (TransitionExecutor.execute would refuse it: ValueError)
        unsupported = (live_unsupported(est.dag, bplan, target) if est is not None and est.feasible and est.dag is not None
                       else None)
        if est is not None and est.feasible and not unsupported:
            rep = TransitionExecutor(d).execute(est, target, adopt=False)
            ev.update(source="live", transition=rep.to_dict(), steps_lost=0)
            self.log(f"  recovered live on workers {format_gpus(alive)}: {rep.summary()}; step {k} re-runs")
        else:
            why = (f"{', '.join(lost_train)} lost every replica" if lost_train else
                   "the live recovery failed" if force_checkpoint else unsupported or
                   (est.reason if est is not None else "no live path from the boundary plan"))
            d._get([d.workers[i].transition_end.remote("") for i in sorted(alive)], "drop units")
            if not has_checkpoint(self._ckpt_path()) and not initial_state_reproducible(self._bnd, self.resume):
                raise NoCheckpoint(f"worker(s) {sorted(e.lost)} lost before the first checkpoint was written; "
                                   + (f"the only copy of {', '.join(lost_train)} is gone" if lost_train else
                                      f"{why} and no checkpoint exists to restore"))
            info, source = restore_or_rebuild(self, target, why)  # the checkpoint, else step 0 (fresh_start.py)
            what = (f"restored the durable checkpoint of step {d.step_index}" if source == "checkpoint" else
                    "no checkpoint written yet: rebuilt every model-stage from its seed at step 0")
            lost = self._bnd["step_index"] - d.step_index
            ev.update(source=source, steps_lost=lost, seconds=info["seconds"])
            self.log(f"  {why}: {what} in {info['seconds']:.2f}s; steps lost: {lost}")
        vd.start_vllm_engines(d, keep)  # the target's vLLM engines (kept ones get the rolled-back weights)
        self.ctl.resume(self.planner.estimate(self.job_at(self.last_len), target, alive))
        ev["recovery_s"] = time.perf_counter() - t0
        ev["plan"] = format_plan(target)
        self.events.append(ev)
        self.recoveries.append(ev)
