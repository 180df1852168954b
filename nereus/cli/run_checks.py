"""Checks of nereus run's arguments before anything starts: counts and rates, the pool schedule against the
workers alive at each step, the layouts against the model, and the chosen layout's (or, with
--adaptive, the smallest plan's) memory against the per-worker budget with the cost model's
breakdown. Each raises ValueError naming the option, the value and what is valid (exit status 2).
"""

from __future__ import annotations

import os
from dataclasses import replace

from nereus.runtime.run.schedules import parse_digits_schedule, parse_schedule_items
from nereus.workflow import workflow_for

__all__ = ["check_args", "check_pool_schedule", "check_memory", "parse_layouts", "with_given_layouts",
           "task_lengths", "joining", "check_checkpoint_dir", "checkpoint_bytes"]


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
    if getattr(args, "no_reference", False) and args.kl_coef > 0:
        raise ValueError(f"--kl-coef {args.kl_coef:g} needs the reference model; drop --no-reference or set --kl-coef 0")
    if getattr(args, "rollout", "builtin") == "vllm":
        if args.asynchronous or args.staleness != 1:
            raise ValueError("--rollout vllm runs synchronous RL only; drop --async/--staleness")
        if args.vllm_kv_mib < 1:
            raise ValueError(f"--vllm-kv-mib must be >= 1, got {args.vllm_kv_mib}")
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
    if args.notice and not args.pool_schedule:
        raise ValueError("--notice announces the departures of --pool-schedule; without --pool-schedule no worker "
                         "leaves (add --pool-schedule STEP:-N or drop --notice)")
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


def check_memory(spec, w, workers: int, memory_gib: float, plan=None, precision: str = "fp32",
                 workspace: float | None = None) -> None:
    """The cost model's memory check against the per-worker budget, before Ray starts.

    With ``plan`` (fixed layouts): every worker's predicted peak (resident state of every
    model-stage on it, the largest transient, the workspace) must fit the budget less the cost model's
    headroom. Without (``--adaptive``): some plan must exist; if no model-stage fits alone on every
    worker, nothing can run (the adaptive run time-shares model-stages that only fit one at a time).

    ``workspace``: bytes per worker the cost model reserves (None: its CUDA default); 0 with
    ``--enforce-memory``, whose accounted bytes hold no CUDA context.

    Raises:
        ValueError: naming the worker, the bytes needed, the budget, and the largest terms.
    """
    from nereus.cost.model import CostModel
    from nereus.planner.search import NoFeasiblePlan, plan_job
    from nereus.runtime.model.precision import workload_bytes
    from nereus.spec.hardware import GPU_PRESETS, ClusterSpec
    from nereus.spec.job import JobSpec

    gpu = replace(GPU_PRESETS["cpu"], memory_bytes=int(memory_gib * 2**30))
    # the bytes the runtime holds in this precision, as nereus.runtime.run.device_model.runtime_job counts them
    job = JobSpec(spec, ClusterSpec(gpu, 1, workers), replace(w, **workload_bytes(precision), activation_model="runtime"))
    cost = CostModel(job) if workspace is None else CostModel(job, workspace=workspace)
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


def parse_layouts(items: list[str]) -> dict[str, tuple[int, int, int]]:
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
    given = parse_layouts(args.layout)
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


def task_lengths(kind: str, digits: int) -> tuple[int, int]:
    """Prompt and response tokens of the built-in task without building it (it imports torch)."""
    from nereus.runtime.rl.task import DigitTask

    t = DigitTask(kind, digits, seed=0)
    return t.prompt_len, t.target_len


def joining(args) -> int:
    if not (args.adaptive and args.pool_schedule):
        return 0
    return sum(max(dn, 0) for _, _, dn in parse_schedule_items(args.pool_schedule))


def checkpoint_bytes(spec, w, precision: str = "fp32") -> int:
    """Bytes of one durable checkpoint of the job: every model-stage's parameters (4 B each in fp32,
    2 B in bf16) and, for a trainable one, Adam's two fp32 moments (8 B) and in bf16 the fp32 master
    (4 B) (``durable/worker_side.py`` saves exactly these kinds, without vocab padding)."""
    from nereus.runtime.model.sharding import param_shapes

    total = 0
    for ms in workflow_for(w).model_stages:
        s = spec if ms.model in ("actor", "reference") else spec.value_head()
        n = 0
        for shape, _ in param_shapes(s).values():
            k = 1
            for x in shape:
                k *= x
            n += k
        per = (2 if precision == "bf16" else 4) + ((8 + (4 if precision == "bf16" else 0)) if ms.trainable else 0)
        total += n * per
    return total


def check_checkpoint_dir(args, spec, w) -> None:
    """Before Ray starts, with ``--adaptive``: ``--checkpoint-dir`` can be written and has room for two
    checkpoints (the new one is complete before the old one goes); with ``--resume``, the checkpoint
    there passes every integrity check against this job (``durable/integrity.py``: manifest, model,
    algorithm, model-stages, shapes, step against the shards).

    Raises:
        ValueError: one line naming the directory and the reason.
    """
    from nereus.runtime.durable import store
    from nereus.runtime.durable.integrity import job_identity, verify_checkpoint

    if not args.adaptive or not args.checkpoint_dir:
        return
    if args.resume:
        verify_checkpoint(store.current_dir(args.checkpoint_dir), job_identity(spec, w))
    store.check_writable(args.checkpoint_dir, 2 * checkpoint_bytes(spec, w, args.precision or "fp32"))
