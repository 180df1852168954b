"""Calibration of ``L_tran`` from measured transitions: the payback rule's price, in seconds it costs.

Why: the payback rule (``admission.py``) and break-even admission (``break_even.py``) compare a
move's saving with its ``L_tran``, so a transition estimate that is low on average admits moves that
do not repay. The controller already calibrates step times and memory from measurements
(``planning.py``); transitions are measured too: the executor knows how long each one took. In the
simulator the true transition time is the DAG estimate times 1.3 times a log-normal tail
(docs/simulate.md, "The simulated cluster"); on the 13 shipped traces (seed 0, 2 h) the measured /
estimated ratio of the transitions Nereus and replan-all made (estimates over 5 s) had a mean of
1.33 (8B), 1.41 (Qwen3-32B GRPO) and 1.24 (Llama-3.3-70B PPO).

Estimator: the ratio of sums over the transitions applied so far (estimate ``e_i``, measured
``m_i``, seconds)::

    scale = Σ m_i / Σ e_i        (1 before the first measured transition)

and every ``L_tran`` the controller compares is ``scale · L_tran(estimate)``. The ratio of sums is
the least-squares slope through the origin weighted by ``1 / e_i``: it estimates the expected seconds
per estimated second, the quantity an expected-value rule needs, and a transition of 0.1 s (a
reshard inside a node) does not move it as much as a 200 s engine restart. Only what the executor
attributes to the transition itself is measured (``StepReport.transition_s``): the teardown of
communicators with dead ranks after an unannounced loss is failure handling, the same whatever the
target, and is not in the estimate either. No constant is chosen.

Measured (``nereus+tcal`` against ``nereus``, the same 13 traces, seed 0, 2 h): 0.996x on 8B and
0.993x on Qwen3-32B GRPO; the ratio from a run's first few transitions is noisy (one 116 s estimate
measured at 70 s lowers every later price), so the simulator's ``nereus`` leaves it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.controller.decisions import Transition, TransitionCost

__all__ = ["TransitionCalibration"]


@dataclass
class TransitionCalibration:
    """Σ measured / Σ estimated transition seconds (module docstring).

    Attributes:
        enabled: apply the scale (:meth:`apply`); when False the sums are still kept and ``L_tran``
            is used as estimated.
        measured, estimated: sums over the transitions measured so far, s.
        count: transitions measured.
        pending: the estimate of the transition decided at the last boundary, awaiting its measurement.
    """

    enabled: bool = True
    measured: float = 0.0
    estimated: float = 0.0
    count: int = 0
    pending: float | None = None

    @property
    def scale(self) -> float:
        """Measured seconds per estimated second (1 before any measured transition, or when disabled)."""
        return self.measured / self.estimated if self.enabled and self.estimated > 0 else 1.0

    def apply(self, cost: TransitionCost) -> TransitionCost:
        """``cost`` with ``l_tran`` times :attr:`scale` (unchanged when the scale is 1 or ``l_tran`` infinite)."""
        s = self.scale
        return replace(cost, l_tran=cost.l_tran * s) if s != 1.0 and math.isfinite(cost.l_tran) else cost

    def decided(self, decision) -> None:
        """The controller's decision at a boundary: for a :class:`Transition` (its estimate as returned
        by :meth:`apply`) the measurement comes in the next report (:meth:`observe`), and the unscaled
        estimate ``l_tran / scale`` is kept (an infinite one is not); any other decision has none."""
        est = decision.estimate.l_tran if isinstance(decision, Transition) else math.inf
        self.pending = est / self.scale if math.isfinite(est) else None

    def observe(self, measured_s: float | None) -> None:
        """The seconds the pending transition took (None: not measured, e.g. it was aborted): added
        to the sums when a transition is pending; the pending estimate is consumed either way.

        Raises:
            ValueError: a negative measurement.
        """
        if measured_s is not None and measured_s < 0:
            raise ValueError(f"measured transition time must be >= 0 s, got {measured_s!r}")
        if self.pending is not None and measured_s is not None:
            self.measured += float(measured_s)
            self.estimated += self.pending
            self.count += 1
        self.pending = None
