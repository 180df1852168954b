"""``H_x``: expected steps until signal ``x`` next crosses its threshold (DESIGN.md §4.5).

``H_x`` is an exponential moving average of the intervals (in RL steps) between crossings of ``x``,
updated only at crossings (not at telemetry samples or admitted transitions). Before the first
interval is seen it is 1 step (the paper's §4.3: "Before the first interval is observed, H_x is one
step"), which makes the payback rule strict until the signal's rhythm is known.

Update at a crossing at step ``s`` with previous crossing ``s0`` and interval ``i = s - s0``::

    H ← i                      on the first interval
    H ← α·i + (1 − α)·H        afterwards (α = ``alpha``, default 0.5)

Opt-in prior before the first interval (``Horizon(first="elapsed", started=s_0)``, used by the
simulator's ``nereus`` policy through ``Monitor(first_horizon="elapsed")``): at the first crossing,
at step ``s``, the signal has been quiet since monitoring began at ``s_0``, so that quiet time is
taken as the first interval::

    H ← max(1, s − s_0)        at the first crossing
    H ← α·i + (1 − α)·H        afterwards, as above

A signal that has been quiet for ``s − s_0`` steps is expected to stay quiet for about as long
again (the "Lindy" / Copernican estimate, Gott, Nature 363, 1993; for a memoryless process it is the
maximum-likelihood estimate of the mean interval from one censored observation). With the paper's
``H = 1`` every move made at the first crossing has to repay within γ steps, so growth that repays
in two steps is rejected however long the pool had been stable (issue 15: a run stayed on 20 of 32
GPUs for about 100 steps). The prior only changes the first crossing; the EMA takes over after it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Horizon", "FIRST_HORIZONS"]

#: what ``H_x`` is at the first crossing: ``one`` (the paper's rule) or ``elapsed`` (steps since
#: monitoring began; module docstring).
FIRST_HORIZONS = ("one", "elapsed")


@dataclass
class Horizon:
    """EMA of crossing intervals of one signal.

    Attributes:
        alpha: EMA weight of the newest interval, in (0, 1].
        first: ``"one"`` (paper: 1 until an interval is seen) or ``"elapsed"`` (the first crossing
            takes the steps since ``started`` as its interval).
        started: step at which the signal began to be monitored (for ``first="elapsed"``).
        last_crossing: step of the last crossing (None before the first).
        ema: current EMA in steps (None before the first interval).

    Raises:
        ValueError: ``alpha`` outside (0, 1], an unknown ``first`` or a negative ``started``.
    """

    alpha: float = 0.5
    last_crossing: int | None = None
    ema: float | None = None
    first: str = "one"
    started: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1):
            raise ValueError(f"horizon alpha must be in (0, 1], got {self.alpha!r}")
        if self.first not in FIRST_HORIZONS:
            raise ValueError(f"horizon field 'first' must be one of {', '.join(FIRST_HORIZONS)}, got {self.first!r}")
        if isinstance(self.started, bool) or not isinstance(self.started, int) or self.started < 0:
            raise ValueError(f"horizon field 'started' must be a step >= 0, got {self.started!r}")

    def crossing(self, step: int) -> float:
        """Record a crossing at ``step``; returns the updated ``H`` in steps."""
        if self.last_crossing is None and self.first == "elapsed":
            self.ema = float(max(1, step - self.started))
        elif self.last_crossing is not None and step > self.last_crossing:
            interval = step - self.last_crossing
            self.ema = float(interval) if self.ema is None else self.alpha * interval + (1 - self.alpha) * self.ema
        self.last_crossing = step
        return self.value

    @property
    def value(self) -> float:
        """``H_x`` in steps (1 before the first interval is known)."""
        return 1.0 if self.ema is None else self.ema
