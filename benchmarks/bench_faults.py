"""Fault benchmark: workers killed or hung at random points of real PPO and GRPO runs (docs/faults.md).

Each run is an :class:`~nereus.runtime.adaptive.AdaptiveRun` (``tiny`` model preset) on 4-6 Ray CPU
workers with a pool schedule whose departures are announced (``notice=True``), so live transitions
happen, and durable checkpoints every 1 or 2 steps. Almost every step gets a fault, drawn from a
seeded generator:

* **where**: one of ``faults.FAULT_POINTS``: generation, a forward for log-probs or values (PPO's
  critic), the forward+backward+optimizer call (``train_fields``, sometimes its second mini-batch,
  after the first optimizer step already ran), the weight sync, a transition primitive (at a step
  whose boundary has an announced departure) and a durable checkpoint save;
* **how**: killed (the process exits) or hung (SIGSTOP: alive, answering nothing);
* **how many**: one worker, or two at once (both armed for the same call).

The first worker of a fault is armed through ``AdaptiveRun(faults={step: (point, worker, how)})``;
the second (and a fault in a later call of the same method, ``skip``) is armed through the pool with
``FaultTolerantWorker.arm``. Which worker is hit is drawn when the phase starts, among the workers
that will make that call (the current plan's layouts, the transition's DAG, the checkpoint's
writers), so every armed fault fires; a fault that did not fire anyway is disarmed and not counted.
A killed worker is replaced by a fresh one a step later (a spot replacement), so a run can take a
fault every step. Every run is bounded by a wall-clock timeout: a run that exceeds it counts as hung.

Reported: faults injected and survived (the run finished all its steps after recovering from it),
runs that hung (must be 0), detection time (max, median), logical state lost (steps lost: 0
wherever a full copy of every training model-stage survived, else at most the steps since the last
durable checkpoint), recovery time, and whether each run ended at the weights of its **replay**: a
fault-free run of the same samples on the same plan at every step (the plan each step last ran on;
:func:`replay`), compared with ``torch.allclose`` (atol 1e-5, rtol 1e-4). The distance to a
fault-free run of the same workload, pool schedule and step count on the plans its own controller
chose is reported too, as **layout drift**: recoveries put steps on other layouts (another DP, PP or
micro-batch split sums the same gradients in another fp32 order), and Adam (eps 1e-8, lr 1e-2)
turns those last-bit differences into 1e-3 after ten PPO steps (docs/faults.md); it is not a check.

    python benchmarks/bench_faults.py --faults 100 --seed 0 --json bench-faults.json
    python benchmarks/bench_faults.py --quick          # about 6 faults, what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nereus.controller.planning import same_plan  # noqa: E402
from nereus.planner.plan import Plan  # noqa: E402
from nereus.runtime.adaptive import AdaptiveRun, parse_pool_schedule, runtime_job  # noqa: E402
from nereus.runtime.driver import RLConfig, RLDriver  # noqa: E402
from nereus.runtime.executor import move_specs  # noqa: E402
from nereus.runtime.faults import FAULT_POINTS  # noqa: E402
from nereus.runtime.pool import WorkerPool  # noqa: E402
from nereus.runtime.relayout import relayout, train_stages  # noqa: E402
from nereus.runtime.task import DigitTask  # noqa: E402
from nereus.spec.model import MODEL_PRESETS  # noqa: E402
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
    state: str = "planned"  # planned → armed → fired | not fired
    workers: list[int] = field(default_factory=list)
    fired: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.phase = PHASE_OF.get(self.point, "step")


@dataclass
class RunSpec:
    algorithm: str
    workers: int
    steps: int
    schedule: str
    checkpoint_every: int
    faults: list[Fault]

    @property
    def key(self) -> tuple:
        """What the fault-free reference run must share: workload, pool, pool schedule, steps."""
        return (self.algorithm, self.workers, self.schedule, self.steps)


class FaultBenchRun(AdaptiveRun):
    """:class:`AdaptiveRun` with several faults per step and a worker replacing each lost one.

    ``_inject`` picks the victims among the workers that make the faulty call in the phase starting
    now; the first is armed through the run's ``faults`` (the public API), a second one (or one with
    ``skip``) through the pool. Every phase end and every recovery disarms armed faults that did not
    fire, so none goes off later. ``_recover`` annotates each recovery event with whether a full
    copy of every training model-stage survived and the steps since the last durable checkpoint,
    and schedules replacements for the lost workers at the next step without a scheduled change.
    ``step_plans`` records the plan each step ran on in its last (counted) execution, for :func:`replay`.
    """

    def __init__(self, *args, bench_faults: list[Fault], rng: random.Random, capacity: int, **kw) -> None:
        super().__init__(*args, faults={}, **kw)
        self.bench = bench_faults
        self.rng = rng
        self.base_schedule = dict(self.schedule)
        self._departures = {k for k, v in self.schedule.items() if v < 0}
        # worker ids grow as replacements join: size the job's cluster for all of them
        self.max_workers = max(self.max_workers, capacity)
        self.job = runtime_job(self.spec, self.workload, self.max_workers, self.job.cluster.gpu)
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
            room = alive - need  # (a loss in the transition is replanned without the leaver)
            f.count = min(f.count, len(callers), room)  # e.g. everything time-shared on one worker
            if f.count < 1:
                f.state = "pool too small"
                continue
            f.workers = sorted(self.rng.sample(callers, f.count))
            f.state = "armed"
            for i, w in enumerate(f.workers):
                if i == 0 and f.skip == 0:  # through the run's fault API
                    self.faults[k] = (f.point, w, f.how)
                    super()._inject(k, phase)
                else:  # a second worker, or a later call of the method: through the pool
                    d._get([d.workers[w].arm.options(concurrency_group="control").remote(f.point, f.how, f.skip)],
                           "arm a fault")
                    self.log(f"  [fault armed: worker {w} will be {'stopped' if f.how == 'stop' else 'killed'} "
                             f"inside call {f.skip + 1} of {f.point} during the {phase} of step {k}]")

    def _settle(self) -> None:
        """Armed faults: the workers lost are fired; survivors still armed are disarmed."""
        d = self.driver
        for f in self.bench:
            if f.state != "armed":
                continue
            f.fired = [w for w in f.workers if d.workers[w] is None]
            alive = [w for w in f.workers if d.workers[w] is not None]
            if alive:
                try:
                    d._get([d.workers[w].arm.options(concurrency_group="control").remote(f.point, "kill", NEVER)
                            for w in alive], "disarm")
                except Exception:  # noqa: BLE001  (a loss here is found by the next call)
                    pass
            f.state = "fired" if f.fired else "not fired"

    # ------------------------------------------------------------------ phase hooks
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

    def _save(self, force: bool = False, k: int = -1) -> None:
        try:
            super()._save(force=force, k=k)
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
        super()._recover(e, k, when)
        for ev in self.recoveries[n_before:]:
            ev.update(full_copy=full, since_checkpoint=since, phase=when)
        # spot replacements: as many fresh workers as were lost, before the next step with no change
        j = self.driver.step_index + 1
        while j in self.base_schedule:
            j += 1
        self.schedule[j] = self.schedule.get(j, 0) + len(e.lost)
        self.replacements += len(e.lost)


# ---------------------------------------------------------------------- the runs
def _bounded(fn, timeout_s: float, on_timeout):
    """``fn()`` in a thread; ``(result, error, hung)``. On timeout ``on_timeout()`` (kill the pool)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        on_timeout()
        t.join(30)
        return None, None, True
    return box.get("result"), box.get("error"), False


def execute(spec: RunSpec, faults: bool, seed: int, timeout_s: float, verbose: bool = False, on_line=None) -> dict:
    """One run (with ``spec.faults`` when ``faults``, else the fault-free reference)."""
    lines: list[str] = []

    def log(s: str) -> None:
        lines.append(s)
        if verbose:
            print(("    " if faults else "    [ref] ") + s, flush=True)
        if on_line:
            on_line(s)

    pool = WorkerPool(spec.workers, timeout_s=GROUP_TIMEOUT_S, hang_timeout_s=HANG_TIMEOUT_S).start()
    planned = spec.faults if faults else []
    capacity = spec.workers + sum(max(v, 0) for v in parse_pool_schedule(spec.schedule).values()) \
        + sum(f.count for f in planned)
    run = FaultBenchRun(SPEC, workload(spec.algorithm), TASK, spec.workers, config(),
                        schedule=parse_pool_schedule(spec.schedule), notice=True, hang_timeout_s=HANG_TIMEOUT_S,
                        log=log, measure=False, checkpoint_every=spec.checkpoint_every,
                        bench_faults=planned, rng=random.Random(seed), capacity=capacity,
                        # synchronous saves: a dcp_save fault fires inside the save, so it is settled and
                        # filed under the checkpoint phase (an async write would fire after the boundary)
                        checkpoint_sync=True)
    run.keep_final = True
    t0 = time.perf_counter()

    def go():
        try:
            return run.run(spec.steps, pool)
        finally:
            pool.close()

    hist, err, hung = _bounded(go, timeout_s, pool.close)
    return {"run": run, "history": hist, "error": None if err is None else f"{type(err).__name__}: {str(err)[:400]}",
            "hung": hung, "seconds": time.perf_counter() - t0, "lines": lines}


def replay(spec: RunSpec, plans: dict[int, Plan], timeout_s: float) -> dict:
    """The fault-free run a faulty one must match: the same samples and steps, each step on the plan
    it last ran on in the faulty run (``FaultBenchRun.step_plans``), on an :class:`RLDriver` of its
    own with no faults, no controller and no checkpoints; a plan change between two steps goes
    through the centralized re-layout (``relayout.py``: gathered into the driver, exact), so nothing
    it shares with the faulty run's recoveries (live transitions, rollback snapshots, durable
    checkpoints) can hide a difference. Worker ids are renumbered ``0..n-1`` in order (layouts,
    hence every sum's order, are unchanged).

    Returns:
        ``{"final_state", "error", "hung", "seconds"}`` (``final_state`` as ``AdaptiveRun.final_state``).
    """
    t0 = time.perf_counter()
    missing = [k for k in range(spec.steps) if k not in plans]
    if missing:
        return {"final_state": None, "error": f"no plan recorded for steps {missing}", "hung": False, "seconds": 0.0}
    ids = sorted({g for p in plans.values() for c in p.candidates for g in c.gpus})
    rank = {g: i for i, g in enumerate(ids)}
    seq = [Plan(candidates=tuple(replace(c, gpus=tuple(rank[g] for g in c.gpus)) for c in plans[k].candidates))
           for k in range(spec.steps)]
    pool = WorkerPool(len(ids), timeout_s=GROUP_TIMEOUT_S, hang_timeout_s=HANG_TIMEOUT_S).start()
    driver = RLDriver(SPEC, workload(spec.algorithm), seq[0], TASK, len(ids), config())

    def go():
        try:
            driver.start(pool)
            for k, plan in enumerate(seq):
                if k and not same_plan(plan, seq[k - 1]):
                    relayout(driver, plan)
                driver.step()
            return {n: driver.gather_logical_state(n) for n in train_stages(driver)}
        finally:
            driver.close()
            pool.close()

    final, err, hung = _bounded(go, timeout_s, pool.close)
    return {"final_state": final, "error": None if err is None else f"{type(err).__name__}: {str(err)[:400]}",
            "hung": hung, "seconds": time.perf_counter() - t0}


def same_layouts(a: dict[int, Plan], b: dict[int, Plan]) -> bool:
    """Every step ran on the same layouts (tp, pp, dp, micro-batch, accumulation) in ``a`` and ``b``,
    whichever workers held them: the same sums in the same order."""
    def shape(p: Plan):
        return sorted((c.model_stage, c.tp, c.pp, c.dp, c.micro_batch, c.grad_accum, c.concurrency, c.recompute)
                      for c in p.candidates)
    return a.keys() == b.keys() and all(shape(a[k]) == shape(b[k]) for k in a)


def compare(a: dict | None, b: dict | None) -> tuple[bool, float]:
    """Same training state (update counters, data position, parameters within fp32 tolerance)?"""
    if not a or not b or a.keys() != b.keys():
        return False, float("inf")
    ok, worst = True, 0.0
    for ms in a:
        if a[ms]["update_count"] != b[ms]["update_count"] or a[ms]["position"] != b[ms]["position"]:
            ok = False
        for n in a[ms]["params"]:
            x, y = a[ms]["params"][n], b[ms]["params"][n]
            worst = max(worst, float((x - y).abs().max()))
            ok &= bool(torch.allclose(x, y, atol=ATOL, rtol=RTOL))
    return ok, worst


# ---------------------------------------------------------------------- the fault plan
def plan_run(rng: random.Random, index: int, quick: bool) -> RunSpec:
    """A seeded run with a fault at (almost) every step; the quick sample covers one of each phase."""
    if quick:
        algorithm, workers, steps, every, schedule = "ppo", 6, 4, 1, "2:-1"
    else:
        algorithm = ("ppo", "grpo")[index % 2]
        workers = (5, 4, 6)[(index // 2) % 3]
        steps, every = 10, (1, 2)[(index // 2) % 2]
        schedule = "2:-1,4:+1,6:-1,8:+1"
    departures = {k for k, v in parse_pool_schedule(schedule).items() if v < 0}
    points = [p for p in STEP_POINTS if algorithm == "ppo" or p != "values"]
    faults: list[Fault] = []
    for k in range(steps):
        how = rng.choice(("kill", "stop")) if not quick else ("stop", "kill", "kill", "stop")[k]
        saves = (k + 1) % every == 0
        if quick:
            phase = ("step", "step", "transition", "checkpoint")[k]
            count = 2 if k in (1, 3) else 1
        else:
            r = rng.random()
            phase = ("transition" if k in departures and r < 0.7 else
                     "checkpoint" if saves and r < 0.3 else "step")
            count = 2 if rng.random() < 0.3 else 1
        point = ("transition_run" if phase == "transition" else "dcp_save" if phase == "checkpoint" else
                 rng.choice(points))
        skip = rng.choice((0, 1)) if point == "train_fields" else 0
        faults.append(Fault(step=k, point=point, how=how, count=count, skip=skip))
    return RunSpec(algorithm, workers, steps, schedule, every, faults)


def summarize(runs: list[dict], refs: dict, wall_s: float, args) -> dict:
    faults = [f for r in runs for f in r["faults"] if f["state"] == "fired"]
    per_worker = [(f, w) for f in faults for w in f["fired"]]
    recs = [ev for r in runs for ev in r["recoveries"]]
    detect = [ev["detect_s"] for ev in recs]
    rec_s = [ev["recovery_s"] for ev in recs]
    full = [ev for ev in recs if ev.get("full_copy")]
    partial = [ev for ev in recs if not ev.get("full_copy")]
    by_point = {p: sum(1 for f, _ in per_worker if f["point"] == p) for p in FAULT_POINTS}
    survived = sum(len(f["fired"]) for r in runs if r["completed"] for f in r["faults"] if f["state"] == "fired"
                   and all(any(w in ev["lost"] for ev in r["recoveries"]) for w in f["fired"]))
    compared = [r for r in runs if r["completed"]]
    return {
        "faults_injected": len(per_worker),
        "fault_events": len(faults),
        "double_faults": sum(1 for f in faults if len(f["fired"]) == 2),
        "faults_survived": survived,
        "faults_not_fired": sum(1 for r in runs for f in r["faults"] if f["state"] in ("not fired", "no caller", "pool too small")),
        "by_point": by_point,
        "by_how": {h: sum(1 for f, _ in per_worker if f["how"] == h) for h in ("kill", "stop")},
        "by_phase": {p: sum(1 for f, _ in per_worker if f["phase"] == p) for p in ("step", "transition", "checkpoint")},
        "runs": len(runs),
        "runs_hung": sum(1 for r in runs if r["hung"]),
        "runs_failed": sum(1 for r in runs if r["error"] and not r["hung"]),
        "reference_runs": len(refs),
        "reference_runs_hung": sum(1 for x in refs.values() if x["hung"]),
        "recoveries": len(recs),
        "recoveries_live": sum(1 for ev in recs if ev.get("source") == "live"),
        "recoveries_checkpoint": sum(1 for ev in recs if ev.get("source") == "checkpoint"),
        "detect_s_max": max(detect, default=0.0),
        "detect_s_median": statistics.median(detect) if detect else 0.0,
        "detect_s_median_kill": _median([ev["detect_s"] for ev in recs if not ev["hung"]]),
        "detect_s_median_hang": _median([ev["detect_s"] for ev in recs if ev["hung"]]),
        "recovery_s_max": max(rec_s, default=0.0),
        "recovery_s_median": statistics.median(rec_s) if rec_s else 0.0,
        "steps_lost_full_copy_max": max((ev.get("steps_lost", 0) for ev in full), default=0),
        "recoveries_full_copy": len(full),
        "recoveries_no_full_copy": len(partial),
        "steps_lost_no_full_copy": [ev.get("steps_lost", 0) for ev in partial],
        "steps_lost_bound_violations": sum(1 for ev in recs if ev.get("steps_lost", 0) > (
            0 if ev.get("full_copy") else ev.get("since_checkpoint", 0))),
        "weights_equal": sum(1 for r in compared if r["weights_equal"]),
        "weights_compared": len(compared),
        "weights_max_abs_diff": max((r["max_abs_diff"] for r in compared), default=0.0),
        "replays_hung": sum(1 for r in runs if r.get("replay_hung")),
        "reference_equal": sum(1 for r in compared if r["reference_equal"]),
        "layout_drift_max": max((r["layout_drift"] for r in compared), default=0.0),
        "layouts_as_reference": sum(1 for r in compared if r["layouts_as_reference"]),
        "reference_equal_same_layouts": sum(1 for r in compared if r["layouts_as_reference"] and r["reference_equal"]),
        "wall_s": wall_s,
        "seed": args.seed,
        "quick": bool(args.quick),
        "hang_timeout_s": HANG_TIMEOUT_S,
    }


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _table(summary: dict, runs: list[dict]):
    from rich.table import Table

    t = Table(title=f"fault benchmark: {summary['faults_injected']} faults in {summary['runs']} runs "
                    f"(seed {summary['seed']}, {summary['wall_s'] / 60:.1f} min)")
    t.add_column("figure")
    t.add_column("value", justify="right")
    s = summary
    rows = [
        ("faults injected (workers lost)", f"{s['faults_injected']} ({s['double_faults']} double)"),
        ("  by point", ", ".join(f"{p} {n}" for p, n in s["by_point"].items())),
        ("  killed / hung (SIGSTOP)", f"{s['by_how']['kill']} / {s['by_how']['stop']}"),
        ("  in a step / transition / checkpoint save",
         f"{s['by_phase']['step']} / {s['by_phase']['transition']} / {s['by_phase']['checkpoint']}"),
        ("faults survived", f"{s['faults_survived']} / {s['faults_injected']}"),
        ("runs hung (wall-clock bound exceeded)", f"{s['runs_hung']} / {s['runs']}"),
        ("runs failed", f"{s['runs_failed']} / {s['runs']}"),
        ("recoveries (live / from checkpoint)",
         f"{s['recoveries']} ({s['recoveries_live']} / {s['recoveries_checkpoint']})"),
        ("detection time max / median", f"{s['detect_s_max']:.2f}s / {s['detect_s_median']:.2f}s"),
        ("detection median: killed / hung",
         f"{_fmt(s['detect_s_median_kill'])} / {_fmt(s['detect_s_median_hang'])}"),
        ("recovery time max / median", f"{s['recovery_s_max']:.2f}s / {s['recovery_s_median']:.2f}s"),
        ("steps lost where a full copy survived (max)",
         f"{s['steps_lost_full_copy_max']} ({s['recoveries_full_copy']} recoveries)"),
        ("steps lost where no full copy survived",
         f"{s['steps_lost_no_full_copy']} ({s['recoveries_no_full_copy']} recoveries)"),
        ("recoveries losing more than allowed", str(s["steps_lost_bound_violations"])),
        ("final weights equal to the fault-free run on the same plans (replay)",
         f"{s['weights_equal']} / {s['weights_compared']} runs (max |diff| {s['weights_max_abs_diff']:.2e})"),
        ("  layout drift: equal to the fault-free run on its own plans",
         f"{s['reference_equal']} / {s['weights_compared']} runs (max |diff| {s['layout_drift_max']:.2e}; "
         f"{s['reference_equal_same_layouts']} of the {s['layouts_as_reference']} runs on its layouts)"),
    ]
    for a, b in rows:
        t.add_row(a, b)
    per = Table(title="runs")
    for c in ("run", "algo", "workers", "ckpt every", "faults", "recoveries", "steps lost", "seconds", "end",
              "drift"):
        per.add_column(c)
    for i, r in enumerate(runs):
        end = ("HUNG" if r["hung"] else "failed" if r["error"] else
               f"= replay ({r['max_abs_diff']:.0e})" if r["weights_equal"] else f"differs ({r['max_abs_diff']:.1e})")
        drift = f"{r['layout_drift']:.1e}" if r["completed"] else "-"
        per.add_row(str(i), r["algorithm"], str(r["workers"]), str(r["checkpoint_every"]),
                    str(sum(len(f["fired"]) for f in r["faults"])), str(len(r["recoveries"])),
                    str(sum(ev.get("steps_lost", 0) for ev in r["recoveries"])), f"{r['seconds']:.0f}", end, drift)
    return t, per


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}s"


def _events(run) -> list[dict]:
    keep = ("step", "phase", "lost", "hung", "detect_s", "source", "steps_lost", "recovery_s", "full_copy",
            "since_checkpoint", "plan")
    return [{k: ev.get(k) for k in keep} for ev in run.recoveries]


def reference_run(spec: RunSpec, seed: int, timeout_s: float, verbose: bool = False) -> dict:
    """The fault-free run of ``spec``'s workload, pool, pool schedule and steps, on the plans its own
    controller chooses: ``{"final_state", "plans", "hung", "error", "seconds"}`` (for the layout drift)."""
    res = execute(spec, False, seed, timeout_s, verbose)
    ok = not res["hung"] and res["error"] is None
    return {"final_state": res["run"].final_state if ok else None, "hung": res["hung"], "error": res["error"],
            "seconds": res["seconds"], "plans": res["run"].step_plans}


def check_run(spec: RunSpec, ref: dict, seed: int, timeout_s: float, verbose: bool = False, on_line=None,
              on_replay=None) -> dict:
    """Run ``spec`` with its faults, then its :func:`replay`; the run's record (faults, recoveries,
    whether it completed, ``weights_equal`` / ``max_abs_diff`` against the replay, and
    ``layout_drift`` against ``ref``, a :func:`reference_run`)."""
    res = execute(spec, True, seed, timeout_s, verbose, on_line)
    run = res["run"]
    # a restore from the durable checkpoint re-runs steps (history has them twice): count the end
    completed = (not res["hung"] and res["error"] is None and res["history"] is not None
                 and run.driver.step_index == spec.steps)
    # the check: the weights of the fault-free run on the same plans
    if completed and on_replay is not None:
        on_replay()
    rep = replay(spec, run.step_plans, timeout_s) if completed else None
    eq, diff = (compare(run.final_state, rep["final_state"]) if rep and rep["final_state"]
                else (False, float("inf")))
    # information: the fault-free run on the plans its own controller chose (layout drift)
    ref_eq, drift = compare(run.final_state, ref["final_state"]) if completed else (False, float("inf"))
    return {"algorithm": spec.algorithm, "workers": spec.workers, "steps": spec.steps,
            "schedule": spec.schedule, "checkpoint_every": spec.checkpoint_every,
            "faults": [asdict(f) for f in spec.faults], "recoveries": _events(run),
            "replacements": run.replacements, "hung": res["hung"], "error": res["error"],
            "completed": completed, "weights_equal": eq, "max_abs_diff": diff,
            "replay_error": rep["error"] if rep else None, "replay_hung": bool(rep and rep["hung"]),
            "replay_seconds": rep["seconds"] if rep else 0.0,
            "reference_equal": ref_eq, "layout_drift": drift,
            "layouts_as_reference": completed and same_layouts(run.step_plans, ref["plans"]),
            "reference_seconds": ref["seconds"], "seconds": res["seconds"],
            "log": res["lines"] if (res["error"] or res["hung"] or not eq) else []}


def run_benchmark(faults: int = 100, seed: int = 0, quick: bool = False, run_timeout_s: float | None = None,
                  verbose: bool = False, console=None) -> dict:
    """Runs until ``faults`` workers were lost to injected faults (``quick``: one small run)."""
    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    refs: dict = {}
    runs: list[dict] = []
    target = 6 if quick else faults
    timeout = run_timeout_s or (240.0 if quick else 900.0)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            bar = progress.add_task("faults injected", total=target)
            lost_so_far = 0
            while lost_so_far < target and len(runs) < (1 if quick else 10 * max(target, 1)):
                spec = plan_run(rng, len(runs), quick)
                if spec.key not in refs:
                    progress.update(bar, description=f"reference run {spec.algorithm} on {spec.workers} workers")
                    refs[spec.key] = reference_run(spec, seed, timeout, verbose)
                desc = f"run {len(runs)}: {spec.algorithm} on {spec.workers} workers"
                progress.update(bar, description=desc)
                base = lost_so_far

                def on_line(s: str, base=base, spec=spec, desc=desc) -> None:
                    if s.lstrip().startswith("lost worker"):
                        n = sum(len(f.workers) for f in spec.faults if f.state in ("armed", "fired"))
                        progress.update(bar, completed=min(target, base + n), description=desc)

                def on_replay(desc=desc) -> None:
                    progress.update(bar, description=f"{desc}: its replay")

                runs.append(check_run(spec, refs[spec.key], seed + len(runs) + 1, timeout, verbose, on_line,
                                      on_replay))
                lost_so_far += sum(len(f.fired) for f in spec.faults)
                progress.update(bar, completed=min(target, lost_so_far))
    finally:
        if started:
            ray.shutdown()
    summary = summarize(runs, refs, time.perf_counter() - t0, argparse.Namespace(seed=seed, quick=quick))
    return {"summary": summary, "runs": runs,
            "references": {"/".join(map(str, k)): {kk: v for kk, v in x.items() if kk not in ("final_state", "plans")}
                           for k, x in refs.items()}}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100, help="workers to lose to injected faults (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one small run, about 6 faults (CI)")
    ap.add_argument("--run-timeout", type=float, default=None, help="wall-clock bound of each run, seconds")
    ap.add_argument("--json", default=None, help="write the figures and every run's faults and recoveries here")
    ap.add_argument("--verbose", action="store_true", help="print every run's log")
    args = ap.parse_args(argv)
    if args.faults < 1:
        ap.error("--faults must be >= 1")
    console = Console()
    out = run_benchmark(args.faults, args.seed, args.quick, args.run_timeout, args.verbose, console)
    t, per = _table(out["summary"], out["runs"])
    console.print(per)
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        console.print(f"wrote {args.json}")
    s = out["summary"]
    ok = (s["runs_hung"] == 0 and s["runs_failed"] == 0 and s["faults_survived"] == s["faults_injected"]
          and s["steps_lost_bound_violations"] == 0 and s["weights_equal"] == s["weights_compared"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
