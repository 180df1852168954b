"""Policies compared by ``nereus simulate``, all behind one small interface.

Every controller-based policy prices the risk of losing trainable state (``controller/risk.py``,
from the simulator's restart-cost model, :func:`risk_model`) unless its name says ``paper``: after
GPUs were lost *without* notice, a plan whose only copy of a ``*.train`` model-stage could go with
the next loss is charged ``L_step · λ · P_hit · (restart + checkpoint_interval/2 · L_step)`` per
step, and the planner also offers the fastest plan with two training replicas on distinct nodes.
With a preemption notice (or before any unannounced loss) it is inert and the rule is the paper's.
Measured (benchmarks/bench_admission.py, 27 runs without notice): 1.04x the paper's rule, restarts
75 → 38; with a 2-minute notice identical to it (docs/simulate.md).

* ``nereus``: the controller (``nereus.controller``) with online calibration, γ = 0.5.
* ``nereus-paper``: the paper's rule exactly (no risk pricing).
* ``static``: the best plan chosen at start with the *true* costs (what sweeping settings on the real
  cluster and fixing the fastest gives, as the paper's baselines do). It never adapts; when GPUs of
  its plan are lost or it runs out of memory it restarts from a checkpoint, picking the best plan
  for the pool and length at that moment (it may resize then).
* ``replan-all``: the same controller and planner, replanning on every trigger and admitting every
  faster feasible target without the payback rule (``replan-all-paper``: without risk pricing).
* ``uncalibrated``: the controller with the offline cost model (defaults, no calibration).
* ``gamma=<g>``: the controller with another payback margin (the γ sweep).
* ``nereus+revisit``: with ``ControllerConfig(revisit=True)``, an extension beyond the paper
  (re-admission of a rejected target once its signal has been quiet for ``H_x`` steps);
  ``nereus+grow``: with the loss horizon for pool growth (``Monitor(grow_horizon=True)``).
  Off by default; measured by ``benchmarks/bench_admission.py``.

Nereus-type policies talk to the simulator only through :class:`~nereus.controller.Controller`'s
``observe(StepReport) -> decision`` — the interface the runtime will use.
"""

from __future__ import annotations

from nereus.controller import (
    Controller,
    ControllerConfig,
    CostModelPlanner,
    Keep,
    Monitor,
    Restart,
    StepReport,
    state_survives,
)
from nereus.controller.risk import RiskModel
from nereus.cost.efficiency import EfficiencyTable
from nereus.planner.plan import Plan
from nereus.sim.restart import RestartCost
from nereus.spec.job import JobSpec

__all__ = ["NereusPolicy", "StaticPolicy", "make_policy", "POLICY_NAMES"]

POLICY_NAMES = ("nereus", "nereus-paper", "static", "replan-all", "replan-all-paper", "uncalibrated")


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


def risk_model(job: JobSpec, restart: RestartCost | None = None) -> RiskModel:
    """The controller's state-loss pricing from the simulator's restart-cost model (whole cluster)."""
    restart = restart or RestartCost()
    return RiskModel(restart_s=restart.restart_s(job, job.cluster.num_nodes),
                     checkpoint_interval=restart.checkpoint_every)


def make_policy(name: str, job: JobSpec, gamma: float, true_efficiency: EfficiencyTable, memory_factor: float,
                restart: RestartCost | None = None):
    """A policy by name (module docstring): ``nereus``, ``nereus-paper``, ``static``, ``replan-all``,
    ``replan-all-paper``, ``uncalibrated``, ``gamma=<g>``, ``nereus+revisit``, ``nereus+grow``
    (``nereus+risk`` is accepted as another name of ``nereus``). Risk pricing uses ``restart``'s
    costs (:func:`risk_model`).

    Raises:
        ValueError: unknown name or a γ outside [0, 1].
    """
    risk = risk_model(job, restart)
    if name in ("nereus", "nereus+risk"):
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk))
    if name == "nereus-paper":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma))
    if name == "static":
        return StaticPolicy(name, job, true_efficiency, memory_factor)
    if name == "replan-all":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, always_admit=True, risk=risk))
    if name == "replan-all-paper":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, always_admit=True))
    if name == "nereus+revisit":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, revisit=True, risk=risk))
    if name == "nereus+grow":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, risk=risk), Monitor(grow_horizon=True))
    if name == "uncalibrated":
        return NereusPolicy(name, job, ControllerConfig(gamma=gamma, calibrate=False, risk=risk))
    if name.startswith("gamma="):
        try:
            g = float(name.split("=", 1)[1])
        except ValueError as e:
            raise ValueError(f"policy {name!r}: γ must be a number, e.g. gamma=0.25") from e
        return NereusPolicy(name, job, ControllerConfig(gamma=g, risk=risk))
    raise ValueError(f"unknown policy {name!r}; valid: {list(POLICY_NAMES)}, nereus+revisit, nereus+grow "
                     "or gamma=<g>")
