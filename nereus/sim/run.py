"""The simulation loop: one policy on one :class:`~nereus.sim.cluster.SimulatedCluster`.

Per iteration: start a plan if none runs (waiting for GPUs when nothing fits), execute one RL step,
hand its :class:`~nereus.controller.monitor.StepReport` to the policy at the safe boundary, and apply
the decision:

* ``Keep``: nothing;
* ``Transition``: the clock advances by the true transition time;
* ``Restart`` (counted per ``Restart.cause`` in ``restarts_by_cause``: ``state_lost``,
  ``infeasible_transition``, ``no_plan``, ``transition_overrun``, ``static_policy``): when a full copy of the state is still alive (``checkpoint_first``), a checkpoint is
  saved first; otherwise the steps since the last checkpoint are redone (their time counts as lost,
  their tokens are removed). Then the clock advances by the restart cost (process restart, load,
  warm-up). A transition that would still read from GPUs that leave before it ends
  (:func:`overrun_at`; GPUs already gone when it starts are not read) is aborted at the loss (the
  time until then counts as lost) and becomes such a restart, cause ``transition_overrun``: with a
  checkpoint saved first when every ``*.train`` model-stage of the running plan keeps a whole
  replica on the GPUs still alive (``state_survives``, the controller's rule), else redoing the
  steps since the last checkpoint. When the notice of that loss arrives after the move began
  (:func:`notice_during`), the executor aborts the move at the notice instead and keeps the
  running plan (event ``transition_aborted``; ``policy.resume``): the transition DAG keeps a whole
  copy of the trained state on alive GPUs at every point (DESIGN.md §4.6), and returning to the
  running layout is approximated as free. The policy decides again at the next boundary, with the
  whole notice window (at once when the running plan uses an announced GPU: its next step does not
  start). A restart whose plan loses GPUs before the restart is up
  (:func:`restart_overrun`) fails at the loss (the time until then counts as restart time) and the
  policy picks a plan for the pool at that moment (``policy.start``), which starts a new restart.
  A checkpoint saved before a restart fails at a loss that leaves no whole replica of the trained
  state alive before the save ends (:func:`save_overrun`; the time until then counts as lost, and
  the steps since the last checkpoint are redone).

A step aborted by a GPU loss or an OOM counts as lost time. Every policy saves checkpoints by the
same rule (``RestartCost.checkpoint_rule``): Young's interval ``sqrt(2 · C · M)`` from the measured
save cost and the failures seen (``nereus.sim.checkpoint``; a failure is a restart that redoes the
work since the last checkpoint), or every ``checkpoint_every`` completed steps. Throughput is response tokens of completed steps
(``global_batch · response_len`` each) over the simulated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from nereus.controller.controller import state_survives
from nereus.controller.decisions import Restart, Transition
from nereus.sim.checkpoint import CheckpointSchedule
from nereus.sim.cluster import SimulatedCluster
from nereus.sim.restart import RestartCost

__all__ = ["RunResult", "simulate", "overrun_at", "notice_during", "restart_overrun", "save_overrun"]


@dataclass
class RunResult:
    """Totals, a per-step timeline and the plan-change events of one policy run (seconds, tokens)."""

    policy: str
    duration: float
    steps: int = 0
    tokens: float = 0.0
    transitions: int = 0
    transition_time: float = 0.0
    urgent_transitions: int = 0
    restarts: int = 0
    restart_time: float = 0.0
    lost_time: float = 0.0
    wait_time: float = 0.0
    checkpoint_time: float = 0.0
    checkpoints: int = 0
    ooms: int = 0
    restart_causes: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)
    events: list = field(default_factory=list)
    log: list = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Response tokens per second over the whole run."""
        return self.tokens / self.duration if self.duration > 0 else 0.0

    @property
    def time_lost(self) -> float:
        """Seconds not spent on steps that count: aborted or redone steps, restarts, waiting, transitions."""
        return self.lost_time + self.restart_time + self.wait_time + self.transition_time

    def summary(self) -> dict:
        return {"policy": self.policy, "throughput_tokens_per_s": self.throughput, "steps": self.steps,
                "tokens": self.tokens, "transitions": self.transitions, "urgent_transitions": self.urgent_transitions,
                "transition_time_s": self.transition_time, "restarts": self.restarts,
                "restarts_by_cause": dict(self.restart_causes), "restart_time_s": self.restart_time, "lost_step_time_s": self.lost_time, "wait_time_s": self.wait_time,
                "checkpoint_time_s": self.checkpoint_time, "checkpoints": self.checkpoints, "time_lost_s": self.time_lost, "ooms": self.ooms,
                "duration_s": self.duration}


def overrun_at(cluster: SimulatedCluster, current, target, alive, t: float, dt: float) -> float | None:
    """When a live transition from ``current`` to ``target`` that starts at ``t`` seconds and takes
    ``dt`` seconds is cut short: the first time in ``(t, t + dt)`` at which one of its source GPUs
    (those of ``current`` that ``target`` does not use) that is in ``alive`` at ``t`` stops running;
    None when the transition finishes first.

    GPUs already gone at ``t`` are not sources (the transition planner plans around them: it reads
    the state from surviving replicas or reloads it), so a later change of the pool, a gain
    included, does not cut the transition short on their account.
    """
    sources = (current.gpus_used() - target.gpus_used()) & frozenset(alive)
    lost_at = cluster.loss_time(sources, t) if sources else math.inf
    return lost_at if lost_at < t + dt else None


def restart_overrun(cluster: SimulatedCluster, plan, t: float, dt: float) -> float | None:
    """When a restart onto ``plan`` that starts at ``t`` and takes ``dt`` seconds fails: the first time in
    ``(t, t + dt)`` at which one of ``plan``'s GPUs stops running (the relaunched processes lose a peer
    before they are up); None when the restart completes first. The failure is taken at the loss
    itself (no failure-detection delay is added: an assumption in the restart's favour, the same for
    every policy)."""
    lost_at = cluster.loss_time(plan.gpus_used(), t)
    return lost_at if lost_at < t + dt else None


def notice_during(cluster: SimulatedCluster, lost_at: float | None, t: float) -> float | None:
    """When the notice of ``lost_at``, the loss that cuts a move started at ``t`` short
    (:func:`overrun_at`), arrives: its time when that is after ``t``; None without a notice, without
    such a loss, or when it was announced before the move (the policy's to plan for).

    Only a move that cannot finish is aborted: one whose target merely uses an announced GPU ends,
    and the policy moves off that GPU at the next boundary, usually cheaply (aborting such moves
    made 70B PPO on ``bamboo-p3``, 120 s notice, seed 0, 0.92x static instead of 1.16x: three growth
    moves of about 220 s given up part-way)."""
    notice = cluster.truth.notice_s
    if notice <= 0 or lost_at is None:
        return None
    return lost_at - notice if lost_at - notice > t else None


def save_overrun(cluster: SimulatedCluster, plan, t: float, dt: float) -> float | None:
    """When a checkpoint save of ``plan``'s state that starts at ``t`` and takes ``dt`` seconds fails:
    the first loss of one of ``plan``'s GPUs in ``(t, t + dt)`` after which no whole replica of every
    ``*.train`` model-stage is left alive (``state_survives``); None when the save completes. Only
    the first loss in the window is checked (a second one during the same save is not)."""
    lost_at = cluster.loss_time(plan.gpus_used(), t)
    if lost_at < t + dt and not state_survives(plan, cluster.alive_at(lost_at)):
        return lost_at
    return None


def simulate(policy, cluster: SimulatedCluster, hours: float, restart: RestartCost | None = None,
             progress=None) -> RunResult:
    """Run ``policy`` for ``hours`` of simulated time. ``progress(t_seconds)`` is called per step."""
    restart = restart or RestartCost()
    end = hours * 3600.0
    job = cluster.job
    res = RunResult(policy=policy.name, duration=end)
    t, step, ckpt_step = 0.0, 0, 0
    schedule = CheckpointSchedule()
    done: list[tuple[float, float]] = []  # (duration, tokens) of steps since the last checkpoint
    plan = None
    pending_restart = False
    measured = None  # seconds of the transition applied at the last boundary (the next report's transition_s)
    batch = job.workload.global_batch
    while t < end:
        pool = cluster.pool_at(t)
        if plan is None:
            try:
                plan = policy.start(pool, cluster.lengths.at(step))
            except ValueError:
                nxt = min(cluster.availability.next_change(t), end)
                if math.isinf(nxt) or nxt <= t:
                    res.wait_time += end - t
                    break
                res.wait_time += nxt - t
                t = nxt
                continue
            if pending_restart:
                dt = restart.restart_s(job, len(job.cluster.nodes_of(pool)))
                cut = restart_overrun(cluster, plan, t, dt)
                if cut is not None:
                    res.restart_time += cut - t
                    t = cut
                    res.events.append({"t": t, "kind": "restart", "reason": "relaunch failed: GPUs of its plan left"})
                    plan = None
                    continue
                res.restart_time += dt
                t += dt
                res.events.append({"t": t, "kind": "restart", "reason": "restart after waiting for GPUs"})
                pending_restart = False
        out = cluster.execute_step(plan, step, t, save_s=restart.save_s(job, len(job.cluster.nodes_of(plan.gpus_used()))))
        t += out.duration
        if out.completed:
            if t > end:
                break
            tokens = batch * out.response_len
            res.tokens += tokens
            done.append((out.duration, tokens))
            step += 1
            res.steps = step
            res.timeline.append({"t": t, "step": step, "gpus": len(out.report.pool), "response_len": out.response_len,
                                 "step_time": out.duration, "plan_gpus": len(plan.gpus_used())})
            save = restart.save_s(job, len(job.cluster.nodes_of(plan.gpus_used())))
            if (step % restart.checkpoint_every == 0 if restart.checkpoint_rule == "fixed"
                    else schedule.due(sum(d for d, _ in done), t, save)):
                res.checkpoint_time += save
                t += save
                schedule.saved(save)
                res.checkpoints += 1
                ckpt_step, done = step, []
        else:
            res.lost_time += out.duration
            res.ooms += int(out.oom)
        report = out.report if measured is None else replace(out.report, transition_s=measured)
        measured = None
        decision = policy.observe(report)
        if not out.completed and out.duration <= 0 and not isinstance(decision, (Transition, Restart)):
            raise RuntimeError(f"policy {policy.name!r} kept a plan that uses GPUs outside the pool at t = {t:.1f} s "
                               f"(step {step}): the simulated clock would not advance")
        if isinstance(decision, Transition):
            alive = frozenset(out.report.alive or out.report.pool) - decision.excluded  # not read: notice.py
            dt = cluster.transition_time(plan, decision.plan, alive, out.response_len)
            lost_at = overrun_at(cluster, plan, decision.plan, alive, t, dt)
            notice_at = notice_during(cluster, lost_at, t)
            if notice_at is not None:
                # announced after the move began: aborted at the notice, the running plan kept
                res.lost_time += notice_at - t
                t = notice_at
                policy.resume(plan)
                res.events.append({"t": t, "kind": "transition_aborted", "reason": "a preemption notice for "
                                   "GPUs the move reads: aborted at the notice, the running plan kept"})
                decision = None
            elif lost_at is not None:
                # the transition still reads from GPUs that leave before it ends: it is aborted at the
                # loss; a checkpoint is saved first iff a full copy of the trained state is still alive
                kept = cluster.alive_at(lost_at)
                res.lost_time += lost_at - t
                t = lost_at
                decision = Restart(decision.plan, "transition did not finish before the preempted GPUs left",
                                   checkpoint_first=state_survives(plan, kept), cause="transition_overrun")
        if isinstance(decision, Transition):
            measured = dt  # the transition itself: the teardown of dead ranks is failure handling
        if isinstance(decision, Transition) and out.detect_s > 0:
            dt += cluster.truth.teardown_s  # abort and rebuild the communicators of the dead ranks first
        if isinstance(decision, Transition):
            res.transitions += 1
            res.urgent_transitions += int(decision.urgent)
            res.transition_time += dt
            t += dt
            plan = decision.plan
            res.events.append({"t": t, "kind": "transition", "urgent": decision.urgent, "seconds": dt,
                               "reason": decision.reason})
        elif isinstance(decision, Restart):
            if decision.checkpoint_first:
                # a full copy of the state is alive: save now, lose no progress, unless the save
                # still needs GPUs that leave before it ends (``save_overrun``): then it fails there
                dt = restart.save_s(job, len(job.cluster.nodes_of(plan.gpus_used())))
                cut = save_overrun(cluster, plan, t, dt)
                if cut is not None:
                    res.lost_time += cut - t
                    t = cut
                    decision = replace(decision, checkpoint_first=False)
            if decision.checkpoint_first:
                res.checkpoint_time += dt
                t += dt
                schedule.saved(dt)
                res.checkpoints += 1
                ckpt_step, done = step, []
            else:
                schedule.failed()  # the work since the last checkpoint is redone: a failure (Young's M)
            redo = sum(d for d, _ in done)
            res.lost_time += redo
            res.tokens -= sum(k for _, k in done)
            step, done = ckpt_step, []
            res.steps = step
            res.restarts += 1
            cause = decision.cause or "other"
            res.restart_causes[cause] = res.restart_causes.get(cause, 0) + 1
            if decision.plan is None:
                plan, pending_restart = None, True
                res.events.append({"t": t, "kind": "restart", "cause": cause, "reason": decision.reason})
            else:
                plan = decision.plan
                dt = restart.restart_s(job, len(job.cluster.nodes_of(out.report.pool)))
                cut = restart_overrun(cluster, plan, t, dt)
                if cut is not None:
                    # GPUs of the relaunched plan leave before it is up: the relaunch fails at the loss
                    # and the policy picks a plan for the pool then (a new restart, at the loop's top)
                    res.restart_time += cut - t
                    t = cut
                    plan, pending_restart = None, True
                    res.events.append({"t": t, "kind": "restart", "cause": cause, "seconds": dt,
                                       "redone_s": redo, "reason": decision.reason + "; relaunch failed: GPUs of "
                                       "its plan left before it was up"})
                else:
                    res.restart_time += dt
                    t += dt
                    res.events.append({"t": t, "kind": "restart", "cause": cause, "seconds": dt,
                                       "redone_s": redo, "reason": decision.reason})
        if progress is not None:
            progress(min(t, end))
    res.log = list(getattr(policy, "log", []))
    return res
