"""Controller decisions as data: :class:`Keep`, :class:`Transition`, :class:`Restart`.

A decision is produced by admission (``admission.py``) and applied by an executor: the simulated
cluster (``nereus.sim``) or the runtime. Each one carries a ``reason`` in words and serializes to
JSON with :func:`decision_to_dict` (DESIGN.md §3 "decisions are data").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from nereus.spec.plan import Plan

__all__ = ["TransitionCost", "Keep", "Transition", "Restart", "Decision", "decision_to_dict", "RESTART_CAUSES"]

#: The controller's restart causes (see :class:`Restart`).
RESTART_CAUSES = ("state_lost", "infeasible_transition", "no_plan")


@dataclass(frozen=True)
class TransitionCost:
    """Predicted cost of moving from the current plan to a target (``L_tran``).

    Attributes:
        l_tran: seconds on the transition's critical path (state movement plus communicator setup).
        feasible: False when no schedule keeps memory, pool and state-copy invariants (DESIGN.md §4.6).
        bytes_moved: bytes of parameter and optimizer state sent over links.
        source: ``"dag"`` (``nereus.transition.estimate_transition``) or ``"bytes/bandwidth"`` (the
            fallback estimate of ``transition_cost.py``).
        reason: why it is infeasible, or how it was estimated.
    """

    l_tran: float
    feasible: bool = True
    bytes_moved: float = 0.0
    source: str = "bytes/bandwidth"
    reason: str = ""

    def __post_init__(self) -> None:
        if not (self.l_tran >= 0):
            raise ValueError(f"transition cost l_tran must be >= 0 seconds, got {self.l_tran!r}")

    def to_dict(self) -> dict:
        return {"l_tran": self.l_tran if self.l_tran != float("inf") else None, "feasible": self.feasible, "bytes_moved": self.bytes_moved,
                "source": self.source, "reason": self.reason}


@dataclass(frozen=True)
class Keep:
    """Stay on the current plan.

    Attributes:
        reason: why (no trigger, target infeasible, payback too long...).
        triggers: names of the signals that fired this step (empty when none did).
    """

    reason: str
    triggers: tuple[str, ...] = ()
    kind: str = field(default="keep", init=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "triggers": list(self.triggers)}


@dataclass(frozen=True)
class Transition:
    """Move live state to ``plan`` at the next safe boundary.

    Attributes:
        plan: the target plan ``S*`` (estimated, placed on concrete GPUs).
        estimate: its :class:`TransitionCost` (``L_tran``; carries the DAG's numbers when it exists).
        reason: why it was admitted (payback numbers, or the urgent cause).
        urgent: True when admitted on the urgent path (profitability waived).
        delta_l: predicted per-step saving ``L_step(S) - L_step(S*)`` in seconds (may be < 0 when urgent).
        triggers: names of the signals that fired.
        excluded: GPU ids under a preemption notice that the move must not read: a whole replica of
            the trained state stays on the other GPUs, so the move is planned as if these were gone
            and cannot be cut short by their leaving (``nereus.controller.notice.notice_cost``);
            empty for an ordinary move.
    """

    plan: Plan
    estimate: TransitionCost
    reason: str
    urgent: bool = False
    delta_l: float = 0.0
    triggers: tuple[str, ...] = ()
    kind: str = field(default="transition", init=False)
    excluded: frozenset = frozenset()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "urgent": self.urgent, "delta_l": self.delta_l,
                "triggers": list(self.triggers), "estimate": self.estimate.to_dict(),
                "plan": self.plan.to_dict()} | ({"excluded": sorted(self.excluded)} if self.excluded else {})


@dataclass(frozen=True)
class Restart:
    """Checkpoint/restart: the urgent path found no transition that keeps the job running.

    Attributes:
        plan: the plan to restart on, or None when nothing fits the pool (wait for GPUs).
        reason: why live adaptation was impossible (no feasible plan, lost state, infeasible DAG).
        triggers: names of the signals that fired.
        checkpoint_first: a full copy of the trained state is still alive, so save a checkpoint now
            and lose no progress; False when the last copy is gone (restore the last checkpoint).
        cause: why, as one word for counting (:data:`RESTART_CAUSES`): ``state_lost`` (every
            replica of a ``*.train`` model-stage was on lost GPUs), ``infeasible_transition`` (a
            target exists but no live transition to it is feasible), ``no_plan`` (nothing fits the
            pool); executors may add their own (the simulator: ``transition_overrun``,
            ``static_policy``). Empty when unknown.
    """

    plan: Plan | None
    reason: str
    triggers: tuple[str, ...] = ()
    checkpoint_first: bool = False
    cause: str = ""
    kind: str = field(default="restart", init=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "reason": self.reason, "triggers": list(self.triggers),
                "checkpoint_first": self.checkpoint_first, "cause": self.cause,
                "plan": None if self.plan is None else self.plan.to_dict()}


Decision = Keep | Transition | Restart


def decision_to_dict(decision: Decision) -> dict:
    """JSON-ready dict of any decision (``json.dumps`` works on the result)."""
    d = decision.to_dict()
    json.dumps(d)  # fail here, not in a log writer, if something is not serializable
    return d
