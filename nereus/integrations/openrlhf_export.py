"""OpenRLHF export: the closest layout OpenRLHF can run for a Nereus plan, as ``train_ppo_ray``
arguments (re-exported by :mod:`nereus.integrations.openrlhf`).

:func:`closest_openrlhf_layout` searches the faster of disjoint GPU groups per model and
``--train.colocate_all`` (every model and the vLLM engines on all GPUs), over one DeepSpeed TP, a
ZeRO stage with or without Adam offload, one training and one inference micro-batch, checkpointing
on or off and the vLLM engines' TP and memory fraction; :func:`openrlhf_args` writes the arguments
and :func:`export_openrlhf` puts them next to the plan with the changes against it.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import replace

from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_tp
from nereus.integrations.common import (
    best_colocated,
    generation_concurrency,
    memory_fraction_for,
    pareto,
    without_fraction,
)
from nereus.integrations.verl_export import _changes
from nereus.planner.whatif import evaluate_layout
from nereus.spec.framework import get_framework
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.workflow import workflow_for

__all__ = ["closest_openrlhf_layout", "openrlhf_args", "export_openrlhf", "openrlhf_job", "infer_zero"]


def _counts(tp: int, n: int, gpn: int) -> list[int]:
    out = set()
    k = tp
    while k <= n:
        if k <= gpn or k % gpn == 0:
            out.add(k)
        k *= 2
    out |= {m for m in range(gpn, n + 1, gpn) if m % tp == 0}
    return sorted(out)


def openrlhf_job(job: JobSpec) -> JobSpec:
    """``job`` with the framework OpenRLHF runs it with: the imported one when the job came from
    OpenRLHF, else the DeepSpeed defaults (no ``--ds.overlap_comm``, bf16 reduce, AutoTP allowed); vLLM's
    fraction left to the export (:func:`~nereus.integrations.common.memory_fraction_for`)."""
    job = without_fraction(job)
    if job.framework.name == "openrlhf-deepspeed":
        return job.with_framework(replace(job.framework, model_parallel_train=True))
    return job.with_framework(replace(get_framework("deepspeed"), name="openrlhf-deepspeed", overlap_grad_reduce=False,
                                      grad_reduce_bytes=2, model_parallel_train=True, drop_model_stages=(),
                                      shared_engine=True))


#: (ZeRO stage, training offload) pairs the export searches: --ds.zero_stage, --ds.adam_offload (ZeRO >= 1,
#: DeepSpeed's offload_optimizer: ``cpu_adam``)
_ZERO_OFFLOAD = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu_adam"), (2, "cpu_adam"),
                 (3, "cpu_adam"))


def infer_zero(z: int, dp: int) -> int:
    """ZeRO stage of an inference model-stage under ``--ds.zero_stage z``: OpenRLHF's evaluation
    engines (reference, reward) take stage 3 when training does and 0 otherwise
    (``get_eval_ds_config``), and log-probs and values run on the training engines, so the pass is
    sharded exactly when ``z == 3`` (and there is more than one replica to shard over)."""
    return 3 if z == 3 and dp > 1 else 0


def _train_pair(r, tp, dp, b, rc, z, off, mb, bi, gpus=()):
    cs = [Candidate(f"{r}.infer", tp, 1, dp, micro_batch=bi, zero=infer_zero(z, dp), gpus=gpus)]
    if r in ("actor", "critic"):
        cs.append(Candidate(f"{r}.train", tp, 1, dp, micro_batch=b, grad_accum=mb // (dp * b), recompute=rc,
                            zero=z, offload=off, gpus=gpus))
    return cs


def _disjoint(job: JobSpec, cost: CostModel, est) -> tuple | None:
    """Fastest layout with a GPU group per model (no colocation): GPU counts per group (powers of two
    times TP inside a node, whole nodes beyond), one DeepSpeed TP, ZeRO stage and Adam offload, one
    training and one inference micro-batch, checkpointing on or off, vLLM engines x TP."""
    w = job.workload
    N, gpn = job.cluster.num_gpus, job.cluster.gpus_per_node
    wf = {m.name for m in workflow_for(w).model_stages}
    roles = [r for r in ("actor", "critic", "reference", "reward") if f"{r}.infer" in wf]
    cap = cost.capacity - cost.workspace
    mb = w.mini_batch_size
    gens = []
    for gtp in (t for t in (1, 2, 4, 8) if t <= gpn and not valid_tp(job.actor, t)):
        for e in range(1, N // gtp + 1):
            per = -(-w.rollouts_per_step // e)
            c = min(per, generation_concurrency(job, gtp, cost.capacity / job.cluster.gpu.memory_bytes
                                                - cost.workspace / job.cluster.gpu.memory_bytes))
            if c < 1 or (e * gtp > gpn and (e * gtp) % gpn):
                continue
            cand = Candidate("actor.generate", gtp, 1, e, concurrency=c)
            ge = est(cand)
            if ge.resident + ge.transient <= cap:
                gens.append((ge.time, e * gtp, cand))
    best = None
    for tp in (t for t in (1, 2, 4, 8) if t <= gpn and not valid_tp(job.actor, t)):
        for b in (1, 2, 4, 8, 16):
            if b > w.micro_batch_size:
                break
            for rc in ("none", "full"):
                for z, off in _ZERO_OFFLOAD:
                    opts = {}
                    for r in roles:
                        lst = []
                        for n in _counts(tp, N, gpn):
                            dp = n // tp
                            if f"{r}.train" in wf and mb % (dp * b):
                                continue
                            cs = _train_pair(r, tp, dp, b, rc, z, off, mb, w.infer_micro_batch_size)
                            es = [est(x) for x in cs]
                            if sum(x.resident for x in es) + max(x.transient for x in es) > cap:
                                continue
                            lst.append((n, es[0].time, es[1].time if len(es) > 1 else 0.0, cs))
                        opts[r] = lst
                    if any(not v for v in opts.values()):
                        continue
                    for gen in gens:
                        for combo in itertools.product(*(opts[r] for r in roles)):
                            used = gen[1] + sum(x[0] for x in combo)
                            if used > N:
                                continue
                            ti, tt = max(x[1] for x in combo), max(x[2] for x in combo)
                            lst_ = max(gen[0], ti + tt) if w.asynchronous else gen[0] + ti + tt
                            if best is None or lst_ < best[0]:
                                best = (lst_, gen, combo)
    if best is None:
        return None
    _, gen, combo = best
    cands, nxt = [], 0
    for (n, _, _, cs) in combo:
        gp = tuple(range(nxt, nxt + n))
        cands += [c.with_gpus(gp) for c in cs]
        nxt += n
    g = gen[2]
    cands.append(g.with_gpus(range(nxt, nxt + g.num_gpus)))
    return best[0], cands


def _colocated(job: JobSpec, cost: CostModel, est) -> tuple | None:
    """Fastest ``--train.colocate_all`` layout (synchronous jobs): every model and the vLLM engines on
    all N GPUs, run one after another; per choice of the shared options (DeepSpeed TP, ZeRO stage, Adam
    offload, micro-batches, checkpointing), :func:`best_colocated` picks the reference's and reward's
    ``--*.offload``, and the engines' TP, concurrency and ``--vllm.enable_sleep``."""
    w = job.workload
    if w.asynchronous:
        return None
    N, gpn = job.cluster.num_gpus, job.cluster.gpus_per_node
    gpus = tuple(range(N))
    wf = {m.name for m in workflow_for(w).model_stages}
    mb, bi = w.mini_batch_size, w.infer_micro_batch_size

    def opt(cs):
        es = [est(x) for x in cs]
        return (sum(e.time for e in es), sum(e.resident for e in es), max(e.transient for e in es), tuple(cs))

    gen = []
    for gtp in (t for t in (1, 2, 4, 8) if t <= gpn and N % t == 0 and not valid_tp(job.actor, t)):
        per = -(-w.rollouts_per_step // (N // gtp))
        for c in sorted({min(per, 2 ** k) for k in range(0, 11)}):
            for o in ("none", "host"):
                gen.append(opt([Candidate("actor.generate", gtp, 1, N // gtp, concurrency=c, offload=o, gpus=gpus)]))
    gen = pareto(gen)
    best = None
    for tp in (t for t in (1, 2, 4, 8) if t <= gpn and N % t == 0 and not valid_tp(job.actor, t)):
        dp = N // tp
        frozen = [pareto([opt([Candidate(f"{r}.infer", tp, 1, dp, micro_batch=bi, offload=o, gpus=gpus)])
                          for o in ("none", "host")]) for r in ("reference", "reward") if f"{r}.infer" in wf]
        for b in (1, 2, 4, 8, 16):
            if b > w.micro_batch_size or mb % (dp * b):
                continue
            for rc in ("none", "full"):
                for z, off in _ZERO_OFFLOAD:
                    trained = [[opt(_train_pair(r, tp, dp, b, rc, z, off, mb, bi, gpus))]
                               for r in ("actor", "critic") if f"{r}.train" in wf]
                    got = best_colocated(trained + frozen + [gen], cost.usable)
                    if got is not None and (best is None or got[0] < best[0]):
                        best = (got[0], [c for g in got[1] for c in g])
    return best


def closest_openrlhf_layout(job: JobSpec, headroom: float | None = None) -> tuple[Candidate, ...]:
    """The fastest layout OpenRLHF can express (module docstring): one GPU group per model
    (:func:`_disjoint`) or every model on all GPUs with ``--train.colocate_all``
    (:func:`_colocated`), with a ZeRO stage and Adam offload for the training model-stages; ``job``
    should carry OpenRLHF's framework (:func:`openrlhf_job`).

    Raises:
        ValueError: nothing expressible fits the cluster.
    """
    cost = CostModel(job, headroom=headroom)
    multi = job.cluster.num_nodes > 1
    cache: dict = {}

    def est(c):
        k = c.key()
        if k not in cache:
            cache[k] = cost.estimate_candidate(c, multi)
        return cache[k]

    found = [x for x in (_disjoint(job, cost, est), _colocated(job, cost, est)) if x is not None]
    if not found:
        raise ValueError(f"no layout OpenRLHF can express fits {job.cluster.num_gpus} GPUs (separate GPU groups or "
                         "--train.colocate_all, any --ds.zero_stage, with or without offload)")
    cands = min(found, key=lambda x: x[0])[1]
    order = {m.name: i for i, m in enumerate(workflow_for(job.workload).model_stages)}
    return tuple(sorted(cands, key=lambda x: order[x.model_stage]))


def openrlhf_args(job: JobSpec, cands, model_path: str | None = None, placeholders: bool = True) -> list[str]:
    """OpenRLHF ``train_ppo_ray`` arguments (tokens) for an OpenRLHF-expressible layout; the framework
    flags (``--ds.overlap_comm``, ``--ds.grad_accum_dtype``) are ``job.framework``'s."""
    w, fw = job.workload, job.framework
    by = {c.model_stage: c for c in cands}
    gpn = job.cluster.gpus_per_node
    est = {"ppo": "gae", "grpo": "group_norm"}.get(w.algorithm)
    if est is None:
        raise ValueError(f"workload algorithm {w.algorithm!r}: OpenRLHF has no ReMax estimator (valid: ppo, grpo)")
    out = ["--algo.advantage.estimator", est]
    if model_path:
        out += ["--actor.model_name_or_path", model_path]
    for role, name in (("actor", "actor"), ("critic", "critic"), ("ref", "reference"), ("reward", "reward")):
        c = by.get(f"{name}.infer")
        if c is None:
            continue
        n = c.num_gpus
        out += [f"--{role}.num_nodes", str(max(1, n // gpn)), f"--{role}.num_gpus_per_node", str(min(n, gpn))]
    a, g = by["actor.train"], by["actor.generate"]
    colocated = set(g.gpus) & set(a.gpus)
    out += ["--vllm.num_engines", str(g.dp), "--vllm.tensor_parallel_size", str(g.tp),
            "--vllm.gpu_memory_utilization", str(memory_fraction_for(job, g.tp, g.concurrency)),
            "--ds.zero_stage", str(a.zero), "--ds.tensor_parallel_size", str(a.tp),
            "--train.micro_batch_size", str(a.micro_batch), "--train.batch_size", str(w.mini_batch_size),
            "--rollout.micro_batch_size", str(by["actor.infer"].micro_batch),
            "--rollout.batch_size", str(w.prompts_per_step), "--rollout.n_samples_per_prompt", str(w.samples_per_prompt),
            "--data.max_len", str(w.prompt_len + w.response_len), "--rollout.max_new_tokens", str(w.response_len),
            "--train.max_epochs", str(w.ppo_epochs)]
    if colocated:
        out.append("--train.colocate_all")
    if g.offload != "none":
        out.append("--vllm.enable_sleep")
    if a.offload == "cpu_adam":
        out.append("--ds.adam_offload")
    elif a.offload == "host":
        out.append("--ds.enable_sleep")
    for role, name in (("ref", "reference"), ("reward", "reward")):
        if name + ".infer" in by and by[name + ".infer"].offload == "host":
            out.append(f"--{role}.offload")
    if fw.overlap_grad_reduce:
        out.append("--ds.overlap_comm")
    if fw.grad_reduce_bytes == 4:
        out += ["--ds.grad_accum_dtype", "fp32"]
    if a.recompute != "none":
        out.append("--actor.gradient_checkpointing_enable")
    if not placeholders:  # the user's own model and reward settings are kept instead
        pass
    elif w.reward_model:
        out += ["--reward.model_name_or_path", model_path or "REWARD_MODEL_PATH"]
    else:
        out += ["--reward.remote_url", "REWARD_FN_OR_URL"]
    if w.asynchronous:
        out.append("--train.async_enable")
    if not w.reference_model:  # OpenRLHF builds a reference model only for a KL coefficient > 0
        out += ["--algo.kl.init_coef", "0"]
    return out


#: options whose presence is part of the layout Nereus writes: a user's copy is dropped even where the
#: export leaves them out (a flag turned off, a degree back to its default)
LAYOUT_OPTIONS = ("--train.colocate_all", "--train.colocate_actor_ref", "--train.colocate_critic_reward",
                  "--vllm.enable_sleep", "--ds.enable_sleep", "--ds.adam_offload", "--ref.offload", "--reward.offload",
                  "--ds.overlap_comm", "--ds.grad_accum_dtype", "--actor.gradient_checkpointing_enable",
                  "--ds.ring_attn_size", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu",
                  "--rollout.max_tokens_per_gpu")


def _groups(tokens) -> list[list[str]]:
    out: list[list[str]] = []
    for t in tokens:
        if t.startswith("--") or not out:
            out.append([t])
        else:
            out[-1].append(t)
    return out


def merge_args(user, mine) -> list[str]:
    """The user's options that Nereus does not set (model paths, reward, data, KL, logging...), then
    Nereus's; the user's copies of :data:`LAYOUT_OPTIONS` are dropped."""
    mine_groups = _groups(mine)
    keys = {g[0] for g in mine_groups} | set(LAYOUT_OPTIONS)
    kept = [g for g in _groups(user) if g[0] not in keys]
    return [t for g in kept + mine_groups for t in g]


def export_openrlhf(job: JobSpec, best: Plan, headroom: float | None = None, model_path: str | None = None,
                    user_args=None) -> dict:
    """Nereus's plan ``best`` as OpenRLHF arguments: the closest expressible layout, what changed and
    both predicted step times; ``framework_spec`` is the framework the prediction used. ``user_args``
    (the tokens of an imported command line): every option Nereus does not set is kept
    (:func:`merge_args`), the model and reward paths among them."""
    ojob = openrlhf_job(job)
    cands = closest_openrlhf_layout(ojob, headroom)
    ev = evaluate_layout(ojob, cands, headroom)
    if user_args is not None and "--actor.model_name_or_path" in user_args:
        model_path = None  # the user's own path is kept (--model gave the shapes only)
    args = openrlhf_args(ojob, cands, model_path, placeholders=user_args is None)
    if user_args is not None:
        args = merge_args(list(user_args), args)
    shared = "--train.colocate_all" in args
    return {"framework": "openrlhf", "args": args, "command": "python3 -m openrlhf.cli.train_ppo_ray " + shlex.join(args),
            "layout": list(cands), "evaluation": ev, "framework_spec": ojob.framework.to_dict(),
            "nereus_l_step": best.l_step, "l_step": ev.l_step, "changes": _changes(best, cands),
            "note": ("OpenRLHF runs every model and the vLLM engines on the same GPUs (--train.colocate_all), one "
                     "after another" if shared else "OpenRLHF gives each model its own GPU group (actor, critic, "
                     "reference, reward, vLLM engines)")
            + f", DeepSpeed ZeRO stage {_zero_of(cands)} and no pipeline",
            "slowdown": ev.l_step / best.l_step if best.l_step > 0 else float("nan")}


def _zero_of(cands) -> int:
    return next((c.zero for c in cands if c.model_stage == "actor.train"), 0)
