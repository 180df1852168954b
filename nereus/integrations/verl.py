"""verl: import a trainer configuration as a Nereus job and layout, export a plan as verl overrides.

Keys (verl 0.9 names; docs/integrations.md lists every key read, and why the rest are ignored):

* job: ``algorithm.adv_estimator`` (gae -> PPO, grpo, remax), ``data.train_batch_size`` (prompts per
  step), ``actor_rollout_ref.rollout.n``, ``data.max_prompt_length`` / ``data.max_response_length``
  (used as the lengths), ``actor_rollout_ref.actor.ppo_mini_batch_size`` (prompts; x n sequences),
  ``actor_rollout_ref.actor.ppo_epochs``, ``reward.reward_model.enable`` (or the legacy
  ``reward_model.enable``), ``trainer.nnodes`` x ``trainer.n_gpus_per_node``; the model from
  ``actor_rollout_ref.model.path`` (its ``config.json``) unless ``--model`` names one.
* framework (:func:`verl_framework`): the ``megatron`` preset with the actor's
  ``sequence_parallel``, ``override_ddp_config`` overlap and reduce dtype, or the ``fsdp`` preset with
  its ``mixed_precision.reduce_dtype``; colocation ``always`` (the hybrid engine).
* layout: verl's hybrid engine runs every role on one resource pool of all N GPUs, one after another
  (every candidate's GPU set is the whole pool): ``actor.train`` and ``actor.infer`` with the actor's
  engine (Megatron TP/PP/VPP, distributed optimizer = ZeRO-1; FSDP: DP over all N,
  ``reshard_after_forward`` = ZeRO-3 else ZeRO-2), ``param_offload`` + ``optimizer_offload`` =
  offload ``host``; ``reference.infer`` with the ref engine, the critic with ``critic.*``; an inference
  model-stage of a FULL_SHARD engine runs ZeRO-3 (over DP > 1); generation with the rollout TP,
  ``max_num_seqs`` and vLLM's pre-allocated ``gpu_memory_utilization`` (the workload's
  ``rollout_memory_fraction``), offload ``drop`` under ``free_cache_engine``; micro-batches from the
  ``*micro_batch_size_per_gpu`` keys (or the legacy global ones, or a token budget under
  ``use_dynamic_bsz``); Ulysses / context parallelism as the candidates' ``cp`` (DP = N/(tp·pp·cp));
  LoRA as the workload's ``lora_rank`` (:mod:`nereus.integrations.verl_features`).

Still refused (named in the report, never approximated): hybrid FSDP sharding (``fsdp_size``), only
one of ``param_offload`` / ``optimizer_offload`` on a training engine, FSDP2 ``offload_policy``,
activation offload, MoE expert parallelism, in-engine rollout DP/PP, a standalone rollout pool and
the asynchronous v1 trainer modes.

Export (:func:`export_verl`, in :mod:`nereus.integrations.verl_export`, re-exported here): the fastest layout verl can express (every model-stage on all N GPUs,
per-role engines with ZeRO, offload and interleaving, vLLM sleep), searched over verl's Megatron
backend (``ppo_megatron_trainer``, the default) and, when asked, its FSDP backend (``ppo_trainer``),
as overrides of the chosen config; predicted with the model-stages of a stage run one after another
on the shared GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from nereus.cost.shapes import valid_pp, valid_tp
from nereus.integrations.common import Imported, Unexpressible
from nereus.integrations.framework_versions import version_key, version_rule
from nereus.integrations.verl_config import (
    VerlConfig,
)
from nereus.integrations.verl_export import (
    ADV_ESTIMATORS,
    VERL_DROP,
)
from nereus.integrations.verl_features import (
    _recompute,
    _train_offload,
    budget_micro_batch,
    legacy_micro_batch,
    seq_split_degree,
    verl_logits_kernel,
    verl_lora_rank,
    verl_ref_in_actor,
    verl_uses_reference,
)
from nereus.integrations.verl_keys import classify_keys
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

__all__ = ["import_verl", "verl_framework"]

def _model(c: VerlConfig, model, key: str):
    if model is not None:
        return get_model(model) if isinstance(model, str) else model
    path = c.get(key, None)
    if path and (Path(str(path)).expanduser() / "config.json").is_file():
        return get_model(str(Path(str(path)).expanduser()))
    raise ValueError(f"verl key {key}={path!r}: no config.json there; pass --model (a preset or a config.json "
                     f"path) for the model")


#: verl's roles with training engines: (config prefix, model section, Nereus model name)
_ROLES = {"actor": ("actor_rollout_ref.actor", "actor_rollout_ref.model", "actor"),
          "ref": ("actor_rollout_ref.ref", "actor_rollout_ref.model", "reference"),
          "critic": ("critic", "critic.model", "critic")}
_FSDP = ("fsdp", "fsdp2")


@dataclass
class _Engine:
    """What Nereus reads of one verl engine (actor, ref or critic)."""

    strategy: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    zero: int = 0
    offload: str = "none"  # the training model-stage's idle state (weights + optimizer)
    param_offload: bool = False  # the engine's weights between phases (its inference model-stage)
    sp: bool = False
    overlap: bool = False
    reduce_bytes: int = 4
    cp: int = 1  # sequence split: Ulysses (FSDP) or context parallelism (Megatron)


def _fsdp_section(c: VerlConfig, role: str) -> str:
    prefix = _ROLES[role][0]
    if role == "critic":
        return "critic.fsdp" if isinstance(c.d.get("critic", {}).get("fsdp"), dict) else "critic.model.fsdp_config"
    return f"{prefix}.fsdp_config"


def _engine(c: VerlConfig, role: str, n: int, out: list, notes: list, model, strategy: str,
            version: str | None = None) -> _Engine:
    """The parallel layout and memory features of a verl role's engine; records the settings the cost
    model cannot express in ``out``. ``version`` (None: installed): before verl 0.2 a forward-only FSDP
    engine offloads only with ``param_offload`` (TinyZero@95df88f ``fsdp_workers.py``; verl@v0.2 on:
    ``CPUOffload(offload_params=True)`` for every role but the actor)."""
    prefix, model_prefix, _ = _ROLES[role]
    train = role != "ref"
    if strategy in _FSDP:
        sec = _fsdp_section(c, role)
        e = _Engine(strategy, overlap=True)
        e.cp, key = seq_split_degree(c, prefix, sec, strategy, model)
        if n % e.cp:
            raise ValueError(f"verl key {key}={e.cp} must divide the {n} GPUs")
        size = c.get(f"{sec}.fsdp_size", -1)
        if size not in (None, -1, 0, n):
            out.append(Unexpressible(f"{sec}.fsdp_size", size, f"hybrid sharding (shard over groups of {size}, "
                                     f"replicate across them); Nereus's ZeRO shards over the whole data-parallel "
                                     f"group of {n} GPUs"))
        reshard = c.get(f"{sec}.reshard_after_forward", True)
        e.zero = 3 if reshard else 2
        mp = c.get(f"{sec}.mixed_precision", None) or {}
        red = str(mp.get("reduce_dtype", "fp32")) if isinstance(mp, dict) else "fp32"
        e.reduce_bytes = 4 if red in ("fp32", "float32") else 2
        po = bool(c.get(f"{sec}.param_offload", False))
        oo = bool(c.get(f"{sec}.optimizer_offload", False))
        if not train and version is not None and version_key(version) < version_key("0.2"):
            # verl 0.1: the ref's FSDP engine offloads its parameters only when param_offload says so
            e.param_offload = po
            e.offload = "host" if po else "none"
            notes.append(f"{prefix}: verl {version} offloads a forward-only FSDP model's parameters only with "
                         f"{sec}.param_offload (here {po}; verl >= 0.2 always does)")
            return e
        if not train:
            # verl wraps a forward-only FSDP engine with CPU offload whatever param_offload says
            e.param_offload = True
            e.offload = "host"
            notes.append(f"{prefix}: verl keeps a forward-only FSDP model's parameters in host memory (CPU "
                         "offload); Nereus models it as offload 'host' of its ZeRO-3 shard (FULL_SHARD; whole "
                         "weights with reshard_after_forward=False)")
            return e
        if c.get(f"{sec}.offload_policy", False):
            out.append(Unexpressible(f"{sec}.offload_policy", True, "FSDP2's CPUOffloadPolicy keeps parameters, "
                                     "gradients and optimizer state in host memory and steps the optimizer on the "
                                     "CPU; the cost model has no CPU optimizer step"))
        if c.get(f"{model_prefix}.enable_activation_offload", False):
            out.append(Unexpressible(f"{model_prefix}.enable_activation_offload", True, "activation offload to "
                                     "host memory is not in the cost model"))
        e.param_offload = po
        e.offload = _train_offload(po, oo, sec, out)
        return e
    if strategy != "megatron":
        raise ValueError(f"verl key {prefix}.strategy={strategy!r}: valid fsdp, fsdp2, megatron")
    m = f"{prefix}.megatron"
    tp = c.int(f"{m}.tensor_model_parallel_size", 1)
    pp = c.int(f"{m}.pipeline_model_parallel_size", 1)
    why = valid_tp(model, tp) or valid_pp(model, pp)
    if why:
        raise ValueError(f"verl keys {m}.tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}: {why}")
    if n % (tp * pp):
        raise ValueError(f"verl keys {m}.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} must "
                         f"divide the {n} GPUs of trainer.nnodes x trainer.n_gpus_per_node")
    e = _Engine("megatron", tp=tp, pp=pp)
    e.cp, key = seq_split_degree(c, prefix, None, "megatron", model)
    if n % (tp * pp * e.cp):
        raise ValueError(f"verl keys {m}.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x "
                         f"{key}={e.cp} must divide the {n} GPUs")
    v = c.get(f"{m}.expert_model_parallel_size", 1)
    if v and v > 1:
        out.append(Unexpressible(f"{m}.expert_model_parallel_size", v, "expert parallelism (MoE) is not in the "
                                 "cost model; Nereus models dense transformers"))
    if c.get(f"{m}.dynamic_context_parallel", False):
        out.append(Unexpressible(f"{m}.dynamic_context_parallel", True, "dynamic context parallelism is not in "
                                 "the cost model"))
    v = c.get(f"{m}.virtual_pipeline_model_parallel_size", None)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"verl key {m}.virtual_pipeline_model_parallel_size={v!r}: must be null or an integer >= 1")
    e.vpp = (v or 1) if train else 1
    if v and v > 1 and not train:
        notes.append(f"{m}.virtual_pipeline_model_parallel_size={v}: interleaving is modelled for training; "
                     "the reference's forward passes use the plain pipeline schedule")
    e.sp = bool(c.get(f"{m}.sequence_parallel", False))
    po = bool(c.get(f"{m}.param_offload", False))
    e.param_offload = po
    if train:
        if c.get(f"{m}.use_megatron_fsdp", False):
            e.zero = 3
        elif c.get(f"{m}.use_distributed_optimizer", False):
            e.zero = 1
        e.offload = _train_offload(po, bool(c.get(f"{m}.optimizer_offload", False)), m, out)
        e.overlap = bool(c.get(f"{m}.override_ddp_config.overlap_grad_reduce", False))
        fp32 = c.get(f"{m}.override_ddp_config.grad_reduce_in_fp32", None)
        if fp32 is None:  # verl: fp32 unless a precision-aware optimizer keeps low-precision main grads
            low = c.get(f"{prefix}.optim.use_precision_aware_optimizer", False) and \
                str(c.get(f"{prefix}.optim.main_grads_dtype", "fp32")) not in ("fp32", "float32")
            fp32 = not low
        e.reduce_bytes = 4 if fp32 else 2
    else:
        e.offload = "host" if po else "none"
    return e


def verl_framework(engines: dict, colocate: str = "always") -> FrameworkSpec:
    """The job's framework for verl engines: the ``megatron`` preset with the actor's sequence
    parallelism, DDP overlap and reduce dtype (verl's defaults: SP on, no overlap, fp32 reduce) and
    Megatron's resident gradient buffer, or the ``fsdp`` preset with its reduce dtype and verl's fp32
    training parameters (:mod:`nereus.cost.train_state`); verl's hybrid engine colocates every role."""
    a = engines["actor"]
    if a.strategy == "megatron":
        base = get_framework("megatron")
        return replace(base, name="verl-megatron", sequence_parallel=_job_sp(engines), overlap_grad_reduce=a.overlap,
                       grad_reduce_bytes=a.reduce_bytes, colocate=colocate, uneven_pp=False,
                       max_virtual_stages=max(base.max_virtual_stages, a.vpp), drop_model_stages=VERL_DROP,
                       shared_engine=True, persistent_grads=True)
    return replace(get_framework("fsdp"), name="verl-fsdp", grad_reduce_bytes=a.reduce_bytes, colocate=colocate,
                   drop_model_stages=VERL_DROP, shared_engine=True, fp32_train_params=True)


def _job_sp(engines: dict) -> bool:
    """Sequence parallelism is one flag of the job: the first Megatron engine with TP > 1 sets it."""
    for r in ("actor", "critic", "ref"):
        e = engines.get(r)
        if e is not None and e.strategy == "megatron" and e.tp > 1:
            return e.sp
    return engines["actor"].sp


def _checked(job: JobSpec, cand: Candidate, keys: str) -> Candidate:
    from nereus.cost.checks import check_candidate

    try:
        check_candidate(job, workflow_for(job.workload).get(cand.model_stage), cand)
    except ValueError as e:
        raise ValueError(f"verl keys {keys}: {e}") from e
    return cand


def import_verl(cfg: dict, model=None, gpu=None, version: str | None = None) -> Imported:
    """Read a verl configuration (a dict from :func:`load_verl_config`) as a job and the user's layout.

    The job's framework is :func:`verl_framework` of the engines; the layout puts every role on the
    one resource pool (the hybrid engine: overlapping GPU sets, run one after another), with ZeRO
    stages, idle-state offload and interleaving read from the engines (docs/integrations.md).

    Args:
        model: a preset name, config.json path or ModelSpec overriding ``actor_rollout_ref.model.path``.
        gpu: a GPU preset name or GpuSpec (verl's config does not say which GPU; default h100).
        version: the verl version the job runs (None: the installed one); it selects the vLLM
            start-up memory rule (:func:`nereus.integrations.framework_versions.version_rule`).

    Raises:
        ValueError: a missing, malformed or contradictory key (named, with its value and what is valid).
    """
    c = VerlConfig(cfg)
    un: list[Unexpressible] = []
    notes: list[str] = [r.note() for r in getattr(cfg, "legacy", ())]  # verl_legacy: older verl's key names
    arr = "actor_rollout_ref"
    actor_model = _model(c, model, f"{arr}.model.path")
    adv = c.get("algorithm.adv_estimator", "gae")
    if adv not in ADV_ESTIMATORS:
        raise ValueError(f"verl key algorithm.adv_estimator={adv!r}: Nereus models "
                         f"{', '.join(f'{k} ({v.upper()})' for k, v in ADV_ESTIMATORS.items())}")
    algo = ADV_ESTIMATORS[adv]
    nodes, gpn = c.int("trainer.nnodes"), c.int("trainer.n_gpus_per_node")
    n = nodes * gpn
    prompts = c.int("data.train_batch_size")
    samples = c.int(f"{arr}.rollout.n", 1)
    mini_prompts = c.int(f"{arr}.actor.ppo_mini_batch_size")
    if prompts % mini_prompts:
        raise ValueError(f"verl key {arr}.actor.ppo_mini_batch_size={mini_prompts} must divide "
                         f"data.train_batch_size={prompts}")
    reward = bool(c.get("reward.reward_model.enable", None) or c.get("reward_model.enable", None))
    frac = c.get(f"{arr}.rollout.gpu_memory_utilization", 0.5)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ValueError(f"verl key {arr}.rollout.gpu_memory_utilization={frac!r}: must be a number in (0, 1)")
    uses_ref = verl_uses_reference(c, cfg, version, notes)  # a KL term, or any job before verl 0.4.0
    in_actor = verl_ref_in_actor(version, uses_ref, (lora := verl_lora_rank(c, algo, un, notes)), notes)
    wl = WorkloadSpec(algorithm=algo, prompts_per_step=prompts, samples_per_prompt=samples,
                      prompt_len=c.int("data.max_prompt_length"), response_len=c.int("data.max_response_length"),
                      mini_batch_size=mini_prompts * samples, ppo_epochs=c.int(f"{arr}.actor.ppo_epochs", 1),
                      reward_model=reward, reference_model=uses_ref, lora_rank=lora,
                      rollout_memory_fraction=float(frac),
                      logits_kernel=verl_logits_kernel(c, c.get(f"{arr}.actor.strategy", "fsdp")),
                      vllm_memory_rule=version_rule("verl", version, notes))
    notes.append("data.max_prompt_length and data.max_response_length are used as the prompt and response "
                 "lengths (verl gives maxima; pass --prompt-len/--response-len for measured means)")
    if gpu is None:
        notes.append("verl's config does not name the GPU: h100 assumed (--gpu)")
        gpu = "h100"
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if c.get(f"{arr}.hybrid_engine", True) is False:
        un.append(Unexpressible(f"{arr}.hybrid_engine", False, "a standalone rollout pool (separate_async "
                                "trainer) is not imported yet"))
    mode = c.get("trainer.v1.trainer_mode", "sync") if c.get("trainer.use_v1", False) else "sync"
    if mode != "sync":
        un.append(Unexpressible("trainer.v1.trainer_mode", mode, "verl's asynchronous trainer modes are not "
                                "imported yet (Nereus's one-step-off mode puts generation on GPUs of its own)"))
    if (c.get(f"{arr}.rollout.nnodes", 0) or 0) > 0:
        un.append(Unexpressible(f"{arr}.rollout.nnodes", c.get(f"{arr}.rollout.nnodes"),
                                "a standalone rollout pool is not imported yet"))
    astrat = c.get(f"{arr}.actor.strategy", "fsdp")
    engines = {"actor": _engine(c, "actor", n, un, notes, actor_model, astrat)}
    ref_engine = _engine(c, "ref", n, *(([], []) if in_actor else (un, notes)), actor_model,
                         c.get(f"{arr}.ref.strategy", astrat), version)
    if uses_ref and not in_actor:
        engines["ref"] = ref_engine
    if algo == "ppo":
        engines["critic"] = _engine(c, "critic", n, un, notes, actor_model, c.get("critic.strategy", "fsdp"))
    own_reward_pool = reward and bool(c.get("reward.reward_model.enable_resource_pool", False))
    fw = replace(verl_framework(engines, "auto" if own_reward_pool else "always"), ref_in_actor=in_actor)
    _framework_conflicts(engines, fw, un)
    job = JobSpec(actor=actor_model, cluster=ClusterSpec(gpu_spec, nodes, gpn), workload=wl, framework=fw)
    gpus = tuple(range(n))
    cands: list[Candidate] = []
    mb = wl.mini_batch_size

    def micro(name, prefix, bkey, dp, cp, dyn_key, budget_key, seqs, default=None):
        """The per-GPU micro-batch: fixed, legacy global, or a token budget's stand-in."""
        if c.get(dyn_key, False):
            b = budget_micro_batch(c.get(budget_key, 16384), budget_key, seqs, wl.memory_seq_len, cp)
            notes.append(f"{dyn_key}: token-budget micro-batches of {budget_key}={c.get(budget_key)} tokens per GPU "
                         f"stand as {name} micro-batch {b} (full-length sequences filling the budget)")
            return b
        b = legacy_micro_batch(c, bkey, dp)
        if b is None:
            b = default
        if b is None:
            raise ValueError(f"verl key {bkey}=None: set the per-GPU micro-batch of {name} (an integer >= 1) or "
                             f"{dyn_key}=True")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"verl key {bkey}={b!r}: must be an integer >= 1")
        return b

    def train_cand(name, role, bkey):
        prefix, model_prefix, _ = _ROLES[role]
        e = engines[role]
        dp = n // (e.tp * e.pp * e.cp)
        if mb % dp:
            raise ValueError(f"verl: the mini-batch {mb} sequences ({arr}.actor.ppo_mini_batch_size={mini_prompts} x "
                             f"rollout.n={samples}) must be a multiple of the data-parallel size {dp}")
        b = micro(name, prefix, bkey, dp, e.cp, f"{prefix}.use_dynamic_bsz", f"{prefix}.ppo_max_token_len_per_gpu",
                  mb // dp)
        if (mb // dp) % b:
            raise ValueError(f"verl key {bkey}={b}: the mini-batch {mb} sequences ({arr}.actor.ppo_mini_batch_size="
                             f"{mini_prompts} x rollout.n={samples}) over DP={dp} must be a multiple of it")
        rc = _recompute(c, prefix, e.strategy, model_prefix)
        # ZeRO over one GPU shards nothing: verl's single-GPU FSDP holds whole weights
        zero = e.zero if dp * e.cp > 1 else 0
        cand = Candidate(name, e.tp, e.pp, dp, micro_batch=b, grad_accum=mb // (dp * b), recompute=rc, zero=zero,
                         offload=e.offload, vpp=e.vpp, gpus=gpus, cp=e.cp)
        keys = (f"{bkey}={b}" + (f", {prefix}.megatron.virtual_pipeline_model_parallel_size={e.vpp}"
                                 if e.vpp > 1 else ""))
        return _checked(job, cand, keys)

    def infer_cand(name, role, bkey, dyn_key, budget_key, default=None):
        e = engines[role]
        dp = n // (e.tp * e.pp * e.cp)
        b = micro(name, _ROLES[role][0], bkey, dp, e.cp, dyn_key, budget_key, -(-wl.global_batch // dp), default)
        # a FULL_SHARD FSDP (or Megatron-FSDP) engine runs the forward pass on its shards: ZeRO-3
        return Candidate(name, e.tp, e.pp, dp, micro_batch=int(b), zero=3 if e.zero == 3 and dp * e.cp > 1 else 0,
                         offload="host" if e.param_offload else "none", gpus=gpus, cp=e.cp)

    ro = f"{arr}.rollout"
    cands.append(train_cand("actor.train", "actor", f"{arr}.actor.ppo_micro_batch_size_per_gpu"))
    # verl computes old log-probs with the actor's training engine: the actor's degrees and param offload
    cands.append(infer_cand("actor.infer", "actor", f"{ro}.log_prob_micro_batch_size_per_gpu",
                            f"{ro}.log_prob_use_dynamic_bsz", f"{ro}.log_prob_max_token_len_per_gpu"))
    if in_actor:  # ref_in_actor: the actor's engine and log-prob settings, the adapters disabled
        cands.append(replace(cands[-1], model_stage="reference.infer"))
    elif uses_ref:  # without a KL term verl builds no reference model (and needs no micro-batch for it)
        cands.append(infer_cand("reference.infer", "ref", f"{arr}.ref.log_prob_micro_batch_size_per_gpu",
                                f"{arr}.ref.log_prob_use_dynamic_bsz", f"{arr}.ref.log_prob_max_token_len_per_gpu"))
    gtp = c.int(f"{arr}.rollout.tensor_model_parallel_size", 1)
    why = valid_tp(actor_model, gtp)
    if why or n % gtp:
        raise ValueError(f"verl key {arr}.rollout.tensor_model_parallel_size={gtp}: "
                         f"{why or f'must divide the {n} GPUs'}")
    for k in ("data_parallel_size", "pipeline_model_parallel_size", "expert_parallel_size"):
        v = c.get(f"{arr}.rollout.{k}", 1)
        if v and v > 1:
            un.append(Unexpressible(f"{arr}.rollout.{k}", v, "Nereus's generation replicas are TP groups "
                                    "(rollout DP is N / TP); in-engine DP/PP/EP is not in its plan space"))
    max_seqs = c.int(f"{arr}.rollout.max_num_seqs", 256)
    # vLLM pre-allocates gpu_memory_utilization (workload.rollout_memory_fraction); the cost model caps the
    # concurrency by the KV blocks that fit it
    conc = max_seqs
    per_replica = -(-wl.rollouts_per_step // (n // gtp))
    sleep = bool(c.get(f"{arr}.rollout.free_cache_engine", False))
    cands.append(Candidate("actor.generate", gtp, 1, n // gtp, concurrency=min(conc, per_replica),
                           offload="drop" if sleep else "none", gpus=gpus))
    if algo == "ppo":
        cm = c.get("critic.model.path", None)
        cands.append(train_cand("critic.train", "critic", "critic.ppo_micro_batch_size_per_gpu"))
        fwd = "critic.forward_micro_batch_size_per_gpu"
        cands.append(infer_cand("critic.infer", "critic", fwd if c.get(fwd, None) is not None
                                or c.get(fwd[:-8], None) is not None else "critic.ppo_micro_batch_size_per_gpu",
                                "critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu"))
        if cm and cm != c.get(f"{arr}.model.path", None):
            notes.append("critic.model.path differs from the actor's: Nereus uses the actor's shapes with a value head")
    if reward:
        wtp = c.get("reward.reward_model.rollout.tensor_model_parallel_size", None) or 1
        wgpus = gpus
        if own_reward_pool:
            wn = c.int("reward.reward_model.nnodes", 1) * c.int("reward.reward_model.n_gpus_per_node", 1)
            wgpus = tuple(range(n, n + wn))
            job = JobSpec(actor=actor_model, cluster=ClusterSpec(gpu_spec, -(-(n + wn) // gpn), gpn), workload=wl,
                          framework=fw)
        wsleep = bool(c.get("reward.reward_model.rollout.free_cache_engine", False))
        cands.append(Candidate("reward.infer", wtp, 1, len(wgpus) // wtp, micro_batch=wl.infer_micro_batch_size,
                               offload="host" if wsleep else "none", gpus=wgpus))
        notes.append(f"reward.infer micro-batch: verl serves the reward model with an inference engine; "
                     f"Nereus's default {wl.infer_micro_batch_size} is used")
    order = {m.name: i for i, m in enumerate(workflow_for(wl).model_stages)}
    cands.sort(key=lambda x: order[x.model_stage])
    classify_keys(cfg, c.read, un, notes, "ppo_megatron_trainer" if astrat == "megatron" else "ppo_trainer")
    read = {k: v for k, v in c.read.items()}
    return Imported("verl", job, tuple(cands), un, read, notes)


def _framework_conflicts(engines: dict, fw: FrameworkSpec, un: list) -> None:
    """Sequence parallelism, DP overlap and reduce dtype are flags of the whole job: an engine that
    sets them otherwise than the actor (where they matter) is named."""
    for role in ("ref", "critic"):
        e = engines.get(role)
        if e is None:
            continue
        prefix = _ROLES[role][0]
        if e.strategy == "megatron" and e.tp > 1 and e.sp != fw.sequence_parallel:
            un.append(Unexpressible(f"{prefix}.megatron.sequence_parallel", e.sp, "sequence parallelism is one "
                                    f"flag of the job in the cost model; the actor's is {fw.sequence_parallel}"))
        if role == "critic" and (e.overlap != fw.overlap_grad_reduce or e.reduce_bytes != fw.grad_reduce_bytes):
            un.append(Unexpressible("critic.strategy", e.strategy, "the critic's gradient reduce (overlap, dtype) "
                                    "differs from the actor's; the cost model has one per job"))
