"""OpenRLHF: import a ``train_ppo_ray`` argument string as a Nereus job and layout, export a plan as
OpenRLHF arguments (OpenRLHF 0.11 names: ``--actor.num_nodes``, ``--vllm.num_engines``...).

The argument names are checked by OpenRLHF's own parser: :func:`openrlhf_parser` reads
``openrlhf/cli/train_ppo_ray.py`` from the installed package (``pip install --no-deps openrlhf``;
its GPU-only dependencies need not be installed) and runs the statements of its ``__main__`` block
that build the ``argparse`` parser, nothing else. Without the package, the keys Nereus reads are
parsed and every other ``--key`` is accepted unchecked (said in the notes).

Layout as OpenRLHF runs it without colocation flags: disjoint GPU groups, placed here in this
order on consecutive GPU ids: actor (``actor.infer`` and ``actor.train``), critic (``critic.infer``
and ``critic.train``), reference, reward, then the vLLM engines (``actor.generate``, one replica per
engine of ``--vllm.tensor_parallel_size`` GPUs). DeepSpeed models use ``--ds.tensor_parallel_size``
and no pipeline; DP = group GPUs / TP.

Not expressible yet (named, never approximated): ``--ds.zero_stage`` > 0 (ZeRO sharding; OpenRLHF's
default is 2), the colocation flags, offload flags, ``--ds.ring_attn_size`` > 1, dynamic batches and
generation without vLLM.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import itertools
import os
import shlex
from pathlib import Path

from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_tp
from nereus.integrations.common import (
    Imported,
    Unexpressible,
    evaluate_layout,
    generation_concurrency,
    memory_fraction_for,
)
from nereus.integrations.verl import _changes
from nereus.planner.plan import Candidate, Plan
from nereus.spec import ClusterSpec, JobSpec, WorkloadSpec, get_gpu, get_model
from nereus.workflow import workflow_for

__all__ = ["openrlhf_source", "openrlhf_parser", "argument_names", "import_openrlhf", "export_openrlhf",
           "ESTIMATORS"]

#: ``--algo.advantage.estimator`` values Nereus models.
ESTIMATORS = {"gae": "ppo", "group_norm": "grpo", "dr_grpo": "grpo"}
_ENTRY = "openrlhf.cli.train_ppo_ray"


def openrlhf_source() -> Path | None:
    """``openrlhf/cli/train_ppo_ray.py`` of the installed OpenRLHF distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None
    p = Path(dist.locate_file("openrlhf/cli/train_ppo_ray.py"))
    return p if p.is_file() else None


def openrlhf_parser(source: Path | None = None) -> argparse.ArgumentParser | None:
    """OpenRLHF's own ``train_ppo_ray`` parser, built by running the statements of the module's
    ``__main__`` block up to ``parser.parse_args()``; None without the package."""
    source = source or openrlhf_source()
    if source is None:
        return None
    tree = ast.parse(Path(source).read_text())
    main = next((n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)), None)
    if main is None:
        raise ValueError(f"{source}: no __main__ block building the argument parser")
    body = []
    for st in main.body:
        if "parse_args" in ast.unparse(st):
            break
        body.append(st)
    ns: dict = {"argparse": argparse, "datetime": datetime.datetime, "os": os}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), ns)  # noqa: S102 - OpenRLHF's own parser
    parser = ns["parser"]

    def error(msg):
        raise ValueError(f"OpenRLHF arguments: {msg}")

    parser.error = error
    return parser


def argument_names(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every ``--option`` of OpenRLHF's ``train_ppo_ray`` parser."""
    parser = parser or openrlhf_parser()
    if parser is None:
        raise ValueError("OpenRLHF is not installed (pip install --no-deps openrlhf)")
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


#: keys Nereus reads, with OpenRLHF 0.11.2's defaults (used when the package is absent)
_DEFAULTS = {
    "actor.num_nodes": 1, "actor.num_gpus_per_node": 8, "critic.num_nodes": 1, "critic.num_gpus_per_node": 8,
    "ref.num_nodes": 1, "ref.num_gpus_per_node": 8, "reward.num_nodes": 1, "reward.num_gpus_per_node": 8,
    "vllm.num_engines": None, "vllm.tensor_parallel_size": 1, "vllm.gpu_memory_utilization": 0.95,
    "train.colocate_all": False, "train.colocate_actor_ref": False, "train.colocate_critic_reward": False,
    "ds.zero_stage": 2, "ds.tensor_parallel_size": 1, "ds.ring_attn_size": 1, "ds.adam_offload": False,
    "ref.offload": False, "reward.offload": False, "train.dynamic_batch_enable": False, "train.async_enable": False,
    "rollout.batch_size": 1024, "rollout.n_samples_per_prompt": 1, "rollout.micro_batch_size": 1,
    "train.batch_size": 128, "train.micro_batch_size": 1, "train.max_epochs": 1, "data.max_len": 2048,
    "rollout.max_new_tokens": None, "algo.advantage.estimator": "gae", "actor.gradient_checkpointing_enable": False,
    "actor.model_name_or_path": None, "reward.model_name_or_path": None, "reward.remote_url": None,
    "critic.model_name_or_path": None, "train.agent_func_path": None,
}
_FLAGS = {k for k, v in _DEFAULTS.items() if v is False}


def _tokens(args) -> list[str]:
    toks = shlex.split(args) if isinstance(args, str) else list(args)
    toks = [t for t in toks if t != "\\"]
    if _ENTRY in toks:
        toks = toks[toks.index(_ENTRY) + 1:]
    return toks


def parse_args(args) -> tuple[dict, list[str]]:
    """``{dest: value}`` of an OpenRLHF argument string (or list) and notes.

    Raises:
        ValueError: an unknown option or a bad value (OpenRLHF's parser's message, naming it).
    """
    toks = _tokens(args)
    parser = openrlhf_parser()
    if parser is not None:
        return vars(parser.parse_args(toks)), []
    out = dict(_DEFAULTS)
    i = 0
    while i < len(toks):
        t = toks[i]
        if not t.startswith("--"):
            raise ValueError(f"OpenRLHF arguments: unexpected token {t!r} (options look like --actor.num_nodes 1)")
        key = t[2:]
        if key in _FLAGS:
            out[key] = True
            i += 1
            continue
        vals = []
        i += 1
        while i < len(toks) and not toks[i].startswith("--"):
            vals.append(toks[i])
            i += 1
        if key in _DEFAULTS:
            v = vals[0] if vals else None
            d = _DEFAULTS[key]
            try:
                out[key] = int(v) if key != "vllm.gpu_memory_utilization" and (isinstance(d, int) or
                                                                              key in ("vllm.num_engines", "rollout.max_new_tokens")) else (
                    float(v) if key == "vllm.gpu_memory_utilization" else v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"OpenRLHF argument --{key} {v!r}: must be a number") from e
    return out, ["OpenRLHF is not installed: option names other than the ones Nereus reads were not checked "
                 "(pip install --no-deps openrlhf to check them with its own parser)"]


def import_openrlhf(args, model=None, gpu=None) -> Imported:
    """Read an OpenRLHF ``train_ppo_ray`` argument string as a job and the user's layout.

    Raises:
        ValueError: unknown or contradictory options, named with the value and what is valid.
    """
    a, notes = parse_args(args)
    read: dict = {}

    def g(k):
        read[k] = a.get(k, _DEFAULTS.get(k))
        return read[k]

    un: list[Unexpressible] = []
    est = g("algo.advantage.estimator")
    if est not in ESTIMATORS:
        raise ValueError(f"OpenRLHF argument --algo.advantage.estimator {est!r}: Nereus models "
                         f"{', '.join(f'{k} ({v.upper()})' for k, v in ESTIMATORS.items())}")
    algo = ESTIMATORS[est]
    if model is None:
        path = g("actor.model_name_or_path")
        if not path or not (Path(str(path)).expanduser() / "config.json").is_file():
            raise ValueError(f"OpenRLHF argument --actor.model_name_or_path {path!r}: no config.json there; pass "
                             "--model (a preset or a config.json path)")
        model = str(Path(str(path)).expanduser())
    actor = get_model(model) if isinstance(model, str) else model
    resp = g("rollout.max_new_tokens")
    if resp is None:
        raise ValueError("OpenRLHF argument --rollout.max_new_tokens is not set: Nereus needs the response length "
                         "(the prompt length is --data.max_len minus it)")
    max_len = g("data.max_len")
    if max_len <= resp:
        raise ValueError(f"OpenRLHF arguments --data.max_len {max_len} must exceed --rollout.max_new_tokens {resp} "
                         "(prompt + response)")
    reward = bool(g("reward.model_name_or_path")) and not g("reward.remote_url") and not g("train.agent_func_path")
    wl = WorkloadSpec(algorithm=algo, prompts_per_step=g("rollout.batch_size"),
                      samples_per_prompt=g("rollout.n_samples_per_prompt"), prompt_len=max_len - resp,
                      response_len=resp, mini_batch_size=g("train.batch_size"), ppo_epochs=g("train.max_epochs"),
                      reward_model=reward, asynchronous=bool(g("train.async_enable")))
    notes.append("--data.max_len minus --rollout.max_new_tokens is used as the prompt length and "
                 "--rollout.max_new_tokens as the response length (maxima; --prompt-len/--response-len override)")
    for k, why in (("ds.adam_offload", "offload to host memory"), ("ref.offload", "offload to host memory"),
                   ("reward.offload", "offload to host memory")):
        if g(k):
            un.append(Unexpressible(f"--{k}", True, f"{why} is not in Nereus's plan space yet"))
    z = g("ds.zero_stage")
    if z and z > 0:
        un.append(Unexpressible("--ds.zero_stage", z, f"ZeRO stage {z} shards "
                                + {1: "optimizer state", 2: "optimizer state and gradients",
                                   3: "weights, gradients and optimizer state"}.get(z, "state")
                                + " across data-parallel ranks; Nereus's plan space has no ZeRO yet (--ds.zero_stage 0 is)"))
    if (g("ds.ring_attn_size") or 1) > 1:
        un.append(Unexpressible("--ds.ring_attn_size", a["ds.ring_attn_size"], "ring attention (context "
                                "parallelism) is not in Nereus's plan space yet"))
    if g("train.dynamic_batch_enable"):
        un.append(Unexpressible("--train.dynamic_batch_enable", True, "token-budget micro-batches are not in "
                                "Nereus's plan space; it plans fixed micro-batches (--train.micro_batch_size)"))
    engines = g("vllm.num_engines")
    if not engines:
        un.append(Unexpressible("--vllm.num_engines", engines, "generation by the DeepSpeed actor (no vLLM engines) "
                                "is not in Nereus's plan space"))
        engines = 1
    tp = g("ds.tensor_parallel_size")
    gtp = g("vllm.tensor_parallel_size")
    for k, v in (("ds.tensor_parallel_size", tp), ("vllm.tensor_parallel_size", gtp)):
        why = valid_tp(actor, v)
        if why:
            raise ValueError(f"OpenRLHF argument --{k} {v}: {why}")

    def size(role):
        return g(f"{role}.num_nodes") * g(f"{role}.num_gpus_per_node")

    roles = ["actor"] + (["critic"] if algo == "ppo" else []) + ["ref"] + (["reward"] if reward else [])
    gpn = max(g(f"{r}.num_gpus_per_node") for r in roles)
    colocate_all, col_ar, col_cr = g("train.colocate_all"), g("train.colocate_actor_ref"), g("train.colocate_critic_reward")
    for k, v, what in (("train.colocate_all", colocate_all, "every model and the vLLM engines"),
                       ("train.colocate_actor_ref", col_ar, "actor and reference"),
                       ("train.colocate_critic_reward", col_cr, "critic and reward model")):
        if v:
            un.append(Unexpressible(f"--{k}", True, f"{what} share GPUs (colocation is not in Nereus's plan space "
                                    "yet; model-stages of one stage get disjoint GPUs)"))
    start = {}
    nxt = 0
    for r in roles:
        if start and (colocate_all or (r == "ref" and col_ar) or (r == "reward" and col_cr and "critic" in start)):
            start[r] = start["actor"] if (colocate_all or r == "ref") else start["critic"]
            continue
        start[r] = nxt
        nxt += size(r)
    gen_start = 0 if colocate_all else nxt
    total = max(nxt, gen_start + engines * gtp)
    nodes = -(-total // gpn)
    gpu = gpu or "h100"
    if gpu == "h100":
        notes.append("OpenRLHF's arguments do not name the GPU: h100 assumed (--gpu)")
    job = JobSpec(actor=actor, cluster=ClusterSpec(get_gpu(gpu) if isinstance(gpu, str) else gpu, nodes, gpn), workload=wl)
    b, bi = g("train.micro_batch_size"), g("rollout.micro_batch_size")
    rc = "full" if g("actor.gradient_checkpointing_enable") else "none"
    mb = wl.mini_batch_size
    cands = []
    for r in roles:
        n = size(r)
        gpus = tuple(range(start[r], start[r] + n))
        if n % tp:
            raise ValueError(f"OpenRLHF arguments --{r}.num_nodes x --{r}.num_gpus_per_node = {n} GPUs must be a "
                             f"multiple of --ds.tensor_parallel_size {tp}")
        dp = n // tp
        name = {"ref": "reference", "reward": "reward"}.get(r, r)
        cands.append(Candidate(f"{name}.infer", tp, 1, dp, micro_batch=bi, gpus=gpus))
        if r in ("actor", "critic"):
            if mb % (dp * b):
                raise ValueError(f"OpenRLHF arguments --train.batch_size {mb} must be a multiple of DP {dp} "
                                 f"({r} GPUs / --ds.tensor_parallel_size) x --train.micro_batch_size {b}")
            cands.append(Candidate(f"{name}.train", tp, 1, dp, micro_batch=b, grad_accum=mb // (dp * b),
                                   recompute=rc, gpus=gpus))
    conc = generation_concurrency(job, gtp, float(g("vllm.gpu_memory_utilization")))
    if conc < 1:
        raise ValueError(f"OpenRLHF argument --vllm.gpu_memory_utilization {a['vllm.gpu_memory_utilization']}: "
                         f"too small to hold the weights at --vllm.tensor_parallel_size {gtp}")
    per = -(-wl.rollouts_per_step // engines)
    cands.append(Candidate("actor.generate", gtp, 1, engines, concurrency=min(conc, per),
                           gpus=tuple(range(gen_start, gen_start + engines * gtp))))
    if rc == "full" and algo == "ppo":
        notes.append("--actor.gradient_checkpointing_enable is applied to the critic too")
    order = {m.name: i for i, m in enumerate(workflow_for(wl).model_stages)}
    cands.sort(key=lambda x: order[x.model_stage])
    return Imported("openrlhf", job, tuple(cands), un, read, notes)


# ---------------------------------------------------------------------------------------- export
def _counts(tp: int, n: int, gpn: int) -> list[int]:
    out = set()
    k = tp
    while k <= n:
        if k <= gpn or k % gpn == 0:
            out.add(k)
        k *= 2
    out |= {m for m in range(gpn, n + 1, gpn) if m % tp == 0}
    return sorted(out)


def closest_openrlhf_layout(job: JobSpec, headroom: float | None = None) -> tuple[Candidate, ...]:
    """The fastest layout OpenRLHF can express without colocation and ZeRO (module docstring):
    GPU counts per group (powers of two times TP inside a node, whole nodes beyond), one DeepSpeed
    TP, one training and one inference micro-batch, activation checkpointing on or off, vLLM
    engines x TP with the largest concurrency that fits.

    Raises:
        ValueError: nothing expressible fits the cluster.
    """
    cost = CostModel(job, headroom=headroom)
    w = job.workload
    N, gpn = job.cluster.num_gpus, job.cluster.gpus_per_node
    multi = job.cluster.num_nodes > 1
    wf = {m.name for m in workflow_for(w).model_stages}
    roles = [r for r in ("actor", "critic", "reference", "reward") if f"{r}.infer" in wf]
    cap = cost.capacity - cost.workspace
    mb = w.mini_batch_size
    est_cache: dict = {}

    def est(c):
        k = c.key()
        if k not in est_cache:
            est_cache[k] = cost.estimate_candidate(c, multi)
        return est_cache[k]

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
                opts = {}
                for r in roles:
                    lst = []
                    for n in _counts(tp, N, gpn):
                        dp = n // tp
                        cs = [Candidate(f"{r}.infer", tp, 1, dp, micro_batch=w.infer_micro_batch_size)]
                        if f"{r}.train" in wf:
                            if mb % (dp * b):
                                continue
                            cs.append(Candidate(f"{r}.train", tp, 1, dp, micro_batch=b, grad_accum=mb // (dp * b),
                                                recompute=rc))
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
        raise ValueError(f"no layout OpenRLHF can express without colocation and ZeRO fits {N} GPUs")
    _, gen, combo = best
    cands, nxt = [], 0
    for (n, _, _, cs) in combo:
        gp = tuple(range(nxt, nxt + n))
        cands += [c.with_gpus(gp) for c in cs]
        nxt += n
    g = gen[2]
    cands.append(g.with_gpus(range(nxt, nxt + g.num_gpus)))
    order = {m.name: i for i, m in enumerate(workflow_for(w).model_stages)}
    return tuple(sorted(cands, key=lambda x: order[x.model_stage]))


def openrlhf_args(job: JobSpec, cands, model_path: str | None = None) -> list[str]:
    """OpenRLHF ``train_ppo_ray`` arguments (tokens) for an OpenRLHF-expressible layout."""
    w = job.workload
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
    out += ["--vllm.num_engines", str(g.dp), "--vllm.tensor_parallel_size", str(g.tp),
            "--vllm.gpu_memory_utilization", str(memory_fraction_for(job, g.tp, g.concurrency)),
            "--ds.zero_stage", "0", "--ds.tensor_parallel_size", str(a.tp),
            "--train.micro_batch_size", str(a.micro_batch), "--train.batch_size", str(w.mini_batch_size),
            "--rollout.micro_batch_size", str(by["actor.infer"].micro_batch),
            "--rollout.batch_size", str(w.prompts_per_step), "--rollout.n_samples_per_prompt", str(w.samples_per_prompt),
            "--data.max_len", str(w.prompt_len + w.response_len), "--rollout.max_new_tokens", str(w.response_len),
            "--train.max_epochs", str(w.ppo_epochs)]
    if a.recompute != "none":
        out.append("--actor.gradient_checkpointing_enable")
    if w.reward_model:
        out += ["--reward.model_name_or_path", model_path or "REWARD_MODEL_PATH"]
    else:
        out += ["--reward.remote_url", "REWARD_FN_OR_URL"]
    if w.asynchronous:
        out.append("--train.async_enable")
    return out


def export_openrlhf(job: JobSpec, best: Plan, headroom: float | None = None, model_path: str | None = None) -> dict:
    """Nereus's plan ``best`` as OpenRLHF arguments: the closest expressible layout, what changed and
    both predicted step times."""
    cands = closest_openrlhf_layout(job, headroom)
    ev = evaluate_layout(job, cands, headroom)
    args = openrlhf_args(job, cands, model_path)
    return {"framework": "openrlhf", "args": args, "command": "python3 -m openrlhf.cli.train_ppo_ray " + shlex.join(args),
            "layout": list(cands), "evaluation": ev, "nereus_l_step": best.l_step, "l_step": ev.l_step,
            "changes": _changes(best, cands),
            "note": ("OpenRLHF gives each model its own GPU group (actor, critic, reference, reward, vLLM engines) "
                     "with DeepSpeed (ZeRO stage 0 here, so Nereus's memory model applies) and no pipeline"),
            "slowdown": ev.l_step / best.l_step if best.l_step > 0 else float("nan")}
