"""``nereus run --adaptive``: the adaptive run on local Ray workers, its per-step lines and the summary of
its plan changes (table and PNG timeline); the asynchronous front end (``run_async.py``) uses it too.
"""

from __future__ import annotations

import json
import os

from nereus.runtime.run.schedules import parse_digits_schedule

__all__ = ["run_adaptive", "quiet_ray", "step_line"]


def step_line(metrics: dict, keys=None) -> str:
    """One step's metrics as ``key=value`` pairs (floats to 4 decimals), in ``keys`` order when given."""
    return " ".join(f"{k}={metrics[k]:.4f}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                    for k in (keys if keys is not None else metrics) if k in metrics)


def quiet_ray() -> None:
    """Ray's own start-up lines and warnings go to its log files unless ``--verbose``."""
    import logging
    import warnings

    os.environ.setdefault("RAY_LOGGER_LEVEL", "error")
    logging.getLogger("ray").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="ray")


def run_adaptive(args, spec, w, task, cfg, run_class=None, **extra) -> int:
    """Run the adaptive loop (``run_class``: :class:`AdaptiveRun` or a subclass such as the
    asynchronous one, which passes its own ``extra`` options), then its summary, plot and JSON."""
    from nereus.runtime.run.adaptive import AdaptiveRun
    from nereus.runtime.run.schedules import parse_pool_schedule

    sched = parse_pool_schedule(args.pool_schedule) if args.pool_schedule else {}
    run = (run_class or AdaptiveRun)(
        spec, w, task, args.workers, cfg, sched, memory_bytes=int(args.memory_gib * 1024**3), gamma=args.gamma,
        log=lambda s: print(s, flush=True), digits=parse_digits_schedule(args.digits_schedule), notice=args.notice,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        checkpoint_sync=getattr(args, "checkpoint_sync", False),
        hang_timeout_s=args.hang_timeout, resume=args.resume, address=args.address, **extra)
    if args.verbose:
        print(f"device model: {run.job.cluster.gpu.source}")
    if getattr(args, "save", None):  # the trained weights, written before the workers stop
        from nereus.cli.run_save import save_hf

        run.on_end = lambda driver: save_hf(driver, args.save)
    history = run.run(args.steps)
    _summary(history, run)
    if args.plot and history:
        from nereus.runtime.run.report import write_timeline

        print(f"wrote {write_timeline(history, run.events, args.plot)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": history, "events": run.events, "controller": run.ctl.log}, f, indent=1,
                      default=str)
    return 0


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _summary(history: list[dict], run) -> None:
    """The run's plan changes as a table, and a closing line."""
    from rich.console import Console
    from rich.table import Table

    from nereus.runtime.run.report import change_rows

    rows = change_rows(run.events)
    if rows:
        t = Table(title="plan changes (L_tran: predicted and measured seconds of the primitives; "
                        "total: with engine hand-over)")
        for col in ("boundary", "how", "primitives", "MB moved", "L_tran predicted", "measured", "total s"):
            t.add_column(col, justify="right" if col not in ("boundary", "how", "primitives") else "left")
        for r in rows:
            t.add_row(r["boundary"], r["how"], r["primitives"], _fmt(r["mb"], ".1f"), _fmt(r["predicted_s"], ".2f"),
                      _fmt(r["measured_s"], ".2f"), _fmt(r["seconds"], ".2f"))
        Console(width=130).print(t)
    live = sum(1 for r in rows if r["how"].endswith("live"))
    rec = len(getattr(run, "recoveries", []))
    print(f"{len(history)} steps; {live} live transition(s), {len(rows) - live} restart(s) from the checkpoint, "
          f"{rec} recover{'y' if rec == 1 else 'ies'} from lost workers; "
          f"{sum(m['seconds'] for m in history):.1f}s in steps; final reward {history[-1]['reward']:.3f}"
          if history else "no steps run")
