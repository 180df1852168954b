"""The fault benchmark's figures (``benchmarks/bench_faults.py``): :func:`summarize` over the runs
and the two ``rich`` tables :func:`tables` prints."""

from __future__ import annotations

import statistics

from fault_checks import restores_past_checkpoint

from nereus.runtime.run.schedules import parse_pool_schedule
from nereus.runtime.worker.fault_tolerant import FAULT_POINTS


def _how(f: dict, w: int) -> str:
    """How worker ``w`` of fault ``f`` failed: the second worker of a double fault may fail later."""
    return f.get("second_how") or f["how"] if f["workers"][1:2] == [w] else f["how"]


def summarize(runs: list[dict], refs: dict, wall_s: float, args, hang_timeout_s: float) -> dict:
    faults = [f for r in runs for f in r["faults"] if f["state"] == "fired"]
    per_worker = [(f, w) for f in faults for w in f["fired"]]
    recs = [ev for r in runs for ev in r["recoveries"]]
    detect = [ev["detect_s"] for ev in recs]
    rec_s = [ev["recovery_s"] for ev in recs]
    full = [ev for ev in recs if ev.get("full_copy")]
    partial = [ev for ev in recs if not ev.get("full_copy")]
    by_point = {p: sum(1 for f, _ in per_worker if f["point"] == p) for p in FAULT_POINTS}
    # survived: the run went on (live or from a checkpoint) after a recovery naming the worker, finished
    # all its steps and ended at its replay's state (issue 30's done-when: a run that kept going on a
    # wrong state did not survive its faults)
    survived = sum(len(f["fired"]) for r in runs if r["completed"] and r["weights_equal"] for f in r["faults"]
                   if f["state"] == "fired" and all(any(w in ev["lost"] for ev in r["recoveries"]) for w in f["fired"]))
    compared = [r for r in runs if r["completed"]]
    return {
        "faults_injected": len(per_worker),
        "fault_events": len(faults),
        "double_faults": sum(1 for f in faults if len(f["fired"]) == 2),
        "faults_survived": survived,
        "faults_not_fired": sum(1 for r in runs for f in r["faults"] if f["state"] in ("not fired", "no caller", "pool too small")),
        "by_point": by_point,
        "by_how": {h: sum(1 for f, w in per_worker if _how(f, w).split(":")[0] == h)
                   for h in ("kill", "stop", "slow", "late")},
        "by_phase": {p: sum(1 for f, _ in per_worker if f["phase"] == p)
                     for p in ("step", "transition", "checkpoint", "recovery")},
        "slow_detected": sum(1 for ev in recs if ev.get("slow")),
        "runs": len(runs),
        "runs_hung": sum(1 for r in runs if r["hung"]),
        "runs_failed": sum(1 for r in runs if r["error"] and not r["hung"]),
        "reference_runs": sum(1 for x in refs.values() if not x.get("skipped")),
        "reference_runs_hung": sum(1 for x in refs.values() if x["hung"]),
        "recoveries": len(recs),
        "recoveries_live": sum(1 for ev in recs if ev.get("source") == "live"),
        "recoveries_checkpoint": sum(1 for ev in recs if ev.get("source") == "checkpoint"),
        # lost before the first checkpoint existed: every model-stage rebuilt from its seed at step 0
        # (run/fresh_start.py); a recovery counted under no source would hide such a fallback
        "recoveries_initial": sum(1 for ev in recs if ev.get("source") == "initial"),
        "recoveries_other_source": sum(1 for ev in recs if ev.get("source") not in ("live", "checkpoint", "initial")),
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
        # the last complete checkpoint gone or unusable at a run's end, or a restore past it (fault_checks.py)
        "checkpoints_lost": sum(1 for r in runs if r.get("checkpoint_problem"))
        + sum(restores_past_checkpoint(r["recoveries"]) for r in runs),
        "weights_equal": sum(1 for r in compared if r["weights_equal"]),
        "weights_compared": len(compared),
        "weights_max_abs_diff": max((r["max_abs_diff"] for r in compared), default=0.0),
        "replays_hung": sum(1 for r in runs if r.get("replay_hung")),
        "reference_equal": sum(1 for r in compared if r["reference_equal"]),
        "layout_drift_max": max((r["layout_drift"] for r in compared if r["layout_drift"] is not None),
                                default=None if any(x.get("skipped") for x in refs.values()) else 0.0),
        "layouts_as_reference": sum(1 for r in compared if r["layouts_as_reference"]),
        "reference_equal_same_layouts": sum(1 for r in compared if r["layouts_as_reference"] and r["reference_equal"]),
        "wall_s": wall_s,
        "seed": args.seed,
        "quick": bool(args.quick),
        "hang_timeout_s": hang_timeout_s,
        "by_kind": by_kind(runs),
    }


def _kinds(f: dict, joins: set[int], departures: set[int]) -> list[str]:
    """The kinds a fired fault belongs to (one fault may be several: a slow worker in a growth's
    transition, the second of a double fault a second later)."""
    how = {"kill": "killed", "stop": "hung (SIGSTOP)", "slow": "slow but alive"}.get(f["how"].split(":")[0], f["how"])
    out = [how]
    if f["phase"] == "transition":
        out.append("in a growth's transition" if f["step"] in joins else
                   "in a departure's transition" if f["step"] in departures else "in a transition")
    elif f["phase"] == "recovery":
        out.append("killed inside a recovery's transition")
    else:
        out.append(f"in a {f['phase']}")
    if len(f["fired"]) == 2:
        out.append("second failure a second later (late:1)" if (f.get("second_how") or "").startswith("late")
                   else "two at once")
    return out


def by_kind(runs: list[dict]) -> dict[str, dict]:
    """Per fault kind (:func:`_kinds`): faults fired, how their recoveries went (``live``: state moved
    from the survivors; ``checkpoint``: restored from the durable checkpoint) and recovery seconds
    (rollback to new plan ready, median and max), over the recoveries that name a worker of the
    fault at its step; ``initial``: rebuilt from the seeds at step 0, no checkpoint written yet
    (``run/fresh_start.py``); ``lost_state``: faults of runs that did not finish or whose final state
    differs from the replay (must be 0)."""
    acc: dict[str, dict] = {}
    for r in runs:
        sched = parse_pool_schedule(r["schedule"])
        joins = {k for k, v in sched.items() if v > 0}
        departures = {k for k, v in sched.items() if v < 0}
        for f in r["faults"]:
            if f["state"] != "fired":
                continue
            evs = [ev for ev in r["recoveries"] if ev["step"] == f["step"] and set(ev["lost"]) & set(f["fired"])]
            for kind in _kinds(f, joins, departures):
                a = acc.setdefault(kind, {"faults": 0, "live": 0, "checkpoint": 0, "initial": 0, "lost_state": 0,
                                          "_s": []})
                a["faults"] += 1
                for source in ("live", "checkpoint", "initial"):
                    a[source] += sum(1 for ev in evs if ev.get("source") == source)
                a["lost_state"] += int(not (r["completed"] and r["weights_equal"]))
                a["_s"] += [ev["recovery_s"] for ev in evs if ev.get("recovery_s") is not None]
    for a in acc.values():
        xs = a.pop("_s")
        a["recovery_s_median"] = _median(xs)
        a["recovery_s_max"] = max(xs, default=None)
    return acc


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tables(summary: dict, runs: list[dict]):
    from rich.table import Table

    t = Table(title=f"fault benchmark: {summary['faults_injected']} faults in {summary['runs']} runs "
                    f"(seed {summary['seed']}, {summary['wall_s'] / 60:.1f} min)")
    t.add_column("figure")
    t.add_column("value", justify="right")
    s = summary
    rows = [
        ("faults injected (workers lost)", f"{s['faults_injected']} ({s['double_faults']} double)"),
        ("  by point", ", ".join(f"{p} {n}" for p, n in s["by_point"].items())),
        ("  killed / hung (SIGSTOP) / slow but alive / killed a second later",
         f"{s['by_how']['kill']} / {s['by_how']['stop']} / {s['by_how']['slow']} / {s['by_how']['late']}"),
        ("  in a step / transition / checkpoint save / recovery",
         f"{s['by_phase']['step']} / {s['by_phase']['transition']} / {s['by_phase']['checkpoint']} / "
         f"{s['by_phase']['recovery']}"),
        ("faults survived", f"{s['faults_survived']} / {s['faults_injected']}"),
        ("runs hung (wall-clock bound exceeded)", f"{s['runs_hung']} / {s['runs']}"),
        ("runs failed", f"{s['runs_failed']} / {s['runs']}"),
        ("recoveries (live / from checkpoint / from the seeds at step 0)",
         f"{s['recoveries']} ({s['recoveries_live']} / {s['recoveries_checkpoint']} / {s['recoveries_initial']})"
         + (f"; {s['recoveries_other_source']} of no known source" if s["recoveries_other_source"] else "")),
        ("detection time max / median", f"{s['detect_s_max']:.2f}s / {s['detect_s_median']:.2f}s"),
        ("detection median: killed / hung",
         f"{_fmt(s['detect_s_median_kill'])} / {_fmt(s['detect_s_median_hang'])}"),
        ("recovery time max / median", f"{s['recovery_s_max']:.2f}s / {s['recovery_s_median']:.2f}s"),
        ("steps lost where a full copy survived (max)",
         f"{s['steps_lost_full_copy_max']} ({s['recoveries_full_copy']} recoveries)"),
        ("steps lost where no full copy survived",
         f"{s['steps_lost_no_full_copy']} ({s['recoveries_no_full_copy']} recoveries)"),
        ("recoveries losing more than allowed", str(s["steps_lost_bound_violations"])),
        ("checkpoints lost (last complete one gone or failing --resume's checks at a run's end, or restored past)",
         str(s["checkpoints_lost"])),
        ("final weights equal to the fault-free run on the same plans (replay)",
         f"{s['weights_equal']} / {s['weights_compared']} runs (max |diff| {s['weights_max_abs_diff']:.2e})"),
        ("  layout drift: equal to the fault-free run on its own plans",
         "not measured (--no-drift)" if s["layout_drift_max"] is None else
         f"{s['reference_equal']} / {s['weights_compared']} runs (max |diff| {s['layout_drift_max']:.2e}; "
         f"{s['reference_equal_same_layouts']} of the {s['layouts_as_reference']} runs on its layouts)"),
    ]
    for kind, a in sorted(s.get("by_kind", {}).items()):
        rows.append((f"  {kind}: faults, recovered live / from checkpoint / from the seeds, state lost; "
                     "recovery median / max",
                     f"{a['faults']}, {a['live']} / {a['checkpoint']} / {a['initial']}, {a['lost_state']}; "
                     f"{_fmt(a['recovery_s_median'])} / {_fmt(a['recovery_s_max'])}"))
    for a, b in rows:
        t.add_row(a, b)
    per = Table(title="runs")
    for c in ("run", "algo", "workers", "ckpt every", "faults", "recoveries", "steps lost", "seconds", "end",
              "drift"):
        per.add_column(c)
    for i, r in enumerate(runs):
        end = ("HUNG" if r["hung"] else "failed" if r["error"] else
               f"= replay ({r['max_abs_diff']:.0e})" if r["weights_equal"] else f"differs ({r['max_abs_diff']:.1e})")
        drift = f"{r['layout_drift']:.1e}" if r["completed"] and r["layout_drift"] is not None else "-"
        per.add_row(str(i), r["algorithm"], str(r["workers"]), str(r["checkpoint_every"]),
                    str(sum(len(f["fired"]) for f in r["faults"])), str(len(r["recoveries"])),
                    str(sum(ev.get("steps_lost", 0) for ev in r["recoveries"])), f"{r['seconds']:.0f}", end, drift)
    return t, per


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}s"
