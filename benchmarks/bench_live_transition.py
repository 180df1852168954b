"""Live transition vs a faithful checkpoint/restart and an in-process DCP reload (docs/live-transition.md).

One PPO job (``small`` model preset, or ``tiny`` where it does not exist) on 4 Ray CPU workers takes
one training step (so Adam's moments are non-zero), then each layout change below is applied from
the same state and the same source layout in three ways:

* **live** (``--live-reps`` times, default 15: medians): ``TransitionExecutor.execute`` of the planner's DAG
  (``estimate_transition`` on the job calibrated from the transitions run before this case,
  ``transition/calibrate.py``): shards move worker to worker, only the model-stages that change are
  touched. Seconds: the ``execute`` call (planning excluded); bytes: the report's ``bytes_moved``;
  L_tran: predicted (the calibrated schedule's makespan) and measured (first primitive's start to
  the last one's end).
* **faithful restart** (once per case, ``benchmarks/faithful_restart.py``): every training
  model-stage saved with DCP (files fsynced, then dropped from the page cache), every worker process
  stopped, a new pool started (one worker less when one leaves), every model-stage rebuilt (the
  rollout engine and the frozen models too), the checkpoint read back and the weights synced.
* **in-process reload** (``--reps`` times; the earlier baseline, kept for comparison and labelled
  as such): ``durable.save`` of the model-stages that change, teardown, rebuild in the target
  layout and ``dcp.load`` in the same worker processes (``durable.restart``).

All are compared with ``est.min_bytes``, the bytes any transition between the two plans must move.
Cases: TP 2->1, TP 1->2, PP 2->1, PP 1->2, DP 1->2, DP 2->1 of ``actor.train``; a pool shrink (worker
3 leaves with notice: the target is planned without it while it is alive, it is removed after the
transition, or after the save for a restart, and a fresh worker takes its slot before the next
repetition, untimed); and a change of five model-stages at once on the full pool. Between measured
transitions, untimed live transitions bring the job back to each case's source layout; before the
first case, four untimed warm-up transitions (TP 2->1, DP 1->2, DP 2->1, TP 1->2) run four times,
and the first calibration is from the last three passes (``WARM_PASSES``; the first pays a job's
one-time costs: allocations, the first communicator of each member set), warm like every case
after it. The
calibration knows the cores the CPU workers share (``device_model.worker_cores``). At the end the gathered logical state of ``actor.train`` and ``critic.train`` is
checked bit for bit against the state after the step.

    python benchmarks/bench_live_transition.py --reps 2 --out docs/img/bench-live-transition.png \\
        --json bench-live-transition.json

Last line: ``live vs faithful restart: min X.Xx, median Y.Yx over N cases; live bytes / minimum:
max Z.ZZ``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nereus.runtime.durable import driver_side as durable  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.device_model import runtime_job, worker_cores  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.pool import WorkerPool, _ray_get  # noqa: E402
from nereus.runtime.transit.driver_side import TransitionExecutor  # noqa: E402
from nereus.runtime.worker.fault_tolerant import fault_tolerant_class  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.transition.calibrate import TransitionCalibration  # noqa: E402
from nereus.transition.estimate import estimate_transition  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faithful_restart import faithful_restart  # noqa: E402
from live_transition_report import final_line, l_tran_line, median, plot, print_table, summarize  # noqa: E402

PRESET = "small" if "small" in MODEL_PRESETS else "tiny"
SPEC = MODEL_PRESETS[PRESET]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
CFG = RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=60)
N = 4
TRAIN = ("actor.train", "critic.train")
BASE = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 2, 1, (1, 2)),
        "critic.infer": (1, 1, 1, (3,)), "actor.train": (2, 1, 1, (0, 1)), "critic.train": (1, 2, 1, (2, 3))}


def plan(**changes) -> Plan:
    lay = {**BASE, **{k.replace("_", "."): v for k, v in changes.items()}}
    return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=1 if not ms.endswith("generate") else 0,
                                           gpus=gpus) for ms, (tp, pp, dp, gpus) in lay.items()))


TP1 = plan(actor_train=(1, 1, 1, (0,)))
#: (name, source, target, worker that leaves or None), in the order they run (each target is, where
#: possible, the next source: fewer untimed moves back)
CASES = [
    ("TP 2->1", plan(), TP1, None),
    ("PP 1->2", TP1, plan(actor_train=(1, 2, 1, (0, 1))), None),
    ("PP 2->1", plan(actor_train=(1, 2, 1, (0, 1))), TP1, None),
    ("DP 1->2", TP1, plan(actor_train=(1, 1, 2, (0, 1))), None),
    ("DP 2->1", plan(actor_train=(1, 1, 2, (0, 1))), TP1, None),
    ("TP 1->2", TP1, plan(), None),
    ("pool shrink 4->3", plan(), plan(actor_train=(1, 1, 1, (0,)), critic_train=(1, 1, 1, (2,)),
                                      actor_generate=(1, 1, 2, (0, 1)), reference_infer=(1, 1, 1, (1,)),
                                      critic_infer=(1, 1, 1, (2,))), 3),
    ("multi-model-stage", plan(), plan(actor_train=(2, 1, 1, (2, 3)), critic_train=(1, 2, 1, (0, 1)),
                                       actor_generate=(2, 1, 2, (0, 1, 2, 3)), critic_infer=(1, 1, 1, (0,)),
                                       actor_infer=(1, 1, 1, (3,))), None),
]
JOB = runtime_job(SPEC, W, N)
#: calibrated warm-up passes before the first case: each gives the calibration one Split, Extend,
#: Destroy and Merge, so the first case is priced from 3 samples of each (one pass: from one, and
#: its prediction swung 1.1-1.9x between runs of the same code)
WARM_PASSES = 3


def _current(d: RLDriver) -> Plan:
    return Plan(candidates=tuple(d.cands.values()))


def _pool_ids(d: RLDriver) -> frozenset:
    return frozenset(i for i, w in enumerate(d.workers) if w is not None)


def _same(a: Plan, b: Plan) -> bool:
    return all((a[m].tp, a[m].pp, a[m].dp, a[m].gpus) == (b[m].tp, b[m].pp, b[m].dp, b[m].gpus)
               for m in BASE)


def _changed(a: Plan, b: Plan) -> list[str]:
    return [m for m in BASE if (a[m].tp, a[m].pp, a[m].dp, a[m].gpus) != (b[m].tp, b[m].pp, b[m].dp, b[m].gpus)]


#: calibration from every live transition run so far (``observe``); a case's predictions use a
#: snapshot taken before the case (``CAL["frozen"]``), never its own measurements
CAL = {"live": TransitionCalibration(cores=worker_cores()), "frozen": None}


def _estimate(d: RLDriver, target: Plan, pool: frozenset, calib: TransitionCalibration | None = None):
    calib = calib or CAL["live"]
    est = estimate_transition(calib.apply(JOB), _current(d), target, pool, params=calib.params())
    if not est.feasible:
        raise RuntimeError(f"transition infeasible: {est.reason}")
    return est


#: every live transition's records, in order (``--json``: the calibration can be replayed offline)
OBSERVED: list = []


def _execute(d: RLDriver, est, target: Plan):
    rep = TransitionExecutor(d).execute(est, target)
    CAL["live"].observe(rep.primitives)
    OBSERVED.append([r.to_dict() for r in rep.primitives])
    return rep


def _move(d: RLDriver, target: Plan) -> None:
    """Untimed live transition to ``target`` (repositioning between measurements)."""
    if not _same(_current(d), target):
        _execute(d, _estimate(d, target, _pool_ids(d)), target)


def _respawn(pool: WorkerPool, i: int, d: RLDriver) -> None:
    """A fresh worker in slot ``i`` (ids stay stable), after ``i`` left."""
    if i >= len(pool.workers):  # a faithful restart started one worker less
        pool.add(1)
        d.num_workers = len(pool.workers)
        return
    env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    w = fault_tolerant_class(0).options(runtime_env=env).remote(i, "127.0.0.1", pool.store.port, pool.timeout_s)
    _ray_get([w.ping.remote()], "respawn", 120)
    pool.workers[i] = w


def _live(d: RLDriver, pool: WorkerPool, target: Plan, leaves) -> dict:
    ids = _pool_ids(d)  # with notice: the leaving worker still sends its shards; the target omits it
    t0 = time.perf_counter()
    est = _estimate(d, target, ids, CAL["frozen"])
    t1 = time.perf_counter()
    rep = _execute(d, est, target)
    t2 = time.perf_counter()
    if leaves is not None:
        pool.remove(leaves)
    return {"seconds": t2 - t1, "plan_s": t1 - t0, "bytes": rep.bytes_moved, "min_bytes": int(est.min_bytes),
            "predicted_bytes": rep.predicted_bytes, "primitives": [r.kind for r in rep.primitives],
            "l_tran_s": rep.measured_l_tran, "predicted_l_tran_s": rep.predicted_l_tran,
            "setup_s": sum(r.setup_s for r in rep.primitives),
            "copy_s": sum(r.copy_s for r in rep.primitives),
            "transfer_s": sum(r.transfer_s for r in rep.primitives),
            "records": [r.to_dict() for r in rep.primitives],
            "predicted_schedule": est.schedule.to_dict()["primitives"] if est.schedule else {}}


def _make_driver(target: Plan, n: int) -> RLDriver:
    return RLDriver(SPEC, W, target, TASK, n, CFG)


def _faithful(d: RLDriver, pool: WorkerPool, target: Plan, leaves, root: str):
    est = _estimate(d, target, _pool_ids(d))  # only for min_bytes
    d, pool, rec = faithful_restart(d, pool, target, leaves, root, _make_driver, TRAIN)
    rec["min_bytes"] = int(est.min_bytes)
    return d, pool, rec


def _restart(d: RLDriver, pool: WorkerPool, target: Plan, leaves, root: str) -> dict:
    ids = _pool_ids(d)  # with notice: the leaving worker still sends its shards; the target omits it
    est = _estimate(d, target, ids)  # only for min_bytes; a restart needs no DAG
    stages = _changed(_current(d), target)
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    s = durable.save(d, root, stages)
    if leaves is not None:
        pool.remove(leaves)
    r = durable.restart(d, root, target)
    t1 = time.perf_counter()
    return {"seconds": t1 - t0, "save_s": s["seconds"], "teardown_s": r["teardown_s"], "build_s": r["build_s"],
            "load_s": r["load_s"], "bytes": s["written"] + r["read"], "written": s["written"], "read": r["read"],
            "loaded": r["loaded"], "min_bytes": int(est.min_bytes), "model_stages": stages}


def _states(d: RLDriver) -> dict:
    return {n: d.gather_logical_state(n) for n in TRAIN}


def _equal(a: dict, b: dict) -> bool:
    for ms in TRAIN:
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            if any(not torch.equal(a[ms][kind][n], b[ms][kind][n]) for n in a[ms][kind]):
                return False
        if any(a[ms][k] != b[ms][k] for k in ("step", "update_count", "version", "policy_version", "position")):
            return False
    return True


def run(reps: int, root: str, log=print, live_reps: int = 15, live_only: bool = False) -> dict:
    import copy

    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    pool = WorkerPool(N, timeout_s=CFG.timeout_s).start()
    d = RLDriver(SPEC, W, plan(), TASK, N, CFG).start(pool)
    out = {"preset": PRESET, "workers": N, "reps": reps, "live_reps": live_reps, "cpus": os.cpu_count(), "cases": {}}
    try:
        t0 = time.perf_counter()
        d.step()
        log(f"[bench] {PRESET}: one PPO step in {time.perf_counter() - t0:.1f}s")
        ref = _states(d)
        out["state_bytes"] = {ms: sum(t.numel() * t.element_size() for k in ("params", "exp_avg", "exp_avg_sq")
                                      for t in ref[ms][k].values()) for ms in TRAIN}
        warm = (TP1, plan(actor_train=(1, 1, 2, (0, 1))), TP1, plan())
        for w in warm:  # the first transitions of a job pay one-time costs (allocations, caches, the
            _move(d, w)  # first communicator of each member set): not what the cases will see
        CAL["live"] = TransitionCalibration(cores=worker_cores())  # so the first calibration is
        OBSERVED.clear()
        for _ in range(WARM_PASSES):  # from later passes, warm like every case after it, and from
            for w in warm:  # more than one sample of each primitive (the first case's prior)
                _move(d, w)
        for name, src, dst, leaves in CASES:
            CAL["frozen"] = copy.deepcopy(CAL["live"])  # this case is predicted from earlier ones only
            out.setdefault("case_starts", {})[name] = len(OBSERVED)
            res = {"live": [], "faithful": [], "reload": [],
                   "calibration": {k: getattr(CAL["frozen"], k) for k in (
                       "bandwidth", "copy_bandwidth", "setup_s", "teardown_s", "teardown_tensor_s", "cores", "strided_copy_factor",
                       "fresh_copy_factor", "copy_cores", "dispatch_s")}}
            for rep in range(max(reps, live_reps)):
                for method in ("live", "faithful", "reload"):
                    if (method == "faithful" and rep) or (method == "live" and rep >= live_reps) or (
                            method == "reload" and rep >= reps) or (live_only and method != "live"):
                        continue  # the faithful restart once per case: it costs tens of seconds
                    _move(d, src)
                    if method == "live":
                        res[method].append(_live(d, pool, dst, leaves))
                    elif method == "faithful":
                        d, pool, r = _faithful(d, pool, dst, leaves, os.path.join(root, "full"))
                        res[method].append(r)
                    else:
                        res[method].append(_restart(d, pool, dst, leaves, os.path.join(root, "ckpt")))
                    if leaves is not None:
                        _respawn(pool, leaves, d)
            out["cases"][name] = res
            med = {m: median([r["seconds"] for r in res[m]]) for m in ("live", "faithful", "reload")}
            log(f"[bench] {name}: live {med['live']:.3f}s, faithful restart {med['faithful']:.3f}s, "
                f"in-process reload {med['reload']:.3f}s")
        _move(d, plan())
        out["state_intact"] = _equal(_states(d), ref)
        out["calibration"] = CAL["live"].history
        out["observed"] = OBSERVED
    finally:
        d.close()
        pool.close()
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions per case of the in-process reload (median "
                    "reported); the faithful restart runs once per case")
    ap.add_argument("--live-reps", type=int, default=15, help="repetitions per case of the live transition (median "
                    "of seconds and of L_tran measured: one transition's seconds swing several-fold on a shared "
                    "machine)")
    ap.add_argument("--out", default="bench-live-transition.png", help="PNG bar chart path")
    ap.add_argument("--json", help="write every measurement and the summary rows to this file")
    ap.add_argument("--live-only", action="store_true", help="run the live transitions only (no faithful "
                    "restart, no in-process reload: their columns and the speedups print as '-' and nan); for "
                    "checking the L_tran prediction in a few minutes")
    ap.add_argument("--ckpt-dir", help="where DCP writes (default: a fresh temporary directory, removed after)")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.live_reps < 1:
        ap.error("--reps and --live-reps must be >= 1")
    root = a.ckpt_dir or tempfile.mkdtemp(prefix="nereus-dcp-")
    t0 = time.perf_counter()
    try:
        out = run(a.reps, root, log=lambda s: print(s, file=sys.stderr), live_reps=a.live_reps,
                  live_only=a.live_only)
    finally:
        if not a.ckpt_dir:
            shutil.rmtree(root, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    rows = summarize(out)
    print_table(rows, out)
    print(f"state after all transitions equal to the state before: {out['state_intact']}; "
          f"benchmark wall time {out['seconds']:.0f}s")
    print(l_tran_line(rows))
    plot(rows, out, a.out)
    print(f"wrote {a.out}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"summary": rows, **out}, fh, indent=1)
        print(f"wrote {a.json}")
    print(final_line(rows))
    return 0 if out["state_intact"] else 1


if __name__ == "__main__":
    sys.exit(main())
