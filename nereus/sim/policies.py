"""Policies compared by ``nereus simulate``, all behind one small interface.

Every controller-based policy prices the risk of losing trainable state (``controller/risk.py``,
from the simulator's restart-cost model, :func:`risk_model`) unless its name says ``paper``: after
GPUs were lost *without* notice, a plan whose only copy of a ``*.train`` model-stage could go with
the next loss is charged ``L_step · λ · P_hit · (restart + checkpoint_interval/2 · L_step)`` per
step, and the planner also offers the fastest plan with two training replicas on distinct nodes.
With a preemption notice (or before any unannounced loss) it is inert and the rule is the paper's.
Measured (benchmarks/bench_admission.py, 27 runs without notice): 1.04x the paper's rule, restarts
75 → 38; with a 2-minute notice identical to it (docs/simulate.md).

* ``nereus``: the controller (``nereus.controller``) with online calibration, γ = 0.5, the pool
  horizon from the loss process (``pool_horizon="process"``), look-ahead plan choice
  (``lookahead=True``), learned loss sites in risk pricing (``loss_sites=True``), the break-even
  admission of payback-rejected moves (``break_even=True``) and the learned last-in-first-out order
  of losses (``loss_order=True``, seventh round; ``nereus-lifo-blind``: without it); issue 29.
* ``nereus-ema``: the same without the issue-29 extensions (``H_pool`` the EMA of crossing intervals,
  plans compared at the current length): the ``nereus`` policy before issue 29.
* ``nereus-paper``: the paper's rule exactly (no risk pricing).
* ``static``: the best plan chosen at start with the *true* costs (what sweeping settings on the real
  cluster and fixing the fastest gives, as the paper's baselines do). It never adapts; when GPUs of
  its plan are lost or it runs out of memory it restarts from a checkpoint, picking the best plan
  for the pool and length at that moment (it may resize then).
* ``replan-all``: the same controller and planner (with the same issue-29 options: look-ahead plan
  choice, the first-loss prior of risk pricing), replanning on every trigger and admitting every
  faster feasible target without the payback rule (``replan-all-paper``: without risk pricing;
  ``replan-all-ema``: without the issue-29 options, the ``replan-all`` before issue 29).
* ``uncalibrated``: the controller with the offline cost model (defaults, no calibration).
* ``gamma=<g>``: the controller with another payback margin (the γ sweep).
* ``nereus+revisit``: with ``ControllerConfig(revisit=True)``, an extension beyond the paper
  (re-admission of a rejected target once its signal has been quiet for ``H_x`` steps);
  ``nereus+grow``: with the loss horizon for pool growth (``Monitor(grow_horizon=True)``);
  ``nereus+tcal``: with ``L_tran`` calibrated from the measured transitions
  (``calibrate_transitions=True``; measured 0.99x ``nereus`` on 26 runs, docs/simulate.md).
  ``nereus+replay``: risk priced with GPU-exact loss rates (``ControllerConfig(loss_replay=True)``,
  ``nereus.controller.loss_replay``); ``nereus+margin``: a plan over the planning headroom is invalid
  only when over the device at the measured peak ratio (``memory_margin=True``,
  ``nereus.controller.memory_margin``); both issue 29, fourth round, measured in docs/simulate.md;
  ``nereus+replay+margin``: both at once (fifth round). Off by default; measured by ``benchmarks/bench_admission.py``.

Nereus-type policies talk to the simulator only through :class:`~nereus.controller.Controller`'s
``observe(StepReport) -> decision`` — the interface the runtime will use.
"""

from __future__ import annotations

import math

from nereus.controller.controller import Controller, ControllerConfig, state_survives
from nereus.controller.decisions import Keep, Restart
from nereus.controller.monitor import Monitor, StepReport
from nereus.controller.planning import CostModelPlanner
from nereus.controller.risk import DETECT_S, RiskModel
from nereus.cost.efficiency import EfficiencyTable
from nereus.sim.restart import RestartCost
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["NereusPolicy", "StaticPolicy", "ElasticPolicy", "restart_pays", "make_policy", "POLICY_NAMES"]

POLICY_NAMES = ("nereus", "nereus-paper", "static", "elastic", "elastic-oracle", "replan-all", "replan-all-paper",
                "uncalibrated", "nereus-h1", "nereus-ema", "replan-all-ema")


def _job_at(job: JobSpec, response_len: float) -> JobSpec:
    return job.with_workload(job.workload.with_response_len(max(1, int(round(response_len)))))


class NereusPolicy:
    """Adapter from the simulator's loop to :class:`Controller` (start, observe, resume)."""

    def __init__(self, name: str, job: JobSpec, config: ControllerConfig, monitor: Monitor | None = None):
        self.name = name
        self.job = job
        self.config = config
        self.monitor = monitor
        self.planner = CostModelPlanner(efficiency=EfficiencyTable(), calibrate=config.calibrate)
        self.controller: Controller | None = None

    def start(self, pool: frozenset, response_len: float) -> Plan:
        """First plan, or the plan after waiting for GPUs (risk-priced once losses were seen).
        Raises ValueError when nothing fits."""
        job = _job_at(self.job, response_len)
        if self.controller is None:
            plan = self.planner.plan(job, pool, None, False)
            self.controller = Controller(self.job, plan, self.planner, config=self.config, monitor=self.monitor)
        else:
            plan = self.controller.best_plan(job, pool, None, False)
            self.controller.resume(plan)
            self.controller.monitor.reset({"seq_len": float(response_len)} | self.planner.efficiencies(), pool)
        return plan

    def observe(self, report: StepReport):
        return self.controller.observe(report)

    def resume(self, plan: Plan) -> None:
        self.controller.resume(plan)

    @property
    def log(self) -> list:
        return self.controller.log if self.controller else []


class StaticPolicy:
    """The best static plan (true costs), restarting from a checkpoint on GPU loss or OOM."""

    def __init__(self, name: str, job: JobSpec, true_efficiency: EfficiencyTable, memory_factor: float):
        self.name = name
        self.job = job
        self.planner = CostModelPlanner(efficiency=true_efficiency, calibrate=False, headroom=0.0)
        self.planner.memory_correction["*"] = memory_factor * 1.02  # oracle memory with 2% slack
        self.plan: Plan | None = None
        self.log: list = []

    def start(self, pool: frozenset, response_len: float) -> Plan:
        self.plan = self.planner.plan(_job_at(self.job, response_len), pool, None, False)
        return self.plan

    def observe(self, report: StepReport):
        pool = frozenset(report.pool)
        alive = frozenset(report.alive) | pool if report.alive is not None else pool
        lost = self.plan.gpus_used() - pool
        if not lost and not report.oom:
            return Keep("static plan")
        why = f"lost {len(lost)} GPUs" if lost else "out of memory"
        # like the controller: save first when a full copy of the trained state is still alive
        save = state_survives(self.plan, alive)
        try:
            plan = self.start(pool, report.response_len)
        except ValueError as e:
            d = Restart(None, f"{why}; nothing fits {len(pool)} GPUs: {e}"[:300], checkpoint_first=save,
                        cause="no_plan")
        else:
            d = Restart(plan, f"{why}; restart from checkpoint on {len(pool)} GPUs", checkpoint_first=save,
                        cause="static_policy" if save else "state_lost")
        self.log.append({"step": report.step, "decision": d.to_dict() | {"plan": None}})
        return d

    def resume(self, plan: Plan) -> None:
        self.plan = plan


def restart_pays(l_cur: float, l_new: float, window_s: float, cost_s: float) -> bool:
    """Whether restarting onto a plan of step time ``l_new`` beats staying at ``l_cur`` over the next
    ``window_s`` seconds, when the restart costs ``cost_s`` seconds (checkpoint save + restart).

    Staying makes ``W / L_cur`` steps; restarting ``(W − R) / L_new``. The second is larger iff
    ``W · (L_cur − L_new) / L_cur > R``.
    """
    if not (l_new < l_cur) or not window_s > 0:
        return False
    if math.isinf(window_s):
        return True
    return window_s * (l_cur - l_new) / l_cur > cost_s


class ElasticPolicy(StaticPolicy):
    """Elastic checkpoint/restart: what users run on spot capacity instead of live transitions.

    SkyPilot managed jobs restart a job from its checkpoint when it is preempted; Bamboo- and
    Oobleck-style systems also resize when nodes join. This baseline does both with the best plan
    the *true* costs give (the same oracle cost model as ``static``, so it is an upper bound on
    what a user's own tuning would pick):

    * **forced**: a GPU of the plan is lost or a step ran out of memory: restart on the best plan for
      the pool (from a checkpoint saved first when a full copy of the state is alive, as ``static``);
    * **voluntary**: when the pool changed since the last decision, or every ``checkpoint_every``
      steps (after the periodic save, when lengths have drifted), take the best plan ``S*`` for the
      pool and restart onto it iff :func:`restart_pays`: ``W · (L_cur − L_new) / L_cur > R`` with
      ``R`` = checkpoint save + restart (``nereus.sim.restart``) and ``W`` the seconds the new plan
      is expected to keep its GPUs:

      - ``elastic``: ``W`` = elapsed run time / (pool losses seen + 1), the mean time between
        losses with one pseudo-loss (0 at the start, so no voluntary restart before some quiet
        time has been seen);
      - ``elastic-oracle``: ``W`` = the true seconds until one of ``S*``'s GPUs leaves (from the
        trace; the rest of the run when none does).

    Args:
        future: ``(gpus, t) -> seconds until one of gpus leaves`` (the oracle's view of the trace).
        restart: restart and checkpoint costs.
    """

    def __init__(self, name: str, job: JobSpec, true_efficiency: EfficiencyTable, memory_factor: float,
                 restart: RestartCost | None = None, future=None):
        super().__init__(name, job, true_efficiency, memory_factor)
        self.restart = restart or RestartCost()
        self.future = future
        self.pool_ref: frozenset | None = None
        self.losses = 0
        self.last_eval_step = 0

    def start(self, pool: frozenset, response_len: float) -> Plan:
        plan = super().start(pool, response_len)
        self.pool_ref = frozenset(pool)
        return plan

    def window(self, plan: Plan, t: float) -> float:
        """``W``: seconds ``plan`` is expected to keep its GPUs (class docstring)."""
        if self.future is not None:
            return self.future(plan.gpus_used(), t)
        return t / (self.losses + 1)

    def restart_cost(self, plan: Plan, pool) -> float:
        nodes = len(self.job.cluster.nodes_of(pool))
        return (self.restart.save_s(self.job, len(self.job.cluster.nodes_of(plan.gpus_used())))
                + self.restart.restart_s(self.job, nodes))

    def observe(self, report: StepReport):
        pool = frozenset(report.pool)
        if self.pool_ref is not None and self.pool_ref - pool:
            self.losses += 1
        changed = pool != self.pool_ref
        self.pool_ref = pool
        if self.plan.gpus_used() - pool or report.oom:
            self.last_eval_step = report.step
            return super().observe(report)
        periodic = report.step + 1 - self.last_eval_step >= self.restart.checkpoint_every
        if not (changed or periodic) or report.step_time <= 0:
            return Keep("elastic: no pool change")
        self.last_eval_step = report.step + 1
        job = _job_at(self.job, report.response_len)
        current = self.planner.estimate(job, self.plan, pool)
        try:
            best = self.planner.plan(job, pool, None, False)
        except ValueError:
            return Keep("elastic: nothing else fits")
        t = report.elapsed_s or 0.0
        w = self.window(best, t)
        cost = self.restart_cost(best, pool)
        if not restart_pays(current.l_step, best.l_step, w, cost):
            d = Keep(f"elastic: restart onto {len(best.gpus_used())} GPUs does not pay: W {w:.0f}s x "
                     f"(L {current.l_step:.1f} -> {best.l_step:.1f}s) / L <= R {cost:.0f}s")
        else:
            self.plan = best
            d = Restart(best, f"elastic: restart onto {len(best.gpus_used())} GPUs pays: W {w:.0f}s x "
                        f"(L {current.l_step:.1f} -> {best.l_step:.1f}s) / L > R {cost:.0f}s",
                        checkpoint_first=True, cause="elastic_resize")
        self.log.append({"step": report.step, "decision": d.to_dict() | {"plan": None}})
        return d


#: the issue-29 controller options of the ``nereus``, ``gamma=<g>`` and ``uncalibrated`` policies
ISSUE29 = {"pool_horizon": "process", "lookahead": True, "loss_sites": True, "break_even": True, "loss_order": True}


def risk_model(job: JobSpec, restart: RestartCost | None = None) -> RiskModel:
    """The controller's state-loss pricing from the simulator's restart-cost model (whole cluster):
    restart seconds; with Young's checkpoint rule (``RestartCost.checkpoint_rule == "young"``) the
    save seconds, so the redone work is half of Young's interval, else the fixed interval; and the
    interruption of a step by a loss, with Ray's failure detection (``risk.DETECT_S``)."""
    restart = restart or RestartCost()
    save = restart.save_s(job, job.cluster.num_nodes) if restart.checkpoint_rule == "young" else None
    return RiskModel(restart_s=restart.restart_s(job, job.cluster.num_nodes),
                     checkpoint_interval=restart.checkpoint_every, save_s=save, detect_s=DETECT_S)


def make_policy(name: str, job: JobSpec, gamma: float, true_efficiency: EfficiencyTable, memory_factor: float,
                restart: RestartCost | None = None, future=None, first_horizon: str = "elapsed"):
    """A policy by name (module docstring): ``nereus``, ``nereus-paper``, ``static``, ``replan-all``,
    ``replan-all-paper``, ``uncalibrated``, ``gamma=<g>``, ``nereus+revisit``, ``nereus+grow``, ``nereus+tcal``,
    ``nereus-lifo-blind``
    (``nereus+risk`` is accepted as another name of ``nereus``). Risk pricing uses ``restart``'s
    costs (:func:`risk_model`).

    ``elastic-oracle`` needs ``future`` (``(gpus, t) -> seconds until one of them leaves``).
    ``first_horizon`` is the monitor's ``H_x`` at a first crossing for every controller policy not
    named ``paper`` (``nereus.controller.horizon``); the ``*-paper`` policies keep the paper's 1.

    Raises:
        ValueError: unknown name or a γ outside [0, 1].
    """
    risk = risk_model(job, restart)

    def mon(**kw):
        return Monitor(first_horizon=first_horizon, **kw)
    if name in ("nereus", "nereus+risk"):
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, **ISSUE29), mon())
    if name == "nereus-ema":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk), mon())
    if name == "nereus-h1":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk), Monitor())
    if name == "elastic":
        return ElasticPolicy(name, job, true_efficiency, memory_factor, restart)
    if name == "elastic-oracle":
        if future is None:
            raise ValueError("policy 'elastic-oracle' needs the future pool (the simulator passes it)")
        return ElasticPolicy(name, job, true_efficiency, memory_factor, restart, future)
    if name == "nereus-paper":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma))
    if name == "static":
        return StaticPolicy(name, job, true_efficiency, memory_factor)
    if name == "replan-all":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, always_admit=True, risk=risk, **ISSUE29), mon())
    if name == "replan-all-ema":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, always_admit=True, risk=risk), mon())
    if name == "replan-all-paper":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, always_admit=True))
    if name == "nereus+revisit":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, revisit=True, risk=risk), mon())
    if name == "nereus+tcal":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, calibrate_transitions=True, **ISSUE29),
                            mon())
    if name == "nereus+margin":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, **ISSUE29, memory_margin=True), mon())
    if name == "nereus+replay":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, **ISSUE29, loss_replay=True), mon())
    if name == "nereus+replay+margin":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, **ISSUE29, loss_replay=True,
                                                        memory_margin=True), mon())
    if name == "nereus-lifo-blind":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk, **(ISSUE29 | {"loss_order": False})),
                            mon())
    if name == "nereus+grow":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk), mon(grow_horizon=True))
    if name == "uncalibrated":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, calibrate=False, risk=risk, **ISSUE29), mon())
    if name.startswith("gamma="):
        try:
            g = float(name.split("=", 1)[1])
        except ValueError as e:
            raise ValueError(f"policy {name!r}: γ must be a number, e.g. gamma=0.25") from e
        return NereusPolicy(name, job, ControllerConfig(gamma=g, risk=risk, **ISSUE29), mon())
    raise ValueError(f"unknown policy {name!r}; valid: {list(POLICY_NAMES)}, nereus+revisit, nereus+grow, nereus+tcal, "
                     "nereus-lifo-blind or gamma=<g>")
