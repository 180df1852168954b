"""``H_x``: expected steps until signal ``x`` next crosses its threshold (DESIGN.md §4.5).

``H_x`` is an exponential moving average of the intervals (in RL steps) between crossings of ``x``,
updated only at crossings (not at telemetry samples or admitted transitions). Before the first
interval is seen it is 1 step (the paper's §4.3: "Before the first interval is observed, H_x is one
step"), which makes the payback rule strict until the signal's rhythm is known.

Update at a crossing at step ``s`` with previous crossing ``s0`` and interval ``i = s - s0``::

    H ← i                      on the first interval
    H ← α·i + (1 − α)·H        afterwards (α = ``alpha``, default 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Horizon"]


@dataclass
class Horizon:
    """EMA of crossing intervals of one signal.

    Attributes:
        alpha: EMA weight of the newest interval, in (0, 1].
        last_crossing: step of the last crossing (None before the first).
        ema: current EMA in steps (None before the first interval).

    Raises:
        ValueError: ``alpha`` outside (0, 1].
    """

    alpha: float = 0.5
    last_crossing: int | None = None
    ema: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1):
            raise ValueError(f"horizon alpha must be in (0, 1], got {self.alpha!r}")

    def crossing(self, step: int) -> float:
        """Record a crossing at ``step``; returns the updated ``H`` in steps."""
        if self.last_crossing is not None and step > self.last_crossing:
            interval = step - self.last_crossing
            self.ema = float(interval) if self.ema is None else self.alpha * interval + (1 - self.alpha) * self.ema
        self.last_crossing = step
        return self.value

    @property
    def value(self) -> float:
        """``H_x`` in steps (1 before the first interval)."""
        return 1.0 if self.ema is None else self.ema
