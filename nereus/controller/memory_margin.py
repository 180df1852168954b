"""Whether a plan over the planning headroom is really invalid: the measured peak against the device.

Why (issue 29, fourth round): the controller declared the running plan *invalid* (an urgent move,
profitability waived) whenever the cost model, times the memory correction, predicted a peak above
``(1 − headroom) · capacity``. The headroom (10% by default, ``nereus.cost.model.DEFAULT_HEADROOM``)
is a margin for *choosing* a plan whose peak has not been measured; it is not evidence that a plan
which just ran a step without running out of memory will do so. On ``oobleck-gcp`` (70B PPO, no
notice, seed 0, 2 h) the first step's measured peaks moved the correction to 1.04 and turned the
running plan invalid: a 350 s urgent move with an engine restart (docs/simulate.md), where ``static``
(an oracle memory model, 2% slack) kept its plan.

Rule (``ControllerConfig(memory_margin=True)``): a plan predicted over the headroom is invalid only
when it ran out of memory, or when its predicted peaks at the next step's projected length, times
the last step's *measured / predicted* peak ratio (the worst model-stage's), exceed the device with
no headroom (``CostModelPlanner.memory_fits``). Otherwise it keeps running and the ordinary triggers
(length drift, pool, efficiency) replan it under the payback rule, where every target must fit the
headroom. The projected length is the length trend's one-step value with its ``2σ`` quantile
(``lookahead.LengthTrend.ahead``), the same margin the look-ahead sizes memory for. No constant.
"""

from __future__ import annotations

from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["measured_ratio", "fits_measured"]


def measured_ratio(predicted: Plan, peak_memory: dict) -> float | None:
    """Worst measured / predicted peak over the model-stages measured (``peak_memory``: model-stage →
    bytes per GPU; ``predicted``: the plan estimated at the step's length); None when none is."""
    r = [peak_memory[ms] / p for ms, p in predicted.peak_memory.items() if p > 0 and peak_memory.get(ms, 0) > 0]
    return max(r) if r else None


def fits_measured(planner, job_at, ahead: float | None, job: JobSpec, plan: Plan, current: Plan, pool,
                  peak_memory: dict) -> bool:
    """The running ``plan`` fits the device at the next step (module docstring).

    Args:
        planner: the controller's backend; False when it has no ``memory_fits``.
        job_at: response length → job.
        ahead: the trend's projected length of the next step (tokens), None without a trend.
        job, current: the job at the last step's length and ``plan`` estimated for it.
        pool: ``P_gpu``.
        peak_memory: the last step's measured peaks (model-stage → bytes per GPU).
    """
    fits = getattr(planner, "memory_fits", None)
    ratio = measured_ratio(current, peak_memory)
    if ratio is None or fits is None:
        return False
    nxt = job_at(ahead) if ahead is not None and ahead > job.workload.response_len else job
    est = current if nxt is job else planner.estimate(nxt, plan, pool)
    return bool(fits(nxt, est, ratio))
