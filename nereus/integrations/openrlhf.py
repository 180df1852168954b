"""OpenRLHF: import a ``train_ppo_ray`` argument string as a Nereus job and layout, export a plan as
OpenRLHF arguments (OpenRLHF 0.11 names: ``--actor.num_nodes``, ``--vllm.num_engines``...).

The argument names are checked by OpenRLHF's own parser: :func:`openrlhf_parser` reads
``openrlhf/cli/train_ppo_ray.py`` from the installed package (``pip install --no-deps openrlhf``;
its GPU-only dependencies need not be installed) and runs the statements of its ``__main__`` block
that build the ``argparse`` parser, nothing else. Without the package, the keys Nereus reads are
parsed and every other ``--key`` is accepted unchecked (said in the notes).

Layout as OpenRLHF runs it: GPU groups placed in this order on consecutive GPU ids: actor
(``actor.infer`` and ``actor.train``), critic (``critic.infer`` and ``critic.train``), reference, reward,
then the vLLM engines (``actor.generate``, one replica per engine of ``--vllm.tensor_parallel_size``
GPUs); ``--train.colocate_all`` puts every group (and the engines, unless asynchronous) on the
actor's GPUs, ``--train.colocate_actor_ref`` the reference on the actor's, and
``--train.colocate_critic_reward`` the reward model on the critic's: model-stages of one stage on
shared GPUs run one after another. DeepSpeed models use ``--ds.tensor_parallel_size`` and no
pipeline; DP = group GPUs / TP. ``--ds.zero_stage`` is the training model-stages' ``zero``, and
with stage 3 the inference model-stages' too (OpenRLHF's evaluation engines use stage 3 or 0);
``--ds.adam_offload`` their ``offload='cpu_adam'`` (ZeRO-Offload: optimizer state and step on the
CPU), ``--ds.enable_sleep`` their ``offload='host'``; ``--ref.offload``,
``--reward.offload`` and ``--vllm.enable_sleep`` (level 1, with colocate_all) ``host`` for theirs. The
job's framework is :func:`openrlhf_framework`.

Also expressed: ``--ds.ring_attn_size`` (ring attention: candidates' ``cp``, DP = GPUs / (TP x
ring)), ``--ds.lora.rank`` (the workload's ``lora_rank``), ``--train.dynamic_batch_enable`` (token
budgets ``--train.max_tokens_per_gpu`` / ``--rollout.max_tokens_per_gpu`` as fixed micro-batches) and
vLLM's pre-allocated ``--vllm.gpu_memory_utilization`` (the workload's ``rollout_memory_fraction``).
Still refused (named, never approximated): ``--ds.zpg`` > 1 and, in ``train_ppo_ray``, generation without
vLLM (OpenRLHF 0.11 has none). ``openrlhf.cli.train_ppo`` lines (DeepSpeed without Ray, generation by the
training engine) are read by :mod:`nereus.integrations.openrlhf_deepspeed`.

Export (:func:`export_openrlhf`, in :mod:`nereus.integrations.openrlhf_export`, re-exported here):
the faster of disjoint groups and ``--train.colocate_all``, with a ZeRO stage and Adam offload
(:func:`closest_openrlhf_layout`).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import os
import shlex
from dataclasses import replace
from pathlib import Path

from nereus.cost.shapes import valid_tp
from nereus.integrations.common import Imported, Unexpressible
from nereus.integrations.framework_versions import version_rule
from nereus.integrations.openrlhf_deepspeed import (
    deepspeed_launch,
    reference_always,
    topology_tokens,
    train_ppo_options,
)
from nereus.integrations.openrlhf_export import infer_zero
from nereus.integrations.openrlhf_keys import classify_args
from nereus.integrations.openrlhf_legacy import is_legacy, translate_legacy
from nereus.integrations.verl_features import budget_micro_batch
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

__all__ = ["openrlhf_source", "openrlhf_parser", "argument_names", "import_openrlhf", "ESTIMATORS"]

#: ``--algo.advantage.estimator`` values Nereus models.
ESTIMATORS = {"gae": "ppo", "group_norm": "grpo", "dr_grpo": "grpo"}
_ENTRY = "openrlhf.cli.train_ppo_ray"
#: vLLM's default ``max_num_seqs`` (``EngineArgs``), which OpenRLHF does not set
VLLM_MAX_NUM_SEQS = 256


def openrlhf_lora_rank(g, un: list) -> int | None:
    """``--ds.lora.rank`` (0: full fine-tuning -> None); target modules other than all-linear are named."""
    r = g("ds.lora.rank") or 0
    if not r:
        return None
    tm = g("ds.lora.target_modules")
    if tm not in ("all-linear", ["all-linear"], None):
        un.append(Unexpressible("--ds.lora.target_modules", tm, "the cost model puts adapters on every linear layer "
                                "(all-linear); other target modules change the adapters' size"))
    return int(r)


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
    "ds.zpg": 1, "ds.enable_sleep": False, "vllm.enable_sleep": False, "ds.overlap_comm": False,
    "ds.grad_accum_dtype": None, "algo.kl.init_coef": 0.01,
    "ref.offload": False, "reward.offload": False, "train.dynamic_batch_enable": False, "train.async_enable": False,
    "rollout.batch_size": 1024, "rollout.n_samples_per_prompt": 1, "rollout.micro_batch_size": 1,
    "train.batch_size": 128, "train.micro_batch_size": 1, "train.max_epochs": 1, "data.max_len": 2048,
    "rollout.max_new_tokens": None, "algo.advantage.estimator": "gae", "actor.gradient_checkpointing_enable": False,
    "actor.model_name_or_path": None, "reward.model_name_or_path": None, "reward.remote_url": None,
    "critic.model_name_or_path": None, "train.agent_func_path": None, "ds.lora.rank": 0,
    "ds.lora.target_modules": "all-linear", "train.max_tokens_per_gpu": 16192, "rollout.max_tokens_per_gpu": None,
}
_FLAGS = {k for k, v in _DEFAULTS.items() if v is False}


def _tokens(args) -> list[str]:
    """Option tokens of an argument string or list: a whole launch line (``ray job submit ... --
    python3 -m openrlhf.cli.train_ppo_ray ...``, line continuations included) is cut after the entry
    point; a ``train_ppo`` launch gives its own options (:func:`~nereus.integrations.openrlhf_deepspeed.deepspeed_launch`).

    Raises:
        ValueError: nothing given (an empty string would otherwise plan OpenRLHF's defaults silently).
    """
    return _legacy(args)[0]


def _legacy(args, version: str | None = None) -> tuple[list[str], list[str], list[Unexpressible]]:
    """:func:`_tokens` with the notes and refusals of a flat-name (pre-0.11) line translated by
    :func:`nereus.integrations.openrlhf_legacy.translate_legacy`."""
    launch = deepspeed_launch(args)  # openrlhf.cli.train_ppo (DeepSpeed without Ray): its own options
    if launch is not None:
        toks, notes, refused = train_ppo_options(launch, version, translate_legacy)
        return toks, notes, [Unexpressible(k, v, why) for k, v, why in refused]
    toks = shlex.split(args.replace("\\\n", " ")) if isinstance(args, str) else list(args)
    toks = [t for t in toks if t != "\\"]
    if _ENTRY in toks:
        toks = toks[toks.index(_ENTRY) + 1:]
    notes: list[str] = []
    un: list[Unexpressible] = []
    if is_legacy(toks):
        toks, notes, refused = translate_legacy(toks, version)
        un = [Unexpressible(k, v, why) for k, v, why in refused]
    if not toks:
        raise ValueError(f"OpenRLHF arguments {args!r}: empty; give train_ppo_ray's options (e.g. "
                         "'--actor.model_name_or_path ... --rollout.max_new_tokens 1024 --vllm.num_engines 4')")
    return toks, notes, un


def parse_args(args, version: str | None = None) -> tuple[dict, list[str]]:
    """``{dest: value}`` of an OpenRLHF argument string (or list) and notes; ``version``: the OpenRLHF
    release a flat-name line ran (its defaults, :func:`~nereus.integrations.openrlhf_legacy.translate_legacy`).

    Raises:
        ValueError: an unknown option or a bad value (OpenRLHF's parser's message, naming it).
    """
    toks, lnotes, _ = _legacy(args, version)
    parser = openrlhf_parser()
    if parser is not None:
        return vars(parser.parse_args(toks)), lnotes
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
                if isinstance(d, float):
                    out[key] = float(v)
                elif isinstance(d, int) or key in ("vllm.num_engines", "rollout.max_new_tokens"):
                    out[key] = int(v)
                else:
                    out[key] = v
            except (TypeError, ValueError) as e:
                raise ValueError(f"OpenRLHF argument --{key} {v!r}: must be a number") from e
    return out, lnotes + ["OpenRLHF is not installed: option names other than the ones Nereus reads were not checked "
                 "(pip install --no-deps openrlhf to check them with its own parser)"]


def openrlhf_framework(a_get, tp: int) -> FrameworkSpec:
    """The job's framework for OpenRLHF's DeepSpeed backend: the ``deepspeed`` preset with
    ``--ds.overlap_comm`` and the reduce dtype (``--ds.grad_accum_dtype fp32``: 4 bytes, else bf16), TP
    for training only when ``--ds.tensor_parallel_size`` > 1 (DeepSpeed AutoTP; no pipeline)."""
    red = str(a_get("ds.grad_accum_dtype") or "bf16").lower()
    return replace(get_framework("deepspeed"), name="openrlhf-deepspeed", overlap_grad_reduce=bool(a_get("ds.overlap_comm")),
                   grad_reduce_bytes=4 if red in ("fp32", "float32") else 2, model_parallel_train=tp > 1,
                   drop_model_stages=(),  # OpenRLHF's sleep (level 1) and offloads copy state out and back
                   shared_engine=True)  # log-probs and values on the actor's and critic's DeepSpeed engines


def import_openrlhf(args, model=None, gpu=None, version: str | None = None, gpus_per_node: int | None = None,
                    nodes: int | None = None) -> Imported:
    """Read an OpenRLHF ``train_ppo_ray`` argument string as a job and the user's layout; a
    ``train_ppo`` (DeepSpeed without Ray) launch as :mod:`nereus.integrations.openrlhf_deepspeed` says,
    on ``gpus_per_node`` x ``nodes`` GPUs where its launcher does not give them.

    The job's framework is :func:`openrlhf_framework`; the layout puts each model on its GPU group
    (colocated groups share GPU ids: ``--train.colocate_all``, ``--train.colocate_actor_ref``,
    ``--train.colocate_critic_reward``), with the ZeRO stage of the training model-stages and the
    offload flags as idle-state offload (docs/integrations.md). ``version`` is the OpenRLHF version
    the job runs (None: the installed one); it selects the vLLM start-up memory rule
    (:func:`nereus.integrations.framework_versions.version_rule`).

    Raises:
        ValueError: unknown or contradictory options, named with the value and what is valid.
    """
    toks, notes, refused = _legacy(args, version)
    launch = deepspeed_launch(args)
    hf = launch is not None  # generation by the training engine (Hugging Face generate), no vLLM
    if hf:
        topo, tnotes = topology_tokens(launch, gpus_per_node, nodes)
        toks, notes = toks + topo, notes + tnotes
    a, pnotes = parse_args(toks, version)
    notes += pnotes
    gpu_spec = get_gpu(gpu or "h100") if isinstance(gpu or "h100", str) else gpu  # an unknown GPU is named first
    read: dict = {}

    def g(k):
        read[k] = a.get(k, _DEFAULTS.get(k))
        return read[k]

    un: list[Unexpressible] = list(refused)
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
    rm, url, agent = g("reward.model_name_or_path"), g("reward.remote_url"), g("train.agent_func_path")
    reward = bool(rm) and not url and not agent
    asynchronous = bool(g("train.async_enable"))
    # train_ppo_ray.py builds ref_model only for --algo.kl.init_coef > 0
    uses_ref = (g("algo.kl.init_coef") or 0) > 0 or (hf and reference_always(version))
    wl = WorkloadSpec(algorithm=algo, prompts_per_step=g("rollout.batch_size"),
                      samples_per_prompt=g("rollout.n_samples_per_prompt"), prompt_len=max_len - resp,
                      response_len=resp, mini_batch_size=g("train.batch_size"), ppo_epochs=g("train.max_epochs"),
                      reward_model=reward, reference_model=uses_ref, asynchronous=asynchronous,
                      lora_rank=openrlhf_lora_rank(g, un),
                      rollout_memory_fraction=None if hf else float(g("vllm.gpu_memory_utilization")),
                      vllm_memory_rule=None if hf else version_rule("openrlhf", version, notes))
    notes.append("--data.max_len minus --rollout.max_new_tokens is used as the prompt length and "
                 "--rollout.max_new_tokens as the response length (maxima; --prompt-len/--response-len override)")
    if not uses_ref:
        notes.append("--algo.kl.init_coef 0: OpenRLHF creates no reference model, so the job has no reference.infer "
                     "(--ref.* settings are read and unused)")
    z = g("ds.zero_stage")
    if z not in (0, 1, 2, 3):
        raise ValueError(f"OpenRLHF argument --ds.zero_stage {z}: valid 0, 1, 2, 3")
    if (g("ds.zpg") or 1) > 1:
        un.append(Unexpressible("--ds.zpg", a["ds.zpg"], "ZeRO++ hierarchical partitioning (a secondary weight "
                                "shard per group) is not in the cost model"))
    adam, ds_sleep = bool(g("ds.adam_offload")), bool(g("ds.enable_sleep"))
    train_off = "host" if ds_sleep else "cpu_adam" if adam else "none"
    if adam and not ds_sleep:
        notes.append("--ds.adam_offload: offload 'cpu_adam' of the training model-stages (ZeRO-Offload: optimizer "
                     "state in host memory, gradients down and weights up over PCIe, the Adam step on the CPU)")
    if adam and ds_sleep:
        notes.append("--ds.adam_offload with --ds.enable_sleep: modelled as offload 'host' (weights and optimizer "
                     "state out and back each step); the CPU Adam step itself is not timed")
    if ds_sleep:
        notes.append("--ds.enable_sleep: the DeepSpeed states are offloaded between training phases, offload "
                     "'host' of the training model-stages (the bf16 weights stay on the GPU in OpenRLHF; the cost "
                     "model moves them too)")
    if z == 3:
        notes.append("--ds.zero_stage 3 also shards the weights of OpenRLHF's inference passes (log-probs and values "
                     "on the training engines, the reference and reward engines): zero 3 for the inference "
                     "model-stages with DP > 1 (actor.infer and critic.infer use the training engines' shards)")
    ring = g("ds.ring_attn_size") or 1
    dynamic = bool(g("train.dynamic_batch_enable"))
    engines = None if hf else g("vllm.num_engines")
    if not engines and not hf:
        un.append(Unexpressible("--vllm.num_engines", engines, "OpenRLHF 0.11 generates only with vLLM engines "
                                "(its samples generator has no training-engine path): set --vllm.num_engines"))
        engines = 1
    tp = g("ds.tensor_parallel_size")
    gtp = 1 if hf else g("vllm.tensor_parallel_size")
    for k, v in (("ds.tensor_parallel_size", tp), ("vllm.tensor_parallel_size", gtp)):
        why = valid_tp(actor, v)
        if why:
            raise ValueError(f"OpenRLHF argument --{k} {v}: {why}")

    def size(role):
        return g(f"{role}.num_nodes") * g(f"{role}.num_gpus_per_node")

    roles = ["actor"] + (["critic"] if algo == "ppo" else []) + (["ref"] if uses_ref else []) + \
        (["reward"] if reward else [])
    gpn = max(g(f"{r}.num_gpus_per_node") for r in roles)
    colocate_all, col_ar, col_cr = g("train.colocate_all"), g("train.colocate_actor_ref"), g("train.colocate_critic_reward")
    # OpenRLHF's own checks (train_ppo_ray.py): colocated groups have the same GPU count
    for r in roles[1:]:
        if (colocate_all or (r == "ref" and col_ar)) and size(r) != size("actor"):
            flag = "--train.colocate_all" if colocate_all else "--train.colocate_actor_ref"
            raise ValueError(f"OpenRLHF arguments {flag}: --{r}.num_nodes x --{r}.num_gpus_per_node = {size(r)} GPUs "
                             f"must equal the actor's {size('actor')} (the colocated groups share its GPUs)")
    if col_cr and not colocate_all and "critic" in roles and "reward" in roles and size("reward") != size("critic"):
        raise ValueError(f"OpenRLHF arguments --train.colocate_critic_reward: --reward.num_nodes x "
                         f"--reward.num_gpus_per_node = {size('reward')} GPUs must equal the critic's {size('critic')}")
    gen_shared = colocate_all and not asynchronous
    engines = size("actor") if hf else engines  # one Hugging Face generate per DeepSpeed rank
    if gen_shared and engines * gtp != size("actor"):
        raise ValueError(f"OpenRLHF arguments --train.colocate_all: --vllm.num_engines {engines} x "
                         f"--vllm.tensor_parallel_size {gtp} must equal the actor's {size('actor')} GPUs")
    vllm_sleep = not hf and bool(g("vllm.enable_sleep")) and gen_shared  # OpenRLHF turns it off otherwise
    if not hf and g("vllm.enable_sleep") and not gen_shared:
        notes.append("--vllm.enable_sleep: OpenRLHF turns it off without --train.colocate_all (and it refuses it "
                     "with --train.async_enable)")
    if vllm_sleep:
        notes.append("--vllm.enable_sleep: vLLM sleeps at level 1 between rollouts (weights to host memory and back, "
                     "KV cache freed): offload 'host' of actor.generate")
    start: dict = {}
    nxt = 0
    for r in roles:
        if start and (colocate_all or (r == "ref" and col_ar) or (r == "reward" and col_cr and "critic" in start)):
            start[r] = start["actor"] if (colocate_all or r == "ref") else start["critic"]
            continue
        start[r] = nxt
        nxt += size(r)
    gen_start = 0 if gen_shared else nxt
    total = max(nxt, gen_start + engines * gtp)
    nodes = -(-total // gpn)
    if gpu is None:
        notes.append("OpenRLHF's arguments do not name the GPU: h100 assumed (--gpu)")
    fw = openrlhf_framework(g, tp)
    fw = replace(fw, train_engine_generation=True) if hf else fw
    job = JobSpec(actor=actor, cluster=ClusterSpec(gpu_spec, nodes, gpn), workload=wl, framework=fw)
    b, bi = g("train.micro_batch_size"), g("rollout.micro_batch_size")
    rc = "full" if g("actor.gradient_checkpointing_enable") else "none"
    mb = wl.mini_batch_size
    off = {"ref": "host" if g("ref.offload") else "none", "reward": "host" if g("reward.offload") else "none"}
    cands = []
    for r in roles:
        n = size(r)
        gpus = tuple(range(start[r], start[r] + n))
        if n % (tp * ring):
            raise ValueError(f"OpenRLHF arguments --{r}.num_nodes x --{r}.num_gpus_per_node = {n} GPUs must be a "
                             f"multiple of --ds.tensor_parallel_size {tp} x --ds.ring_attn_size {ring}")
        dp = n // (tp * ring)  # OpenRLHF: DP = world / (ring_attn_size x tensor_parallel_size)
        name = {"ref": "reference", "reward": "reward"}.get(r, r)
        if mb % dp:
            raise ValueError(f"OpenRLHF arguments --train.batch_size {mb} must be a multiple of DP {dp}")
        ib = budget_micro_batch(g("rollout.max_tokens_per_gpu") or g("train.max_tokens_per_gpu"),
                                "--rollout.max_tokens_per_gpu", -(-wl.global_batch // dp), wl.memory_seq_len,
                                ring) if dynamic else bi
        cands.append(Candidate(f"{name}.infer", tp, 1, dp, micro_batch=ib, offload=off.get(r, "none"),
                               zero=infer_zero(z, dp * ring), gpus=gpus, cp=ring))
        if r in ("actor", "critic"):
            tb = budget_micro_batch(g("train.max_tokens_per_gpu"), "--train.max_tokens_per_gpu", mb // dp,
                                    wl.memory_seq_len, ring) if dynamic else b
            if mb % (dp * tb):
                raise ValueError(f"OpenRLHF arguments --train.batch_size {mb} must be a multiple of DP {dp} "
                                 f"({r} GPUs / --ds.tensor_parallel_size) x --train.micro_batch_size {tb}")
            cands.append(Candidate(f"{name}.train", tp, 1, dp, micro_batch=tb, grad_accum=mb // (dp * tb),
                                   recompute=rc, zero=z if dp * ring > 1 else 0, offload=train_off, gpus=gpus,
                                   cp=ring))
    # vLLM pre-allocates --vllm.gpu_memory_utilization (the workload's rollout_memory_fraction) and the cost
    # model caps the concurrency by its KV blocks; OpenRLHF leaves max_num_seqs at vLLM's default
    conc = bi if hf else VLLM_MAX_NUM_SEQS  # Hugging Face generate: one micro-rollout batch at a time
    if dynamic:
        notes.append("--train.dynamic_batch_enable: token-budget micro-batches stand as the largest fixed micro-batch "
                     "whose full-length sequences fit --train.max_tokens_per_gpu (--rollout.max_tokens_per_gpu)")
    per = -(-wl.rollouts_per_step // engines)
    cands.append(Candidate("actor.generate", gtp, 1, engines, concurrency=min(conc, per),
                           offload="host" if vllm_sleep else "none",
                           gpus=tuple(range(gen_start, gen_start + engines * gtp))))
    if rc == "full" and algo == "ppo":
        notes.append("--actor.gradient_checkpointing_enable is applied to the critic too")
    if colocate_all or col_ar or col_cr:
        notes.append("colocated groups share GPU ids: their model-stages of one stage run one after another "
                     "(times add); idle ones keep their resident state unless offloaded")
    order = {m.name: i for i, m in enumerate(workflow_for(wl).model_stages)}
    cands.sort(key=lambda x: order[x.model_stage])
    parser = openrlhf_parser()
    if parser is not None:
        classify_args(a, vars(parser.parse_args([])), read, un, notes)
    return Imported("openrlhf", job, tuple(cands), un, read, notes)
