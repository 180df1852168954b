"""The simulated cluster: executes plans with hidden "true" costs and reports measurements.

The simulator plays the part of the real workers. It executes a plan step by step and returns the
same :class:`~nereus.controller.monitor.StepReport` the runtime will return, so the controller
calibrates from simulated measurements exactly as from real ones. Hidden ground truth
(:class:`Truth`) differs from the planner's defaults on purpose:

* **efficiency**: the true table (:data:`TRUE_EFFICIENCY`) is lower than the defaults of
  ``nereus.cost.efficiency`` for memory-bound decode and inter-node collectives and higher for NVLink
  collectives; step times come from the same :class:`~nereus.cost.model.CostModel` run with it;
* **noise**: every op class's measured time gets independent log-normal noise (σ = 2% by default;
  the paper reports max–min step spreads below 2% on its testbeds);
* **congestion**: drift events (a Poisson process, default one per 3 h, 20–60 minutes long) multiply
  the efficiency of every ``*@ib`` collective by 0.4 while they last;
* **memory**: true peaks are the cost model's prediction times ``memory_factor`` (1.08: allocator
  fragmentation and buffers the model omits); a GPU above its device memory is an OOM, which costs
  half of the step and leaves the plan invalid;
* **transitions**: take ``transition_factor`` (1.3) times the transition planner's estimate, with
  10% noise (links rarely reach peak; communicator setup varies);
* **GPU pool**: from an availability trace scaled to the cluster; GPUs ``0 .. n-1`` are available
  when the trace says ``n``, so losses take the highest ids first. A loss that hits a GPU of the
  running plan aborts the step at that moment (its work is lost).
* **preemption notice** (``notice_s``, default 0 = none): a loss is announced ``notice_s`` seconds
  before the GPUs go (AWS sends spot interruption notices 2 minutes ahead, GCP 30 s for preemptible
  VMs). Announced GPUs leave ``P_gpu`` but stay *alive*: a step that cannot finish before the loss is
  stopped at the notice, and state on those GPUs can still be moved or checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from nereus.controller.monitor import StepReport
from nereus.controller.transition_cost import bandwidth_estimate, engine_reinit, estimate_transition_cost
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.model import CostModel
from nereus.planner.plan import Plan
from nereus.sim.traces import AvailabilityTrace, LengthTrace
from nereus.spec.job import JobSpec

__all__ = ["TRUE_EFFICIENCY", "Truth", "Congestion", "StepOutcome", "SimulatedCluster", "DriftedTable"]

#: hidden per-op-class efficiencies of the simulated hardware (planner defaults: gemm 0.6,
#: attention 0.45, memory_bound 0.7, *@nvlink 0.6, *@ib 0.75).
TRUE_EFFICIENCY = {"gemm": 0.55, "attention": 0.40, "memory_bound": 0.50, "@nvlink": 0.70, "@ib": 0.45}


class DriftedTable(EfficiencyTable):
    """An efficiency table keyed by exact class or by ``@link`` suffix, times a congestion factor on ``@ib``."""

    def __init__(self, base: dict, ib_factor: float = 1.0):
        super().__init__()
        self.base = dict(base)
        self.ib_factor = ib_factor

    def get(self, op_class: str) -> float:
        if op_class in self.base:
            v = self.base[op_class]
        else:
            _, _, link = op_class.partition("@")
            v = self.base.get(f"@{link}", super().get(op_class)) if link else super().get(op_class)
        return v * (self.ib_factor if op_class.endswith("@ib") else 1.0)


@dataclass(frozen=True)
class Congestion:
    """An efficiency-drift event: ``*@ib`` efficiencies times ``factor`` during ``[start, end)`` seconds."""

    start: float
    end: float
    factor: float = 0.4


@dataclass(frozen=True)
class Truth:
    """Hidden ground truth of the simulated hardware (module docstring).

    Raises:
        ValueError: non-positive factors or negative noise.
    """

    efficiency: dict = field(default_factory=lambda: dict(TRUE_EFFICIENCY))
    memory_factor: float = 1.08
    step_noise: float = 0.02
    transition_factor: float = 1.3
    transition_noise: float = 0.10
    congestion_per_hour: float = 1 / 3
    congestion_minutes: tuple[float, float] = (20.0, 60.0)
    congestion_factor: float = 0.4
    notice_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("memory_factor", "transition_factor", "congestion_factor"):
            if not getattr(self, f) > 0:
                raise ValueError(f"truth field {f!r} must be > 0, got {getattr(self, f)!r}")
        for f in ("step_noise", "transition_noise", "congestion_per_hour", "notice_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"truth field {f!r} must be >= 0, got {getattr(self, f)!r}")

    def table(self, ib_factor: float = 1.0) -> DriftedTable:
        return DriftedTable(self.efficiency, ib_factor)


@dataclass(frozen=True)
class StepOutcome:
    """One executed (or aborted) step: ``duration`` seconds elapsed; ``report`` for the controller."""

    duration: float
    completed: bool
    oom: bool
    aborted_by_pool: bool
    response_len: float
    report: StepReport


class SimulatedCluster:
    """Executes plans against the hidden :class:`Truth`, a GPU availability trace and a length trace.

    Args:
        job: the job (its workload's response length is replaced per step from ``lengths``).
        availability: GPU counts over time (already scaled to ``job.cluster``).
        lengths: mean response length per RL step.
        truth: hidden costs.
        seed: RNG seed for noise and congestion events.
        hours: how long congestion events are generated for.

    Raises:
        ValueError: the availability trace is not in GPUs or exceeds the cluster.
    """

    QUANTUM = 64  # tokens: true costs are computed at lengths rounded to this (cache key)

    def __init__(self, job: JobSpec, availability: AvailabilityTrace, lengths: LengthTrace,
                 truth: Truth | None = None, seed: int = 0, hours: float = 12.0):
        if availability.unit != "gpus":
            raise ValueError("availability trace must be scaled to GPUs (AvailabilityTrace.scaled)")
        if max(availability.counts) > job.cluster.num_gpus:
            raise ValueError(f"availability trace reaches {max(availability.counts)} GPUs but the cluster has "
                             f"{job.cluster.num_gpus}")
        self.job = job
        self.availability = availability
        self.lengths = lengths
        self.truth = truth or Truth()
        self.rng = np.random.default_rng(seed)
        self.congestion = self._congestion_events(np.random.default_rng(seed + 1), hours)
        self._cache: dict = {}

    # ------------------------------------------------------------------ environment
    def _congestion_events(self, rng, hours: float) -> list[Congestion]:
        ev, t, end = [], 0.0, hours * 3600.0
        rate = self.truth.congestion_per_hour / 3600.0
        while rate > 0:
            t += rng.exponential(1.0 / rate)
            if t >= end:
                break
            lo, hi = self.truth.congestion_minutes
            ev.append(Congestion(t, t + 60.0 * rng.uniform(lo, hi), self.truth.congestion_factor))
        return ev

    def ib_factor(self, t: float) -> float:
        f = 1.0
        for c in self.congestion:
            if c.start <= t < c.end:
                f *= c.factor
        return f

    def alive_at(self, t: float) -> frozenset:
        """GPUs running at ``t`` (including those under a preemption notice)."""
        return frozenset(range(self.availability.count_at(t)))

    def pool_at(self, t: float) -> frozenset:
        """``P_gpu`` at ``t``: alive GPUs without a pending preemption notice."""
        n = self.availability.count_at(t)
        if self.truth.notice_s > 0:
            tc = self.availability.next_change(t)
            while tc <= t + self.truth.notice_s:
                n = min(n, self.availability.count_at(tc))
                tc = self.availability.next_change(tc)
        return frozenset(range(n))

    def loss_time(self, gpus, t: float) -> float:
        """First time after ``t`` at which one of ``gpus`` stops running (inf if never)."""
        tc = self.availability.next_change(t)
        while tc < float("inf"):
            if not set(gpus) <= self.alive_at(tc):
                return tc
            tc = self.availability.next_change(tc)
        return float("inf")

    def job_at(self, response_len: float) -> JobSpec:
        return self.job.with_workload(self.job.workload.with_response_len(max(1, int(round(response_len)))))

    def true_plan(self, plan: Plan, response_len: float, t: float) -> Plan:
        """``plan`` estimated with the hidden efficiencies at time ``t`` (cached per length quantum)."""
        q = max(self.QUANTUM, int(round(response_len / self.QUANTUM)) * self.QUANTUM)
        f = self.ib_factor(t)
        pool = self.pool_at(t)
        key = (tuple((c.key(), c.gpus) for c in plan.candidates), q, f, self.job.cluster.spans_nodes(pool))
        if key not in self._cache:
            if len(self._cache) > 20000:
                self._cache.clear()
            cm = CostModel(self.job_at(q), efficiency=self.truth.table(f), headroom=0.0)
            self._cache[key] = cm.estimate(plan, pool)
        return self._cache[key]

    # ------------------------------------------------------------------ execution
    def execute_step(self, plan: Plan, step: int, t: float) -> StepOutcome:
        """Run RL step ``step`` (0-based) of ``plan`` starting at ``t`` seconds."""
        length = self.lengths.at(step)
        pool = self.pool_at(t)
        if not plan.gpus_used() <= pool:
            return self._aborted(step, length, 0.0, t)
        true = self.true_plan(plan, length, t)
        noise = {}
        op_seconds = {}
        for ms, est in true.estimates.items():
            op_seconds[ms] = {}
            for cls, s in est.breakdown.items():
                n = noise.setdefault(cls, math.exp(self.rng.normal(0.0, self.truth.step_noise)))
                op_seconds[ms][cls] = s * n
        duration = true.l_step * math.exp(self.rng.normal(0.0, self.truth.step_noise))
        peak = {ms: v * self.truth.memory_factor for ms, v in true.peak_memory.items()}
        oom = max(true.gpu_memory.values(), default=0.0) * self.truth.memory_factor > self.job.cluster.gpu.memory_bytes
        if oom:
            duration *= 0.5
        # a loss of one of the plan's GPUs during the step aborts it: at the loss without a notice;
        # at the notice when the step would not finish before the loss
        lost_at = self.loss_time(plan.gpus_used(), t)
        if lost_at < t + duration:
            stop = max(t, lost_at - self.truth.notice_s)
            return self._aborted(step, length, stop - t, stop)
        end = t + duration
        report = StepReport(step=step, response_len=length, pool=self.pool_at(end), step_time=0.0 if oom else duration,
                            op_seconds={} if oom else op_seconds, peak_memory=peak, oom=oom, alive=self.alive_at(end), elapsed_s=end)
        return StepOutcome(duration, not oom, oom, False, length, report)

    def _aborted(self, step, length, duration, t) -> StepOutcome:
        return StepOutcome(duration, False, False, True, length,
                           StepReport(step=step, response_len=length, pool=self.pool_at(t), alive=self.alive_at(t),
                                      elapsed_s=t))

    def transition_time(self, current: Plan, target: Plan, pool, response_len: float) -> float:
        """True seconds of a live transition: ``transition_factor`` × the transition planner's estimate
        (the DAG's when ``nereus.transition`` provides it and finds it feasible, else bytes over
        bandwidth), with log-normal noise."""
        job = self.job_at(response_len)
        tgt = target if target.estimates else CostModel(job).estimate(target)
        est = estimate_transition_cost(job, current, tgt, pool)
        if not est.feasible or not math.isfinite(est.l_tran):
            est = bandwidth_estimate(job, current, tgt, pool)
            est = type(est)(est.l_tran + engine_reinit(current, tgt))
        return est.l_tran * self.truth.transition_factor * math.exp(self.rng.normal(0, self.truth.transition_noise))
