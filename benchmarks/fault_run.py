"""The fault benchmark's runs (``benchmarks/bench_faults.py``): its constants, the planned
:class:`Fault` and :class:`RunSpec`, and :class:`FaultBenchRun`, an
:class:`~nereus.runtime.run.adaptive.AdaptiveRun` that injects several faults per step and replaces
each lost worker a step later."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field, replace

os.environ.setdefault("OMP_NUM_THREADS", "1")


from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.device_model import runtime_job  # noqa: E402
from nereus.runtime.run.faults import probe  # noqa: E402
from nereus.runtime.run.relayout import train_stages  # noqa: E402
from nereus.runtime.transit.driver_side import move_specs  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
HANG_TIMEOUT_S = 3.0
GROUP_TIMEOUT_S = 15.0
ATOL, RTOL = 1e-5, 1e-4
STEP_POINTS = ("generate", "logprobs", "values", "train_fields", "sync_weights")
PHASE_OF = {"transition_run": "transition", "dcp_save": "checkpoint"}
NEVER = 10 ** 9  # ``arm(..., skip=NEVER)`` disarms a worker


def workload(algorithm: str) -> WorkloadSpec:
    return WorkloadSpec(algorithm=algorithm, prompts_per_step=4, samples_per_prompt=2, prompt_len=5,
                        response_len=4, mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4,
                        reward_model=False)


def config() -> RLConfig:
    return RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=GROUP_TIMEOUT_S)


@dataclass
class Fault:
    """One planned fault: ``count`` workers die or hang inside ``point`` during ``phase`` of ``step``."""

    step: int
    point: str
    how: str
    count: int = 1
    skip: int = 0
    phase: str = ""
    second_how: str = ""  # how the second worker fails (e.g. ``late:1``: a second later); "" as the first
    in_recovery: bool = False  # also kill one more worker inside the recovery's live transition
    first_lost_at: float = 0.0  # time.monotonic() of the settle that first saw its first worker lost
    state: str = "planned"  # planned → armed → fired | not fired
    workers: list[int] = field(default_factory=list)
    fired: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.phase:
            self.phase = PHASE_OF.get(self.point, "step")


@dataclass
class RunSpec:
    algorithm: str
    workers: int
    steps: int
    schedule: str
    checkpoint_every: int
    faults: list[Fault]
    grow: bool = False  # every scheduled join replans onto the joining workers (FaultBenchRun.grow)

    @property
    def key(self) -> tuple:
        """What the fault-free reference run must share: workload, pool, pool schedule, steps, growth."""
        return (self.algorithm, self.workers, self.schedule, self.steps, self.grow)


class FaultBenchRun(AdaptiveRun):
    """:class:`AdaptiveRun` with several faults per step and a worker replacing each lost one.

    ``_inject`` picks the victims among the workers that make the faulty call in the phase starting
    now; the first is armed through the run's ``faults`` (the public API), a second one (or one with
    ``skip``) through the pool. Every phase end and every recovery disarms armed faults that did not
    fire, so none goes off later. ``_recover`` annotates each recovery event with whether a full
    copy of every training model-stage survived and the steps since the last durable checkpoint,
    and schedules replacements for the lost workers at the next step without a scheduled change.
    ``step_plans`` records the plan each step ran on in its last (counted) execution, for :func:`replay`.

    ``grow``: at each join of the pool schedule the controller decides with ``always_admit``
    (``ControllerConfig``: any faster feasible target, no payback rule), so the plan grows onto the
    joining workers in a live transition whenever the planner has a faster plan there, and a
    transition fault drawn for that boundary fires in a growth's transition (with the payback rule
    the tiny model's joins kept their plan: the transition costs more than the steps left repay).
    """

    def __init__(self, *args, bench_faults: list[Fault], rng: random.Random, capacity: int, grow: bool = False,
                 **kw) -> None:
        super().__init__(*args, faults={}, **kw)
        self.grow = bool(grow)
        self.bench = bench_faults
        self.rng = rng
        self.base_schedule = dict(self.schedule)
        self._departures = {k for k, v in self.schedule.items() if v < 0}
        # worker ids grow as replacements join: size the job's cluster for all of them
        self.max_workers = max(self.max_workers, capacity)
        # (the same device, precision and plan space: ``framework`` picks the space, and a job rebuilt
        # without it would plan in the default one, where ZeRO/offloaded state recovers through the checkpoint)
        self.job = runtime_job(self.spec, self.workload, self.max_workers, self.job.cluster.gpu,
                               precision=self.cfg.precision, framework=self.framework)
        self._target = None
        self.replacements = 0
        self.step_plans: dict[int, Plan] = {}

    # ------------------------------------------------------------------ who makes the call
    def _callers(self, point: str) -> list[int]:
        d = self.driver
        lays = d.layouts
        if point == "generate":
            names = ["actor.generate"]
        elif point == "logprobs":
            names = ["actor.infer", "reference.infer"]
        elif point == "values":
            names = ["critic.infer", "reward.infer"]
        elif point == "train_fields":
            names = ["actor.train", "critic.train"]
        elif point == "sync_weights":
            out: set[int] = set()
            for src, dsts in (("actor.train", ("actor.generate", "actor.infer")), ("critic.train", ("critic.infer",))):
                for dst in dsts:
                    if src in lays and dst in lays:
                        out |= set(lays[src].replica(0)) | set(lays[dst].workers)
            return sorted(out)
        elif point == "dcp_save":
            return sorted({w for ms in lays for w in lays[ms].replica(0)})
        elif point == "transition_run":
            if self._target is None:
                return []
            current, target, alive = self._target
            try:
                est = estimate_transition(self.calib.apply(self.job_at(self.last_len)), current, target, alive,
                                          params=self.calib.params())
            except ValueError:
                return []
            if not est.feasible or est.dag is None:
                return []
            specs = move_specs(est.dag, {ms.name: ms.trainable for ms in d.wf.model_stages}, d.storage_seeds())
            return sorted({w for m in specs.values() for w in m.workers})
        else:
            names = []
        return sorted({w for n in names if n in lays for w in lays[n].workers})

    def _inject(self, k: int, phase: str) -> None:
        d = self.driver
        for f in self.bench:
            if f.step != k or f.phase != phase or f.state != "planned":
                continue
            callers = [w for w in self._callers(f.point) if w < len(d.workers) and d.workers[w] is not None]
            if not callers:
                f.state = "no caller"
                continue
            # keep enough workers for a plan: 3 after the fault, 4 when a departure follows, 2 besides
            # the leaver in its transition (a
            # departure that leaves PPO 2 workers hits the shared-plan bug in docs/faults.md)
            alive = sum(1 for w in d.workers if w is not None) - len(self._announced)
            need = 2 if phase == "transition" else 4 if k + 1 in self._departures else 3
            room = alive - need - (1 if f.in_recovery else 0)  # (a loss in the transition: without the leaver)
            f.count = min(f.count, len(callers), room)  # e.g. everything time-shared on one worker
            if f.count < 1:
                f.state = "pool too small"
                continue
            f.workers = sorted(self.rng.sample(callers, f.count))
            f.state = "armed"
            for i, w in enumerate(f.workers):
                how = f.second_how if i == 1 and f.second_how else f.how
                if i == 0 and f.skip == 0:  # through the run's fault API
                    self.faults[k] = (f.point, w, how)
                    super()._inject(k, phase)
                else:  # a second worker, or a later call of the method: through the pool
                    d._get([d.workers[w].arm.options(concurrency_group="control").remote(f.point, how, f.skip)],
                           "arm a fault")
                    self.log(f"  [fault armed: worker {w} will be {how} inside call {f.skip + 1} of {f.point} "
                             f"during the {phase} of step {k}]")
            if f.in_recovery:  # one more, inside the recovery this fault causes (its live transition)
                rest = [i for i, w in enumerate(d.workers) if w is not None and i not in f.workers
                        and i not in self._announced]
                if rest:
                    w = self.rng.choice(rest)
                    nested = Fault(step=k, point="transition_run", how="kill", phase="recovery", workers=[w],
                                   state="waiting")  # armed when the recovery starts (_inject_in_recovery)
                    self.bench.append(nested)
                    self.recovery_faults[k] = ("transition_run", w, "kill")

    def _settle(self, final: bool = False) -> None:
        """Armed faults: the workers lost are fired; survivors still armed are disarmed. The second
        worker of a ``late:<s>`` double fault whose first worker was lost is left armed for ``s`` plus
        a detection round (:meth:`_late_pending`): it goes off during the first one's recovery (or the
        step re-run after it), and a later settle, after the call that found it lost, counts it.
        ``final`` (at the end of the run, ``bench_faults.execute``): nothing is left pending."""
        d = self.driver
        for f in self.bench:
            if f.state != "armed":
                continue
            f.fired = [w for w in f.workers if d.workers[w] is None]
            alive = [w for w in f.workers if d.workers[w] is not None]
            if not final and self._late_pending(f, alive):
                continue
            if alive:
                try:
                    d._get([d.workers[w].arm.options(concurrency_group="control").remote(f.point, "kill", NEVER)
                            for w in alive], "disarm")
                except Exception:  # noqa: BLE001  (a loss here is found by the next call)
                    pass
            f.state = "fired" if f.fired else "not fired"

    def _late_pending(self, f: Fault, alive: list[int]) -> bool:
        """``f``'s second worker fails ``late:<s>`` after its first one was lost and may still go off:
        within ``s`` + 2 x ``hang_timeout_s`` + 1 s of the settle that first saw the first one lost
        (its timer started before that: at its call or at the cancel the first loss sent,
        ``FaultTolerantWorker.arm``), or dead or silent now but not found yet (the next call finds it)."""
        # (a fault whose count the guard lowered to one has no second worker: nothing to wait for; such
        # faults at a run's last step stayed "armed" and went uncounted: 3 of seed 4242's 102 losses)
        if not (f.second_how.startswith("late:") and len(f.workers) > 1 and f.workers[1:] == alive
                and f.workers[0] in f.fired):
            return False
        now = time.monotonic()
        f.first_lost_at = f.first_lost_at or now
        if now < f.first_lost_at + float(f.second_how.split(":", 1)[1]) + 2 * self.hang_timeout_s + 1.0:
            return True
        dead, silent = probe([self.driver.workers[w] for w in alive], self.hang_timeout_s)
        return bool(dead or silent)

    # ------------------------------------------------------------------ phase hooks
    def _pool_change(self, pool, k: int) -> None:
        if not (self.grow and self.base_schedule.get(k, 0) > 0):
            return super()._pool_change(pool, k)
        cfg = self.ctl.config
        self.ctl.config = replace(cfg, always_admit=True)  # a scheduled join: grow onto it (class docstring)
        try:
            return super()._pool_change(pool, k)
        finally:
            self.ctl.config = cfg

    def _step(self, k: int) -> dict:
        try:
            m = super()._step(k)
        finally:
            self._settle()
        # a restore from the durable checkpoint re-runs steps: the last execution is the one that counts
        self.step_plans[int(m["step"])] = Plan(candidates=tuple(self.driver.cands.values()))
        return m

    def _live(self, current, target, alive, k: int = -1):
        self._target = (current, target, alive)
        try:
            return super()._live(current, target, alive, k)
        finally:
            self._target = None
            self._settle()

    def _inject_in_recovery(self, k: int) -> None:
        super()._inject_in_recovery(k)
        for f in self.bench:
            if f.step == k and f.phase == "recovery" and f.state == "waiting":
                f.state = "armed"

    def _save(self, force: bool = False, k: int = -1, sync: bool = False) -> None:
        try:
            super()._save(force=force, k=k, sync=sync)
        finally:
            self._settle()

    def _recover(self, e, k: int, when: str) -> None:
        self._settle()
        d = self.driver
        alive = {i for i, w in enumerate(d.workers) if w is not None}
        bplan = {c.model_stage: c for c in self._bnd["plan"].candidates}
        full = True
        for n in train_stages(d):
            c = bplan[n]
            size = c.tp * c.pp
            reps = [c.gpus[r * size:(r + 1) * size] for r in range(c.dp)]
            full &= any(set(r) <= alive for r in reps)
        since = self._bnd["step_index"] - self.ckpt_step
        n_before = len(self.recoveries)
        try:
            super()._recover(e, k, when)
        finally:
            self._settle()  # a fault armed inside the recovery: fired, or disarmed now
        for ev in self.recoveries[n_before:]:
            ev.update(full_copy=full, since_checkpoint=since, phase=when)
        lost = {w for ev in self.recoveries[n_before:] for w in ev["lost"]} | set(e.lost)
        # spot replacements: as many fresh workers as were lost, before the next step with no change
        j = self.driver.step_index + 1
        while j in self.base_schedule:
            j += 1
        self.schedule[j] = self.schedule.get(j, 0) + len(lost)
        self.replacements += len(lost)
