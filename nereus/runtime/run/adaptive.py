"""The adaptive RL run (``nereus run --adaptive``): the controller of ``nereus simulate`` drives the
real runtime on local Ray workers (DESIGN.md §3: one controller, two drivers).

At every safe boundary (the end of a synchronous step) the run hands the controller the step's
:class:`~nereus.controller.monitor.StepReport` (``RLDriver.step_report``: op-class seconds such as
``gemm``, ``attention``, ``allreduce@gloo``, which are also the cost model's classes for the ``cpu``
device below) and applies its decision:

* ``Keep``: nothing;
* ``Transition(plan)``: a live transition (``transit/driver_side.py``): the transition planner's DAG and
  schedule (``nereus.transition.estimate_transition`` on the calibrated link bandwidth and
  communicator setup) run on the workers that hold the state, Split/Merge/Extend/Destroy (and
  Offload/Restore/Load where the planner needs them), each printed with its bytes and predicted and
  measured seconds; the measurements calibrate the next estimates (``transition/calibrate.py``).
  ZeRO-1/2/3 slices, host-pool copies and colocated state move live too (``transit/flat.py``,
  ``transit/regroup.py``, ``transit/residency.py``); a DAG the live executor cannot run (``transit/sharded.py``) goes the
  restart path below, and the admission charges that restart (``run/restart_cost.py``);
* ``Restart(plan)``, or a change whose DAG is infeasible or whose training state lost every
  replica: restore the last durable checkpoint (``durable/driver_side.py``: each worker writes and reads its own
  shards with ``torch.distributed.checkpoint``; taken first when a full copy is alive, so nothing is
  lost then), on ``plan``, or, when nothing fits (``plan`` None), on a time-shared fallback plan
  (``plans.shared_plan``) that the controller is told about with ``resume``. No state tensor passes
  through the driver on any path.

Workers that die or hang in the middle of anything are detected and recovered from (``run/recovery.py``, ``run/faults.py``):
roll back to the boundary's per-worker snapshot, replan on the survivors, move state live, re-run the
step with the same samples.

Curriculum (``--digits-schedule STEP:D``): from step ``STEP`` the task uses ``D``-digit problems, so
prompts and responses get longer; the controller sees the response length drift.

Pool changes (``--pool-schedule STEP:-N,STEP:+N``) happen just before step ``STEP`` (0-based): the
highest-numbered live workers leave (their engines and any state only they held are gone), or new
workers join with new ids. The controller sees the change through ``StepReport.pool`` at once. With
``notice`` a departure is announced first (as AWS's two-minute spot notice or a scheduler's drain):
the controller replans without the leaving workers and the transition reads their state before
they go.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.controller.controller import ControllerConfig
from nereus.controller.decisions import Keep, Transition, TransitionCost
from nereus.controller.monitor import StepReport
from nereus.controller.planning import CostModelPlanner, same_plan
from nereus.controller.transition_cost import bandwidth_estimate
from nereus.planner.notation import format_plan
from nereus.runtime.durable import driver_side as durable
from nereus.runtime.durable.scheduling import CheckpointingMixin
from nereus.runtime.rl.task import DigitTask
from nereus.runtime.run import vllm_driver as vd
from nereus.runtime.run.config import RLConfig
from nereus.runtime.run.device_model import cpu_gpu_spec, runtime_job, worker_cores
from nereus.runtime.run.driver import RLDriver
from nereus.runtime.run.fresh_start import RESTART_FROM, restore_or_rebuild
from nereus.runtime.run.plans import format_workers, plan_diff, shared_plan
from nereus.runtime.run.pool import WorkerPool
from nereus.runtime.run.recovery import RecoveryMixin
from nereus.runtime.run.relayout import intact_replica, train_stages
from nereus.runtime.run.restart_cost import restart_charge
from nereus.runtime.run.teardown import end_run, is_interrupt
from nereus.runtime.run.vllm_warm import make_controller
from nereus.runtime.transit.driver_side import TransitionExecutor
from nereus.runtime.transit.sharded import live_unsupported, schedule_fault
from nereus.runtime.worker.failures import WorkerFailure, WorkerLost
from nereus.spec.framework import DEFAULT_FRAMEWORK
from nereus.spec.hardware import GIB
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.spec.plan import Plan
from nereus.spec.workload import WorkloadSpec
from nereus.transition.calibrate import TransitionCalibration
from nereus.transition.estimate import estimate_transition

__all__ = ["AdaptiveRun"]

class AdaptiveRun(RecoveryMixin, CheckpointingMixin):
    """The controller (``Controller`` over ``CostModelPlanner``) driving an :class:`RLDriver`.

    Args:
        spec, workload, task, cfg: as for :class:`RLDriver`; the cost model sees ``workload`` with
            fp32 bytes per parameter and KV element (what the CPU runtime holds).
        num_workers: workers at start.
        schedule: :func:`parse_pool_schedule` output.
        digits: :func:`parse_digits_schedule` output (a curriculum: longer problems, longer
            responses from the given steps on).
        notice: departures are announced at the boundary before they happen (a spot reclaim
            notice, a scheduler's drain): the controller plans without the leaving workers while
            their state can still be read, then they leave. Without it they vanish at once.
        checkpoint_dir: durable checkpoints (``durable/driver_side.py``: every worker writes its own shards with
            ``torch.distributed.checkpoint``) go here; None: a temporary directory removed at the end.
        checkpoint_every: steps between durable checkpoints (one is also taken before step 0).
        checkpoint_sync: write each checkpoint before the run goes on (the step waits for every
            writer's files). Default: asynchronous: at the boundary each writer copies its shards and
            counters into memory of its own and returns, the files are written in its background
            thread, and the run completes the checkpoint later (:meth:`_complete_save`).
        hang_timeout_s: seconds a worker may leave a heartbeat unanswered (``run/faults.py``).
        faults: ``{step: (point, worker, how)}`` injected faults (tests and ``bench_faults.py``):
            worker ``worker`` dies (``how="kill"``) or hangs (``"stop"``, SIGSTOP) inside its next
            call of ``point`` (``worker.fault_tolerant.FAULT_POINTS``) in step ``step``, the transition after it, or
            the checkpoint save after it.
        resume: continue from the durable checkpoint in ``checkpoint_dir`` (its step index, update
            counter and state, in this run's first plan).
        address: attach to this Ray cluster; its nodes become the planner's nodes (workers spread
            evenly, node by node), so losing a node takes all of its workers.
        memory_bytes: per-worker memory budget of the cost model.
        gamma: the controller's payback margin.
        log: a ``print``-like callable for the per-step lines (None: silent).
    """

    def __init__(self, spec: ModelSpec, workload: WorkloadSpec, task: DigitTask, num_workers: int,
                 cfg: RLConfig | None = None, schedule: dict[int, int] | None = None,
                 memory_bytes: int = 2 * GIB, gamma: float = 0.5, log=None, measure: bool = True,
                 digits: dict[int, int] | None = None, notice: bool = False, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 5, hang_timeout_s: float = 10.0, faults: dict | None = None,
                 resume: bool = False, address: str | None = None, checkpoint_sync: bool = False,
                 framework: str = DEFAULT_FRAMEWORK) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 step, got {checkpoint_every}")
        self.schedule = dict(schedule or {})
        self.digits = dict(digits or {})
        self.notice = bool(notice)
        self.ckpt_dir, self.ckpt_every, self._own_ckpt = checkpoint_dir, int(checkpoint_every), checkpoint_dir is None
        self.hang_timeout_s, self.faults, self.resume = float(hang_timeout_s), dict(faults or {}), bool(resume)
        self.address = address
        self.before_step = None  # optional callable(step) run at each boundary before the step (tests)
        self.stop_before = None  # optional callable(step) -> bool: end the run before that step (tests)
        self.recovery_faults: dict = {}  # {step: (point, worker, how)}: armed during that step's recovery
        self.on_end = None  # optional callable(driver) run after the last step, before the workers stop
        self.recoveries: list[dict] = []
        self._announced: set[int] = set()
        self.final_state: dict | None = None  # with keep_final: the training model-stages' state at the end
        self.keep_final = False  # True: the training model-stages' state kept; "all": frozen ones too
        self.calib = TransitionCalibration(cores=worker_cores())  # CPU workers share the cores
        self.max_workers = num_workers + sum(max(v, 0) for v in self.schedule.values())
        self.num_workers, self.log = num_workers, log or (lambda *a, **k: None)
        gpu = cpu_gpu_spec(memory_bytes, measure)
        self.spec, self.workload, self.task, self.cfg = spec, workload, task, cfg or RLConfig()
        self.framework = framework  # the plan space (nereus.spec.framework preset name)
        self.job = runtime_job(spec, workload, self.max_workers, gpu, precision=self.cfg.precision, framework=framework)
        self.planner = CostModelPlanner()
        self.gamma, self.last_len = gamma, float(workload.response_len)
        self.events: list[dict] = []
        self.ckpt_step = 0
        self.ckpt_sync = bool(checkpoint_sync)
        self._pending: durable.PendingSave | None = None  # an asynchronous save not yet complete
        self.checkpoints: list[dict] = []  # every completed checkpoint: step, blocking/background seconds, bytes

    def make_driver(self, spec, workload, plan, task, num_workers, cfg) -> RLDriver:
        """The RL driver the run steps (subclasses return another, e.g. the asynchronous one)."""
        return RLDriver(spec, workload, plan, task, num_workers, cfg)

    # ------------------------------------------------------------------ plans
    def _legal(self, driver: RLDriver, plan: Plan) -> Plan:
        """``plan`` with each candidate's dp lowered (dropping its last replicas) until the runtime's
        batch rules hold (e.g. dp must divide the prompts; the planner may pick dp=3 for 8 prompts);
        with ``--rollout vllm`` actor.generate's PP folded into TP or DP first (``vllm_driver.vllm_legal``)."""
        out = []
        for c in vd.vllm_legal(driver, plan).candidates:
            ms = next(m for m in driver.wf.model_stages if m.name == c.model_stage)
            for dp in range(c.dp, 0, -1):
                b = c.micro_batch or self.workload.micro_batch_size
                a = self.workload.mini_batch_size // (dp * b) if ms.trainable else c.grad_accum
                cand = replace(c, dp=dp, gpus=c.gpus[:c.tp * c.pp * dp], grad_accum=a)
                try:
                    driver._check_batches(c.model_stage, ms.stage, cand)
                    break
                except ValueError:
                    continue
            out.append(cand)
        return replace(plan, candidates=tuple(out))

    def _first_plan(self, pool: frozenset) -> Plan:
        try:
            plan = self.planner.plan(self.job, pool, None, False)
        except ValueError as e:
            self.log(f"planner: nothing fits {len(pool)} workers ({str(e)[:160]}); time-sharing them")
            return shared_plan(self.workload, pool, self.workload.micro_batch_size)
        return plan

    # ------------------------------------------------------------------ the run
    def run(self, steps: int, pool: WorkerPool | None = None) -> list[dict]:
        """Run ``steps`` RL steps; returns per-step metrics with the decision of each boundary.

        Raises:
            ValueError: ``steps`` < 1.
            WorkerFailure: a worker died during a step, or a restart was needed before the first
                checkpoint.
        """
        import ray

        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        own = pool is None
        if own:
            if not ray.is_initialized() and not self.address:
                ray.init(address="local", num_cpus=self.max_workers, include_dashboard=False,
                         log_to_driver=False)
            pool = WorkerPool(self.num_workers, self.cfg.timeout_s, self.hang_timeout_s, self.address).start()
        if pool.num_nodes > 1:  # the planner sees the cluster's nodes (a node loss takes all its workers)
            self.job = runtime_job(self.spec, self.workload, self.max_workers, self.job.cluster.gpu, pool.num_nodes,
                                   precision=self.cfg.precision, framework=self.framework)
        alive = frozenset(i for i, w in enumerate(pool.workers) if w is not None)
        plan = self._first_plan(alive)
        driver = self.make_driver(self.spec, self.workload, shared_plan(self.workload, alive), self.task,
                                  len(pool.workers), self.cfg)
        plan = self._legal(driver, plan)
        driver.set_plan(plan)
        driver.start(pool)
        self.driver = driver
        self.ctl = make_controller(self, self.job, self.planner.estimate(self.job_at(self.last_len), plan, alive),
                                   self.planner, transition_cost=self._transition_cost,
                                   config=ControllerConfig(gamma=self.gamma))  # vLLM: warms rejected targets
        self.log("plan:\n" + format_plan(plan, indent="  "))
        self._set_progress_bound()
        history: list[dict] = []
        self._setup_checkpoints()
        ok = stop = False
        try:
            if self.resume:
                durable.restart(driver, self._ckpt_path(), Plan(candidates=tuple(driver.cands.values())))
                self.log(f"resumed from {self.ckpt_dir} at step {driver.step_index} ({driver.updates} updates); "
                         f"running {steps} more steps, to step {driver.step_index + steps}")
            end = driver.step_index + steps
            self._save(force=True)
            done: set[int] = set()  # pool and curriculum changes already applied (a restored step re-runs)
            while driver.step_index < end:
                k = driver.step_index
                if self.before_step is not None:
                    self.before_step(k)
                if self.stop_before is not None and self.stop_before(k):
                    break  # a scenario that ends on an event (tests)
                if k in self.digits and ("digits", k) not in done:
                    self._set_digits(self.digits[k], k)
                    done.add(("digits", k))
                if self.schedule.get(k) and ("pool", k) not in done:
                    done.add(("pool", k))
                    self._pool_change(pool, k)
                    if driver.step_index != k:  # restored from an earlier checkpoint: re-run from there
                        continue
                m = self._step(k)
                self.last_len = max(m["response_len"], 1.0)
                m["pool"] = sum(1 for w in driver.workers if w is not None)
                m["workers_used"] = len(Plan(candidates=tuple(driver.cands.values())).gpus_used())
                dec = self.ctl.observe(driver.step_report(m))
                self.log(f"step {k}: reward {m['reward']:.3f}  response {m['response_len']:.1f} tokens  "
                         f"{m['seconds']:.2f}s  updates {driver.updates}  decision: {dec.kind} ({dec.reason})")
                m["decision"] = self._apply(dec, k, "after step")
                m["update_count"] = driver.updates
                if (k + 1) % self.ckpt_every == 0:
                    self._save(k=k)
                history.append(m)
                if driver.step_index >= end and self._pending is not None:
                    self._end_save()  # the last checkpoint completes before the run ends
                if driver.step_index >= end and not self._own_ckpt and self.ckpt_step != driver.step_index:
                    self._save(k=driver.step_index - 1, sync=True)  # a final checkpoint at the end of the run
            if self.keep_final:  # for checks: gathered into the driver once, at the end
                stages = driver.layouts if self.keep_final == "all" else train_stages(driver)  # "all": frozen too
                self.final_state = {n: driver.gather_logical_state(n) for n in stages}
            if self.on_end is not None:
                self.on_end(driver)
            ok = True
        except BaseException as e:
            stop = is_interrupt(e)  # Ctrl-C / SIGTERM: the clean-up's waits are bounded (run/teardown.py)
            raise
        finally:
            end_run(self, driver, pool, own, ok, interrupted=stop)
        return history

    def _pool_change(self, pool: WorkerPool, k: int) -> None:
        leaving = self._leaving(pool, self.schedule[k]) if self.notice else []
        if leaving:  # announced: plan without them while their state can still be read
            self.log(f"before step {k}: {format_workers(leaving)} announced to leave")
            live = frozenset(i for i, w in enumerate(pool.workers) if w is not None)
            rep = StepReport(step=max(k - 1, 0), response_len=self.last_len, pool=live - set(leaving), alive=live)
            self._announced = set(leaving)
            try:
                self._apply(self.ctl.observe(rep), k, "pool change")
            finally:
                self._announced = set()
            self._complete_before(k, leaving)  # the leavers' background writes complete before they go
            self._change_pool(pool, self.schedule[k], k, gone=leaving)  # the announced ones, not others
        else:
            self._complete_before(k, self._leaving(pool, self.schedule[k]))
            rep = StepReport(step=max(k - 1, 0), response_len=self.last_len,
                             pool=self._change_pool(pool, self.schedule[k], k))
            self._apply(self.ctl.observe(rep), k, "pool change")

    def job_at(self, response_len: float) -> JobSpec:
        return self.job.with_workload(self.job.workload.with_response_len(max(1, int(round(response_len)))))

    def _transition_cost(self, job: JobSpec, current: Plan, target: Plan, pool=None) -> TransitionCost:
        """``L_tran`` for admission: the transition DAG's makespan on the calibrated link bandwidth
        and communicator setup (no rollout-engine start: the runtime's engines take milliseconds);
        bytes over bandwidth when the current plan is the time-shared fallback, which the DAG
        planner does not accept (two model-stages of one stage on one worker)."""
        try:
            e = estimate_transition(self.calib.apply(job), current, target, pool, params=self.calib.params())
        except ValueError:
            return bandwidth_estimate(job, current, target, pool)
        why = live_unsupported(e.dag, current, target) if e.feasible and e.dag is not None else None
        if why:  # run through the durable checkpoint (_live): its cost is what admission charges
            return restart_charge(self, e, why)
        return TransitionCost(float(e.l_tran) + vd.start_term(self, current, target, float(e.l_tran)), bool(e.feasible),
                              float(e.bytes_moved), "dag", e.reason)  # + vLLM's engine start not hidden by the DAG

    def _set_digits(self, digits: int, k: int) -> None:
        """Switch the task to ``digits``-digit problems before step ``k`` (longer prompts and responses)."""
        d = self.driver
        d.task = DigitTask(d.task.kind, digits, d.task.seed)
        d.R = self.cfg.max_new_tokens or d.task.target_len
        self.log(f"before step {k}: task now {digits}-digit problems (responses up to {d.R} tokens)")

    @staticmethod
    def _leaving(pool: WorkerPool, delta: int) -> list[int]:
        """The workers a change of ``delta`` removes: the highest-numbered live ones (one stays)."""
        if delta >= 0:
            return []
        live = sorted(i for i, w in enumerate(pool.workers) if w is not None)
        return live[delta:] if -delta < len(live) else live[1:]

    def _change_pool(self, pool: WorkerPool, delta: int, k: int, gone: list[int] | None = None) -> frozenset:
        """Apply a scheduled change: ``gone`` (default: the highest-numbered live workers) leave, or
        ``delta`` new workers join; returns the live ids."""
        if delta < 0:
            gone = [i for i in (gone if gone is not None else self._leaving(pool, delta))
                    if pool.workers[i] is not None]  # an announced leaver may have died already
            for i in gone:
                pool.remove(i)
            self.log(f"before step {k}: {format_workers(gone)} left")
        else:
            new = pool.add(delta)
            self.driver.num_workers = len(pool.workers)
            self.log(f"before step {k}: {format_workers(new)} joined")
        return frozenset(i for i, w in enumerate(pool.workers) if w is not None)

    def _apply(self, dec, k: int, when: str) -> dict:
        """Apply a decision at a safe boundary; returns what happened (also kept in ``events``).

        While every training model-stage has an intact replica the change runs live on the workers
        (``transit/driver_side.py``): only the shards that must move, moved directly between workers. When a
        training model-stage lost every replica, or no live DAG exists (e.g. from the time-shared
        fallback plan), the run restarts from the last durable checkpoint (``durable/``; taken
        first when every replica 0 is alive, so nothing is lost then).
        """
        d = self.driver
        ev = {"step": k, "when": when, "kind": dec.kind, "reason": dec.reason}
        if when == "pool change":
            self.log(f"  decision: {dec.kind} ({dec.reason})")
        if isinstance(dec, Keep):
            return ev
        current = Plan(candidates=tuple(d.cands.values()))
        alive = frozenset(i for i, w in enumerate(d.workers) if w is not None)
        usable = alive - self._announced  # a worker announced to leave gets no state
        target = dec.plan if dec.plan is not None else shared_plan(self.workload, usable,
                                                                   self.workload.micro_batch_size)
        asked, target = target, self._legal(d, target)
        if isinstance(dec, Transition) and same_plan(target, current):
            # the target, made legal for the runtime (dp, vLLM's PP), is the current plan: nothing moves
            self.ctl.resume(self.planner.estimate(self.job_at(self.last_len), current, alive))
            self.log(f"  no transition: the target made legal for the runtime is the current plan ({plan_diff(asked, current)})")
            ev.update(source="unchanged")
            return ev
        intact = all(intact_replica(d, n) is not None for n in train_stages(d))
        if intact:
            try:
                report, why = self._live(current, target, alive, k)
            except WorkerFailure as fail:  # a worker lost during the transition: roll back, replan, go on
                e = self._classified(fail)
                if e is None:
                    raise
                self._recover(e, k, "transition")
                ev.update(source="recovered")
                self.events.append(ev)
                return ev
            if report is not None:  # the controller holds the plan the driver runs (a ZeRO group's rank order aligned)
                target = Plan(candidates=tuple(d.cands[c.model_stage] for c in target.candidates))
                self.ctl.resume(self.planner.estimate(self.job_at(self.last_len), target, alive))
                ev.update(source="live", seconds=report.seconds, transition=report.to_dict(),
                          plan=format_plan(target))
                self.log(f"  live transition ({when}): {report.summary()}")
                for r in report.primitives:
                    moved = f"{r.bytes_received / 1e6:7.3f} MB" if r.bytes_received else "      -   "
                    self.log(f"    {r.pid:34s} {moved}  predicted {r.predicted_s:6.3f}s  measured {r.measured_s:6.3f}s")
                self.log("  plan:\n" + format_plan(target, indent="    "))
                self.events.append(ev)
                return ev
            self.log(f"  no live transition: {why}; restarting from the durable checkpoint")
            try:  # a full copy is alive: checkpoint it now and lose nothing, if every replica 0 is here
                self._save()
            except ValueError:
                pass
        try:  # the restore reads the last complete checkpoint: complete the one in flight first
            self._complete_save(k)
        except WorkerLost as e:
            self._recover(e, k, "checkpoint save")
            ev.update(source="recovered")
            self.events.append(ev)
            return ev
        before = d.step_index
        d._get([w.transition_end.remote("") for w in d.workers if w is not None], "drop units")
        vd.stop_vllm_engines(d)  # --rollout vllm: the engines restart in the target layout after the load
        info, source = restore_or_rebuild(self, target, "a restart was needed", live_state=intact)  # fresh_start.py
        if vd.start_vllm_engines(d):
            self.log(f"  vLLM engines restarted: start {max(d.vllm_info['start_s']):.1f}s")
        self.ctl.resume(self.planner.estimate(self.job_at(self.last_len), target, alive))
        ev.update(source=source, seconds=info["seconds"], steps_lost=before - d.step_index, plan=format_plan(target))
        if dec.plan is None:
            self.log("  restart: the planner found no plan; time-sharing the live workers")
        self.log(f"  restart ({when}) from {RESTART_FROM[source]} of step {d.step_index} in {info['seconds']:.2f}s, "
                 f"steps lost: {before - d.step_index}")
        self.log("  plan:\n" + format_plan(target, indent="    "))
        self.events.append(ev)
        return ev

    def _live(self, current: Plan, target: Plan, alive: frozenset, k: int = -1):
        """Plan the transition DAG and execute it live; ``(report, None)`` or ``(None, why not)``.

        Raises:
            WorkerLost: a worker died or hung during the transition (the caller recovers).
        """
        job = self.calib.apply(self.job_at(self.last_len))
        try:
            est = estimate_transition(job, current, target, alive, params=self.calib.params())
        except ValueError as e:  # e.g. the current plan is the time-shared fallback
            return None, str(e)
        if not est.feasible:
            return None, est.reason
        why = live_unsupported(est.dag, current, target) or schedule_fault(est)  # e.g. ZeRO-1 <-> ZeRO-3
        if why:
            return None, why
        self._mark()
        self._complete_save(k)  # the transition changes the workers: the save in flight completes first
        self._inject(k, "transition")
        restart = vd.begin_relayout(self, current, target)  # vLLM: the old engines stop, new ones start after
        report = TransitionExecutor(self.driver).execute(est, target)
        self.calib.observe(report.primitives)
        if restart is not None:
            report.engine_start = vd.finish_relayout(self, restart, report)
        return report, None
