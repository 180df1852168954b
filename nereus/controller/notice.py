"""Preemption notices: what can still be done before announced GPUs leave.

Why (issue 29, sixth round): with a 120 s notice the controller took urgent moves whose estimated
``L_tran`` was 215 s, reading state from GPUs that left 120 s later. Such a move cannot finish: the
executor loses the notice window and restarts anyway, without the checkpoint it could have saved
in that window (70B PPO on ``oobleck-p3``, ``nereus+margin``, seed 0, 2 h: two such overruns, 1,700 s
of restart and redone steps). Cloud providers announce the time at which an instance goes (AWS
spot: two minutes, the instance-action time in the metadata; GCP preemptible VMs: 30 s), so the
executor reports it: ``StepReport.leave_in_s`` maps each announced GPU to the seconds left.

Rules (pure; the controller applies them, ``controller.py``):

* :func:`notice_window`: a live transition from ``current`` to ``target`` reads from its source GPUs,
  those of ``current`` that ``target`` does not use (the simulator's ``overrun_at`` uses the same
  set); it must end before the first of them that is announced leaves.
* :func:`within_notice`: a transition estimate longer than that window is infeasible ("exceeds the
  notice window"), so admission takes a slower target whose move fits, or falls back to a restart.
* :func:`notice_cost`: before that, when a whole replica of the trained state stays on GPUs that are
  not announced, the move is planned around the announced GPUs (as if they were gone) and cannot
  overrun, and the :class:`~nereus.controller.decisions.Transition` names them (``excluded``) so
  that the executor does not read them.
* :func:`can_checkpoint`: that restart saves a checkpoint first when a whole replica of every
  ``*.train`` model-stage stays on GPUs that do not leave, or when the state is whole now and the
  save ends before the first announced GPU of the plan leaves. The save's seconds scale inversely
  with the nodes writing (``nereus.sim.restart.RestartCost.save_s``: state bytes over per-node
  storage bandwidth times nodes), so ``RiskModel.save_s`` (whole cluster) is scaled by
  ``cluster nodes / plan nodes``. Unknown ``save_s``: a checkpoint is assumed possible whenever the
  state is whole now (the rule before notices were reported).
"""

from __future__ import annotations

import math
from dataclasses import replace

from nereus.controller.decisions import TransitionCost
from nereus.controller.risk import state_survives
from nereus.planner.notation import format_gpus
from nereus.spec.hardware import ClusterSpec
from nereus.spec.plan import Plan

__all__ = ["notice_window", "within_notice", "notice_cost", "can_checkpoint", "plan_save_s"]


def notice_window(current: Plan, target: Plan, leave_in: dict) -> float:
    """Seconds until the first announced source GPU of the move ``current`` → ``target`` leaves.

    Args:
        leave_in: announced GPU id → seconds until it stops (``StepReport.leave_in_s``).

    Returns:
        seconds (inf when no source GPU is announced).
    """
    sources = current.gpus_used() - target.gpus_used()
    return min((leave_in[g] for g in sources if g in leave_in), default=math.inf)


def within_notice(cost: TransitionCost, current: Plan, target: Plan, leave_in: dict) -> TransitionCost:
    """``cost``, marked infeasible when its ``l_tran`` (s) exceeds :func:`notice_window`."""
    if not leave_in or not cost.feasible:
        return cost
    w = notice_window(current, target, leave_in)
    if cost.l_tran <= w:
        return cost
    gone = sorted(g for g in current.gpus_used() - target.gpus_used() if g in leave_in)
    return replace(cost, feasible=False, reason=f"L_tran {cost.l_tran:.1f}s exceeds the {w:.1f}s notice window "
                   f"of GPU(s) {format_gpus(gone)}")


def notice_cost(estimate, current: Plan, target: Plan, alive, leave_in: dict) -> tuple[TransitionCost, frozenset]:
    """The move ``current`` → ``target`` as it can run before announced GPUs leave, and the GPUs it
    must not read.

    ``estimate(gpus) -> TransitionCost`` prices the move reading from ``gpus``. When the move would
    read announced GPUs and every ``*.train`` model-stage keeps a whole replica on the GPUs not
    announced, it is planned around the announced ones (``estimate(staying)``, what the transition
    planner does once they are gone, started before they go): it reads nothing that leaves, so no
    error in the estimate can make it overrun (the simulated truth's moves take 1.3x the estimate
    with a log-normal spread of σ = 0.5, ``nereus.sim.cluster``). Otherwise (no replica stays, or
    that move is infeasible) the move reading every alive GPU, marked infeasible when it does not
    fit :func:`notice_window` (:func:`within_notice`).

    Returns:
        ``(cost, excluded)``: ``excluded`` = the announced GPUs of ``current`` the move does not
        read (empty unless planned around them).
    """
    alive = frozenset(alive)
    full = estimate(alive)
    announced = frozenset(leave_in) & (current.gpus_used() - target.gpus_used())
    if not announced:
        return full, frozenset()
    staying = alive - frozenset(leave_in)
    if state_survives(current, staying):
        around = estimate(staying)
        if around.feasible:
            return around, frozenset(leave_in) & current.gpus_used()
    return within_notice(full, current, target, leave_in), frozenset()


def plan_save_s(save_s: float, cluster: ClusterSpec, plan: Plan) -> float:
    """One checkpoint save of ``plan``'s state, s: ``save_s`` (whole cluster) x nodes / plan nodes."""
    nodes = len({cluster.node_of(g) for g in plan.gpus_used()}) or 1
    return save_s * cluster.num_nodes / nodes


def can_checkpoint(plan: Plan, alive, leave_in: dict, save_s: float | None, cluster: ClusterSpec) -> bool:
    """Whether a checkpoint of ``plan``'s trained state can be saved before a restart (module docstring).

    Args:
        alive: GPU ids running now, announced ones included.
        leave_in: announced GPU id → seconds until it stops.
        save_s: ``RiskModel.save_s`` (whole cluster, s) or None (unknown).
    """
    alive = frozenset(alive)
    if not state_survives(plan, alive):
        return False
    staying = alive - frozenset(leave_in)
    if not leave_in or state_survives(plan, staying) or save_s is None:
        return True
    first = min((leave_in[g] for g in plan.gpus_used() if g in leave_in), default=math.inf)
    return plan_save_s(save_s, cluster, plan) <= first
