"""Monitor: per-step signals, urgent and opportunistic triggers, reference values (DESIGN.md §4.5).

Signals read at every safe boundary (a :class:`StepReport`):

* ``seq_len``: mean response length of the step, tokens (opportunistic, ``δ = 30%``);
* ``pool``: the GPU pool ``P_gpu`` (urgent when it changes);
* ``peak_memory``: measured peaks per model-stage (they calibrate the memory model; a *predicted*
  violation on the current plan is urgent);
* ``eff:<op class>``: achieved efficiency per op class after calibration (opportunistic, ``δ = 20%``).

An opportunistic signal ``x`` fires when ``|x − ref_x| / ref_x > δ_x``, where ``ref_x`` is its value at
the last replan. References are reset after **every** replan, admitted or not (paper §4.1), so a
persistent deviation does not retrigger at every step while steady growth produces repeated crossings.
Each firing is a crossing that updates ``H_x`` (``horizon.py``); a pool change is a crossing of ``pool``.

Opt-in extension beyond the paper (``Monitor(grow_horizon=True)``): a pool change that removes
GPUs is also a crossing of ``pool:loss``. For a change that only *adds* GPUs the trigger carries
``H_pool:loss`` (steps until GPUs next leave) instead of ``H_pool`` once a loss interval is known:
the paper's ``H_pool`` is the time until the pool changes again, but a later growth leaves the
target valid and still faster than the current plan, so the saving lasts until GPUs leave. On spot
traces changes come in same-direction bursts (Bamboo p3: 65 changes in the first 4 h in 26 runs of
one direction), which makes ``H_pool`` 2–3 steps and rejects growth transitions that pay back in
under two steps. Measured (benchmarks/bench_admission.py, 6 runs): no throughput change on
average (geometric mean 1.00x against the paper's rule), so it is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.controller.horizon import FIRST_HORIZONS, Horizon

__all__ = ["StepReport", "Trigger", "Monitor", "DEFAULT_THRESHOLDS", "POOL_LOSS"]

#: the horizon of pool changes that remove GPUs (module docstring).
POOL_LOSS = "pool:loss"

#: relative drift thresholds δ_x; ``eff:*`` applies to every op class (paper §7: δ_len = 30%).
DEFAULT_THRESHOLDS = {"seq_len": 0.30, "eff:*": 0.20}


@dataclass(frozen=True)
class StepReport:
    """What the executor measured in one RL step, delivered at its safe boundary.

    Attributes:
        step: RL step index just completed (0-based).
        response_len: mean generated tokens per response in that step.
        pool: GPU ids available now and for the next step (``P_gpu``); GPUs under a preemption
            notice are not in it.
        alive: GPU ids still running, including those under a preemption notice (state on them can
            still be read); None means the same as ``pool``.
        step_time: measured seconds of the step (0 when it did not complete).
        op_seconds: model-stage → op class → measured seconds (framework instrumentation).
        peak_memory: model-stage → measured peak bytes per GPU.
        oom: True when the step ran out of memory (the current plan is then invalid).
        elapsed_s: seconds since the job started, by the executor's clock (None: unknown; the
            loss-rate estimate then sums step times).
        transition_s: measured seconds of the transition applied at the previous boundary, without
            the teardown of communicators with dead ranks (None: none was applied, or not measured);
            calibrates ``L_tran`` (``nereus.controller.transition_calibration``).
        leave_in_s: GPU id → seconds from this report until that GPU stops, for each GPU under a
            preemption notice (in ``alive``, not in ``pool``); None or empty: none announced
            (``nereus.controller.notice``).
    """

    step: int
    response_len: float
    pool: frozenset
    step_time: float = 0.0
    op_seconds: dict = field(default_factory=dict)
    peak_memory: dict = field(default_factory=dict)
    oom: bool = False
    alive: frozenset | None = None
    elapsed_s: float | None = None
    transition_s: float | None = None
    leave_in_s: dict | None = None

    def __post_init__(self) -> None:
        if not (self.response_len > 0):
            raise ValueError(f"step report field 'response_len' must be > 0 tokens, got {self.response_len!r}")
        if self.step < 0:
            raise ValueError(f"step report field 'step' must be >= 0, got {self.step!r}")
        if self.transition_s is not None and not self.transition_s >= 0:
            raise ValueError(f"step report field 'transition_s' must be >= 0 s or None, got {self.transition_s!r}")
        bad = {g: s for g, s in (self.leave_in_s or {}).items() if not s >= 0}
        if bad:
            raise ValueError(f"step report field 'leave_in_s' must map GPU ids to seconds >= 0, got {bad!r}")


@dataclass(frozen=True)
class Trigger:
    """One signal that fired.

    Attributes:
        signal: ``pool``, ``memory``, ``seq_len`` or ``eff:<op class>``.
        urgent: pool change or predicted memory violation.
        value, reference: the signal now and at the last replan (GPU counts for ``pool``).
        horizon: ``H_x`` in steps after this crossing was recorded.
        reason: text for logs.
    """

    signal: str
    urgent: bool
    value: float
    reference: float
    horizon: float
    reason: str

    def to_dict(self) -> dict:
        return {"signal": self.signal, "urgent": self.urgent, "value": self.value,
                "reference": self.reference, "horizon": self.horizon, "reason": self.reason}


@dataclass
class Monitor:
    """Tracks reference values and ``H_x`` per signal and reports which triggers fire.

    Attributes:
        thresholds: δ_x per opportunistic signal (``eff:*`` covers all op classes).
        alpha: EMA weight for ``H_x``.
        grow_horizon: a pure pool growth carries ``H_pool:loss`` (module docstring; off by default).
        first_horizon: ``H_x`` at a signal's first crossing: ``"one"`` (the paper's rule, default)
            or ``"elapsed"`` (the steps since monitoring began; ``nereus.controller.horizon``).

    Raises:
        ValueError: a threshold that is not > 0, or an unknown ``first_horizon``.
    """

    thresholds: dict = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    alpha: float = 0.5
    grow_horizon: bool = False
    first_horizon: str = "one"
    started: int | None = None
    references: dict = field(default_factory=dict)
    pool_reference: frozenset | None = None
    horizons: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k, v in self.thresholds.items():
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"threshold δ for signal {k!r} must be > 0, got {v!r}")
        if self.first_horizon not in FIRST_HORIZONS:
            raise ValueError(f"monitor field 'first_horizon' must be one of {', '.join(FIRST_HORIZONS)}, "
                             f"got {self.first_horizon!r}")

    def threshold(self, signal: str) -> float | None:
        if signal in self.thresholds:
            return self.thresholds[signal]
        if signal.startswith("eff:"):
            return self.thresholds.get("eff:*")
        return None

    def horizon(self, signal: str) -> Horizon:
        if signal not in self.horizons:
            self.horizons[signal] = Horizon(alpha=self.alpha, first=self.first_horizon, started=self.started or 0)
        return self.horizons[signal]

    def check(self, step: int, values: dict, pool: frozenset, memory_violation: bool = False,
              memory_reason: str = "") -> list[Trigger]:
        """Triggers that fire at ``step`` (crossings update ``H_x``); references are not touched.

        Args:
            step: RL step just completed.
            values: opportunistic signal name → value (``seq_len``, ``eff:<class>``).
            pool: current ``P_gpu``.
            memory_violation: the cost model predicts the current plan exceeds capacity (or it OOMed).
        """
        fired: list[Trigger] = []
        if self.started is None:
            self.started = step
        if self.pool_reference is None:
            self.pool_reference = frozenset(pool)
        elif frozenset(pool) != self.pool_reference:
            h = self.horizon("pool").crossing(step)
            shrank = bool(self.pool_reference - frozenset(pool))
            if shrank:
                self.horizon(POOL_LOSS).crossing(step)
            elif self.grow_horizon and self.horizon(POOL_LOSS).ema is not None:
                # a pure growth: the target's gain lasts until GPUs leave again (a later growth does
                # not undo it), so its payback window is the EMA of intervals between losses
                h = self.horizon(POOL_LOSS).value
            fired.append(Trigger("pool", True, len(pool), len(self.pool_reference), h,
                                 f"P_gpu changed {len(self.pool_reference)} -> {len(pool)} GPUs"))
        if memory_violation:
            fired.append(Trigger("memory", True, 1.0, 0.0, self.horizon("memory").value,
                                 memory_reason or "predicted memory violation on the current plan"))
        for name, x in sorted(values.items()):
            delta = self.threshold(name)
            if delta is None:
                continue
            ref = self.references.get(name)
            if ref is None:
                self.references[name] = x
                continue
            drift = abs(x - ref) / abs(ref) if ref else float("inf")
            if drift > delta:
                h = self.horizon(name).crossing(step)
                fired.append(Trigger(name, False, x, ref, h,
                                     f"{name} drifted {drift:.0%} (> δ={delta:.0%}): {ref:.4g} -> {x:.4g}"))
        return fired

    def reset(self, values: dict, pool: frozenset) -> None:
        """Reset every reference to its current value (called after every replan, admitted or not)."""
        for name, x in values.items():
            if self.threshold(name) is not None:
                self.references[name] = x
        self.pool_reference = frozenset(pool)
