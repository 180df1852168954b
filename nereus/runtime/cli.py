"""RL steps on local Ray workers with a fixed layout per model-stage (``nereus run``).

Prints one line per step (reward, losses, KL, seconds) and the measurements the controller
calibrates from. With ``--adaptive`` the controller (the one ``nereus simulate`` drives) chooses
the plan and changes it between steps (``nereus.runtime.adaptive``).
"""

from __future__ import annotations

import json
import os

__all__ = ["add_arguments", "main", "DEFAULT_LAYOUTS"]

#: used when at least 4 workers are given: a different layout per model-stage
DEFAULT_LAYOUTS = {"actor.generate": (1, 1, 2), "actor.infer": (2, 1, 1), "reference.infer": (1, 2, 1),
                   "critic.infer": (1, 1, 1), "reward.infer": (1, 1, 1), "actor.train": (2, 1, 2),
                   "critic.train": (1, 2, 2)}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model preset or config.json path")
    p.add_argument("--algo", "--algorithm", dest="algorithm", default="ppo", choices=["ppo", "grpo", "remax"],
                   help="RL algorithm")
    p.add_argument("--steps", type=int, default=5, help="RL steps")
    p.add_argument("--workers", type=int, default=4, help="Ray workers (one per device)")
    p.add_argument("--task", default="reverse", choices=["reverse", "add"])
    p.add_argument("--digits", type=int, default=3, help="digits per operand of the task")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--mini-batch", type=int, default=16, help="sequences per optimizer update")
    p.add_argument("--micro-batch", type=int, default=4, help="per-replica micro-batch b")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3, help="actor (and critic) learning rate")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reward-model", action="store_true", help="score with a reward model stage")
    p.add_argument("--layout", action="append", default=[], metavar="STAGE=TP,PP,DP",
                   help="layout of one model-stage, e.g. actor.train=2,1,2 (repeatable); default: "
                        "all 1,1,1 below 4 workers, else a different layout per model-stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective gives up")
    p.add_argument("--json", default=None, help="write per-step metrics and measurements here")
    p.add_argument("--adaptive", action="store_true",
                   help="let the controller choose and change the plan between steps (ignores --layout)")
    p.add_argument("--pool-schedule", default=None, metavar="STEP:-N,STEP:+N",
                   help="with --adaptive: N workers leave (-) or join (+) just before 0-based step STEP")
    p.add_argument("--memory-gib", type=float, default=2.0, help="with --adaptive: per-worker memory budget "
                                                                 "the cost model plans with")
    p.add_argument("--gamma", type=float, default=0.5, help="with --adaptive: the controller's payback margin")


def _parse_layouts(items: list[str]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for it in items:
        name, _, rest = it.partition("=")
        try:
            tp, pp, dp = (int(x) for x in rest.split(","))
        except ValueError:
            raise ValueError(f"--layout {it!r} must look like actor.train=2,1,2") from None
        out[name] = (tp, pp, dp)
    return out


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from nereus.runtime.driver import RLConfig, RLDriver, simple_plan
    from nereus.runtime.task import DigitTask
    from nereus.spec.model import get_model
    from nereus.spec.workload import WorkloadSpec
    from nereus.workflow import workflow_for

    spec = get_model(args.model)
    task = DigitTask(args.task, args.digits, seed=args.seed)
    w = WorkloadSpec(algorithm=args.algorithm, prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                     prompt_len=task.prompt_len, response_len=task.target_len, mini_batch_size=args.mini_batch,
                     micro_batch_size=args.micro_batch, infer_micro_batch_size=max(args.micro_batch, 1),
                     ppo_epochs=args.ppo_epochs, reward_model=args.reward_model)
    cfg = RLConfig(temperature=args.temperature, actor_lr=args.lr, critic_lr=args.lr, kl_coef=args.kl_coef,
                   seed=args.seed, timeout_s=args.timeout)
    if getattr(args, "adaptive", False):
        return _adaptive(args, spec, w, task, cfg)
    if args.pool_schedule:
        raise ValueError("--pool-schedule needs --adaptive")
    base = DEFAULT_LAYOUTS if args.workers >= 4 else {}
    layouts = {ms.name: base.get(ms.name, (1, 1, 1)) for ms in workflow_for(w).model_stages}
    layouts.update(_parse_layouts(args.layout))
    plan = simple_plan(w, layouts, args.workers, micro_batch=args.micro_batch)
    driver = RLDriver(spec, w, plan, task, args.workers, cfg)
    for c in plan.candidates:
        print(f"{c.model_stage:16s} {c.short():22s} workers {list(c.gpus)}")
    driver.start()
    history = []
    try:
        for _ in range(args.steps):
            m = driver.step()
            history.append(m)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()),
                  flush=True)
        meas = driver.measurements()
    finally:
        driver.close()
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


def _adaptive(args, spec, w, task, cfg) -> int:
    from nereus.runtime.adaptive import AdaptiveRun, parse_pool_schedule

    sched = parse_pool_schedule(args.pool_schedule)
    run = AdaptiveRun(spec, w, task, args.workers, cfg, sched, memory_bytes=int(args.memory_gib * 1024**3),
                      gamma=args.gamma, log=lambda s: print(s, flush=True))
    print(f"device model: {run.job.cluster.gpu.source}")
    history = run.run(args.steps)
    kinds = [e["kind"] for e in run.events]
    print(f"{len(history)} steps; {kinds.count('transition')} transition(s), {kinds.count('restart')} "
          f"restart(s); final reward {history[-1]['reward']:.3f}" if history else "no steps run")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": history, "events": run.events, "controller": run.ctl.log}, f, indent=1,
                      default=str)
    return 0
