"""When the simulated executor saves a checkpoint: Young's interval from the measured save cost and
an online estimate of the time between failures (issue 29).

Why: a fixed interval of 25 RL steps is hours for a 70B job (steps of 2–4 minutes) and ten or more
minutes for Qwen3-32B GRPO, while the shipped traces lose GPUs every few minutes in bursts. A policy
that loses its trained state then redoes everything since step 0 (docs/simulate.md: Qwen3-32B on
parcae-lh redid 16 steps; 70B on bamboo-g4dn never reached step 25). The interval that minimises the
expected time lost to checkpoints and to re-executed work is, to first order,

    T_opt = sqrt(2 · C · M)                                   (seconds of work between checkpoints)

with ``C`` the seconds one checkpoint save takes and ``M`` the mean time between failures (Young,
"A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974). Daly ("A
higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006)
derives the higher-order optimum ``sqrt(2CM) · [1 + sqrt(C/(2M))/3 + C/(18M)] − C`` for ``C < 2M``
and shows Young's form is within a few per cent of it while ``C`` is small against ``M``; we use
Young's, as the issue asks, and say so.

How the two inputs are obtained (the same rule for every policy of the simulator, ``static``
included, so no policy is favoured):

* ``C``: the duration of the last checkpoint this executor saved (its measurement); before the first
  save, the restart-cost model's estimate for the plan's nodes (``RestartCost.save_s``).
* ``M``: a *failure* is what a checkpoint protects against: a restart that re-executes the steps
  since the last checkpoint (the trained state was lost; restarts that saved first lose nothing and
  do not count). With ``n`` failures in ``t`` seconds of run time, ``M = t / (n + 1)``: the mean
  interval with the quiet time since the last failure counted as one more interval (the Copernican
  estimate used for the first interval elsewhere, ``nereus.controller.pool_process``; with no
  failure yet, ``M = t``, so the interval grows as ``sqrt(2 · C · t)``).
* The check runs at every completed step: save when the work done since the last checkpoint (the
  seconds of completed steps a failure would make the executor redo) reaches ``T_opt``. The run
  starts from a checkpoint (step 0), so the first save comes once ``t ≥ 2C`` seconds of work.

Assumptions: failures form a stationary process whose mean the estimate tracks (bursts make it
short right after a burst, which is when a short interval pays); a save is synchronous and its cost
does not depend on the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CheckpointSchedule", "young_interval"]


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval ``sqrt(2 · C · M)``, seconds of work.

    Args:
        cost_s: ``C``, seconds one checkpoint save takes (>= 0).
        mtbf_s: ``M``, mean seconds between failures (>= 0; ``inf`` gives ``inf``).

    Raises:
        ValueError: a negative or NaN ``cost_s`` or ``mtbf_s``.
    """
    for name, v in (("cost_s", cost_s), ("mtbf_s", mtbf_s)):
        if not v >= 0:
            raise ValueError(f"checkpoint interval: {name!r} must be >= 0 s, got {v!r}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


@dataclass
class CheckpointSchedule:
    """Online Young interval of one run (module docstring). All times in seconds of simulated time.

    Attributes:
        failures: restarts that re-executed work since the last checkpoint, seen so far.
        measured_cost_s: duration of the last save (None before the first).
    """

    failures: int = 0
    measured_cost_s: float | None = None

    def mtbf(self, now_s: float) -> float:
        """``M = t / (n + 1)`` at run time ``now_s`` (0 at the start)."""
        return max(0.0, now_s) / (self.failures + 1)

    def cost(self, estimate_s: float) -> float:
        """``C``: the measured save seconds, or ``estimate_s`` before the first save."""
        return self.measured_cost_s if self.measured_cost_s is not None else estimate_s

    def interval(self, now_s: float, estimate_s: float) -> float:
        """``T_opt`` in seconds of work at run time ``now_s`` (``estimate_s``: the save-cost model)."""
        return young_interval(self.cost(estimate_s), self.mtbf(now_s))

    def due(self, work_s: float, now_s: float, estimate_s: float) -> bool:
        """Save now: ``work_s`` seconds of completed steps since the last checkpoint reach ``T_opt``."""
        return work_s > 0 and work_s >= self.interval(now_s, estimate_s)

    def saved(self, seconds: float) -> None:
        """Record a save that took ``seconds``."""
        self.measured_cost_s = float(seconds)

    def failed(self) -> None:
        """Record a failure (a restart that re-executes the work since the last checkpoint)."""
        self.failures += 1
