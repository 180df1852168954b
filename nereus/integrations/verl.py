"""verl: import a trainer configuration as a Nereus job and layout, export a plan as verl overrides.

Keys (verl 0.9 names; docs/integrations.md lists every key read, and why the rest are ignored):

* job: ``algorithm.adv_estimator`` (gae -> PPO, grpo, remax), ``data.train_batch_size`` (prompts per
  step), ``actor_rollout_ref.rollout.n``, ``data.max_prompt_length`` / ``data.max_response_length``
  (used as the lengths), ``actor_rollout_ref.actor.ppo_mini_batch_size`` (prompts; x n sequences),
  ``actor_rollout_ref.actor.ppo_epochs``, ``reward.reward_model.enable`` (or the legacy
  ``reward_model.enable``), ``trainer.nnodes`` x ``trainer.n_gpus_per_node``; the model from
  ``actor_rollout_ref.model.path`` (its ``config.json``) unless ``--model`` names one.
* layout: verl's hybrid engine runs every role on one resource pool of all N GPUs, one after another:
  ``actor.train`` and ``actor.infer`` with the actor's Megatron TP/PP
  (``actor_rollout_ref.actor.megatron.{tensor,pipeline}_model_parallel_size``), ``reference.infer``
  with ``actor_rollout_ref.ref.megatron.*``, the critic with ``critic.megatron.*``, generation with
  ``actor_rollout_ref.rollout.tensor_model_parallel_size`` and a concurrency from
  ``gpu_memory_utilization`` and ``max_num_seqs``; DP = N / (TP·PP); micro-batches from the
  ``*micro_batch_size_per_gpu`` keys.

Not expressible yet (named in the report, never approximated): colocation (several model-stages of
one stage on the same GPUs, which the hybrid engine always does), ``strategy`` fsdp/fsdp2, Megatron's
distributed optimizer, offload, context/sequence parallel sizes > 1, dynamic batch sizes, a
standalone rollout pool and the asynchronous v1 trainer modes.

Export (:func:`export_verl`): the fastest layout verl can express (every model-stage on all N GPUs,
per-role TP/PP, Megatron without the distributed optimizer, so that Nereus's memory model applies),
as overrides of verl's ``ppo_megatron_trainer`` config; predicted with model-stages of one stage run
one after another on the shared GPUs.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import yaml

from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_pp, valid_tp
from nereus.integrations.common import (
    Imported,
    Unexpressible,
    evaluate_layout,
    generation_concurrency,
    memory_fraction_for,
)
from nereus.planner.plan import Candidate, Plan
from nereus.spec import ClusterSpec, JobSpec, WorkloadSpec, get_gpu, get_model
from nereus.workflow import workflow_for

__all__ = ["verl_config_dir", "load_verl_config", "import_verl", "export_verl", "ADV_ESTIMATORS"]

#: verl's ``algorithm.adv_estimator`` values Nereus models, and the algorithm each one is.
ADV_ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "remax": "remax"}
_MISSING = object()
COLOCATION = ("verl's hybrid engine puts every role on the one resource pool of trainer.nnodes x "
              "trainer.n_gpus_per_node GPUs, so {names} run one after another on the same GPUs; Nereus's plan "
              "space gives the model-stages of one stage disjoint GPUs (colocation is not expressible yet)")


def verl_config_dir() -> Path | None:
    """``verl/trainer/config`` of the installed verl package, or None when verl is not installed."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        return None
    d = Path(spec.origin).parent / "trainer" / "config"
    return d if d.is_dir() else None


def _parse_override(ov: str) -> tuple[str, object]:
    key, sep, val = ov.partition("=")
    if not sep or not key.lstrip("+"):
        raise ValueError(f"verl override {ov!r} must look like key=value (e.g. trainer.nnodes=2)")
    return key.lstrip("+"), yaml.safe_load(val) if val != "" else None


def _set(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"verl override {key}={value!r}: {p!r} is not a section")
    d[parts[-1]] = value


def _compose(config_dir: Path, name: str, overrides: list[str]) -> dict:
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf
    except ImportError as e:
        raise ValueError(f"verl config {name!r} uses Hydra defaults; install hydra-core (or verl) to read it") from e
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            cfg = compose(config_name=name, overrides=list(overrides))
    except Exception as e:  # hydra's errors name the override and the key
        raise ValueError(f"verl config {name!r}: {' '.join(str(e).split())}"[:500]) from e
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def load_verl_config(config: str, overrides=()) -> dict:
    """A verl trainer configuration as a nested dict, with Hydra-style ``key=value`` overrides.

    ``config`` is a YAML file, or the name of a config of the installed verl (``ppo_trainer``,
    ``ppo_megatron_trainer``). A file with a Hydra ``defaults`` list (verl's own layout) is composed
    by Hydra from its directory; a plain file gets the overrides merged by OmegaConf in struct
    mode, so an override of a key the file does not have is refused (``+key=value`` adds one).

    Raises:
        ValueError: missing file, malformed YAML, or an override naming an unknown key.
    """
    overrides = [str(o) for o in overrides]
    p = Path(config)
    vdir = verl_config_dir()
    if not p.exists() and p.suffix == "" and vdir is not None and (vdir / f"{config}.yaml").is_file():
        return _compose(vdir, config, overrides)
    if not p.is_file():
        hint = " (verl is not installed, so verl's own config names are not available)" if vdir is None else \
            " or a config name of the installed verl (ppo_trainer, ppo_megatron_trainer)"
        raise ValueError(f"--from-verl {config!r}: no such file; give a verl trainer YAML{hint}")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"verl config {str(p)!r} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"verl config {str(p)!r} must be a mapping of sections, got {type(doc).__name__}")
    if "defaults" in doc:
        return _compose(p.parent, p.stem, overrides)
    try:
        from omegaconf import OmegaConf
    except ImportError:
        for ov in overrides:
            _set(doc, *_parse_override(ov))
        return doc
    cfg = OmegaConf.create(doc)
    OmegaConf.set_struct(cfg, True)
    for ov in overrides:
        key, val = _parse_override(ov)
        try:
            if ov.startswith("+"):
                with __import__("omegaconf").open_dict(cfg):
                    OmegaConf.update(cfg, key, val, force_add=True)
            else:
                OmegaConf.update(cfg, key, val)
        except Exception as e:
            raise ValueError(f"verl override {ov!r}: {str(p)!r} has no key {key!r} (use +{key}=... to add one)") from e
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


class _Cfg:
    """Reads dotted keys of a nested dict and remembers what was read."""

    def __init__(self, d: dict):
        self.d, self.read = d, {}

    def get(self, key: str, default=_MISSING):
        cur = self.d
        for part in key.split("."):
            if not isinstance(cur, dict) or part not in cur:
                if default is _MISSING:
                    raise ValueError(f"verl config has no key {key!r} (Nereus needs it; docs/integrations.md)")
                return default
            cur = cur[part]
        if cur == "???":
            cur = default if default is not _MISSING else None
        self.read[key] = cur
        return cur

    def int(self, key: str, default=_MISSING, low: int = 1):
        v = self.get(key, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"verl key {key}={v!r}: must be an integer >= {low}")
        return v


def _model(c: _Cfg, model, key: str):
    if model is not None:
        return get_model(model) if isinstance(model, str) else model
    path = c.get(key, None)
    if path and (Path(str(path)).expanduser() / "config.json").is_file():
        return get_model(str(Path(str(path)).expanduser()))
    raise ValueError(f"verl key {key}={path!r}: no config.json there; pass --model (a preset or a config.json "
                     f"path) for the model")


def _degrees(c: _Cfg, prefix: str, role: str, n: int, out: list, model) -> tuple[int, int]:
    """(tp, pp) of a Megatron role; records the settings outside the plan space."""
    strategy = c.get(f"{prefix}.strategy", "fsdp")
    if strategy in ("fsdp", "fsdp2"):
        out.append(Unexpressible(f"{prefix}.strategy", strategy, f"FSDP shards the {role}'s weights, gradients and "
                                 "optimizer state across data-parallel ranks; Nereus's plan space has no "
                                 "FSDP/ZeRO sharding yet"))
        sp = c.get(f"{prefix}.fsdp_config.ulysses_sequence_parallel_size", 1)
        if sp and sp > 1:
            out.append(Unexpressible(f"{prefix}.fsdp_config.ulysses_sequence_parallel_size", sp,
                                     "sequence parallelism is not in Nereus's plan space yet"))
        return 1, 1
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
    for k, why in (("use_distributed_optimizer", "the distributed optimizer shards optimizer state across DP (ZeRO-1); "
                    "Nereus's memory model keeps full optimizer state per replica (no ZeRO yet)"),
                   ("param_offload", "offload to host memory is not in Nereus's plan space yet"),
                   ("optimizer_offload", "offload to host memory is not in Nereus's plan space yet"),
                   ("grad_offload", "offload to host memory is not in Nereus's plan space yet")):
        v = c.get(f"{m}.{k}", False)
        if v:
            out.append(Unexpressible(f"{m}.{k}", v, why))
    for k in ("context_parallel_size",):
        v = c.get(f"{m}.{k}", 1)
        if v and v > 1:
            out.append(Unexpressible(f"{m}.{k}", v, "context parallelism is not in Nereus's plan space yet"))
    v = c.get(f"{m}.virtual_pipeline_model_parallel_size", None)
    if v:
        out.append(Unexpressible(f"{m}.virtual_pipeline_model_parallel_size", v,
                                 "interleaved (virtual) pipeline stages are not in Nereus's plan space yet"))
    return tp, pp


def _recompute(c: _Cfg, prefix: str, strategy: str, model_prefix: str) -> str:
    if strategy == "megatron":
        g = c.get(f"{prefix}.megatron.override_transformer_config.recompute_granularity", None)
        if g in (None, "null", "none"):
            return "none"
        if g not in ("full", "selective"):
            raise ValueError(f"verl key {prefix}.megatron.override_transformer_config.recompute_granularity={g!r}: "
                             "valid null, selective, full")
        return g
    return "full" if c.get(f"{model_prefix}.enable_gradient_checkpointing", False) else "none"


def import_verl(cfg: dict, model=None, gpu=None) -> Imported:
    """Read a verl configuration (a dict from :func:`load_verl_config`) as a job and the user's layout.

    Args:
        model: a preset name, config.json path or ModelSpec overriding ``actor_rollout_ref.model.path``.
        gpu: a GPU preset name or GpuSpec (verl's config does not say which GPU; default h100).

    Raises:
        ValueError: a missing, malformed or contradictory key (named, with its value and what is valid).
    """
    c = _Cfg(cfg)
    un: list[Unexpressible] = []
    notes: list[str] = []
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
    wl = WorkloadSpec(algorithm=algo, prompts_per_step=prompts, samples_per_prompt=samples,
                      prompt_len=c.int("data.max_prompt_length"), response_len=c.int("data.max_response_length"),
                      mini_batch_size=mini_prompts * samples, ppo_epochs=c.int(f"{arr}.actor.ppo_epochs", 1),
                      reward_model=reward)
    notes.append("data.max_prompt_length and data.max_response_length are used as the prompt and response "
                 "lengths (verl gives maxima; pass --prompt-len/--response-len for measured means)")
    if gpu is None:
        notes.append("verl's config does not name the GPU: h100 assumed (--gpu)")
        gpu = "h100"
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    job = JobSpec(actor=actor_model, cluster=ClusterSpec(gpu_spec, nodes, gpn), workload=wl)
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
    gpus = tuple(range(n))
    cands: list[Candidate] = []
    mb = wl.mini_batch_size

    def train_cand(name, prefix, tp, pp, bkey, model_prefix):
        strategy = c.get(f"{prefix}.strategy", "fsdp")
        if c.get(f"{prefix}.use_dynamic_bsz", False):
            un.append(Unexpressible(f"{prefix}.use_dynamic_bsz", True, "token-budget micro-batches "
                                    "(ppo_max_token_len_per_gpu) are not in Nereus's plan space; it plans fixed "
                                    "micro-batches"))
        dp = n // (tp * pp)
        b = c.int(bkey, None)
        if b is None:
            if not c.get(f"{prefix}.use_dynamic_bsz", False):
                raise ValueError(f"verl key {bkey}=None: set the per-GPU micro-batch (an integer >= 1)")
            b = 1
        if mb % dp or (mb // dp) % b:
            raise ValueError(f"verl key {bkey}={b}: the mini-batch {mb} sequences ({arr}.actor.ppo_mini_batch_size="
                             f"{mini_prompts} x rollout.n={samples}) over DP={dp} must be a multiple of it")
        rc = _recompute(c, prefix, strategy, model_prefix)
        return Candidate(name, tp, pp, dp, micro_batch=b, grad_accum=mb // (dp * b), recompute=rc, gpus=gpus)

    def infer_cand(name, tp, pp, bkey, default=None):
        b = c.int(bkey, default) if default is None else (c.get(bkey, None) or default)
        if b is None:
            raise ValueError(f"verl key {bkey}=None: set the per-GPU micro-batch of {name} (an integer >= 1)")
        return Candidate(name, tp, pp, n // (tp * pp), micro_batch=int(b), gpus=gpus)

    atp, app = _degrees(c, f"{arr}.actor", "actor", n, un, actor_model)
    cands.append(train_cand("actor.train", f"{arr}.actor", atp, app, f"{arr}.actor.ppo_micro_batch_size_per_gpu",
                            f"{arr}.model"))
    cands.append(infer_cand("actor.infer", atp, app, f"{arr}.rollout.log_prob_micro_batch_size_per_gpu"))
    rtp, rpp = _degrees(c, f"{arr}.ref", "reference", n, [], actor_model) \
        if c.get(f"{arr}.ref.strategy", c.get(f"{arr}.actor.strategy", "fsdp")) == "megatron" else (atp, app)
    cands.append(infer_cand("reference.infer", rtp, rpp, f"{arr}.ref.log_prob_micro_batch_size_per_gpu"))
    gtp = c.int(f"{arr}.rollout.tensor_model_parallel_size", 1)
    why = valid_tp(actor_model, gtp)
    if why or n % gtp:
        raise ValueError(f"verl key {arr}.rollout.tensor_model_parallel_size={gtp}: "
                         f"{why or f'must divide the {n} GPUs'}")
    for k in ("data_parallel_size", "pipeline_model_parallel_size"):
        v = c.get(f"{arr}.rollout.{k}", 1)
        if v and v > 1:
            un.append(Unexpressible(f"{arr}.rollout.{k}", v, "Nereus's generation replicas are TP groups "
                                    "(rollout DP is N / TP); in-engine DP/PP is not in its plan space"))
    frac = c.get(f"{arr}.rollout.gpu_memory_utilization", 0.5)
    max_seqs = c.int(f"{arr}.rollout.max_num_seqs", 256)
    conc = generation_concurrency(job, gtp, float(frac), max_seqs)
    if conc < 1:
        raise ValueError(f"verl key {arr}.rollout.gpu_memory_utilization={frac}: too small to hold the "
                         f"{actor_model.name} weights at rollout TP {gtp} on {gpu_spec.name}")
    per_replica = -(-wl.rollouts_per_step // (n // gtp))
    cands.append(Candidate("actor.generate", gtp, 1, n // gtp, concurrency=min(conc, per_replica), gpus=gpus))
    if algo == "ppo":
        cm = c.get("critic.model.path", None)
        ctp, cpp = _degrees(c, "critic", "critic", n, un, actor_model)
        cands.append(train_cand("critic.train", "critic", ctp, cpp, "critic.ppo_micro_batch_size_per_gpu",
                                "critic.model"))
        cands.append(infer_cand("critic.infer", ctp, cpp, "critic.ppo_micro_batch_size_per_gpu"))
        if cm and cm != c.get(f"{arr}.model.path", None):
            notes.append("critic.model.path differs from the actor's: Nereus uses the actor's shapes with a value head")
    if reward:
        wtp = c.get("reward.reward_model.rollout.tensor_model_parallel_size", None) or 1
        wgpus = gpus
        if c.get("reward.reward_model.enable_resource_pool", False):
            wn = c.int("reward.reward_model.nnodes", 1) * c.int("reward.reward_model.n_gpus_per_node", 1)
            wgpus = tuple(range(n, n + wn))
            job = JobSpec(actor=actor_model, cluster=ClusterSpec(gpu_spec, -(-(n + wn) // gpn), gpn), workload=wl)
        cands.append(Candidate("reward.infer", wtp, 1, len(wgpus) // wtp, micro_batch=wl.infer_micro_batch_size,
                               gpus=wgpus))
        notes.append(f"reward.infer micro-batch: verl serves the reward model with an inference engine; "
                     f"Nereus's default {wl.infer_micro_batch_size} is used")
    names = sorted(m.name for m in workflow_for(wl).model_stages if m.stage == "infer")
    if n and len(names) > 1:
        un.insert(0, Unexpressible("trainer.n_gpus_per_node", gpn, COLOCATION.format(names=", ".join(names))))
    order = {m.name: i for i, m in enumerate(workflow_for(wl).model_stages)}
    cands.sort(key=lambda x: order[x.model_stage])
    read = {k: v for k, v in c.read.items()}
    return Imported("verl", job, tuple(cands), un, read, notes)


# ---------------------------------------------------------------------------------------- export
def _pow2_upto(k: int):
    v = 1
    while v <= k:
        yield v
        v *= 2


def _train_options(job, cost, name, n, tp, pp, bmax):
    dp = n // (tp * pp)
    mb = job.workload.mini_batch_size
    if mb % dp:
        return []
    out = []
    for b in _pow2_upto(min(bmax, mb // dp)):
        if (mb // dp) % b:
            continue
        for rc in ("none", "selective", "full"):
            out.append(Candidate(name, tp, pp, dp, micro_batch=b, grad_accum=mb // (dp * b), recompute=rc,
                                 gpus=tuple(range(n))))
    return out


def _pareto(items):
    """Keep (time, resident, transient, payload) items no other beats on all three."""
    items = sorted(items, key=lambda x: (x[0], x[1], x[2]))
    kept = []
    for it in items:
        if not any(k[0] <= it[0] and k[1] <= it[1] and k[2] <= it[2] for k in kept):
            kept.append(it)
    return kept


def closest_verl_layout(job: JobSpec, headroom: float | None = None) -> tuple[Candidate, ...]:
    """The fastest layout verl can express for ``job`` on its whole cluster (module docstring).

    Groups: actor (train and infer share TP/PP; verl computes old log-probs with the training
    engine), reference, critic (train and infer share TP/PP and micro-batch), rollout (TP and
    concurrency), reward (inference-engine TP). Exhaustive over the groups' Pareto-optimal options.

    Raises:
        ValueError: nothing verl can express fits (names the smallest per-GPU need).
    """
    cost = CostModel(job, headroom=headroom)
    w = job.workload
    n = job.cluster.num_gpus
    model = job.actor
    wf = {m.name for m in workflow_for(w).model_stages}
    layouts = [(tp, pp) for tp in _pow2_upto(n) for pp in _pow2_upto(n // tp)
               if not (valid_tp(model, tp) or valid_pp(model, pp)) and n % (tp * pp) == 0]

    def est(c):
        e = cost.estimate_candidate(c, job.cluster.num_nodes > 1)
        return e

    groups = []  # each: list of (time by stage dict, resident, transient, candidates)

    def add_group(options):
        items = []
        for cs in options:
            es = [est(x) for x in cs]
            t = sum(e.time for e in es)
            items.append((t, sum(e.resident for e in es), max(e.transient for e in es), tuple(cs)))
        groups.append(_pareto(items))

    bmax = w.micro_batch_size
    opts = []
    for tp, pp in layouts:
        for tr in _train_options(job, cost, "actor.train", n, tp, pp, bmax):
            for bi in sorted({tr.micro_batch, w.infer_micro_batch_size}):
                opts.append((tr, Candidate("actor.infer", tp, pp, n // (tp * pp), micro_batch=bi, gpus=tr.gpus)))
    add_group(opts)
    add_group([(Candidate("reference.infer", tp, pp, n // (tp * pp), micro_batch=b, gpus=tuple(range(n))),)
               for tp, pp in layouts for b in sorted({1, w.infer_micro_batch_size})])
    if "critic.train" in wf:
        opts = []
        for tp, pp in layouts:
            for tr in _train_options(job, cost, "critic.train", n, tp, pp, bmax):
                opts.append((tr, Candidate("critic.infer", tp, pp, tr.dp, micro_batch=tr.micro_batch, gpus=tr.gpus)))
        add_group(opts)
    gen = []
    for tp in _pow2_upto(n):
        if valid_tp(model, tp) or n % tp:
            continue
        per = -(-w.rollouts_per_step // (n // tp))
        for c in sorted({min(per, 2 ** k) for k in range(0, 11)}):
            gen.append((Candidate("actor.generate", tp, 1, n // tp, concurrency=c, gpus=tuple(range(n))),))
    add_group(gen)
    if "reward.infer" in wf:
        add_group([(Candidate("reward.infer", tp, 1, n // tp, micro_batch=w.infer_micro_batch_size,
                              gpus=tuple(range(n))),) for tp in _pow2_upto(n) if not valid_tp(model, tp) and n % tp == 0])
    usable = cost.usable
    best = None
    for combo in itertools.product(*groups):
        r = sum(g[1] for g in combo)
        x = max(g[2] for g in combo)
        if r + x > usable:
            continue
        t = sum(g[0] for g in combo)
        if best is None or t < best[0]:
            best = (t, combo)
    if best is None:
        need = sum(min(g[1] + g[2] for g in grp) for grp in groups) / 1024**3
        raise ValueError(f"no layout verl can express fits: every model-stage on all {n} GPUs needs at least "
                         f"{need:.1f} GiB per GPU, {usable / 1024**3:.1f} GiB usable")
    cands = [c for g in best[1] for c in g[3]]
    order = {m.name: i for i, m in enumerate(workflow_for(w).model_stages)}
    return tuple(sorted(cands, key=lambda x: order[x.model_stage]))


def verl_overrides(job: JobSpec, cands, model_path: str | None = None) -> list[str]:
    """``key=value`` overrides of verl's ``ppo_megatron_trainer`` config for a verl-expressible layout."""
    w = job.workload
    by = {c.model_stage: c for c in cands}
    if w.mini_batch_size % w.samples_per_prompt:
        raise ValueError(f"workload mini_batch_size={w.mini_batch_size} is not a multiple of samples_per_prompt="
                         f"{w.samples_per_prompt}: verl's ppo_mini_batch_size counts prompts")
    adv = {v: k for k, v in ADV_ESTIMATORS.items()}[w.algorithm]
    arr = "actor_rollout_ref"
    a, g = by["actor.train"], by["actor.generate"]
    ov = [f"algorithm.adv_estimator={adv}", f"data.train_batch_size={w.prompts_per_step}",
          f"data.max_prompt_length={w.prompt_len}", f"data.max_response_length={w.response_len}",
          f"trainer.nnodes={job.cluster.num_nodes}", f"trainer.n_gpus_per_node={job.cluster.gpus_per_node}",
          f"{arr}.rollout.n={w.samples_per_prompt}",
          f"{arr}.actor.ppo_mini_batch_size={w.mini_batch_size // w.samples_per_prompt}",
          f"{arr}.actor.ppo_epochs={w.ppo_epochs}"]
    if model_path:
        ov.append(f"{arr}.model.path={model_path}")

    def megatron(prefix, c, train):
        out = [f"{prefix}.strategy=megatron", f"{prefix}.megatron.tensor_model_parallel_size={c.tp}",
               f"{prefix}.megatron.pipeline_model_parallel_size={c.pp}"]
        if train:
            out += [f"{prefix}.megatron.use_distributed_optimizer=False",
                    f"{prefix}.ppo_micro_batch_size_per_gpu={c.micro_batch}"]
            rc = {"none": "null", "selective": "selective", "full": "full"}[c.recompute]
            out.append(f"{prefix}.megatron.override_transformer_config.recompute_granularity={rc}")
            if c.recompute == "full":
                out += [f"{prefix}.megatron.override_transformer_config.recompute_method=uniform",
                        f"{prefix}.megatron.override_transformer_config.recompute_num_layers=1"]
        return out

    ov += megatron(f"{arr}.actor", a, True)
    ov += [f"{arr}.actor.use_dynamic_bsz=False",
           f"{arr}.rollout.log_prob_micro_batch_size_per_gpu={by['actor.infer'].micro_batch}"]
    r = by["reference.infer"]
    ov += megatron(f"{arr}.ref", r, False) + [f"{arr}.ref.log_prob_micro_batch_size_per_gpu={r.micro_batch}"]
    ov += [f"{arr}.rollout.tensor_model_parallel_size={g.tp}",
           f"{arr}.rollout.gpu_memory_utilization={memory_fraction_for(job, g.tp, g.concurrency)}",
           f"{arr}.rollout.max_num_seqs={g.concurrency}"]
    if "critic.train" in by:
        ov += megatron("critic", by["critic.train"], True)
    if "reward.infer" in by:
        ov += ["reward.reward_model.enable=True",
               f"reward.reward_model.rollout.tensor_model_parallel_size={by['reward.infer'].tp}"]
    return ov


def _changes(best: Plan, cands) -> list[str]:
    out = []
    by = {c.model_stage: c for c in cands}
    for b in best.candidates:
        c = by.get(b.model_stage)
        if c is None:
            continue
        diffs = [f"{k} {getattr(b, k)} -> {getattr(c, k)}" for k in
                 ("tp", "pp", "dp", "micro_batch", "grad_accum", "recompute", "concurrency") if getattr(b, k) != getattr(c, k)]
        if sorted(b.gpus) != sorted(c.gpus):
            from nereus.planner.notation import format_gpus
            diffs.append(f"GPUs {format_gpus(b.gpus)} -> {format_gpus(c.gpus)}")
        if diffs:
            out.append(f"{b.model_stage}: " + ", ".join(diffs))
    return out


def export_verl(job: JobSpec, best: Plan, headroom: float | None = None, model_path: str | None = None) -> dict:
    """Nereus's plan ``best`` as verl overrides: the closest layout verl can express, what changed,
    and both predicted step times. JSON-ready."""
    cands = closest_verl_layout(job, headroom)
    ev = evaluate_layout(job, cands, headroom)
    return {"framework": "verl", "config_name": "ppo_megatron_trainer",
            "overrides": verl_overrides(job, cands, model_path),
            "layout": [c for c in cands], "evaluation": ev, "nereus_l_step": best.l_step,
            "l_step": ev.l_step, "changes": _changes(best, cands),
            "note": ("verl runs every model-stage on all GPUs of one resource pool (hybrid engine), one after "
                     "another; predicted with model-stages that share GPUs in a stage run in sequence"),
            "slowdown": ev.l_step / best.l_step if best.l_step > 0 else math.nan}
