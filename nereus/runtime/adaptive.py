"""The adaptive RL run (``nereus run --adaptive``): the controller of ``nereus simulate`` drives the
real runtime on local Ray workers (DESIGN.md §3: one controller, two drivers).

At every safe boundary (the end of a synchronous step) the run hands the controller the step's
:class:`~nereus.controller.monitor.StepReport` (``RLDriver.step_report``: op-class seconds such as
``gemm``, ``attention``, ``allreduce@gloo``, which are also the cost model's classes for the ``cpu``
device below) and applies its decision:

* ``Keep``: nothing;
* ``Transition(plan)``: a state-preserving re-layout (``relayout.py``; a centralized re-shard through
  the driver, not yet the Split/Merge/Extend/Destroy executor);
* ``Restart(plan)``: rebuild from the in-memory checkpoint taken at the previous safe boundary
  (``relayout.checkpoint``), on ``plan``, or, when nothing fits (``plan`` None), on a time-shared
  fallback plan (``plans.shared_plan``) that the controller is told about with ``resume``.

Pool changes (``--pool-schedule STEP:-N,STEP:+N``) happen just before step ``STEP`` (0-based): the
highest-numbered live workers leave (their engines and any state only they held are gone), or new
workers join with new ids. The controller sees the change through ``StepReport.pool`` at once.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from nereus.controller import Controller, ControllerConfig, CostModelPlanner, StepReport
from nereus.controller.decisions import Keep, Restart, Transition
from nereus.controller.planning import same_plan
from nereus.controller.transition_cost import bandwidth_estimate, estimate_transition_cost
from nereus.planner.plan import Plan
from nereus.runtime.driver import RLConfig, RLDriver
from nereus.runtime.plans import shared_plan
from nereus.runtime.pool import WorkerFailure, WorkerPool
from nereus.runtime.relayout import checkpoint, intact_replica, relayout, train_stages
from nereus.runtime.task import DigitTask
from nereus.spec.hardware import GIB, GPU_PRESETS, ClusterSpec, GPUSpec
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["AdaptiveRun", "runtime_job", "cpu_gpu_spec", "measure_matmul_flops", "parse_pool_schedule", "plan_summary"]


def measure_matmul_flops(n: int = 256, reps: int = 5) -> float:
    """FLOP/s of an ``n×n`` float32 matmul on one thread (best of ``reps``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / max(best, 1e-9)


def cpu_gpu_spec(memory_bytes: int = 2 * GIB, measure: bool = True) -> GPUSpec:
    """The ``cpu`` preset with ``memory_bytes`` as the per-worker budget and, when ``measure``, the
    peak FLOP/s of a float32 matmul measured now (the preset's 20 GFLOP/s is an assumption)."""
    base = GPU_PRESETS["cpu"]
    flops = measure_matmul_flops() if measure else base.peak_flops
    src = base.source + (f"; peak_flops measured at start-up: {flops / 1e9:.1f} GFLOP/s (256x256 fp32 "
                         "matmul, 1 thread)" if measure else "")
    return replace(base, peak_flops=flops, memory_bytes=int(memory_bytes), source=src)


def runtime_job(spec: ModelSpec, workload: WorkloadSpec, num_workers: int, gpu: GPUSpec | None = None) -> JobSpec:
    """The job as the cost and transition planners see this runtime: ``num_workers`` devices of
    ``gpu`` (default: the ``cpu`` preset) on one node, and the bytes the runtime really holds: fp32
    weights and KV cache (4 B), and for training only Adam's two moments on top (8 B): the fp32
    weights are Adam's master weights, so there is no separate master copy (the GPU default of
    ``WorkloadSpec`` counts bf16 weights plus a 12 B fp32 master and moments)."""
    gpu = gpu or GPU_PRESETS["cpu"]
    return JobSpec(spec, ClusterSpec(gpu, 1, num_workers),
                   replace(workload, param_bytes=4, kv_bytes=4, optimizer_bytes=8))


def parse_pool_schedule(text: str | None) -> dict[int, int]:
    """``"3:-2,6:+1"`` → ``{3: -2, 6: 1}`` (step → workers joining (+) or leaving (-) before it).

    Raises:
        ValueError: an item not of the form ``STEP:±N`` or a negative step.
    """
    out: dict[int, int] = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        step, _, n = item.partition(":")
        try:
            k, dn = int(step), int(n)
        except ValueError:
            raise ValueError(f"--pool-schedule item {item!r} must look like 3:-2 or 5:+1") from None
        if k < 0:
            raise ValueError(f"--pool-schedule item {item!r}: step must be >= 0")
        out[k] = out.get(k, 0) + dn
    return out


def plan_summary(plan: Plan) -> str:
    return ", ".join(f"{c.model_stage} {c.tp}/{c.pp}/{c.dp}@{list(c.gpus)}" for c in plan.candidates)


def _transition_cost(job: JobSpec, current: Plan, target: Plan, pool=None):
    """``L_tran`` for this runtime: the transition DAG's estimate without the 20 s rollout-engine
    start the simulator assumes (here the rebuild is part of the measured re-layout, well under a
    second on the tiny model); bytes over bandwidth when the current plan is the time-shared
    fallback, which the DAG planner does not accept (two model-stages of one stage on one worker)."""
    try:
        return estimate_transition_cost(job, current, target, pool, engine_reinit_s=0.0)
    except ValueError:
        return bandwidth_estimate(job, current, target, pool)


class AdaptiveRun:
    """The controller (``Controller`` over ``CostModelPlanner``) driving an :class:`RLDriver`.

    Args:
        spec, workload, task, cfg: as for :class:`RLDriver`; the cost model sees ``workload`` with
            fp32 bytes per parameter and KV element (what the CPU runtime holds).
        num_workers: workers at start.
        schedule: :func:`parse_pool_schedule` output.
        memory_bytes: per-worker memory budget of the cost model.
        gamma: the controller's payback margin.
        log: a ``print``-like callable for the per-step lines (None: silent).
    """

    def __init__(self, spec: ModelSpec, workload: WorkloadSpec, task: DigitTask, num_workers: int,
                 cfg: RLConfig | None = None, schedule: dict[int, int] | None = None,
                 memory_bytes: int = 2 * GIB, gamma: float = 0.5, log=None, measure: bool = True) -> None:
        self.schedule = dict(schedule or {})
        self.max_workers = num_workers + sum(max(v, 0) for v in self.schedule.values())
        self.num_workers, self.log = num_workers, log or (lambda *a, **k: None)
        gpu = cpu_gpu_spec(memory_bytes, measure)
        self.job = runtime_job(spec, workload, self.max_workers, gpu)
        self.planner = CostModelPlanner()
        self.spec, self.workload, self.task, self.cfg = spec, workload, task, cfg or RLConfig()
        self.gamma, self.last_len = gamma, float(workload.response_len)
        self.events: list[dict] = []
        self.ckpt: dict | None = None

    # ------------------------------------------------------------------ plans
    def _legal(self, driver: RLDriver, plan: Plan) -> Plan:
        """``plan`` with each candidate's dp lowered (dropping its last replicas) until the runtime's
        batch rules hold (e.g. dp must divide the prompts; the planner may pick dp=3 for 8 prompts)."""
        out = []
        for c in plan.candidates:
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
        """Run ``steps`` RL steps; returns per-step metrics with the decision of each boundary."""
        import ray

        own = pool is None
        if own:
            if not ray.is_initialized():
                ray.init(num_cpus=self.max_workers, include_dashboard=False, log_to_driver=False)
            pool = WorkerPool(self.num_workers, self.cfg.timeout_s).start()
        alive = frozenset(i for i, w in enumerate(pool.workers) if w is not None)
        plan = self._first_plan(alive)
        driver = RLDriver(self.spec, self.workload, shared_plan(self.workload, alive), self.task,
                          len(pool.workers), self.cfg)
        plan = self._legal(driver, plan)
        driver.set_plan(plan)
        driver.start(pool)
        self.driver = driver
        self.ctl = Controller(self.job, self.planner.estimate(self.job_at(self.last_len), plan, alive),
                              self.planner, transition_cost=_transition_cost,
                              config=ControllerConfig(gamma=self.gamma))
        self.log(f"plan: {plan_summary(plan)}")
        history: list[dict] = []
        self.ckpt = checkpoint(driver)
        try:
            for k in range(steps):
                if self.schedule.get(k):
                    rep = StepReport(step=max(k - 1, 0), response_len=self.last_len,
                                     pool=self._change_pool(pool, self.schedule[k], k))
                    self._apply(self.ctl.observe(rep), k, "pool change")
                driver.reset_measurements()
                m = driver.step()
                self.last_len = max(m["response_len"], 1.0)
                dec = self.ctl.observe(driver.step_report(m))
                m["decision"] = self._apply(dec, k, "after step")
                self.ckpt = checkpoint(driver)  # the safe boundary's in-memory checkpoint
                m["update_count"] = {n: st["update_count"] for n, st in self.ckpt["states"].items()}
                self.log(f"step {k}: reward={m['reward']:.3f} seconds={m['seconds']:.2f} updates={driver.updates} "
                         f"decision={dec.kind}: {dec.reason}")
                history.append(m)
        finally:
            driver.close()
            if own:
                pool.close()
        return history

    def job_at(self, response_len: float) -> JobSpec:
        return self.job.with_workload(self.job.workload.with_response_len(max(1, int(round(response_len)))))

    def _change_pool(self, pool: WorkerPool, delta: int, k: int) -> frozenset:
        live = [i for i, w in enumerate(pool.workers) if w is not None]
        if delta < 0:
            gone = sorted(live)[delta:] if -delta < len(live) else sorted(live)[1:]
            for i in gone:
                pool.remove(i)
            self.log(f"before step {k}: workers {gone} left")
        else:
            new = pool.add(delta)
            self.driver.num_workers = len(pool.workers)
            self.log(f"before step {k}: workers {new} joined")
        return frozenset(i for i, w in enumerate(pool.workers) if w is not None)

    def _apply(self, dec, k: int, when: str) -> dict:
        """Apply a decision at a safe boundary; returns what happened (also kept in ``events``)."""
        d = self.driver
        ev = {"step": k, "when": when, "kind": dec.kind, "reason": dec.reason}
        if when == "pool change":
            self.log(f"  decision={dec.kind}: {dec.reason}")
        if isinstance(dec, Keep):
            return ev
        current = Plan(candidates=tuple(d.cands.values()))
        alive = frozenset(i for i, w in enumerate(d.workers) if w is not None)
        target = dec.plan if dec.plan is not None else shared_plan(self.workload, alive,
                                                                   self.workload.micro_batch_size)
        target = self._legal(d, target)
        if isinstance(dec, Transition) and same_plan(target, current):
            return ev
        intact = all(intact_replica(d, n) is not None for n in train_stages(d))
        use_ckpt = isinstance(dec, Restart) or not intact
        if use_ckpt and intact:  # Restart.checkpoint_first: a full copy is alive, save it now, lose nothing
            self.ckpt = checkpoint(d)
        if use_ckpt and self.ckpt is None:
            raise WorkerFailure("restart needed before the first checkpoint (pool change before step 1)")
        try:
            info = relayout(d, target, self.ckpt if use_ckpt else None)
        except WorkerFailure:
            info = relayout(d, target, self.ckpt)
        self.ctl.resume(self.planner.estimate(self.job_at(self.last_len), target, alive))
        ev.update(info, plan=plan_summary(target))
        if dec.plan is None:
            self.log("  restart: the planner found no plan; time-sharing the live workers")
        self.log(f"  {dec.kind} ({when}) applied in {info['seconds']:.2f}s from {info['source']} state"
                 + (f", steps lost: {info['steps_lost']}" if use_ckpt else ""))
        self.log(f"  plan: {plan_summary(target)}")
        self.events.append(ev)
        return ev
