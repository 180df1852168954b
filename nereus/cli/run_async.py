"""``nereus run --async [--staleness N]``: one-step-off asynchronous RL (``run/async_driver.py``).

Without ``--layout`` generation gets the last ``workers // 2`` workers and every other model-stage the
rest (each at the largest DP the batch sizes allow); ``--layout`` degrees are placed the same way
(generation after the others). A layout that needs more workers than given is refused (exit 2).
``--staleness 0`` runs the same plan synchronously (the baseline of the comparison). At the end the
run prints the mean step time of the steps after the warm-up, and the cost model's predicted
synchronous and asynchronous step times of the plan (``predict``; device FLOP/s measured at start).
"""

from __future__ import annotations

import json
from dataclasses import replace

__all__ = ["add_async_arguments", "check_async_args", "default_async_layouts", "main_async", "predict"]


def add_async_arguments(p) -> None:
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="one-step-off asynchronous RL: generation of step k+1 runs on workers of its own while "
                        "step k trains; the weight sync ending a step is where weights reach generation (and, "
                        "with --adaptive, where plan changes apply)")
    p.add_argument("--staleness", type=int, default=1, metavar="N",
                   help="with --async: batch k is generated with the weights of step k-N at the oldest (0: "
                        "synchronous on the same plan)")


def check_async_args(args) -> None:
    """Raises ValueError naming the option."""
    if getattr(args, "staleness", 1) != 1 and not getattr(args, "asynchronous", False):
        raise ValueError("--staleness needs --async")
    if args.staleness < 0:
        raise ValueError(f"--staleness must be >= 0, got {args.staleness}")
    if args.asynchronous and args.data:
        raise ValueError("--async runs the built-in digit tasks; drop --data")


def _largest_dp(limit: int, ok) -> int:
    return next(d for d in range(max(limit, 1), 0, -1) if ok(d))


def default_async_layouts(w, workers: int) -> dict[str, tuple[int, int, int]]:
    """Generation at DP over the last ``workers // 2`` workers, the rest at DP over the others."""
    from nereus.workflow import workflow_for

    g = max(workers // 2, 1)
    gen_dp = _largest_dp(g, lambda d: w.global_batch % d == 0 and w.prompts_per_step % d == 0)
    rest = max(workers - gen_dp, 1)
    dp = _largest_dp(rest, lambda d: w.global_batch % d == 0 and w.prompts_per_step % d == 0
                     and w.mini_batch_size % (d * w.micro_batch_size) == 0)
    return {ms.name: ((1, 1, gen_dp) if ms.name == "actor.generate" else (1, 1, dp))
            for ms in workflow_for(w).model_stages}


def predict(spec, w, plan, workers: int, gpu=None) -> dict:
    """The cost model's per-model-stage seconds and ``L_step`` of ``plan``, synchronous and asynchronous."""
    from nereus.cost.model import CostModel
    from nereus.runtime.run.device_model import runtime_job

    out = {}
    for mode, asyn in (("sync", False), ("async", True)):
        est = CostModel(runtime_job(spec, replace(w, asynchronous=asyn), workers, gpu)).estimate(plan)
        out[mode] = est.l_step
        out["stages"] = {k: v.time for k, v in est.estimates.items()}
    return out


def main_async(args) -> int:
    from nereus.cli.run_adaptive import quiet_ray, step_line
    from nereus.cli.run_checks import check_memory, task_lengths, with_given_layouts
    from nereus.planner.notation import format_plan
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    check_async_args(args)
    spec = get_model(args.model)
    from nereus.cli.run_save import check_save_target

    check_save_target(args.save, spec, args.model)
    plen, rlen = task_lengths(args.task, args.digits)
    w = WorkloadSpec(algorithm=args.algorithm, prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                     prompt_len=plen, response_len=rlen, mini_batch_size=args.mini_batch,
                     micro_batch_size=args.micro_batch, infer_micro_batch_size=max(args.micro_batch, 1),
                     ppo_epochs=args.ppo_epochs, reward_model=args.reward_model, asynchronous=args.staleness > 0,
                     reference_model=not getattr(args, "no_reference", False))
    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run.config import RLConfig

    task = DigitTask(args.task, args.digits, seed=args.seed)
    extra = {"precision": args.precision} if getattr(args, "precision", None) is not None else {}
    cfg = RLConfig(temperature=args.temperature, actor_lr=args.lr, critic_lr=args.lr, kl_coef=args.kl_coef,
                   seed=args.seed, timeout_s=args.timeout,
                   device_capacity=int(args.memory_gib * 2**30) if getattr(args, "enforce_memory", False) else 0,
                   **extra)
    if args.adaptive:
        from nereus.cli.run_checks import check_checkpoint_dir

        check_memory(spec, w, args.workers, args.memory_gib, None)
        check_checkpoint_dir(args, spec, w)
        if not args.verbose:
            quiet_ray()
        return _adaptive_async(args, spec, w, task, cfg)
    from nereus.runtime.run.async_driver import AsyncRLDriver, async_plan
    from nereus.runtime.run.plans import arrange

    layouts = with_given_layouts(spec, w, args, default_async_layouts(w, args.workers))
    plan = arrange(async_plan(w, layouts, args.workers, micro_batch=args.micro_batch), getattr(args, "colocate", False),
                   getattr(args, "zero", 0), keep=("actor.generate",))
    check_memory(spec, w, args.workers, args.memory_gib, plan, workspace=0.0 if getattr(args, "enforce_memory", False)
                 else None)
    if not args.verbose:
        quiet_ray()
    driver = AsyncRLDriver(spec, w, plan, task, args.workers, cfg, staleness=args.staleness)
    for line in format_plan(plan, "workers").splitlines():
        print(line)
    print(f"{'asynchronous, staleness ' + str(args.staleness) if args.staleness else 'synchronous (--staleness 0)'}:"
          f" generation on workers {list(driver.layouts['actor.generate'].workers)}")
    driver.start()
    history = []
    keys = ("step", "reward", "actor_loss", "critic_loss", "kl", "gen_version", "train_version", "mode",
            "is_weight_mean", "gen_wait_s", "train_s", "drain_s", "sync_s", "seconds")
    try:
        for _ in range(args.steps):
            m = driver.step()
            history.append(m)
            print(step_line(m, keys), flush=True)
        meas = driver.measurements()
        if args.save:
            from nereus.cli.run_save import save_hf

            save_hf(driver, args.save)
    finally:
        driver.close()
    from nereus.runtime.run.device_model import cpu_gpu_spec

    pred = predict(spec, w, plan, args.workers, cpu_gpu_spec(int(args.memory_gib * 2**30)))
    steady = history[1:] or history
    mean = sum(m["seconds"] for m in steady) / len(steady)
    print(f"mean step {mean:.3f}s over steps {steady[0]['step']}..{steady[-1]['step']}; predicted step "
          f"(cost model, measured FLOP/s, no weight sync): sync {pred['sync']:.3f}s, async {pred['async']:.3f}s")
    secs = meas.get("stage_seconds", {})
    if secs:
        print("seconds per model-stage (all steps): " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": history, "measurements": meas, "predicted": pred,
                       "samples": driver.sample_log, "notes": driver.notes}, f, indent=1, default=str)
    return 0


def _adaptive_async(args, spec, w, task, cfg) -> int:
    from nereus.cli.run_adaptive import run_adaptive
    from nereus.runtime.run.async_driver import AsyncAdaptiveRun

    return run_adaptive(args, spec, w, task, cfg, run_class=AsyncAdaptiveRun, staleness=args.staleness)
