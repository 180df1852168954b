"""The simulated cluster: executes plans with hidden "true" costs and reports measurements.

The simulator plays the part of the real workers. It executes a plan step by step and returns the
same :class:`~nereus.controller.monitor.StepReport` the runtime will return, so the controller
calibrates from simulated measurements exactly as from real ones. Hidden ground truth
(:class:`Truth`) differs from the planner's defaults on purpose:

* **efficiency**: the true table (:data:`TRUE_EFFICIENCY`) is lower than the defaults of
  ``nereus.cost.efficiency`` for GEMMs, memory-bound decode and inter-node collectives and higher
  for attention (H100 default 0.33) and NVLink collectives; step times come from the same
  :class:`~nereus.cost.model.CostModel` run with it;
* **noise**: every op class's measured time gets independent log-normal noise (σ = 2% by default;
  the paper reports max–min step spreads below 2% on its testbeds);
* **congestion**: drift events (a Poisson process, default one per 3 h, 20–60 minutes long) multiply
  the efficiency of every ``*@ib`` collective by 0.4 while they last;
* **memory**: true peaks are the cost model's prediction times ``memory_factor`` (1.08: allocator
  fragmentation and buffers the model omits); a GPU above its device memory is an OOM, which costs
  half of the step and leaves the plan invalid;
* **effects the planner does not model** (so calibration cannot recover the truth exactly, and the
  payback rule meets model error; sizes in docs/simulate.md):

  - *size-dependent efficiency*: the per-GPU GEMMs, attention and decode kernels of a TP-``t``
    shard run ``1 + tp_penalty · log2(t)`` times slower than the op-class efficiency says
    (``tp_penalty`` = 0.06: TP 8 is 18% slower per FLOP). Smaller per-GPU matrices reach a lower
    fraction of peak; Megatron-LM reports per-GPU throughput falling as the TP degree grows at a
    fixed model size (Narayanan et al., SC'21, §5.4 and Fig. 13). The size of the effect is an
    assumption. The planner's calibration is per op class, shared by every TP degree, so it learns
    an average;
  - *overlap*: a ``*.train`` model-stage hides ``overlap`` (0.5) of ``min(collective seconds,
    compute seconds)`` behind compute (PyTorch DDP and FSDP overlap bucketed gradient all-reduce
    with the backward pass: Li et al., VLDB'20, "PyTorch Distributed", §3.2.3); the planner adds
    them. The measured op-class seconds are the kernels' own (instrumentation sees the whole
    collective), so calibration does not see the hidden part;
  - *congestion* (above) and *transfer-time tails* (below).

* **transitions**: the state movement takes ``transition_factor`` (1.3) times the transition
  planner's estimate, times log-normal noise with σ = ``transition_noise`` (0.5): the spread of
  measured / predicted seconds per primitive of the live executor after calibration (0.54–1.85,
  log-σ ≈ 0.5, docs/runtime.md "Adaptive run"; measured on CPU workers over gloo with 19–57 MB
  moves, so it stands for the shape of the tail, not for NVLink/InfiniBand magnitudes). Starting
  rollout engines and creating process groups takes the controller's estimate (``engine_reinit``
  with the job: ``nereus.controller.engine_start``, by model size and TP, 25 s for 8B TP 1 to
  3.5 min for 70B TP 8) times log-normal noise with σ = ``engine_noise`` (0.35).
* **failure detection and teardown**: an *unannounced* loss of a GPU of the running plan is seen
  only after ``detect_s`` seconds, uniform in (15, 50): Ray's GCS declares a node dead after
  ``health_check_failure_threshold`` (5) failed probes ``health_check_period_ms`` (3 s) apart, each
  allowed ``health_check_timeout_ms`` (10 s) (defaults in ``src/ray/common/ray_config_def.h``: 15 s
  when probes fail fast, 50 s when they time out). A live transition after such a loss first
  aborts and rebuilds the communicators of the surviving ranks: ``teardown_s`` = 5 s (an
  assumption: ``ncclCommAbort`` plus re-initialising a few groups; the live executor's communicator
  setup is 0.26–0.49 s for many groups on 4 CPU workers, docs/live-transition.md, a lower bound).
  Every policy pays the detection; restarts include teardown in their process restart.
* **GPU pool**: from an availability trace scaled to the cluster; GPUs ``0 .. n-1`` are available
  when the trace says ``n``, so losses take the highest ids first. A loss that hits a GPU of the
  running plan aborts the step at that moment (its work is lost).
* **preemption notice** (``notice_s``, default 0 = none): a loss is announced ``notice_s`` seconds
  before the GPUs go (AWS sends spot interruption notices 2 minutes ahead, GCP 30 s for preemptible
  VMs). Announced GPUs leave ``P_gpu`` but stay *alive* (reports carry the seconds left,
  :meth:`SimulatedCluster.leave_in`): a step that cannot finish before the loss, or would leave too
  little time after it to save a checkpoint when the loss takes every replica of the trained state
  (``execute_step``'s ``save_s``), is stopped at the notice, and state on those GPUs can still be
  moved or checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from nereus.controller.monitor import StepReport
from nereus.controller.risk import state_survives
from nereus.controller.transition_cost import bandwidth_estimate, engine_reinit, estimate_transition_cost
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.model import CostModel
from nereus.cost.step import stage_groups
from nereus.sim.traces import AvailabilityTrace, LengthTrace
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["TRUE_EFFICIENCY", "Truth", "Congestion", "StepOutcome", "SimulatedCluster", "DriftedTable",
           "unmodelled"]

#: hidden per-op-class efficiencies of the simulated hardware (the planner's H100 defaults,
#: ``nereus.cost.efficiency.default_efficiency``: gemm 0.6, attention 0.33, memory_bound 0.7,
#: *@nvlink 0.6, *@ib 0.75).
TRUE_EFFICIENCY = {"gemm": 0.55, "attention": 0.40, "memory_bound": 0.50, "@nvlink": 0.70, "@ib": 0.45}


class DriftedTable(EfficiencyTable):
    """An efficiency table keyed by exact class or by ``@link`` suffix, times a congestion factor on ``@ib``."""

    def __init__(self, base: dict, ib_factor: float = 1.0):
        super().__init__()
        self.base = dict(base)
        self.ib_factor = ib_factor

    def get(self, op_class: str, gpu=None) -> float:
        """The true efficiency of ``op_class``. ``gpu`` is accepted for the cost model's calls and not
        used: the truth names its own values, and a class it does not name takes the GPU-independent
        default."""
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
    transition_noise: float = 0.5
    engine_noise: float = 0.35
    tp_penalty: float = 0.06
    overlap: float = 0.5
    detect_s: tuple[float, float] = (15.0, 50.0)
    teardown_s: float = 5.0
    congestion_per_hour: float = 1 / 3
    congestion_minutes: tuple[float, float] = (20.0, 60.0)
    congestion_factor: float = 0.4
    notice_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("memory_factor", "transition_factor", "congestion_factor"):
            if not getattr(self, f) > 0:
                raise ValueError(f"truth field {f!r} must be > 0, got {getattr(self, f)!r}")
        for f in ("step_noise", "transition_noise", "engine_noise", "congestion_per_hour", "notice_s", "tp_penalty",
                  "teardown_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"truth field {f!r} must be >= 0, got {getattr(self, f)!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"truth field 'overlap' must be in [0, 1], got {self.overlap!r}")
        lo, hi = self.detect_s
        if not 0 <= lo <= hi:
            raise ValueError(f"truth field 'detect_s' must be (low, high) seconds with 0 <= low <= high, "
                             f"got {self.detect_s!r}")

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
    detect_s: float = 0.0


#: op classes whose per-GPU kernels slow down on smaller TP shards (``Truth.tp_penalty``)
COMPUTE_CLASSES = ("gemm", "attention", "memory_bound")
#: collectives a training model-stage overlaps with compute (``Truth.overlap``); p2p is on the critical path
OVERLAP_PREFIXES = ("allreduce", "allgather", "reducescatter", "reduce_scatter")


def unmodelled(est, tp: int, train: bool, tp_penalty: float, overlap: float):
    """The "true" seconds and op-class breakdown of one model-stage from the planner-form estimate
    ``est`` (a :class:`~nereus.spec.plan.StageEstimate` under the true efficiencies), with the
    effects the planner does not model (module docstring)::

        f       = 1 + tp_penalty · log2(tp)
        compute = Σ breakdown[c] for c in COMPUTE_CLASSES
        comm    = Σ collective seconds (``train`` only)
        time    = est.time + (f − 1) · compute − overlap · min(comm, f · compute)

    Returns ``(time, breakdown)``; the breakdown has the compute classes times ``f`` and the
    collectives whole (what kernel instrumentation measures).
    """
    f = 1.0 + tp_penalty * math.log2(max(1, tp))
    bd = dict(est.breakdown)
    compute = sum(v for k, v in bd.items() if k in COMPUTE_CLASSES)
    for k in COMPUTE_CLASSES:
        if k in bd:
            bd[k] *= f
    comm = sum(v for k, v in bd.items() if k.partition("@")[0] in OVERLAP_PREFIXES) if train else 0.0
    time = est.time + (f - 1.0) * compute - overlap * min(comm, f * compute)
    return max(time, 0.0), bd


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

    def leave_in(self, t: float) -> dict:
        """GPU id → seconds from ``t`` until it stops, for the GPUs under a preemption notice at ``t``
        (``StepReport.leave_in_s``: the executor reads the announced time, e.g. AWS's instance-action)."""
        return {g: self.loss_time((g,), t) - t for g in self.alive_at(t) - self.pool_at(t)}

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
            est = cm.estimate(plan, pool)
            tp = {c.model_stage: c.tp for c in plan.candidates}
            ests = {}
            for ms, e in est.estimates.items():
                t_ms, bd = unmodelled(e, tp[ms], ms.endswith(".train"), self.truth.tp_penalty, self.truth.overlap)
                ests[ms] = replace(e, time=t_ms, breakdown=bd)
            l_step = cm.stage_latency({k: v.time for k, v in ests.items()}, stage_groups(plan, cm.workflow))
            self._cache[key] = replace(est, estimates=ests, l_step=l_step)
        return self._cache[key]

    # ------------------------------------------------------------------ execution
    def execute_step(self, plan: Plan, step: int, t: float, save_s: float = 0.0) -> StepOutcome:
        """Run RL step ``step`` (0-based) of ``plan`` starting at ``t`` seconds.

        With a preemption notice the executor stops the step at the notice unless it ends before
        the loss with ``save_s`` seconds left to checkpoint after it (when the loss would leave no
        whole replica of the trained state; otherwise only the end before the loss is needed): a
        step that ends just before its GPUs go would leave no time to save or move the state."""
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
        reserve = 0.0
        if self.truth.notice_s > 0 and math.isfinite(lost_at) and not state_survives(plan, self.alive_at(lost_at)):
            reserve = min(save_s, self.truth.notice_s)
        if lost_at < t + duration + reserve:
            if self.truth.notice_s > 0:
                stop = max(t, lost_at - self.truth.notice_s)
                return self._aborted(step, length, stop - t, stop)
            # unannounced: the job notices the loss only after failure detection
            detect = self.rng.uniform(*self.truth.detect_s)
            return self._aborted(step, length, lost_at + detect - t, lost_at + detect, detect)
        end = t + duration
        report = StepReport(step=step, response_len=length, pool=self.pool_at(end), step_time=0.0 if oom else duration,
                            op_seconds={} if oom else op_seconds, peak_memory=peak, oom=oom, alive=self.alive_at(end), elapsed_s=end,
                            leave_in_s=self.leave_in(end))
        return StepOutcome(duration, not oom, oom, False, length, report)

    def _aborted(self, step, length, duration, t, detect_s: float = 0.0) -> StepOutcome:
        return StepOutcome(duration, False, False, True, length,
                           StepReport(step=step, response_len=length, pool=self.pool_at(t), alive=self.alive_at(t),
                                      elapsed_s=t, leave_in_s=self.leave_in(t)), detect_s)

    def transition_time(self, current: Plan, target: Plan, pool, response_len: float) -> float:
        """True seconds of a live transition (module docstring): the state movement of the transition
        planner's estimate (the DAG's when ``nereus.transition`` provides it and finds it feasible,
        else bytes over bandwidth) times ``transition_factor`` and a log-normal tail, plus the rollout
        engine start with its own noise."""
        job = self.job_at(response_len)
        tgt = target if target.estimates else CostModel(job).estimate(target)
        engine = engine_reinit(current, tgt, job=job)
        est = estimate_transition_cost(job, current, tgt, pool)
        if est.feasible and math.isfinite(est.l_tran):
            move = max(0.0, est.l_tran - engine)
        else:
            move = bandwidth_estimate(job, current, tgt, pool).l_tran
        move *= self.truth.transition_factor * math.exp(self.rng.normal(0, self.truth.transition_noise))
        return move + engine * math.exp(self.rng.normal(0, self.truth.engine_noise))
