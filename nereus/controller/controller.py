"""The adaptation controller: one policy for every driver (``nereus simulate``, and ``nereus run
--adaptive`` through ``nereus.runtime.run.adaptive``, whose ``step_report()`` gives the same :class:`StepReport`).

At every safe boundary the executor hands :meth:`Controller.observe` a ``StepReport``; it returns a
decision (:class:`Keep`, :class:`Transition`, :class:`Restart`) applied before the next step. The
controller imports nothing from the simulator or the runtime (DESIGN.md §3). Flow (DESIGN.md §4.5):

1. calibrate the cost model from the step's op-class seconds and peaks (unless disabled);
2. re-estimate the current plan for the current response length and pool; it is *invalid* when it
   uses lost GPUs, ran out of memory, or is predicted to exceed memory (see ``memory_margin``);
3. monitor: urgent triggers (pool change, memory) and opportunistic ones (drift > δ_x), with ``H_x``;
4. on a trigger, replan (urgent options on the urgent path), estimate ``L_tran`` of each target, and
   admit (``admission.admit``); restart only if the only copy of trainable state was on lost GPUs
   or no target's transition is feasible; 5. reset every reference value (admitted or not).

Preemption notices (always on; nothing changes without one): a move that would read GPUs announced
to leave is planned around them when a whole replica of the trained state stays elsewhere, else it
must end before they go or it is infeasible; a restart saves a checkpoint first only when the save
can end in time (``nereus.controller.notice``, ``StepReport.leave_in_s``).

Beyond the paper (``ControllerConfig(risk=RiskModel(...))``): plans are compared with their priced
risk of losing trainable state added (``nereus.controller.risk``), and the fastest plan with two
replicas of every ``*.train`` model-stage is also considered. ``risk=None`` (the default, and the
runtime's) is the paper's rule. Issue 29's extensions (off by default; ``nereus.sim.policies`` says
which the simulator's ``nereus`` uses):

* ``pool_horizon="process"``: a pool trigger's ``H`` is the expected steps until the pool next loses
  GPUs (``nereus.controller.pool_process``), not the EMA of crossing intervals; risk pricing then
  charges the first loss at ``1 / H_loss`` until a loss is seen (:meth:`Controller.loss_rate`);
* ``lookahead=True``: plans compared over their window at the projected length (``lookahead.py``);
* ``break_even=True``: a payback-rejected move is admitted once the seconds forgone by staying reach
  its ``L_tran`` (the ski-rental rule, ``nereus.controller.break_even``);
* ``calibrate_transitions=True``: ``L_tran`` times measured / estimated transition seconds so far
  (``StepReport.transition_s``; ``nereus.controller.transition_calibration``);
* risk priced with ``loss_sites=True`` per-node hit probabilities, ``loss_replay=True`` GPU-exact loss
  rates or ``loss_order=True`` the learned last-in-first-out order of losses (modules of those names);
* ``memory_margin=True``: over the headroom is not invalid (``nereus.controller.memory_margin``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.controller.admission import Option, admit
from nereus.controller.break_even import ForgoneSaving, rejected_rate
from nereus.controller.decisions import Keep, Restart, Transition, decision_to_dict
from nereus.controller.lookahead import LengthTrend, window_steps
from nereus.controller.loss_order import LossOrder
from nereus.controller.loss_replay import LossReplay
from nereus.controller.loss_sites import LossSites
from nereus.controller.memory_margin import fits_measured
from nereus.controller.monitor import Monitor, StepReport, Trigger
from nereus.controller.notice import can_checkpoint, notice_cost
from nereus.controller.planning import PlannerBackend, same_plan
from nereus.controller.pool_process import PoolProcess
from nereus.controller.risk import LossRate, RiskModel, state_copies, state_survives
from nereus.controller.transition_calibration import TransitionCalibration
from nereus.controller.transition_cost import estimate_transition_cost
from nereus.planner.notation import format_gpus
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["Controller", "ControllerConfig", "state_survives"]


@dataclass(frozen=True)
class ControllerConfig:
    """Policy knobs.

    Attributes:
        gamma: payback margin γ in [0, 1] (0.5 default; 0 admits only urgent transitions).
        always_admit: replan on every trigger and admit any faster feasible target (baseline).
        calibrate: learn efficiencies and memory corrections from measurements.
        slowdown: opportunistic alternatives up to this fraction slower than the best target are
            tried (the urgent path tries every alternative).
        revisit: after a payback rejection, if the rejected signal has not crossed again for ``H_x``
            steps, replan once more with ``H = steps since its last crossing`` (beyond the paper).
        risk: prices the risk of losing trainable state (:class:`~nereus.controller.risk.RiskModel`;
            the executor should pass its own restart cost and checkpoint interval); None (default)
            keeps the paper's objective, step time alone.
        loss_prior: ``(events, seconds)`` pseudo-observations of unannounced GPU losses (e.g.
            ``(1, 3600)`` for a pool known to lose a node about hourly); ``(0, 0)`` waits for the
            first loss.
        pool_horizon: ``"ema"`` (the paper's ``H_pool``) or ``"process"`` (the expected steps until
            the next loss, ``nereus.controller.pool_process``).
        lookahead: compare plans over the window they are expected to last at the projected
            response length (``nereus.controller.lookahead``).
        loss_sites: per-node hit probabilities (``loss_sites.py``) instead of uniform hits, and the
            fastest plans on the nodes least likely to be hit (:meth:`Controller.best_plan`).
        break_even: the ski-rental admission of ``nereus.controller.break_even``.
        loss_replay: price risk with the GPU-exact rates of ``nereus.controller.loss_replay``.
        memory_margin: over the headroom is invalid only if over the device (``memory_margin``).
        calibrate_transitions: ``L_tran`` times measured / estimated (``transition_calibration``).
        loss_order: the LIFO estimate of ``nereus.controller.loss_order`` (announced losses priced
            too), and plans on the oldest GPUs.

    Raises:
        ValueError: gamma outside [0, 1], a negative slowdown, a negative prior or an unknown
            pool_horizon.
    """

    gamma: float = 0.5
    always_admit: bool = False
    calibrate: bool = True
    slowdown: float = 0.25
    revisit: bool = False
    risk: RiskModel | None = None
    loss_prior: tuple[float, float] = (0.0, 0.0)
    pool_horizon: str = "ema"
    lookahead: bool = False
    loss_sites: bool = False
    break_even: bool = False
    loss_replay: bool = False
    memory_margin: bool = False
    calibrate_transitions: bool = False
    loss_order: bool = False

    def __post_init__(self) -> None:
        if self.pool_horizon not in ("ema", "process"):
            raise ValueError(f"controller field 'pool_horizon' must be 'ema' or 'process', got {self.pool_horizon!r}")
        if not (0 <= self.gamma <= 1):
            raise ValueError(f"controller field 'gamma' must be in [0, 1], got {self.gamma!r}")
        if self.slowdown < 0:
            raise ValueError(f"controller field 'slowdown' must be >= 0, got {self.slowdown!r}")
        if not (isinstance(self.loss_prior, tuple) and len(self.loss_prior) == 2 and min(self.loss_prior) >= 0):
            raise ValueError(f"controller field 'loss_prior' must be (events >= 0, seconds >= 0), "
                             f"got {self.loss_prior!r}")
        if self.risk is not None and not isinstance(self.risk, RiskModel):
            raise ValueError(f"controller field 'risk' must be a RiskModel or None, got {self.risk!r}")


class Controller:
    """Monitor + replanning + admission over an injected planner backend.

    Args:
        job: the job at its starting workload (the response length is replaced by the measured one).
        plan: the plan in effect (estimated).
        planner: a :class:`~nereus.controller.planning.PlannerBackend`.
        transition_cost: ``(job, current, target, pool) -> TransitionCost``; defaults to the DAG
            estimate of ``nereus.transition`` when importable, else bytes over bandwidth.
        config: :class:`ControllerConfig`.
        monitor: a :class:`Monitor` (thresholds δ_x, EMA weight).
    """

    def __init__(self, job: JobSpec, plan: Plan, planner: PlannerBackend, transition_cost=None,
                 config: ControllerConfig | None = None, monitor: Monitor | None = None):
        self.job = job
        self.plan = plan
        self.planner = planner
        self.transition_cost = transition_cost or estimate_transition_cost
        self.config = config or ControllerConfig()
        self.monitor = monitor or Monitor()
        self.log: list[dict] = []
        self.loss = LossRate(*self.config.loss_prior)
        self._pending: tuple[str, int] | None = None  # (signal, step) of a rejected target to revisit
        self.pool_process = PoolProcess()
        self.sites = LossSites(job.cluster)
        self._leave_in: dict = {}  # announced GPU → seconds left (``StepReport.leave_in_s``, notice.py)
        self.replay = LossReplay()
        self.order = LossOrder()
        self.trend = LengthTrend()
        self._window = None     # (job at the projected length, W) of the current replan, look-ahead only
        self._forced_to = None  # the planner's best plan at the projected length
        self.rent = ForgoneSaving()  # seconds forgone since a payback rejection (break_even)
        self._rejected = None        # (rate s/step, L_tran s) of the last payback rejection
        self.tran_cal = TransitionCalibration(enabled=self.config.calibrate_transitions)

    def job_at(self, response_len: float) -> JobSpec:
        return self.job.with_workload(self.job.workload.with_response_len(max(1, int(round(response_len)))))

    def observe(self, report: StepReport):
        """Decide at a safe boundary after one step (see module docstring). Returns a decision."""
        pool = frozenset(report.pool)
        alive = frozenset(report.alive) | pool if report.alive is not None else pool
        self._leave_in = dict(report.leave_in_s or {})
        self.loss.observe(pool, alive, report.elapsed_s, report.step_time)
        self.pool_process.observe(pool, self.loss.seconds)
        self.sites.observe(pool, alive)
        self.replay.observe(pool, alive, self.loss.seconds)
        self.order.observe(pool, alive, self.loss.seconds)
        self.trend.observe(report.step, report.response_len)
        self.rent.advance(report.step)
        self.tran_cal.observe(report.transition_s)
        job = self.job_at(report.response_len)
        if report.oom:
            self.planner.note_oom()
        current = self.planner.estimate(job, self.plan, pool)
        if self.config.calibrate and report.step_time > 0 and not report.oom:
            self.planner.calibrate(job, current, report.op_seconds, report.peak_memory, pool)
        lost = self.plan.gpus_used() - pool
        # memory estimates do not depend on efficiencies; the calibrated headroom applies in memory_ok
        mem_bad = report.oom or not self.planner.memory_ok(job, current)
        if mem_bad and not report.oom and self.config.memory_margin and report.step_time > 0:
            mem_bad = not fits_measured(self.planner, self.job_at, self.trend.ahead(1), job, self.plan, current,
                                        pool, report.peak_memory)
        mem_reason = ("out of memory in the last step" if report.oom else
                      f"predicted peak exceeds capacity at {job.workload.response_len} tokens")
        values = {"seq_len": float(report.response_len)}
        if self.config.calibrate:
            values |= self.planner.efficiencies()
        triggers = self.monitor.check(report.step, values, pool, mem_bad, mem_reason)
        if lost and not any(t.signal == "pool" for t in triggers):
            # the plan is invalid although P_gpu equals the monitor's reference (the GPUs left before
            # the first report, which only set the reference): still urgent, or the executor would
            # retry the same plan on GPUs that are gone forever
            triggers.append(Trigger("pool", True, len(pool), len(self.plan.gpus_used()),
                                    self.monitor.horizon("pool").value,
                                    f"the plan uses {len(lost)} GPU(s) outside P_gpu"))
        if not triggers and self._pending is not None and report.step >= self._pending[1]:
            triggers = [self._stale_trigger(report.step)]
        if not triggers and self.config.break_even and self.rent.due():
            triggers = [self.rent.trigger(report.step)]
        if not triggers:
            return self._record(report, Keep("no trigger"), [])
        urgent = bool(lost) or mem_bad
        if self.config.calibrate:
            current = self.planner.estimate(job, self.plan, pool)  # times under the updated efficiencies
        if self.config.pool_horizon == "process":
            h = self.loss_horizon(report, current)
            triggers = [replace(t, horizon=h, reason=f"{t.reason}; H = {h:.1f} steps to the next expected loss")
                        if t.signal == "pool" else t for t in triggers]
        names = tuple(t.signal for t in triggers)
        self._window = self._lookahead(job, report, current) if self.config.lookahead else None
        decision = self._replan(job, pool, alive, current, urgent, bool(lost), names,
                                min(t.horizon for t in triggers))
        self.monitor.reset(values, pool)
        self._pending = None
        if self.config.revisit and isinstance(decision, Keep) and "payback" in decision.reason:
            t = min(triggers, key=lambda t: t.horizon)
            sig = t.signal.removeprefix("stale:")
            self._pending = (sig, report.step + max(1, int(math.ceil(t.horizon))))
        if self.config.loss_order and self.config.risk is not None:  # the forced move off announced GPUs
            self.order.forced(self.plan, pool, alive, decision, self.config.risk.forced_restart_s)
        if isinstance(decision, (Transition, Restart)) and decision.plan is not None:
            self.plan = decision.plan
        self.tran_cal.decided(decision)  # a transition is measured in the next report
        rejected = isinstance(decision, Keep) and "payback" in decision.reason and self._rejected is not None
        self.rent.reject(report.step, *self._rejected) if rejected else self.rent.clear()
        return self._record(report, decision, triggers)

    def loss_horizon(self, report: StepReport, current: Plan) -> float:
        """Expected steps until the pool next loses GPUs (``PoolProcess``), at the last step's time."""
        step_s = report.step_time if report.step_time > 0 else current.l_step
        if not (step_s > 0 and math.isfinite(step_s)):
            step_s = self.plan.l_step if self.plan.l_step > 0 and math.isfinite(self.plan.l_step) else 1.0
        return self.pool_process.horizon_steps(step_s)

    def _lookahead(self, job: JobSpec, report: StepReport, current: Plan):
        """``(job at the projected length, W steps)`` or None when no growth is seen (``lookahead.py``)."""
        fit = self.trend.fit()
        if fit is None or fit[1] <= 0:
            return None
        w = window_steps(fit[1], self.monitor.threshold("seq_len") or 0.3, self.loss_horizon(report, current))
        ahead = self.trend.ahead(w)
        if ahead is None or ahead <= job.workload.response_len:
            return None
        return self.job_at(ahead), w

    def risk(self, plan: Plan, pool) -> float:
        """Priced state-loss risk of ``plan``, s per step (0 without a risk model; + announced, ``loss_order``)."""
        if (r := self.config.risk) is None:
            return 0.0
        notice = (self.order.announced_risk(plan, self.job.cluster, pool, self.loss.seconds, r.forced_restart_s)
                  if self.config.loss_order else 0.0)
        if self.config.loss_replay:
            return notice + self.replay.risk(r, plan, self.job.cluster, pool, self.loss_rate(),
                                             self.loss.mean_event_gpus())
        adjust = (lambda h, t: self.order.probabilities(plan, pool, h, t)) if self.config.loss_order else None
        return notice + r.risk(plan, self.job.cluster, pool, self.loss_rate(), self.loss.mean_event_gpus(),
                               self.sites if self.config.loss_sites else None, adjust)

    def loss_rate(self) -> float:
        """λ of unannounced losses, events/s: ``LossRate.rate``; with ``pool_horizon="process"`` and no
        loss of either kind seen yet, ``1 / H_loss`` (the Copernican prior of ``pool_process``: no
        evidence yet that losses are announced, so the first one is priced as unannounced)."""
        rate = self.loss.rate
        if rate == 0 and self.config.pool_horizon == "process" and self.pool_process.losses == 0:
            h = self.pool_process.horizon_s()
            rate = 1.0 / h if h > 0 else 0.0
        return rate

    def expected_l(self, plan: Plan, pool) -> float:
        """``L_step`` plus :meth:`risk`, s."""
        return plan.l_step + self.risk(plan, pool)

    def best_plan(self, job: JobSpec, pool, current: Plan | None, urgent: bool) -> Plan:
        """The planner's fastest plan, or, when that one carries risk, the one with the smallest
        risk-adjusted step time among it, the fastest with redundant training state, and the
        fastest plans on the nodes least likely to be hit (``loss_sites``) and on the oldest GPUs
        (``loss_order``; :meth:`_plans_on`). Raises ``ValueError`` when nothing fits."""
        best = self.planner.plan(job, pool, current, urgent)
        if self.risk(best, pool) <= 0:
            return best
        cands = [best]
        try:
            cands.append(self.planner.plan(job, pool, current, urgent, min_train_replicas=2))
        except ValueError:
            pass
        for on, subs in ((self.config.loss_sites and self.sites.events > 0,
                          lambda: self.sites.safest_pools(pool, self.loss.mean_event_gpus())),
                         (self.config.loss_order, lambda: self.order.oldest_pools(pool))):
            bound = min(self.expected_l(p, pool) for p in cands)
            if on and bound > best.l_step:
                cands += self._plans_on(job, subs(), current, urgent, bound)
        return min(cands, key=lambda p: self.expected_l(p, pool))

    def _plans_on(self, job, subs, current, urgent, bound: float) -> list[Plan]:
        """The fastest plan on each GPU set of ``subs`` (each smaller than the last: the safest
        nodes, ``loss_sites``, or the oldest GPUs, ``loss_order``). Stops at the first where nothing
        fits or whose plan's ``L_step`` alone reaches ``bound`` (the best risk-adjusted step time so
        far, s): fewer GPUs neither fit more nor run faster, so no smaller set can win. Called only
        when ``bound`` exceeds the fastest plan's ``L_step`` (else no plan on fewer GPUs can win)."""
        out = []
        for sub in subs:
            try:
                p = self.planner.plan(job, sub, current, urgent)
            except ValueError:
                break
            if p.l_step >= bound:
                break
            out.append(p)
        return out

    def _replan(self, job, pool, alive, current, urgent, lost, names, horizon):
        self._rejected = None
        survives = state_survives(self.plan, alive)
        save_ok = can_checkpoint(self.plan, alive, self._leave_in, self.config.risk and self.config.risk.save_s,
                                 self.job.cluster)
        try:
            best = self.best_plan(job, pool, self.plan, urgent)
        except ValueError as e:
            diag = " ".join(str(e).split())  # the planner's message (``e.diagnosis`` is data, not prose)
            if urgent:
                return Restart(None, f"urgent and no feasible plan on {len(pool)} GPUs: {diag}"[:400], names,
                               checkpoint_first=save_ok, cause="no_plan")
            return Keep(f"replanned: no feasible plan ({diag})"[:400], names)
        if lost and not survives:
            lost_gpus = sorted(self.plan.gpus_used() - alive)
            gone = [c.model_stage for c in self.plan.candidates if c.model_stage.endswith(".train")
                    and not any(set(gpus) <= alive for gpus in state_copies(c))]
            return Restart(best, f"{len(lost_gpus)} GPU(s) of the plan were lost ({format_gpus(lost_gpus)}), "
                           f"taking every replica of the trainable model-stage(s) {', '.join(gone) or '?'}; "
                           "restore from checkpoint", names,
                           cause="state_lost")
        la = self._ahead_target(job, pool, best, urgent)
        if not urgent and same_plan(best, self.plan) and (la is None or la[2] is None):
            return Keep("replanned: the current plan is still the best", names)
        cur_l = math.inf if urgent else self._score(job, current, pool, alive, la)
        # the best plan now is an option only when it is not the current plan (then only the
        # look-ahead target is: a "transition" to the plan in effect moves nothing)
        options = [] if not urgent and same_plan(best, self.plan) else [self._option(job, best, pool, alive, la)]
        if la is not None and la[2] is not None and not same_plan(la[2], self.plan):
            options.append(self._option(job, la[2], pool, alive, la))
        if not options:
            return Keep("replanned: the current plan is still the best", names)
        options = self._order(options, la)
        waited = self.rent.waited if self.config.break_even else 0
        decision = admit(cur_l, options, gamma=self.config.gamma, horizon=horizon, urgent=urgent,
                         triggers=names, always=self.config.always_admit, waited=waited)
        if isinstance(decision, Transition):
            return decision
        # S* failed feasibility or payback: try slightly slower plans with cheaper transitions
        best_l = options[0].l_step
        n0 = len(options)
        for alt in self.planner.alternatives(job, pool, self.plan, best):
            opt = self._option(job, alt, pool, alive, la)
            slow_ok = urgent or opt.l_step <= best_l * (1 + self.config.slowdown)
            if slow_ok and not same_plan(alt, self.plan) and not any(same_plan(alt, o.plan) for o in options):
                options.append(opt)
        if len(options) > n0:
            options = self._order(options, la)
            decision = admit(cur_l, options, gamma=self.config.gamma, horizon=horizon, urgent=urgent,
                             triggers=names, always=self.config.always_admit, waited=waited)
        if isinstance(decision, Restart) and save_ok:
            decision = replace(decision, checkpoint_first=True)
        if isinstance(decision, Keep):  # the break-even count's rate and price (``break_even.py``)
            now = self.expected_l(current, pool)
            self._rejected = rejected_rate([(now - self.expected_l(o.plan, pool), o.cost.l_tran) for o in options
                                            if o.cost.feasible and o.l_step < cur_l])
        return decision

    def _ahead_target(self, job, pool, best, urgent):
        """``(job ahead, W, S_ahead or None)`` for look-ahead (None when off or no growth). ``S_ahead`` is
        the planner's best plan at the projected length, estimated at the current one, when it differs
        from ``best`` and fits memory now; the forced-transition charge uses it (or ``best``)."""
        if self._window is None:
            return None
        job_ahead, w = self._window
        try:
            ahead = self.planner.plan(job_ahead, pool, self.plan, urgent)
        except ValueError:
            return None  # nothing fits the projected length: compare plans at the current one
        self._forced_to = ahead
        if same_plan(ahead, best):
            return job_ahead, w, None
        now = self.planner.estimate(job, ahead, pool)
        return job_ahead, w, (now if self.planner.memory_ok(job, now) else None)

    def _score(self, job, plan, pool, alive, la) -> float:
        """``L_eff`` of ``plan`` (``lookahead.py``): its risk-adjusted step time, or with look-ahead the
        mean of now and ahead plus the forced transition over the window when it will not fit."""
        now = self.expected_l(plan, pool)
        if la is None:
            return now
        job_ahead, w, _ = la
        est = self.planner.estimate(job_ahead, plan, pool)
        score = 0.5 * (now + self.expected_l(est, pool))
        if not self.planner.memory_ok(job_ahead, est):
            forced = self.tran_cal.apply(self.transition_cost(job_ahead, plan, self._forced_to, alive))
            score += (forced.l_tran if forced.feasible and math.isfinite(forced.l_tran) else 0.0) / w
        return score

    @staticmethod
    def _order(options, la):
        """Targets by the window's total seconds ``L_tran + W · L_eff`` (look-ahead only; else as given)."""
        if la is None:
            return options
        w = la[1]
        return sorted(options, key=lambda o: (not o.cost.feasible, o.cost.l_tran + w * o.l_step))

    def _option(self, job, plan, pool, alive, la=None) -> Option:
        cost, excluded = notice_cost(lambda gpus: self.tran_cal.apply(self.transition_cost(job, self.plan, plan, gpus)),
                                     self.plan, plan, alive, self._leave_in)  # done before announced GPUs leave
        return Option(plan, cost, self._score(job, plan, pool, alive, la), excluded)

    def _stale_trigger(self, step: int) -> Trigger:
        sig = self._pending[0]
        h = self.monitor.horizon(sig)
        elapsed = step - (h.last_crossing if h.last_crossing is not None else 0)
        return Trigger(f"stale:{sig}", False, float(elapsed), h.value, float(max(elapsed, 1)),
                       f"no {sig} crossing for {elapsed} steps (H={h.value:.2f}): revisit the rejected target")

    def revisit(self, step: int, signal: str = "pool") -> None:
        """Replan at the boundary after ``step`` even without a trigger: the executor reports that a
        target rejected for payback became cheaper to reach (e.g. its rollout engines were started in
        the background). The replan is the ``revisit`` extension's (``_stale_trigger``): ``H`` is the
        steps since ``signal`` last crossed, so the payback rule still decides."""
        self._pending = (signal, int(step))

    def resume(self, plan: Plan) -> None:
        """The executor reports the plan actually in effect (e.g. after a restart it chose itself)."""
        self.plan = plan
        self.rent.clear()

    def _record(self, report: StepReport, decision, triggers):
        d = decision_to_dict(decision)
        d.pop("plan", None)
        self.log.append({"step": report.step, "triggers": [t.to_dict() for t in triggers], "decision": d})
        return decision
