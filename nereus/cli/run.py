"""RL steps on local Ray workers: a fixed layout per model-stage, or with --adaptive the controller's plans.

Prints one line per step (reward, losses, KL, seconds) and the measurements the controller
calibrates from. With ``--adaptive`` the controller (the one ``nereus simulate`` drives) chooses
the plan and changes it between steps (``nereus.runtime.run.adaptive``).

Everything is checked before Ray starts (:func:`~nereus.cli.run_checks.check_args`, :func:`~nereus.cli.run_checks.check_memory`): counts and
rates, the pool schedule against the workers alive at each step, the layouts against the model,
and the memory of the chosen layout (or, with ``--adaptive``, of the smallest plan) against the
per-worker budget with the cost model's breakdown. Errors exit with status 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from nereus.cli.run_adaptive import quiet_ray, run_adaptive, step_line
from nereus.cli.run_checks import (
    check_args,
    check_checkpoint_dir,
    check_memory,
    joining,
    task_lengths,
    with_given_layouts,
)
from nereus.cli.run_save import check_save_target, save_hf
from nereus.planner.notation import format_plan
from nereus.workflow import workflow_for

__all__ = ["add_arguments", "main", "DEFAULT_LAYOUTS", "SCENARIOS", "apply_scenario"]

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
                "between plans; γ (--gamma) is the payback margin: a new plan is adopted when it repays L_tran "
                "within γ·H steps, L_tran / ΔL <= γ·H (ΔL: the predicted seconds saved per step; H: the steps "
                "the plan is expected to stay useful), so a smaller γ adopts fewer changes and γ = 0 only urgent "
                "ones (lost workers).")
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
    p.add_argument("--no-reference", action="store_true",
                   help="run no reference model (the workload's reference_model false): no reference.infer "
                        "model-stage, its log-probs, layout or memory; needs --kl-coef 0")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts (> 0)")
    p.add_argument("--rollout", default="builtin", choices=["builtin", "vllm"],
                   help="generation engine of actor.generate: the runtime's KV-cache decode loop, or one vLLM "
                        "engine per replica with its TP (needs vllm: docs/runtime.md, 'Generating with vLLM')")
    p.add_argument("--vllm-kv-mib", type=int, default=256, metavar="MIB",
                   help="with --rollout vllm: KV cache each engine pre-allocates (vLLM's kv_cache_memory_bytes)")
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
    p.add_argument("--colocate", action="store_true",
                   help="fixed layouts: every model-stage of a stage on the same workers, taking turns (verl's hybrid "
                        "engine); idle trained state offloaded to host memory, idle frozen weights dropped")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="fixed layouts: ZeRO stage of the training model-stages (1: Adam state sharded over DP; "
                        "2: gradients too; 3: parameters too, gathered per layer, also for the infer passes)")
    p.add_argument("--enforce-memory", action="store_true",
                   help="every worker accounts its tensors against --memory-gib and fails past it (a CPU "
                        "worker's device capacity)")
    p.add_argument("--gamma", type=float, default=0.5, help="with --adaptive: the controller's payback margin γ "
                                                            "in [0, 1]: a change is adopted when L_tran / ΔL <= γ·H")
    p.add_argument("--scenario", default=None, choices=sorted(SCENARIOS),
                   help="an embedded adaptive scenario; options given on the command line win; 'elastic': "
                        + " ".join(
                       f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                       for k, v in SCENARIOS["elastic"].items()))
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="with --adaptive: durable checkpoints (each worker writes its own shards with "
                        "torch.distributed.checkpoint) go here, and a final one at the end of the run; default: a "
                        "temporary directory, removed when the run completes and kept (its path printed) when an "
                        "error ends it")
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
                   help="with --adaptive: continue from the checkpoint in --checkpoint-dir (step, counters, state); "
                        "--steps N then runs N MORE steps (a checkpoint of step 7 with --steps 12 ends at step 19). "
                        "The checkpoint is verified first (manifest checksums, model, algorithm, model-stages, "
                        "shapes, step against the shards) and refused with a one-line reason")
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
                   help="write the trained actor (and critic, DIR/critic) as Hugging Face directories at the end (also "
                        "with --adaptive and --async); DIR must not be an existing file or the --model directory")
    # asynchronous RL (nereus.cli.run_async): --async, --staleness
    from nereus.cli.run_async import add_async_arguments

    add_async_arguments(p)


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ray's C++ failure-signal handler prints a stack for SIGTERM and aborts; the CLI ends in one line
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    apply_scenario(args)
    check_args(args)
    if args.asynchronous or args.staleness != 1:  # --async: nereus.cli.run_async
        from nereus.cli.run_async import main_async

        return main_async(args)
    from nereus.runtime.run.plans import arrange, simple_plan
    from nereus.spec.presets import get_model
    from nereus.spec.workload import WorkloadSpec

    spec = get_model(args.model)
    check_save_target(args.save, spec, args.model)
    data_task = _data_task(args, spec) if args.data else None
    if data_task is not None:  # workers mask the left padding of the dataset's prompts
        spec = replace(spec, extra={**spec.extra, "pad_id": data_task.tokenizer.pad_id})
        task_lens = (data_task.prompt_len, data_task.target_len)
    else:
        task_lens = task_lengths(args.task, args.digits)
    w = WorkloadSpec(algorithm=args.algorithm, prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                     prompt_len=task_lens[0], response_len=task_lens[1], mini_batch_size=args.mini_batch,
                     micro_batch_size=args.micro_batch, infer_micro_batch_size=max(args.micro_batch, 1),
                     ppo_epochs=args.ppo_epochs, reward_model=args.reward_model,
                     reference_model=not args.no_reference)
    plan = None
    if not args.adaptive:
        base = DEFAULT_LAYOUTS if args.workers >= 4 else {}
        layouts = with_given_layouts(spec, w, args, {n: base.get(n, (1, 1, 1))
                                                     for n in (ms.name for ms in workflow_for(w).model_stages)})
        plan = arrange(simple_plan(w, layouts, args.workers, micro_batch=args.micro_batch), args.colocate,
                       args.zero)
    check_memory(spec, w, args.workers + joining(args), args.memory_gib, plan, args.precision or "fp32",
                 0.0 if args.enforce_memory else None)
    check_checkpoint_dir(args, spec, w)
    if not args.verbose:
        quiet_ray()

    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run.config import RLConfig
    from nereus.runtime.run.driver import RLDriver

    task = data_task or DigitTask(args.task, args.digits, seed=args.seed)
    cfg = RLConfig(temperature=args.temperature, actor_lr=args.lr, critic_lr=args.lr, kl_coef=args.kl_coef,
                   seed=args.seed, timeout_s=args.timeout, precision=args.precision, rollout=args.rollout,
                   vllm={"kv_cache_bytes": args.vllm_kv_mib << 20},
                   device_capacity=int(args.memory_gib * 2**30) if args.enforce_memory else 0)
    if args.adaptive:
        return run_adaptive(args, spec, w, task, cfg)
    driver = RLDriver(spec, w, plan, task, args.workers, cfg)
    for line in format_plan(plan, "workers").splitlines():
        print(line)
    driver.start()
    history = []
    try:
        for _ in range(args.steps):
            m = driver.step()
            history.append(m)
            if len(history) == 1 and args.steps > 1:  # the steady state's moves are counted from here
                first = driver.measurements()
            print(step_line(m), flush=True)
        meas = driver.measurements()
        if args.save:
            save_hf(driver, args.save)
    finally:
        driver.close()
    _memory_report(spec, w, plan, args, meas, first if args.steps > 1 else None)
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


def _memory_report(spec, w, plan, args, meas, first=None) -> None:
    """Measured vs predicted peak memory per model-stage (``run/memreport.py``)."""
    from nereus.cost.model import CostModel
    from nereus.runtime.run import memreport as mr
    from nereus.runtime.run.device_model import runtime_job

    job = runtime_job(spec, w, args.workers, precision=args.precision or "fp32")
    cost = CostModel(job)
    meas["memory_vs_predicted"] = mr.memory_rows(cost, plan, meas)
    meas["workers_vs_predicted"] = mr.worker_rows(cost, plan, meas)
    meas["moves_vs_predicted"] = mr.move_rows(cost, plan, meas, args.steps,
                                              w.ppo_epochs * (w.global_batch // w.mini_batch_size), first)
    print(mr.format_rows(meas["memory_vs_predicted"]))
    print(mr.format_workers(meas["workers_vs_predicted"]))
    print(mr.format_moves(meas["moves_vs_predicted"]))
    print(mr.generation_line(cost, plan, meas, args.steps, args.rollout))


