"""Look-ahead for plan choice: the response-length trend and the window a new plan has to last.

Why: plans chosen for the current response length go infeasible as responses grow, and each time
the memory trigger forces an urgent transition (profitability waived) that a plan chosen for the
coming lengths would not need (issue 29). When the controller replans it knows the length trend and
how long the target is expected to stay in effect, so it compares targets over that window.

Trend (:class:`LengthTrend`): ordinary least squares of ``log(mean response length)`` on the step
index over the last ``window`` steps (default 50), giving the relative growth per step ``g`` and the
residual standard deviation ``σ`` of ``log(length)``. Why 50: with the noise of the real verl logs
(σ ≈ 0.017, ``nereus.sim.growth``) the standard error of the slope, ``σ·sqrt(12 / W³)``, is 1.7e-4
per step at ``W = 50``, a sixteenth of the paper's growth rate (0.28% per step), while 50 steps
stay short against the 1,000 steps of the paper's growth.

Window (:func:`window_steps`): the target stays in effect until the next replan the controller is
sure to make, the next ``seq_len`` crossing (the monitor fires when the length drifts by ``δ``), or
until the pool loses GPUs (``nereus.controller.pool_process``), whichever is expected first::

    W = min(ln(1 + δ) / g,  H_loss)        (steps; W >= 1)

Projected length (:meth:`LengthTrend.ahead`): the trend's value now times ``exp(g·W)`` times
``exp(2σ)``: memory is sized for the upper 97.7% one-sided quantile of a log-normal step mean, the
headroom a response-length distribution needs above its trend.

Objective (used by the controller): each plan ``S`` (the current one and every target) is scored by
its mean step time over the window, approximated by the mean of ``L_step`` at the current and the
projected length, plus, when ``S`` does not fit memory at the projected length, the forced
transition it will need, charged over the window::

    L_eff(S) = (L_step(S, now) + L_step(S, ahead)) / 2 + [S infeasible ahead] · L_tran(S → S_ahead) / W

where ``S_ahead`` is the planner's best plan for the projected length. The payback rule then
compares ``L_eff`` of the current plan and of the target (``ΔL = L_eff(S) − L_eff(S*)``), and
targets are tried in the order of ``L_tran + W · L_eff`` (the window's total seconds).
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["LengthTrend", "window_steps", "TREND_WINDOW", "MIN_POINTS", "QUANTILE_Z"]

#: steps of history for the trend fit (module docstring).
TREND_WINDOW = 50
#: fewest steps before a trend is used.
MIN_POINTS = 10
#: one-sided normal quantile for the memory headroom above the trend (97.7%).
QUANTILE_Z = 2.0


class LengthTrend:
    """Least-squares trend of log response length over the last ``window`` steps.

    Args:
        window: steps of history kept (>= ``MIN_POINTS``).

    Raises:
        ValueError: a window below ``MIN_POINTS``; a non-positive length.
    """

    def __init__(self, window: int = TREND_WINDOW):
        if isinstance(window, bool) or not isinstance(window, int) or window < MIN_POINTS:
            raise ValueError(f"length trend field 'window' must be an integer >= {MIN_POINTS} steps, got {window!r}")
        self.points: deque = deque(maxlen=window)

    def observe(self, step: int, length: float) -> None:
        """Record the mean response length (tokens) of ``step``."""
        if not length > 0:
            raise ValueError(f"response length must be > 0 tokens, got {length!r}")
        if self.points and step <= self.points[-1][0]:
            self.points.clear()  # the run was rewound (a restart redoes steps): start the fit again
        self.points.append((step, math.log(length)))

    def fit(self) -> tuple[float, float, float] | None:
        """``(log length at the last step, growth per step g, residual σ)``; None with too few points."""
        n = len(self.points)
        if n < MIN_POINTS:
            return None
        xs = [p[0] for p in self.points]
        ys = [p[1] for p in self.points]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            return None
        g = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        res = [y - (my + g * (x - mx)) for x, y in zip(xs, ys)]
        sigma = math.sqrt(sum(r * r for r in res) / (n - 2)) if n > 2 else 0.0
        return my + g * (xs[-1] - mx), g, sigma

    def ahead(self, steps: float) -> float | None:
        """Projected length ``steps`` ahead with the ``QUANTILE_Z·σ`` headroom, tokens (None: no fit)."""
        f = self.fit()
        if f is None:
            return None
        y, g, sigma = f
        return math.exp(y + max(0.0, g) * max(0.0, steps) + QUANTILE_Z * sigma)


def window_steps(growth: float, delta: float, loss_horizon: float) -> float:
    """``W = min(ln(1 + δ) / g, H_loss)`` in steps, at least 1; ``H_loss`` alone when ``g <= 0``.

    Raises:
        ValueError: ``delta`` <= 0 or ``loss_horizon`` <= 0.
    """
    if not delta > 0:
        raise ValueError(f"drift threshold δ must be > 0, got {delta!r}")
    if not loss_horizon > 0:
        raise ValueError(f"loss horizon must be > 0 steps, got {loss_horizon!r}")
    cross = math.log1p(delta) / growth if growth > 0 else math.inf
    return max(1.0, min(cross, loss_horizon))
