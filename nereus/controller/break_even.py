"""Break-even admission: a rejected move is admitted once the saving forgone by waiting has paid for it.

Why: the payback rule (``admission.py``) admits a move iff ``L_tran / ΔL <= γ · H``, so it is only as
good as ``H``, the expected steps the target will stay in effect. Right after a burst of pool changes
every estimate of ``H`` is a few steps (the loss process, ``pool_process``, has seen only short
intervals; the EMA of crossings is short by construction), and a move that would have repaid many
times over is turned down; when the pool then stays quiet no trigger fires again and the job runs on
the slower plan until the next change. Measured on the 13 shipped traces (Qwen3-32B GRPO, seed 0,
no notice, 2 h, ``benchmarks/bench_admission.py``): three such rejections cost 3,182 s, the run on
``spotserve-b`` 0.76x replan-on-every-trigger (H = 2.1 steps at the rejection, then 53 quiet steps);
with this rule 0.975x, and the Qwen geometric mean against replan-all 0.995x → 1.014x
(docs/simulate.md, Results, "Issue 29, third round").

Rule (the deterministic *ski-rental* strategy: rent until the rent paid equals the price, then buy;
Karlin, Manasse, Rudolph and Sleator, "Competitive snoopy caching", Algorithmica 3, 1988): after a
payback rejection the controller keeps running the current plan and counts the seconds that costs,
``F = w · r`` over the ``w`` steps since the rejection, with ``r`` the per-step saving the best rejected
target offers *at the current length* (``L_step(S) − L_step(S*)`` with the same risk pricing; the
look-ahead's amortized forced-transition charge is not a second a step actually loses, so it is not
counted). Once ``F >= L_tran`` of the cheapest rejected target it replans (a ``break-even`` trigger)
and admission takes a faster target whose payback, at the estimates of that replan, is at most the
``w`` steps waited (``admission.admit(waited=w)``; ``w · ΔL >= L_tran``: the saving forgone at the
current estimate has paid for it)::

    admit iff  L_tran / ΔL <= γ · H   or   L_tran / ΔL <= w

Whatever the true horizon ``T`` (steps the target would have lasted), waiting this way costs at most
twice the offline optimum for that one move: if ``T`` ends before the break-even point the move was
never made and nothing is lost against not moving (``F <= L_tran``); otherwise the job paid ``F ≈
L_tran`` in forgone savings plus ``L_tran``, against the ``L_tran`` the optimum pays. No constant is
chosen: the threshold is the move's own ``L_tran``. ``w`` is kept across consecutive payback
rejections (the job has been forgoing a faster plan all along; ``r`` and ``L_tran`` become the newest
rejection's, so a saving re-estimated lower is not counted at its old value) and dropped when the
plan changes, a replan finds nothing faster, or the run restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.controller.monitor import Trigger

__all__ = ["ForgoneSaving", "rejected_rate", "BREAK_EVEN"]

#: the trigger signal of a break-even replan
BREAK_EVEN = "break-even"


def rejected_rate(savings) -> tuple[float, float] | None:
    """``(r, L_tran)`` of a payback rejection from ``(saving s/step at the current length, L_tran s)`` of
    each faster feasible target: the largest positive saving and the smallest ``L_tran`` among the
    targets with a positive saving; None when none saves anything at the current length."""
    pos = [(r, lt) for r, lt in savings if r > 0]
    return (max(r for r, _ in pos), min(lt for _, lt in pos)) if pos else None


@dataclass
class ForgoneSaving:
    """The steps waited, and the seconds forgone, since a payback rejection (module docstring).

    Attributes:
        since: step of the first payback rejection of the pending run; None when nothing is pending.
        step: the last step counted.
        rate: seconds per step forgone, ``r``, at the newest rejection's estimate (> 0 while pending).
        l_tran: ``L_tran`` of the cheapest target of the newest rejection, s.
    """

    since: int | None = None
    step: int | None = None
    rate: float = 0.0
    l_tran: float = math.inf

    @property
    def pending(self) -> bool:
        return self.since is not None

    @property
    def waited(self) -> int:
        """Steps completed on the current plan since the first rejection (0 when nothing is pending)."""
        return self.step - self.since if self.pending else 0

    @property
    def forgone(self) -> float:
        """``F = waited · r``, s: the saving forgone so far at the newest estimate of ``r``."""
        return self.waited * self.rate

    def reject(self, step: int, rate: float, l_tran: float) -> None:
        """Record a payback rejection at ``step``: the best rejected target saves ``rate`` s per step
        now, the cheapest costs ``l_tran`` s. A ``rate`` <= 0 (nothing faster at the current length)
        or a non-finite ``l_tran`` clears the count; otherwise the steps waited keep counting from the
        first rejection of the run.

        Raises:
            ValueError: a negative ``l_tran``.
        """
        if l_tran < 0:
            raise ValueError(f"L_tran must be >= 0 s, got {l_tran!r}")
        if not (rate > 0 and math.isfinite(rate) and math.isfinite(l_tran)):
            self.clear()
            return
        self.advance(step)
        if self.since is None:
            self.since = step
        self.step, self.rate, self.l_tran = step, float(rate), float(l_tran)

    def advance(self, step: int) -> None:
        """Count the steps completed on the current plan up to ``step``; a step before the last one
        counted (the run was rewound) clears the count."""
        if self.step is None:
            return
        if step < self.step:
            self.clear()
            return
        self.step = step

    def due(self) -> bool:
        """``F >= L_tran``: the forgone saving has paid for the cheapest rejected move."""
        return self.pending and self.forgone >= self.l_tran

    def trigger(self, step: int) -> Trigger:
        """The opportunistic ``break-even`` trigger at ``step``: value ``F``, reference ``L_tran``,
        horizon the steps waited (at least 1)."""
        return Trigger(BREAK_EVEN, False, self.forgone, self.l_tran, float(max(1, self.waited)),
                       f"{self.forgone:.1f}s forgone in {self.waited} steps since the payback rejection at "
                       f"step {self.since} >= L_tran {self.l_tran:.1f}s")

    def clear(self) -> None:
        self.since, self.step, self.rate, self.l_tran = None, None, 0.0, math.inf
