"""Fault benchmark: workers killed or hung at random points of real PPO and GRPO runs (docs/faults.md).

Each run is an :class:`~nereus.runtime.run.adaptive.AdaptiveRun` (``tiny`` model preset) on 4-6 Ray CPU
workers with a pool schedule whose departures are announced (``notice=True``), so live transitions
happen, and durable checkpoints every 1 or 2 steps. Almost every step gets a fault, drawn from a
seeded generator:

* **where**: one of ``worker.fault_tolerant.FAULT_POINTS``: generation, a forward for log-probs or values (PPO's
  critic), the forward+backward+optimizer call (``train_fields``, sometimes its second mini-batch,
  after the first optimizer step already ran), the weight sync, a transition primitive (at a step
  whose boundary has an announced departure) and a durable checkpoint save;
* **how**: killed (the process exits), hung (SIGSTOP: alive, answering nothing) or slow but alive
  (asleep for a minute inside the call while its heartbeats answer: only the progress check in
  ``run/faults.py`` catches it);
* **how many**: one worker, or two at once (both armed for the same call), the second sometimes a
  second after the first (``late:1``); and sometimes one more worker killed inside the live
  transition of the recovery the fault causes (a fault during a recovery);
* **when**: transition faults also hit the growth onto joining workers (a join's boundary), not only
  announced departures: the full benchmark's runs grow onto every scheduled join
  (``RunSpec.grow``: the controller decides there without the payback rule, ``FaultBenchRun``),
  so a growth's transition runs there whenever the planner has a faster plan.

The check covers every model-stage, trained and frozen, and every state kind: parameters, the fp32
master, both Adam moments, the Adam step, update counter and data position (:func:`compare`).

The first worker of a fault is armed through ``AdaptiveRun(faults={step: (point, worker, how)})``;
the second (and a fault in a later call of the same method, ``skip``) is armed through the pool with
``FaultTolerantWorker.arm``. Which worker is hit is drawn when the phase starts, among the workers
that will make that call (the current plan's layouts, the transition's DAG, the checkpoint's
writers), so every armed fault fires; a fault that did not fire anyway is disarmed and not counted.
A killed worker is replaced by a fresh one a step later (a spot replacement), so a run can take a
fault every step. Every run is bounded by a wall-clock timeout: a run that exceeds it counts as hung.

Reported: faults injected and survived (a recovery named the worker, the run finished all its steps
after it, live or from a checkpoint, and ended at the state of its replay),
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
    python benchmarks/bench_faults.py --faults 100 --seed 0 --no-drift   # no reference runs: no layout drift
    python benchmarks/bench_faults.py --quick          # about 6 faults, what CI runs

The runs' machinery (:class:`Fault`, :class:`RunSpec`, :class:`FaultBenchRun`, the constants) is in
``fault_run.py`` and the figures and tables in ``fault_report.py``, next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# this checkout's package first, here and in the Ray workers (they inherit the environment, not
# sys.path, and would otherwise import an installed copy): ``python benchmarks/bench_faults.py`` runs
# from any directory with no PYTHONPATH; then this folder's helper modules (below)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path[:1]:
    sys.path.insert(0, _ROOT)
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != _ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


from nereus.controller.planning import same_plan  # noqa: E402
from nereus.runtime.durable.integrity import job_identity  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.runtime.run.relayout import relayout  # noqa: E402
from nereus.runtime.run.schedules import parse_pool_schedule  # noqa: E402
from nereus.runtime.worker.failures import WorkerFailure  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from fault_checks import checkpoint_problem  # noqa: E402
from fault_compare import _renumbered, compare, same_layouts  # noqa: E402
from fault_pools import SparePool, close_replay_pool, replay_pool  # noqa: E402
from fault_report import summarize, tables  # noqa: E402
from fault_run import (  # noqa: E402
    GROUP_TIMEOUT_S,
    HANG_TIMEOUT_S,
    SPEC,
    STEP_POINTS,
    TASK,
    Fault,
    FaultBenchRun,
    RunSpec,
    config,
    workload,
)


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


#: seconds a pool's workers may take to start: at a load average of 70-90 on 2 cores, starting 5-6
#: workers (each importing torch) took over the 120 s default twice in a row, ending the benchmark
START_TIMEOUT_S = 600.0


def start_pool(n: int, tries: int = 3, spares: int = 2, warm: bool = True) -> WorkerPool:
    """A started pool of ``n`` workers with ``spares`` more started ahead for its joins
    (``fault_pools.SparePool``), allowed :data:`START_TIMEOUT_S` to start. A start that still
    times out (``WorkerFailure``) is retried, up to ``tries`` times: no fault has been injected yet,
    so it is not a fault outcome.

    Raises:
        WorkerFailure: every try failed."""
    for attempt in range(tries):
        pool = SparePool(n, timeout_s=GROUP_TIMEOUT_S, hang_timeout_s=HANG_TIMEOUT_S, spares=spares, warm=warm)
        pool.start_timeout_s = START_TIMEOUT_S  # not the 120 s of 4x the group timeout + 60
        try:
            return pool.start()
        except WorkerFailure:
            pool.close()
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def execute(spec: RunSpec, faults: bool, seed: int, timeout_s: float, verbose: bool = False, on_line=None) -> dict:
    """One run (with ``spec.faults`` when ``faults``, else the fault-free reference)."""
    lines: list[str] = []

    def log(s: str) -> None:
        lines.append(s)
        if verbose:
            print(("    " if faults else "    [ref] ") + s, flush=True)
        if on_line:
            on_line(s)

    pool = start_pool(spec.workers)
    planned = spec.faults if faults else []
    capacity = spec.workers + sum(max(v, 0) for v in parse_pool_schedule(spec.schedule).values()) \
        + sum(f.count for f in planned)
    run = FaultBenchRun(SPEC, workload(spec.algorithm), TASK, spec.workers, config(),
                        schedule=parse_pool_schedule(spec.schedule), notice=True, hang_timeout_s=HANG_TIMEOUT_S,
                        log=log, measure=False, checkpoint_every=spec.checkpoint_every,
                        # the paper's disjoint plan space, where every recovery can run live (in the
                        # default `runtime` space colocated/offloaded/ZeRO state recovers through the checkpoint)
                        framework="nereus",
                        bench_faults=planned, rng=random.Random(seed), capacity=capacity, grow=spec.grow,
                        # synchronous saves: a dcp_save fault fires inside the save, so it is settled and
                        # filed under the checkpoint phase (an async write would fire after the boundary)
                        checkpoint_sync=True)
    run.keep_final = "all"  # every model-stage, frozen ones too (compare)
    ident, ckpt = job_identity(SPEC, workload(spec.algorithm)), {}
    def on_end(_driver) -> None:  # before the workers stop: every fault settled, the checkpoint checked
        run._settle(final=True)
        ckpt.setdefault("problem", checkpoint_problem(run, ident))  # before its removal

    run.on_end = on_end
    t0 = time.perf_counter()

    def go():
        try:
            return run.run(spec.steps, pool)
        finally:
            pool.close()

    hist, err, hung = _bounded(go, timeout_s, pool.close)
    if "problem" not in ckpt and not hung:  # ended early: the run keeps its checkpoint (the only copy)
        ckpt["problem"] = checkpoint_problem(run, ident)
        shutil.rmtree(run.ckpt_dir or "/nonexistent", ignore_errors=True)
    return {"run": run, "history": hist, "error": None if err is None else f"{type(err).__name__}: {str(err)[:400]}",
            "hung": hung, "seconds": time.perf_counter() - t0, "lines": lines,
            "checkpoint_problem": ckpt.get("problem")}


def replay(spec: RunSpec, plans: dict[int, Plan], timeout_s: float) -> dict:
    """The fault-free run a faulty one must match: the same samples and steps, each step on the plan
    it last ran on in the faulty run (``FaultBenchRun.step_plans``), on an :class:`RLDriver` of its
    own with no faults, no controller and no checkpoints; a plan change between two steps goes
    through the centralized re-layout (``run/relayout.py``: gathered into the driver, exact), so nothing
    it shares with the faulty run's recoveries (live transitions, rollback snapshots, durable
    checkpoints) can hide a difference. Each step's worker ids are renumbered ``0..n-1`` in order
    (layouts, hence every sum's order, are unchanged; the re-layout between two steps gathers
    everything into the driver, so which worker held what before does not matter), and every replay
    runs on the benchmark's one replay pool (``fault_pools.replay_pool``).

    Returns:
        ``{"final_state", "error", "hung", "seconds"}`` (``final_state`` as ``AdaptiveRun.final_state``).
    """
    t0 = time.perf_counter()
    missing = [k for k in range(spec.steps) if k not in plans]
    if missing:
        return {"final_state": None, "error": f"no plan recorded for steps {missing}", "hung": False, "seconds": 0.0}
    seq = [_renumbered(plans[k]) for k in range(spec.steps)]
    n = max(len(p.gpus_used()) for p in seq)
    pool = replay_pool(n, lambda m: start_pool(m, spares=0, warm=False))
    driver = RLDriver(SPEC, workload(spec.algorithm), seq[0], TASK, n, config())

    def go():
        try:
            driver.start(pool)
            for k, plan in enumerate(seq):
                if k and not same_plan(plan, seq[k - 1]):
                    relayout(driver, plan)
                driver.step()
            return {n: driver.gather_logical_state(n) for n in driver.layouts}  # frozen model-stages too
        finally:
            driver.close()  # its engines; the pool serves the next replay

    final, err, hung = _bounded(go, timeout_s, pool.close)
    return {"final_state": final, "error": None if err is None else f"{type(err).__name__}: {str(err)[:400]}",
            "hung": hung, "seconds": time.perf_counter() - t0}


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
    sched = parse_pool_schedule(schedule)
    departures = {k for k, v in sched.items() if v < 0}
    joins = {k for k, v in sched.items() if v > 0}
    points = [p for p in STEP_POINTS if algorithm == "ppo" or p != "values"]
    faults: list[Fault] = []
    for k in range(steps):
        how = rng.choice(HOWS) if not quick else ("stop", "kill", "kill", "stop")[k]
        saves = (k + 1) % every == 0
        second, nested = "", False
        if quick:
            phase = ("step", "step", "transition", "checkpoint")[k]
            count = 2 if k in (1, 3) else 1
        else:
            r = rng.random()
            # a transition fault at an announced departure, or during the growth onto joining workers
            phase = ("transition" if (k in departures and r < 0.7) or (k in joins and r < 0.5) else
                     "checkpoint" if saves and r < 0.3 else "step")
            count = 2 if rng.random() < 0.3 else 1
            second = "late:1" if count == 2 and rng.random() < 0.5 else ""  # a second fault a second later
            nested = phase == "step" and rng.random() < 0.25  # one more inside the recovery it causes
        if how == "slow":
            how = f"slow:{SLOW_S:g}"  # asleep in the call, answering heartbeats: caught by the progress check
        point = ("transition_run" if phase == "transition" else "dcp_save" if phase == "checkpoint" else
                 rng.choice(points))
        skip = rng.choice((0, 1)) if point == "train_fields" else 0
        faults.append(Fault(step=k, point=point, how=how, count=count, skip=skip, second_how=second,
                            in_recovery=nested))
    return RunSpec(algorithm, workers, steps, schedule, every, faults, grow=not quick)


#: how a fault fails its worker (``FaultTolerantWorker.arm``): killed, hung (SIGSTOP), or slow but alive
HOWS = ("kill", "stop", "slow")
#: seconds a slow worker sleeps: longer than the progress bound (4x a step), so it is caught first
SLOW_S = 60.0


def _events(run) -> list[dict]:
    # ``slow``: the workers caught by the progress check (slow but alive), ``fault_report``'s slow_detected
    keep = ("step", "phase", "lost", "hung", "slow", "detect_s", "source", "steps_lost", "recovery_s", "full_copy",
            "since_checkpoint", "plan")
    return [{k: ev.get(k) for k in keep} for ev in run.recoveries]


#: the reference of a run without ``drift`` (``--no-drift``): none was made
NO_REFERENCE = {"final_state": None, "plans": {}, "seconds": 0.0, "hung": False, "error": None, "skipped": True}


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
    ref_eq, drift = (compare(run.final_state, ref["final_state"]) if completed and not ref.get("skipped") else
                     (None, None) if ref.get("skipped") else (False, float("inf")))  # skipped: --no-drift
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
            "checkpoint_problem": res["checkpoint_problem"],
            "log": res["lines"] if (res["error"] or res["hung"] or not eq) else []}


def run_benchmark(faults: int = 100, seed: int = 0, quick: bool = False, run_timeout_s: float | None = None,
                  verbose: bool = False, console=None, on_run=None, drift: bool = True) -> dict:
    """Runs until ``faults`` workers were lost to injected faults (``quick``: one small run);
    ``on_run(runs)`` after each run (``main`` writes the runs so far next to ``--json``); without
    ``drift`` no fault-free reference run is made (the layout drift is information, not a check)."""
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
                if spec.key not in refs and not drift:
                    refs[spec.key] = dict(NO_REFERENCE)
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
                if on_run is not None:
                    on_run(runs)
                progress.update(bar, completed=min(target, lost_so_far))
    finally:
        close_replay_pool()
        if started:
            ray.shutdown()
    summary = summarize(runs, refs, time.perf_counter() - t0, argparse.Namespace(seed=seed, quick=quick),
                        HANG_TIMEOUT_S)
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
    ap.add_argument("--no-drift", action="store_true",
                    help="no fault-free reference runs: the layout drift (information, not a check) is not measured")
    args = ap.parse_args(argv)
    if args.faults < 1:
        ap.error("--faults must be >= 1")
    console = Console()
    def partial(runs: list[dict]) -> None:  # what finished survives a benchmark cut short
        if args.json:
            with open(args.json + ".partial", "w") as f:
                json.dump({"seed": args.seed, "runs": runs}, f, indent=1, default=str)

    out = run_benchmark(args.faults, args.seed, args.quick, args.run_timeout, args.verbose, console, partial,
                        drift=not args.no_drift)
    t, per = tables(out["summary"], out["runs"])
    console.print(per)
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        console.print(f"wrote {args.json}")
    s = out["summary"]
    ok = (s["runs_hung"] == 0 and s["runs_failed"] == 0 and s["faults_survived"] == s["faults_injected"]
          and s["steps_lost_bound_violations"] == 0 and s["weights_equal"] == s["weights_compared"]
          and s["checkpoints_lost"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
