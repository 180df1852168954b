"""RL steps on local Ray workers: a fixed layout per model-stage, or with --adaptive the controller's plans.

Prints one line per step (reward, losses, KL, seconds) and the measurements the controller
calibrates from. With ``--adaptive`` the controller (the one ``nereus simulate`` drives) chooses
the plan and changes it between steps (``nereus.runtime.run.adaptive``).

Everything is checked before Ray starts (:func:`check_args`, :func:`check_memory`): counts and
rates, the pool schedule against the workers alive at each step, the layouts against the model,
and the memory of the chosen layout (or, with ``--adaptive``, of the smallest plan) against the
per-worker budget with the cost model's breakdown. Errors exit with status 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from nereus.planner.notation import format_plan
from nereus.runtime.run.schedules import parse_digits_schedule, parse_schedule_items
from nereus.workflow import workflow_for

__all__ = ["add_arguments", "main", "DEFAULT_LAYOUTS", "check_args", "check_pool_schedule", "check_memory"]

#: used when at least 4 workers are given: a different layout per model-stage
DEFAULT_LAYOUTS = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
                   "critic.infer": (1, 1, 1), "reward.infer": (1, 1, 1), "actor.train": (2, 1, 2),
                   "critic.train": (1, 2, 2)}


#: the embedded scenario of the README's first command: a pool that shrinks (with notice) and later
#: grows, and responses that get longer (a curriculum), on the ``small`` model
SCENARIOS = {
    "elastic": {"adaptive": True, "model": "small", "workers": 4, "steps": 14, "prompts": 32, "mini_batch": 32,
                "pool_schedule": "2:-1,10:+3", "notice": True, "digits_schedule": "5:8"},
}


def apply_scenario(args) -> None:
    """Fill the options of ``args.scenario`` that were left at their defaults (an option given on the
    command line wins, e.g. ``--scenario elastic --steps 8``).

    Raises:
        ValueError: an unknown scenario name.
    """
    import argparse

    name = getattr(args, "scenario", None)
    if not name:
        return
    if name not in SCENARIOS:
        raise ValueError(f"--scenario {name!r} is unknown; valid: {sorted(SCENARIOS)}")
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = p.parse_args([])
    for k, v in SCENARIOS[name].items():
        if getattr(args, k) == getattr(defaults, k):
            setattr(args, k, v)


def add_arguments(p) -> None:
    p.epilog = ("terms: a layout tp,pp,dp is tensor, pipeline and data parallel degrees (tp*pp*dp workers); "
                "plans print as 'tp2 pp1 dp2 on workers 0-3'; L_tran is the predicted seconds of a transition "
                "between plans; γ (--gamma) is the payback margin: a new plan is adopted when its saving over "
                "the expected horizon H exceeds (1+γ)·L_tran.")
    p.add_argument("--model", default="tiny", help="model preset, or a Hugging Face config.json path or directory")
    p.add_argument("--algo", "--algorithm", dest="algorithm", default="ppo", choices=["ppo", "grpo", "remax"],
                   help="RL algorithm")
    p.add_argument("--steps", type=int, default=5, help="RL steps (>= 1)")
    p.add_argument("--workers", type=int, default=4, help="Ray workers (one per device)")
    p.add_argument("--task", default="reverse", choices=["reverse", "add"],
                   help="built-in verifiable task: reverse the digits, or add two numbers")
    p.add_argument("--digits", type=int, default=3, help="digits per operand of the task (1-8)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--mini-batch", type=int, default=16, help="sequences per optimizer update")
    p.add_argument("--micro-batch", type=int, default=4, help="per-replica micro-batch b")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's batch (optimizer epochs)")
    p.add_argument("--lr", type=float, default=1e-3, help="actor (and critic) learning rate")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of the KL penalty against the reference model (0: none)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts (> 0)")
    p.add_argument("--reward-model", action="store_true", help="score with a reward model stage")
    p.add_argument("--layout", action="append", default=[], metavar="STAGE=TP,PP,DP",
                   help="layout of one model-stage, e.g. actor.train=2,1,2 (repeatable); default: "
                        "all 1,1,1 below 4 workers, else a different layout per model-stage")
    p.add_argument("--seed", type=int, default=0, help="seed of the task's prompts, sampling and initial weights")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="bf16: bf16 weights and compute with fp32 master weights, gradients and Adam moments "
                        "(Megatron); fp32: fp32 throughout; default bf16 where CUDA supports it, else fp32")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective gives up")
    p.add_argument("--json", default=None, help="write per-step metrics and measurements here")
    p.add_argument("--adaptive", action="store_true",
                   help="let the controller choose and change the plan between steps (ignores --layout)")
    p.add_argument("--pool-schedule", default=None, metavar="STEP:-N,STEP:+N",
                   help="with --adaptive: N workers leave (-) or join (+) just before 0-based step STEP")
    p.add_argument("--notice", action="store_true",
                   help="with --pool-schedule: departures are announced one boundary ahead (spot notice, "
                        "scheduler drain), so state moves off leaving workers live instead of being lost")
    p.add_argument("--digits-schedule", default=None, metavar="STEP:D,...",
                   help="with --adaptive: from 0-based step STEP the task uses D-digit problems (a curriculum: "
                        "longer prompts and responses), e.g. 4:6")
    p.add_argument("--memory-gib", type=float, default=2.0, help="per-worker memory budget the cost model checks "
                                                                 "the layout against (and plans with, --adaptive)")
    p.add_argument("--gamma", type=float, default=0.5, help="with --adaptive: the controller's payback margin γ "
                                                            "in [0, 1]")
    p.add_argument("--scenario", default=None, choices=sorted(SCENARIOS),
                   help="an embedded adaptive scenario; options given on the command line win; 'elastic': "
                        + " ".join(
                       f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                       for k, v in SCENARIOS["elastic"].items()))
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="with --adaptive: durable checkpoints (each worker writes its own shards with "
                        "torch.distributed.checkpoint) go here; default: a temporary directory removed at the end")
    p.add_argument("--checkpoint-every", type=int, default=5, metavar="K",
                   help="with --adaptive: steps between durable checkpoints (one is also taken before the first "
                        "step). Checkpoints are asynchronous: at the step boundary each writing worker only copies "
                        "its shards and counters into host memory of its own (the blocking part), the files are "
                        "written in a background thread (dcp.async_save) while training goes on, and the "
                        "checkpoint replaces the previous one once every writer has finished (checked before the "
                        "next checkpoint, a transition, a recovery and at the end)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="with --adaptive: write each durable checkpoint synchronously (the step boundary waits "
                        "for every writer's files), as before asynchronous checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="with --adaptive: continue from the checkpoint in --checkpoint-dir (step, counters, state)")
    p.add_argument("--hang-timeout", type=float, default=10.0,
                   help="with --adaptive: seconds a worker may leave a heartbeat unanswered before it is "
                        "declared hung, killed and recovered from")
    p.add_argument("--address", default=None,
                   help="with --adaptive: attach to this running Ray cluster (e.g. 10.0.0.1:6379 or 'auto') "
                        "instead of starting a local one; workers are spread evenly over its nodes")
    p.add_argument("--plot", default="nereus-run.png",
                   help="with --adaptive: write the PNG timeline (step time, pool, response length, plan "
                        "changes) here; '' for none")
    p.add_argument("--verbose", action="store_true",
                   help="also print the assumed device model and Ray's own log lines")
    # your own model and data (docs/runtime.md, "Your own model and data")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="prompts and ground truth from a parquet or JSONL file in verl's layout (needs --model DIR "
                        "with a tokenizer); reward: exact final answer, GSM8K style")
    p.add_argument("--prompt-key", default="prompt", help="with --data: the prompt field (string or chat messages)")
    p.add_argument("--answer-key", default="reward_model.ground_truth",
                   help="with --data: the ground-truth field (dots for nesting)")
    p.add_argument("--response-len", type=int, default=32, help="with --data: tokens generated per response")
    p.add_argument("--max-prompt-len", type=int, default=256, help="with --data: longer prompts keep their last "
                                                                    "tokens")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write the trained actor (and critic, DIR/critic) as Hugging Face directories at the end")
    # asynchronous RL (nereus.cli.run_async): --async, --staleness
    from nereus.cli.run_async import add_async_arguments

    add_async_arguments(p)


def check_args(args) -> None:
    """Counts, rates and the pool schedule, before anything is built.

    Raises:
        ValueError: naming the option, the value and what is valid.
    """
    for opt in ("steps", "workers", "digits", "prompts", "samples", "mini_batch", "micro_batch", "ppo_epochs"):
        v = getattr(args, opt)
        if v < 1:
            raise ValueError(f"--{opt.replace('_', '-')} must be >= 1, got {v}")
    for opt, lo, strict in (("lr", 0.0, True), ("temperature", 0.0, True), ("timeout", 0.0, True),
                            ("memory_gib", 0.0, True), ("kl_coef", 0.0, False)):
        v = getattr(args, opt)
        if not (v > lo if strict else v >= lo) or v != v or v == float("inf"):
            raise ValueError(f"--{opt.replace('_', '-')} must be a finite number {'>' if strict else '>='} {lo:g}, "
                             f"got {v}")
    if not 0.0 <= args.gamma <= 1.0:
        raise ValueError(f"--gamma must be in [0, 1], got {args.gamma}")
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent) or os.path.isdir(args.json):
            raise ValueError(f"--json {args.json!r}: cannot write a file there")
    if args.pool_schedule and not args.adaptive:
        raise ValueError("--pool-schedule needs --adaptive")
    if args.adaptive and args.layout:
        raise ValueError("--layout has no effect with --adaptive (the controller chooses layouts); drop one")
    if args.pool_schedule:
        check_pool_schedule(args.pool_schedule, args.workers, args.steps)
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1 step, got {args.checkpoint_every}")
    if not args.hang_timeout > 0 or args.hang_timeout != args.hang_timeout:
        raise ValueError(f"--hang-timeout must be > 0 seconds, got {args.hang_timeout}")
    if not args.adaptive and (args.resume or args.checkpoint_dir or args.address):
        raise ValueError("--resume, --checkpoint-dir and --address need --adaptive")
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR (the checkpoint to continue from)")
    if args.resume and not os.path.exists(os.path.join(args.checkpoint_dir, "current", "driver.json")):
        raise ValueError(f"--resume: no checkpoint in {args.checkpoint_dir!r} (current/driver.json missing)")
    if args.digits_schedule:
        if not args.adaptive:
            raise ValueError("--digits-schedule needs --adaptive")
        bad = [k for k in parse_digits_schedule(args.digits_schedule) if k >= args.steps]
        if bad:
            raise ValueError(f"--digits-schedule: step {bad[0]} never runs (--steps {args.steps} runs steps "
                             f"0..{args.steps - 1})")


def check_pool_schedule(text: str, workers: int, steps: int) -> None:
    """Every change happens before a step that runs and leaves at least one worker alive.

    Raises:
        ValueError: naming the item, the workers alive at that step, and what is valid.
    """
    alive = workers
    for item, k, dn in sorted(parse_schedule_items(text), key=lambda x: x[1]):
        if k >= steps:
            raise ValueError(f"--pool-schedule item {item!r}: step {k} never runs (--steps {steps} runs steps "
                             f"0..{steps - 1})")
        if alive + dn < 1:
            raise ValueError(f"--pool-schedule item {item!r}: removes {-dn} worker(s) before step {k}, but only "
                             f"{alive} are alive then; at most {alive - 1} can leave (one must stay)")
        alive += dn


def _breakdown(est, names) -> str:
    parts = []
    for ms in names:
        e = est.estimates[ms]
        terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in e.memory.items() if v > 0)
        parts.append(f"{ms} ({terms} GiB)")
    return "; ".join(parts)


def check_memory(spec, w, workers: int, memory_gib: float, plan=None, precision: str = "fp32") -> None:
    """The cost model's memory check against the per-worker budget, before Ray starts.

    With ``plan`` (fixed layouts): every worker's predicted peak (resident state of every
    model-stage on it, the largest transient, the workspace) must fit the budget less the cost model's
    headroom. Without (``--adaptive``): some plan must exist; if no model-stage fits alone on every
    worker, nothing can run (the adaptive run time-shares model-stages that only fit one at a time).

    Raises:
        ValueError: naming the worker, the bytes needed, the budget, and the largest terms.
    """
    from nereus.cost.model import CostModel
    from nereus.planner.search import NoFeasiblePlan, plan_job
    from nereus.runtime.model.precision import workload_bytes
    from nereus.spec.hardware import GPU_PRESETS, ClusterSpec
    from nereus.spec.job import JobSpec

    gpu = replace(GPU_PRESETS["cpu"], memory_bytes=int(memory_gib * 2**30))
    # the bytes the runtime holds in this precision, as nereus.runtime.run.adaptive.runtime_job counts them
    job = JobSpec(spec, ClusterSpec(gpu, 1, workers), replace(w, **workload_bytes(precision)))
    cost = CostModel(job)
    budget = f"{cost.capacity / 2**30:.2f} GiB allowed per worker (--memory-gib {memory_gib:g} less " \
             f"{cost.headroom:.0%} headroom)"
    if plan is None:
        try:
            plan_job(job, cost=cost)
        except NoFeasiblePlan as e:
            if e.diagnosis.get("kind") == "joint":
                return  # fits one model-stage at a time: the adaptive run time-shares the workers
            msg = " ".join(str(e).split())
            raise ValueError(f"{spec.name} cannot run on {workers} worker(s) of {memory_gib:g} GiB: {msg}; "
                             "use a smaller model, more workers or a larger --memory-gib") from None
        return
    est = cost.estimate(plan)
    worst = max(est.gpu_memory, key=est.gpu_memory.get)
    if est.gpu_memory[worst] <= cost.capacity:
        return
    on = [c.model_stage for c in plan.candidates if worst in c.gpus]
    raise ValueError(f"{spec.name} with this layout does not fit: worker {worst} needs "
                     f"{est.gpu_memory[worst] / 2**30:.2f} GiB, {budget}; it holds {_breakdown(est, on)} plus "
                     f"{cost.workspace / 2**30:.2f} GiB workspace; use a smaller model, more workers, other "
                     "--layout degrees or a larger --memory-gib")


def _parse_layouts(items: list[str]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for it in items:
        name, _, rest = it.partition("=")
        try:
            tp, pp, dp = (int(x) for x in rest.split(","))
        except ValueError:
            raise ValueError(f"--layout {it!r} must look like actor.train=2,1,2") from None
        if min(tp, pp, dp) < 1:
            raise ValueError(f"--layout {it!r}: degrees tp, pp, dp must be >= 1")
        out[name] = (tp, pp, dp)
    return out


def with_given_layouts(spec, w, args, layouts: dict) -> dict:
    """``layouts`` (model-stage -> (tp, pp, dp)) updated with the ``--layout`` options, checked.

    Raises:
        ValueError: a malformed ``--layout``, a model-stage outside the workflow, or a layout the
            model cannot take.
    """
    names = [ms.name for ms in workflow_for(w).model_stages]
    given = _parse_layouts(args.layout)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"--layout names model-stage(s) {unknown} not in the {args.algorithm.upper()} workflow; "
                         f"valid: {names}")
    layouts = dict(layouts) | given
    _check_layouts(spec, layouts)
    return layouts


def _check_layouts(spec, layouts) -> None:
    from nereus.cost.shapes import valid_pp, valid_tp

    for name, (tp, pp, _) in layouts.items():
        why = valid_tp(spec, tp) or valid_pp(spec, pp)
        if why:
            raise ValueError(f"layout of {name}: {why} (model {spec.name})")


def _task_lengths(kind: str, digits: int) -> tuple[int, int]:
    """Prompt and response tokens of the built-in task without building it (it imports torch)."""
    from nereus.runtime.rl.task import DigitTask

    t = DigitTask(kind, digits, seed=0)
    return t.prompt_len, t.target_len


def _joining(args) -> int:
    if not (args.adaptive and args.pool_schedule):
        return 0
    return sum(max(dn, 0) for _, _, dn in parse_schedule_items(args.pool_schedule))


def _quiet_ray() -> None:
    """Ray's own start-up lines and warnings go to its log files unless ``--verbose``."""
    import logging
    import warnings

    os.environ.setdefault("RAY_LOGGER_LEVEL", "error")
    logging.getLogger("ray").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="ray")


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    apply_scenario(args)
    check_args(args)
    if args.asynchronous or args.staleness != 1:  # --async: nereus.cli.run_async
        from nereus.cli.run_async import main_async

        return main_async(args)
    from nereus.runtime.run.plans import simple_plan
    from nereus.spec.model import get_model
    from nereus.spec.workload import WorkloadSpec

    spec = get_model(args.model)
    data_task = _data_task(args, spec) if args.data else None
    if data_task is not None:  # workers mask the left padding of the dataset's prompts
        spec = replace(spec, extra={**spec.extra, "pad_id": data_task.tokenizer.pad_id})
        task_lens = (data_task.prompt_len, data_task.target_len)
    else:
        task_lens = _task_lengths(args.task, args.digits)
    w = WorkloadSpec(algorithm=args.algorithm, prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                     prompt_len=task_lens[0], response_len=task_lens[1], mini_batch_size=args.mini_batch,
                     micro_batch_size=args.micro_batch, infer_micro_batch_size=max(args.micro_batch, 1),
                     ppo_epochs=args.ppo_epochs, reward_model=args.reward_model)
    plan = None
    if not args.adaptive:
        base = DEFAULT_LAYOUTS if args.workers >= 4 else {}
        layouts = with_given_layouts(spec, w, args, {n: base.get(n, (1, 1, 1))
                                                     for n in (ms.name for ms in workflow_for(w).model_stages)})
        plan = simple_plan(w, layouts, args.workers, micro_batch=args.micro_batch)
    check_memory(spec, w, args.workers + _joining(args), args.memory_gib, plan, args.precision or "fp32")
    if not args.verbose:
        _quiet_ray()

    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run.driver import RLConfig, RLDriver

    task = data_task or DigitTask(args.task, args.digits, seed=args.seed)
    cfg = RLConfig(temperature=args.temperature, actor_lr=args.lr, critic_lr=args.lr, kl_coef=args.kl_coef,
                   seed=args.seed, timeout_s=args.timeout, precision=args.precision)
    if args.adaptive:
        return _adaptive(args, spec, w, task, cfg)
    driver = RLDriver(spec, w, plan, task, args.workers, cfg)
    for line in format_plan(plan, "workers").splitlines():
        print(line)
    driver.start()
    history = []
    try:
        for _ in range(args.steps):
            m = driver.step()
            history.append(m)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()),
                  flush=True)
        meas = driver.measurements()
        if args.save:
            _save(driver, args.save)
    finally:
        driver.close()
    _memory_report(spec, w, plan, args, meas)
    secs = meas.get("stage_seconds", {})
    if secs:
        print("seconds per model-stage (all steps): "
              + ", ".join(f"{k} {v:.2f}" for k, v in secs.items()))
    print(f"peak tracked bytes {meas.get('peak_bytes', 0):,}; bytes sent {meas.get('bytes_sent', 0):,.0f}"
          + ("" if args.json else "; --json FILE writes every step and the full measurements"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": history, "measurements": meas}, f, indent=1)
    return 0


def _data_task(args, spec):
    """The ``--data`` task with the tokenizer of ``--model DIR``.

    Raises:
        ValueError: naming the option when the model has no directory or a value is out of range.
    """
    from nereus.runtime.rl.data import DataTask, HFTokenizer

    if args.adaptive and args.digits_schedule:
        raise ValueError("--digits-schedule applies to the built-in digit tasks; drop it with --data")
    if not spec.checkpoint:
        raise ValueError(f"--data needs --model DIR, a Hugging Face model directory with weights and a tokenizer; "
                         f"got --model {args.model!r}")
    return DataTask(args.data, HFTokenizer(spec.checkpoint), response_len=args.response_len,
                    prompt_key=args.prompt_key, answer_key=args.answer_key, max_prompt_len=args.max_prompt_len,
                    seed=args.seed)


def _save(driver, directory: str) -> None:
    """Write replica 0 of actor.train (and critic.train) as Hugging Face directories."""
    for ms, sub in (("actor.train", ""), ("critic.train", "critic")):
        if ms not in driver.layouts:
            continue
        d = os.path.join(directory, sub) if sub else directory
        lay = driver.layouts[ms]
        n = sum(driver._get([driver.workers[i].save_hf.remote(ms, d) for i in lay.replica(0)], f"saving {ms}"))
        print(f"wrote {ms} to {d} ({n / 1e6:.1f} MB)")


def _memory_report(spec, w, plan, args, meas) -> None:
    """Measured vs predicted peak memory per model-stage (``memreport.py``)."""
    from nereus.cost.model import CostModel
    from nereus.runtime.run.device_model import runtime_job
    from nereus.runtime.run.memreport import format_rows, memory_rows

    job = runtime_job(spec, w, args.workers, precision=args.precision or "fp32")
    rows = memory_rows(CostModel(job), plan, meas)
    meas["memory_vs_predicted"] = rows
    print(format_rows(rows))


def _adaptive(args, spec, w, task, cfg, run_class=None, **extra) -> int:
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
