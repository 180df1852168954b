"""The planner interface the controller uses, and its adapter over the cost model and plan search.

The controller needs five things from planning (:class:`PlannerBackend`); injecting them keeps the
controller testable with small fakes and lets policies differ only in their backend (the
"uncalibrated offline cost model" policy is :class:`CostModelPlanner` with ``calibrate=False``).

Calibration (DESIGN.md §4.3): measured seconds per op class update the shared
:class:`~nereus.cost.efficiency.EfficiencyTable`; a model-stage measured only as a total
(``op_seconds[ms]["total"]``, what external trainers time) is fitted with
:func:`nereus.cost.fit.fit_scales` over the classes its prediction exercises; measured peaks update a per-model-stage memory
correction (EMA of measured/predicted). The correction enters feasibility as extra headroom:
``usable = (1 − headroom) · capacity / max correction`` (conservative: the worst model-stage's factor
applies to every GPU), so it works whatever the cost model does with per-stage corrections.
An OOM multiplies every correction by ``OOM_BACKOFF`` even without calibration: any policy must stop
re-selecting a plan that just ran out of memory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from nereus.controller.alternatives import destroy_only, extend_only
from nereus.cost.efficiency import EfficiencyTable
from nereus.planner.candidates import even_dp_rows
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["PlannerBackend", "CostModelPlanner", "OOM_BACKOFF", "same_plan", "STAGE_TOTAL"]

OOM_BACKOFF = 1.05
NOT_OP_CLASSES = {"bubble"}
#: key of ``op_seconds[model_stage]`` holding the model-stage's measured total seconds
STAGE_TOTAL = "total"
#: efficiency box of the stage-total fit (engine overhead classes start at 1, so above 0.95)
TOTAL_FIT_BOUNDS = (0.02, 1.5)


def same_plan(a: Plan, b: Plan) -> bool:
    """Same candidates on the same GPUs."""
    return sorted((c.key(), c.gpus) for c in a.candidates) == sorted((c.key(), c.gpus) for c in b.candidates)


class PlannerBackend(Protocol):
    """What the controller calls; every job argument carries the current response length."""

    def estimate(self, job: JobSpec, plan: Plan, pool=None) -> Plan:
        """``plan`` with estimates (``l_step``, breakdowns, peaks) under the current calibration."""

    def memory_ok(self, job: JobSpec, plan: Plan) -> bool:
        """Predicted peaks (with memory corrections) fit the usable capacity."""

    def plan(self, job: JobSpec, pool: frozenset, current: Plan | None, urgent: bool,
             min_train_replicas: int = 1) -> Plan:
        """Fastest feasible plan on ``pool`` (with at least ``min_train_replicas`` replicas of every
        ``*.train`` model-stage, on distinct nodes where possible); raises ``ValueError`` when
        nothing fits."""

    def alternatives(self, job: JobSpec, pool: frozenset, current: Plan, best: Plan) -> list[Plan]:
        """Slightly slower plans with cheaper transitions (may be empty)."""

    def calibrate(self, job: JobSpec, plan: Plan, op_seconds: dict, peak_memory: dict, pool=None) -> None:
        """Update efficiencies and memory corrections from one step's measurements; ``plan`` is the
        running plan as :meth:`estimate` returned it for ``job`` (the predictions to compare with)."""

    def note_oom(self) -> None:
        """The current plan ran out of memory."""

    def efficiencies(self) -> dict:
        """Calibrated efficiency per op class (the ``eff:<class>`` signals)."""


def default_urgent_options() -> dict:
    """``plan_job`` options of the urgent path: every recompute mode and micro-batches down to 1
    (paper §4.3: "This path also considers smaller per-replica batches and recomputation")."""
    from nereus.planner.search import SearchOptions

    return {"options": SearchOptions(recompute_modes=("none", "selective", "full"), min_micro_batch=1)}


class CostModelPlanner:
    """:class:`PlannerBackend` over ``nereus.cost.model.CostModel`` and ``nereus.planner.search.plan_job``.

    Args:
        efficiency: the shared table (a default one when None); calibration mutates it.
        calibrate: False for the offline (uncalibrated) cost model.
        headroom: capacity fraction kept free; None: the job's ``memory_fraction`` when set, else 10%.
        plan_fn: ``plan_job``-compatible callable (``plan_job(job, pool=, current=, cost=, **options)``).
        options: passed to ``plan_fn``; ``urgent_options`` override them on the urgent path
            (default :func:`default_urgent_options`: smaller per-replica batches, recompute).
        alpha: EMA weight of the memory correction.
    """

    def __init__(self, efficiency: EfficiencyTable | None = None, calibrate: bool = True,
                 headroom: float | None = None,
                 plan_fn=None, options: dict | None = None, urgent_options: dict | None = None,
                 alpha: float = 0.5):
        self.efficiency = efficiency if efficiency is not None else EfficiencyTable()
        self.calibrate_enabled = calibrate
        self.headroom = headroom
        self.memory_correction: dict = {}
        self.plan_fn = plan_fn
        self.options = dict(options or {})
        self.urgent_options = dict(urgent_options) if urgent_options is not None else default_urgent_options()
        self.alpha = alpha

    # ------------------------------------------------------------------ cost model
    def _headroom(self, job: JobSpec | None = None) -> float:
        from nereus.cost.model import DEFAULT_HEADROOM, default_headroom

        base = self.headroom if self.headroom is not None else (
            default_headroom(job) if job is not None else DEFAULT_HEADROOM)
        worst = max([1.0, *self.memory_correction.values()])
        return 1.0 - (1.0 - base) / worst

    def cost(self, job: JobSpec):
        from nereus.cost.model import CostModel

        return CostModel(job, efficiency=self.efficiency, headroom=self._headroom(job))

    def estimate(self, job: JobSpec, plan: Plan, pool=None) -> Plan:
        return self.cost(job).estimate(plan, pool)

    def memory_ok(self, job: JobSpec, plan: Plan) -> bool:
        return self.cost(job).memory_ok(plan)

    def memory_fits(self, job: JobSpec, plan: Plan, correction: float) -> bool:
        """Predicted peaks times ``correction`` (measured / predicted, >= 1 applied) fit the whole
        device, no headroom (``nereus.controller.memory_margin``)."""
        from nereus.cost.model import CostModel

        return CostModel(job, efficiency=self.efficiency, headroom=1.0 - 1.0 / max(1.0, correction)).memory_ok(plan)

    def plan(self, job: JobSpec, pool: frozenset, current: Plan | None, urgent: bool,
             min_train_replicas: int = 1) -> Plan:
        fn = self.plan_fn
        if fn is None:
            from nereus.planner.search import plan_job as fn
        opts = dict(self.options)
        if urgent:
            opts.update(self.urgent_options)
        if min_train_replicas > 1:
            from nereus.planner.search import SearchOptions

            opts["options"] = replace(opts.get("options") or SearchOptions(), min_train_replicas=min_train_replicas)
        return fn(job, pool=pool, current=current, cost=self.cost(job), **opts)

    def alternatives(self, job: JobSpec, pool: frozenset, current: Plan, best: Plan) -> list[Plan]:
        """Destroy-only and extend-only variants of ``current`` that fit memory (``alternatives.py``)."""
        mini = job.workload.mini_batch_size
        rows = ({c.model_stage: even_dp_rows(job.workload, c.model_stage) for c in current.candidates}
                if job.framework.even_dp else None)
        out = []
        base = current
        if not current.gpus_used() <= pool:
            base = destroy_only(current, pool, mini, rows)
            if base is None:
                return []
            base = self.estimate(job, base, pool)
            if self.memory_ok(job, base):
                out.append(base)
        times = {k: v.time for k, v in base.estimates.items()}
        ext = extend_only(base, pool, mini, job.cluster, times, rows)
        if ext is not None:
            ext = self.estimate(job, ext, pool)
            if self.memory_ok(job, ext):
                out.append(ext)
        return sorted(out, key=lambda p: p.l_step)

    # ------------------------------------------------------------------ calibration
    def calibrate(self, job: JobSpec, plan: Plan, op_seconds: dict, peak_memory: dict, pool=None) -> None:
        if not self.calibrate_enabled:
            return
        est = plan if plan.estimates else self.estimate(job, plan, pool)
        self._calibrate_totals(job, est, op_seconds)
        measured: dict = {}
        predicted: dict = {}
        for ms, by_class in op_seconds.items():
            if ms not in est.estimates:
                continue
            for cls, s in by_class.items():
                p = est.estimates[ms].breakdown.get(cls, 0.0)
                if cls in NOT_OP_CLASSES or s <= 0 or p <= 0:
                    continue
                measured[cls] = measured.get(cls, 0.0) + s
                predicted[cls] = predicted.get(cls, 0.0) + p
        for cls in measured:
            self.efficiency.update(cls, measured[cls], predicted[cls], gpu=job.cluster.gpu)
        for ms, peak in peak_memory.items():
            pred = est.peak_memory.get(ms, 0.0)
            if pred <= 0 or peak <= 0:
                continue
            # est used the headroom-adjusted model but unscaled bytes: ratio is measured / raw
            ratio = peak / pred
            old = self.memory_correction.get(ms, 1.0)
            self.memory_correction[ms] = (1 - self.alpha) * old + self.alpha * ratio

    def _calibrate_totals(self, job: JobSpec, est: Plan, op_seconds: dict) -> None:
        """Model-stages measured only as a whole (``op_seconds[ms][STAGE_TOTAL]``, seconds: what an
        external trainer times, e.g. verl's ``timing_s/gen``): one scale per op-class group fitted on
        all such totals at once (:func:`nereus.cost.fit.fit_scales`: log-space least squares with a
        prior towards the current table), over the classes each model-stage's predicted breakdown
        exercises, on totals moved onto the model's 10% noise band
        (:func:`nereus.cost.fit.deadband_targets`: a stage already predicted within it changes
        nothing); the fitted efficiencies replace the current ones. Bounds 0.02-1.5 (overhead
        classes start at 1)."""
        from nereus.cost.fit import deadband_targets, fit_scales

        bds, meas = [], []
        for ms, by_class in op_seconds.items():
            s = by_class.get(STAGE_TOTAL, 0.0) if isinstance(by_class, dict) else 0.0
            if ms in est.estimates and s > 0 and est.estimates[ms].time > 0:
                bds.append(est.estimates[ms].breakdown)
                meas.append(float(s))
        if not bds:
            return
        meas = deadband_targets([sum(bd.values()) for bd in bds], meas)
        fit = fit_scales(bds, meas, base=self.efficiency, gpu=job.cluster.gpu, eff_bounds=TOTAL_FIT_BOUNDS)
        for cls, e in fit.efficiencies.items():
            self.efficiency.set(cls, e)

    def note_oom(self) -> None:
        if not self.memory_correction:
            self.memory_correction["*"] = 1.0
        for k in self.memory_correction:
            self.memory_correction[k] *= OOM_BACKOFF
        self.memory_correction["*"] = max(self.memory_correction.values())

    def efficiencies(self) -> dict:
        if not self.calibrate_enabled:
            return {}
        return {f"eff:{k}": v for k, v in self.efficiency.values.items()}
