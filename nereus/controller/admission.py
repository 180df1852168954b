"""Admission: feasibility, the payback rule, the urgent path and the restart fallback (DESIGN.md §4.5).

Payback rule (paper §4.3, Eq. 2; after Pollux/Sia's re-allocation penalty, cost-model.md §4)::

    ΔL = L_step(S) − L_step(S*)        admit iff  ΔL > 0  and  L_tran / ΔL <= γ · H_x

``L_tran / ΔL`` is the payback period in steps; ``H_x`` the smallest horizon among the signals that
fired; ``γ ∈ [0, 1]`` a confidence margin (default 0.5). ``γ = 0`` admits only urgent transitions.

With ``waited = w > 0`` (the steps the job has run on since a payback rejection,
``nereus.controller.break_even``) a faster target is also admitted when ``L_tran / ΔL <= w``: the
saving forgone by waiting has paid for the move (the ski-rental break-even rule; off unless the
controller passes ``w``).

The urgent path (current plan invalid: GPUs lost or memory violated) waives profitability and takes
the fastest target whose transition is feasible; when none is, it falls back to checkpoint/restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.controller.decisions import Keep, Restart, Transition, TransitionCost
from nereus.spec.plan import Plan

__all__ = ["payback_steps", "payback_ok", "Option", "admit"]


def payback_steps(l_tran: float, delta_l: float) -> float:
    """Steps for the saving ``delta_l`` (s/step) to repay ``l_tran`` (s); inf when ``delta_l <= 0``."""
    return l_tran / delta_l if delta_l > 0 else float("inf")


def payback_ok(l_tran: float, delta_l: float, gamma: float, horizon: float) -> bool:
    """The payback rule ``L_tran / ΔL <= γ · H_x`` with ``ΔL > 0`` (so ``γ = 0`` rejects everything
    except a free transition with a positive saving, which has nothing to repay).

    Raises:
        ValueError: ``gamma`` < 0 or ``horizon`` <= 0.
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    if horizon <= 0:
        raise ValueError(f"horizon H_x must be > 0 steps, got {horizon!r}")
    if gamma == 0:
        return False
    return delta_l > 0 and payback_steps(l_tran, delta_l) <= gamma * horizon


@dataclass(frozen=True)
class Option:
    """A target plan with its transition estimate (admission's input).

    Attributes:
        plan: the target (estimated).
        cost: its ``L_tran`` estimate.
        expected_l: step time admission compares, s: ``plan.l_step`` plus the priced risk of losing
            trainable state (``nereus.controller.risk``); None means ``plan.l_step``.
        excluded: GPUs under a notice the move was planned not to read (``Transition.excluded``).
    """

    plan: Plan
    cost: TransitionCost
    expected_l: float | None = None
    excluded: frozenset = frozenset()

    @property
    def l_step(self) -> float:
        """The step time admission uses, s."""
        return self.plan.l_step if self.expected_l is None else self.expected_l


def admit(current_l_step: float, options: list[Option], *, gamma: float, horizon: float, urgent: bool,
          triggers: tuple[str, ...] = (), always: bool = False, waited: float = 0.0) -> Keep | Transition | Restart:
    """Decide among target options (fastest first; later ones are slower with cheaper transitions).

    Args:
        current_l_step: ``L_step`` of the current plan re-estimated for the current workload, s
            (``inf`` when the current plan is invalid), with the same risk pricing as the options.
        options: candidate targets in the order to try; may be empty (no feasible plan).
        gamma: payback margin γ.
        horizon: smallest ``H_x`` among the fired triggers, steps.
        urgent: the current plan is invalid: waive profitability, restart if nothing is feasible.
        always: admit any feasible faster target without the payback rule (the replan-on-every-trigger
            baseline).
        waited: steps run since a payback rejection, ``w`` (``break_even.py``); a faster feasible
            target with payback ``<= w`` steps is admitted even when it exceeds ``γ·H``.

    Returns:
        :class:`Transition`, :class:`Keep`, or (urgent only) :class:`Restart`.
    """
    feasible = [o for o in options if o.cost.feasible]
    if urgent:
        if feasible:
            o = feasible[0]
            skipped = len(options) - len(feasible)
            why = (f"urgent: current plan invalid ({', '.join(triggers) or 'unknown'}); profitability waived; "
                   f"L_step {o.plan.l_step:.1f}s, L_tran {o.cost.l_tran:.1f}s")
            if o.l_step > o.plan.l_step:
                why += f", state-loss risk or look-ahead {o.l_step - o.plan.l_step:.1f}s/step"
            if skipped:
                why += f"; {skipped} faster target(s) infeasible"
            return Transition(o.plan, o.cost, why, urgent=True,
                              delta_l=_delta(current_l_step, o.l_step), triggers=triggers,
                              excluded=o.excluded)
        if options:
            reasons = "; ".join(o.cost.reason for o in options if o.cost.reason)[:300]
            return Restart(options[0].plan, f"urgent and no feasible live transition ({reasons}); "
                           "checkpoint/restart", triggers, cause="infeasible_transition")
        return Restart(None, "urgent and no feasible plan fits the pool; checkpoint and wait for GPUs",
                       triggers, cause="no_plan")
    if not feasible:
        if not options:
            return Keep("replanned: no feasible target plan", triggers)
        return Keep(f"replanned: target transition infeasible ({options[0].cost.reason})", triggers)
    best = None
    for o in feasible:
        dl = _delta(current_l_step, o.l_step)
        if dl <= 0:
            continue
        if always:
            return Transition(o.plan, o.cost, f"replan-on-every-trigger: ΔL {dl:.2f}s/step, "
                              f"L_tran {o.cost.l_tran:.1f}s (no payback check)",
                              delta_l=dl, triggers=triggers, excluded=o.excluded)
        steps = payback_steps(o.cost.l_tran, dl)
        if payback_ok(o.cost.l_tran, dl, gamma, horizon):
            return Transition(o.plan, o.cost, f"payback {steps:.2f} steps <= γ·H = {gamma:g}·{horizon:.2f}; "
                              f"ΔL {dl:.2f}s/step, L_tran {o.cost.l_tran:.1f}s",
                              delta_l=dl, triggers=triggers, excluded=o.excluded)
        if waited > 0 and steps <= waited:
            return Transition(o.plan, o.cost, f"break-even: payback {steps:.2f} steps <= {waited:g} steps waited "
                              f"since the rejection (> γ·H = {gamma:g}·{horizon:.2f}); ΔL {dl:.2f}s/step, "
                              f"L_tran {o.cost.l_tran:.1f}s",
                              delta_l=dl, triggers=triggers, excluded=o.excluded)
        if best is None:
            best = (steps, dl, o)
    if best is None:
        return Keep("replanned: no target is faster than the current plan", triggers)
    steps, dl, o = best
    return Keep(f"replanned: payback {steps:.2f} steps > γ·H = {gamma:g}·{horizon:.2f} "
                f"(ΔL {dl:.2f}s/step, L_tran {o.cost.l_tran:.1f}s)", triggers)


def _delta(current: float, target: float) -> float:
    """``ΔL`` in seconds per step; 0 when the current plan is invalid (``current = inf``)."""
    return current - target if math.isfinite(current) else 0.0
