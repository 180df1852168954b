"""``H_pool`` from a model of pool changes as a point process, not an EMA of crossing intervals.

Why: on spot traces pool changes come in bursts (Bamboo p3: 65 changes in the first 4 h, a third of
them within 2 minutes of the previous one). The EMA of crossing intervals (``horizon.py``) then says
1–3 steps after every change of a burst, and the payback rule rejects growth transitions that would
have repaid many times over (issue 29: a 70B PPO job stayed on 38 of 64 GPUs for 18 steps of 3
minutes, rejecting a move with a payback of 1.2 steps).

Model (all times in seconds of the executor's clock, ``StepReport.elapsed_s``):

* **directions**: a pool change that removes GPUs is a *loss* event, one that only adds GPUs a *gain*
  event; each direction has its own rate (events per second, for reports). With a preemption notice
  the loss is the announcement: announced GPUs leave ``P_gpu`` when the notice arrives, so the event
  is recorded then (the target never uses them).
* **what a move needs**: a transition admitted at a pool change repays while the target keeps its
  GPUs; a later *gain* leaves it valid (and may be followed by another move), a *loss* may not. So
  the horizon of a pool trigger is the expected time until the next loss, whatever the direction of
  the change that fired it.
* **time to the next loss**: the loss process is a renewal process with the empirical distribution of
  the inter-loss intervals seen so far; the expected time left at age ``a`` (seconds since the last
  loss, or since monitoring began before any) is its *mean residual life*, with the current
  (censored) interval counted once as "as long again" (Gott's Copernican estimate, Nature 363, 1993,
  the same prior as the ``elapsed`` first horizon of ``horizon.py``)::

      H(a) = mean({x − a : x ∈ intervals, x > a} ∪ {a})

  The quiet time before the first loss counts as the first interval (the same prior).
* **bursts**: clustered losses appear as a mass of short intervals. Right after a loss (``a`` ≈ 0)
  they pull ``H`` down (a loss is often followed by another); once the pool has been quiet for
  longer than a burst's gaps, intervals shorter than ``a`` drop out of the mean and ``H`` is the
  residual of the long, between-burst intervals. No burst threshold is chosen.

Assumptions: the intervals are independent draws of one distribution (no trend within the run; a
change of regime is learned only as new intervals arrive); a loss hits the target (in the simulator
the GPUs that arrived last leave first, so a growth target is the most exposed); the step time to
convert seconds into steps is the current one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PoolProcess"]


@dataclass
class PoolProcess:
    """Loss and gain events of ``P_gpu`` and the expected seconds until the next loss.

    Attributes:
        started: clock at the first observation, s (None before it).
        last_loss: clock of the last loss event, s (None before the first).
        intervals: seconds between consecutive losses (the first from ``started``).
        losses, gains: events seen per direction.
        now: clock of the last observation, s.
    """

    started: float | None = None
    last_loss: float | None = None
    intervals: list = field(default_factory=list)
    losses: int = 0
    gains: int = 0
    now: float = 0.0
    _pool: frozenset | None = field(default=None, repr=False)

    def observe(self, pool: frozenset, now_s: float) -> str | None:
        """Record ``P_gpu`` at clock ``now_s`` (s, non-decreasing); returns ``"loss"``, ``"gain"`` or None.

        Raises:
            ValueError: a clock that goes backwards.
        """
        if self.started is not None and now_s < self.now:
            raise ValueError(f"pool process clock must not go backwards: {now_s!r} < {self.now!r}")
        pool = frozenset(pool)
        if self.started is None:
            self.started, self.now, self._pool = float(now_s), float(now_s), pool
            return None
        self.now = float(now_s)
        kind = None
        if self._pool - pool:
            kind = "loss"
            ref = self.last_loss if self.last_loss is not None else self.started
            self.intervals.append(self.now - ref)
            self.last_loss = self.now
            self.losses += 1
        elif pool - self._pool:
            kind = "gain"
            self.gains += 1
        self._pool = pool
        return kind

    def rate(self, direction: str) -> float:
        """Events per second of ``direction`` (``loss`` or ``gain``) over the observed time (0 before any).

        Raises:
            ValueError: an unknown direction.
        """
        if direction not in ("loss", "gain"):
            raise ValueError(f"direction must be 'loss' or 'gain', got {direction!r}")
        t = self.now - (self.started or 0.0)
        n = self.losses if direction == "loss" else self.gains
        return n / t if t > 0 else 0.0

    def age(self) -> float:
        """Seconds since the last loss (since the first observation before any), >= 0."""
        ref = self.last_loss if self.last_loss is not None else (self.started or 0.0)
        return max(0.0, self.now - ref)

    def horizon_s(self) -> float:
        """Expected seconds until the next loss: the mean residual life at :meth:`age` (module docstring)."""
        a = self.age()
        rest = [x - a for x in self.intervals if x > a]
        return (sum(rest) + a) / (len(rest) + 1)

    def horizon_steps(self, step_s: float) -> float:
        """:meth:`horizon_s` in steps of ``step_s`` seconds, at least 1.

        Raises:
            ValueError: ``step_s`` <= 0.
        """
        if not step_s > 0:
            raise ValueError(f"step time must be > 0 s, got {step_s!r}")
        return max(1.0, self.horizon_s() / step_s)
