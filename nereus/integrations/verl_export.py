"""verl export: Nereus's plan as overrides of verl's trainer configs (:func:`export_verl`).

The closest layout verl can express is searched over per-role TP/PP, ZeRO stage, interleaving,
offload, recompute, micro-batches and rollout concurrency/sleep, every model-stage on the one
resource pool of the hybrid engine (:func:`closest_verl_layout`); when Nereus's own plan is a layout
verl runs (:func:`verl_expressible`) and faster, it is exported as is. :func:`verl_overrides` writes
the Hydra overrides of ``ppo_megatron_trainer`` or ``ppo_trainer`` (FSDP). The import side is
:mod:`nereus.integrations.verl`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_pp, valid_tp
from nereus.integrations.common import (
    best_colocated,
    memory_fraction_for,
    pareto,
    without_fraction,
)
from nereus.planner.whatif import evaluate_layout
from nereus.spec.framework import get_framework
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.workflow import workflow_for

__all__ = ["export_verl", "verl_job", "verl_overrides", "verl_expressible", "closest_verl_layout",
           "CONFIG_NAMES", "DEFAULT_BACKENDS", "VERL_DROP", "ADV_ESTIMATORS"]

#: verl's ``algorithm.adv_estimator`` values Nereus models, and the algorithm each one is.
ADV_ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "remax": "remax"}
#: the only model-stage verl frees and reloads (the rollout engine's sleep, level 2, re-synced weights)
VERL_DROP = ("actor.generate",)

# ---------------------------------------------------------------------------------------- export
#: verl's backends: the trainer config each one's overrides apply to
CONFIG_NAMES = {"megatron": "ppo_megatron_trainer", "fsdp": "ppo_trainer"}
#: backends an export searches by default (``nereus plan --export verl`` prints ppo_megatron_trainer)
DEFAULT_BACKENDS = ("megatron",)


def _pow2_upto(k: int):
    v = 1
    while v <= k:
        yield v
        v *= 2


def verl_job(job: JobSpec, backend: str) -> JobSpec:
    """``job`` with the framework flags verl's ``backend`` runs with: the imported ones when the job
    came from the same verl backend, else verl's defaults (Megatron: SP on, no DDP overlap, fp32
    reduce; FSDP: fp32 reduce, overlapped), colocation ``always`` (the hybrid engine), and the
    backend's logits kernel (:func:`nereus.integrations.verl_features.verl_logits_kernel`: Megatron's
    fp32 vocab-parallel cross-entropy; FSDP's bf16 logits with flash-attn's, the job's own when it came
    from FSDP, else verl's defaults ``flash_ce``)."""
    job = without_fraction(job)  # the export sizes vLLM's fraction itself (memory_fraction_for)
    fw = job.framework
    w = job.workload
    kernel = None if backend == "megatron" else (w.logits_kernel if fw.name == "verl-fsdp" else "flash_ce")
    if w.logits_kernel != kernel:
        job = job.with_workload(replace(w, logits_kernel=kernel))
    if backend == "megatron":
        if fw.name == "verl-megatron":
            return job.with_framework(replace(fw, colocate="always"))
        return job.with_framework(replace(get_framework("megatron"), name="verl-megatron", sequence_parallel=True,
                                          overlap_grad_reduce=False, grad_reduce_bytes=4, colocate="always",
                                          uneven_pp=False, drop_model_stages=VERL_DROP, shared_engine=True,
                                          persistent_grads=True))
    # the export writes no mixed_precision section: verl reduces in fp32
    return job.with_framework(replace(get_framework("fsdp"), name="verl-fsdp", grad_reduce_bytes=4, colocate="always",
                                      drop_model_stages=VERL_DROP, shared_engine=True, fp32_train_params=True))


class _Search:
    """Options of every verl role on the whole pool, each group Pareto-pruned (time, resident,
    transient), combined by :func:`best_colocated`."""

    def __init__(self, job: JobSpec, backend: str, headroom):
        self.job, self.backend = job, backend
        self.cost = CostModel(job, headroom=headroom)
        self.n = job.cluster.num_gpus
        self.gpus = tuple(range(self.n))
        self.multi = job.cluster.num_nodes > 1
        self._est: dict = {}
        self._costs: dict = {}
        self.headroom = headroom

    def est(self, c: Candidate):
        k = c.key()
        if k not in self._est:
            cost = self.cost
            if c.model_stage == "actor.generate":  # vLLM holds the fraction the export writes for it
                cost = self._gen_cost(_fraction(self.job, (c,)))
            self._est[k] = cost.estimate_candidate(c, self.multi)
        return self._est[k]

    def _gen_cost(self, frac: float) -> CostModel:
        if frac not in self._costs:
            self._costs[frac] = CostModel(with_fraction(self.job, frac), headroom=self.headroom)
        return self._costs[frac]

    def valid(self, c: Candidate) -> bool:
        from nereus.cost.checks import check_candidate

        try:
            check_candidate(self.job, self.cost.workflow.get(c.model_stage), c)
        except ValueError:
            return False
        return True

    def group(self, options) -> list:
        items = []
        for cs in options:
            es = [self.est(x) for x in cs]
            items.append((sum(e.time for e in es), sum(e.resident for e in es), max(e.transient for e in es),
                          tuple(cs)))
        return pareto(items)

    def layouts(self):
        model, n = self.job.actor, self.n
        if self.backend == "fsdp":
            return [(1, 1)]
        return [(tp, pp) for tp in _pow2_upto(n) for pp in _pow2_upto(n // tp)
                if not (valid_tp(model, tp) or valid_pp(model, pp)) and n % (tp * pp) == 0]

    def train_options(self, name: str, tp: int, pp: int):
        w, fw = self.job.workload, self.job.framework
        dp = self.n // (tp * pp)
        mb = w.mini_batch_size
        if mb % dp:
            return []
        if self.backend == "fsdp":
            zeros, rcs, vpps = ((2, 3) if dp > 1 else (3,)), ("none", "full"), (1,)
        else:
            zeros, rcs = ((0, 1) if dp > 1 else (0,)), ("none", "selective", "full")
            per_rank = self.job.actor.num_layers // pp
            vpps = (1,) + tuple(v for v in range(2, fw.max_virtual_stages + 1) if pp > 1 and per_rank % v == 0)
        out = []
        for b in _pow2_upto(min(w.micro_batch_size, mb // dp)):
            if (mb // dp) % b:
                continue
            for rc in rcs:
                for z in zeros:
                    for off in ("none", "host"):
                        for v in vpps:
                            c = Candidate(name, tp, pp, dp, micro_batch=b, grad_accum=mb // (dp * b), recompute=rc,
                                          zero=z, offload=off, vpp=v, gpus=self.gpus)
                            if self.valid(c):
                                out.append(c)
        return out

    def groups(self):
        w, n, gpus, model = self.job.workload, self.n, self.gpus, self.job.actor
        wf = {m.name for m in workflow_for(w).model_stages}
        layouts = self.layouts()
        bi = w.infer_micro_batch_size
        out = []
        opts = []
        for tp, pp in layouts:
            for tr in self.train_options("actor.train", tp, pp):
                for b in sorted({tr.micro_batch, bi}):  # verl: rollout.log_prob_micro_batch_size_per_gpu
                    opts.append((tr, Candidate("actor.infer", tp, pp, tr.dp, micro_batch=b, offload=tr.offload,
                                               zero=_infer_zero(tr), gpus=gpus)))
        out.append(self.group(opts))
        ref_offload = ("host",) if self.backend == "fsdp" else ("none", "host")  # FSDP: forward-only CPU offload
        ref_zero = 3 if self.backend == "fsdp" and n > 1 else 0  # verl's FSDP ref: FULL_SHARD
        if "reference.infer" in wf:
            out.append(self.group([(Candidate("reference.infer", tp, pp, n // (tp * pp), micro_batch=b, offload=o,
                                              zero=ref_zero, gpus=gpus),)
                                   for tp, pp in layouts for b in sorted({1, bi}) for o in ref_offload]))
        if "critic.train" in wf:
            opts = []
            for tp, pp in layouts:
                for tr in self.train_options("critic.train", tp, pp):
                    opts.append((tr, Candidate("critic.infer", tp, pp, tr.dp, micro_batch=tr.micro_batch,
                                               offload=tr.offload, zero=_infer_zero(tr), gpus=gpus)))
            out.append(self.group(opts))
        gen = []
        for tp in _pow2_upto(n):
            if valid_tp(model, tp) or n % tp:
                continue
            per = -(-w.rollouts_per_step // (n // tp))
            for c in sorted({min(per, 2 ** k) for k in range(0, 11)}):
                for o in ("none", "drop"):
                    gen.append((Candidate("actor.generate", tp, 1, n // tp, concurrency=c, offload=o, gpus=gpus),))
        out.append(self.group(gen))
        if "reward.infer" in wf:
            out.append(self.group([(Candidate("reward.infer", tp, 1, n // tp, micro_batch=bi, offload=o, gpus=gpus),)
                                   for tp in _pow2_upto(n) if not valid_tp(model, tp) and n % tp == 0
                                   for o in ("none", "host")]))
        return out

    def best(self):
        groups = self.groups()
        if any(not g for g in groups):
            return None, groups
        return best_colocated(groups, self.cost.usable), groups


def with_fraction(job: JobSpec, frac: float) -> JobSpec:
    """``job`` with vLLM's ``gpu_memory_utilization`` ``frac``: what verl's vLLM pre-allocates, held
    through training unless it sleeps (``free_cache_engine``), as the re-import evaluates it."""
    return job.with_workload(replace(job.workload, rollout_memory_fraction=frac))


def _fraction(job: JobSpec, cands) -> float:
    """The generation engine's fraction rounded as written (0.41, not 0.41000000000000003)."""
    g = next(c for c in cands if c.model_stage == "actor.generate")
    return round(memory_fraction_for(job, g.tp, g.concurrency), 2)


def closest_verl_layout(job: JobSpec, headroom: float | None = None,
                        backends=DEFAULT_BACKENDS) -> tuple[str, JobSpec, tuple[Candidate, ...]]:
    """The fastest layout verl can express for ``job`` on its whole cluster (module docstring), over
    ``backends``: ``(backend, the job with that backend's framework, candidates)``.

    Groups: actor (train and infer share the engine: TP/PP, param offload), reference, critic (train
    and infer share the engine and micro-batch), rollout (TP, concurrency, sleep), reward (inference
    engine TP, sleep). Megatron: TP/PP, distributed optimizer (ZeRO-1), VPP, recompute none /
    selective / full; FSDP: DP over all GPUs, ZeRO-2/3, gradient checkpointing. Offload ``host``
    (param + optimizer offload) or none per engine; exact over the groups' Pareto-optimal options.

    Raises:
        ValueError: nothing verl can express fits (names the smallest per-GPU need).
    """
    found = []
    need = []
    for backend in backends:
        vjob = verl_job(job, backend)
        s = _Search(vjob, backend, headroom)
        best, groups = s.best()
        if best is not None:
            found.append((best[0], backend, vjob, [c for g in best[1] for c in g]))
        elif groups and all(groups):
            need.append((sum(min(x[1] + x[2] for x in g) for g in groups) / 1024**3, backend, s.cost.usable))
    if not found:
        msg = "; ".join(f"{b}: at least {gib:.1f} GiB per GPU, {u / 1024**3:.1f} GiB usable" for gib, b, u in need)
        raise ValueError(f"no layout verl can express fits: every model-stage on all {job.cluster.num_gpus} GPUs "
                         f"({msg or 'the mini-batch does not split over the GPUs'})")
    _, backend, vjob, cands = min(found, key=lambda x: x[0])
    vjob = with_fraction(vjob, _fraction(vjob, cands))
    order = {m.name: i for i, m in enumerate(workflow_for(job.workload).model_stages)}
    return backend, vjob, tuple(sorted(cands, key=lambda x: order[x.model_stage]))


def _tf(v: bool) -> str:
    return "True" if v else "False"


def verl_overrides(job: JobSpec, cands, model_path: str | None = None, backend: str = "megatron") -> list[str]:
    """``key=value`` overrides of verl's ``ppo_megatron_trainer`` (``backend="megatron"``) or
    ``ppo_trainer`` (``"fsdp"``) config for a verl-expressible layout on the whole pool; the
    framework flags (SP, DDP overlap, reduce dtype) are ``job.framework``'s."""
    w, fw = job.workload, job.framework
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
        if "critic.train" in by:
            ov.append(f"critic.model.path={model_path}")

    def megatron(prefix, c, train):
        m = f"{prefix}.megatron"
        out = [f"{prefix}.strategy=megatron", f"{m}.tensor_model_parallel_size={c.tp}",
               f"{m}.pipeline_model_parallel_size={c.pp}", f"{m}.sequence_parallel={_tf(fw.sequence_parallel)}",
               f"{m}.param_offload={_tf(c.offload == 'host')}", f"{m}.context_parallel_size=1"]
        if train:
            out += [f"{m}.optimizer_offload={_tf(c.offload == 'host')}",
                    f"{m}.use_distributed_optimizer={_tf(c.zero >= 1)}",
                    f"{m}.virtual_pipeline_model_parallel_size={c.vpp if c.vpp > 1 else 'null'}",
                    f"{prefix}.ppo_micro_batch_size_per_gpu={c.micro_batch}"]
            rc = {"none": "null", "selective": "selective", "full": "full"}[c.recompute]
            out.append(f"{m}.override_transformer_config.recompute_granularity={rc}")
            if c.recompute == "full":
                out += [f"{m}.override_transformer_config.recompute_method=uniform",
                        f"{m}.override_transformer_config.recompute_num_layers=1"]
            if fw.overlap_grad_reduce:
                out.append(f"+{m}.override_ddp_config.overlap_grad_reduce=True")
            if fw.grad_reduce_bytes == 2:
                out.append(f"+{m}.override_ddp_config.grad_reduce_in_fp32=False")
        return out

    def fsdp(prefix, sec, model_prefix, c):
        return [f"{prefix}.strategy=fsdp", f"{sec}.reshard_after_forward={_tf(c.zero == 3)}",
                f"{sec}.param_offload={_tf(c.offload == 'host')}", f"{sec}.optimizer_offload={_tf(c.offload == 'host')}",
                f"{prefix}.ppo_micro_batch_size_per_gpu={c.micro_batch}", f"{prefix}.ulysses_sequence_parallel_size=1",
                f"{model_prefix}.enable_gradient_checkpointing={_tf(c.recompute == 'full')}"]

    if backend == "megatron":
        ov += megatron(f"{arr}.actor", a, True)
    else:
        ov += fsdp(f"{arr}.actor", f"{arr}.actor.fsdp_config", f"{arr}.model", a)
    ov += [f"{arr}.actor.use_dynamic_bsz=False",
           f"{arr}.rollout.log_prob_micro_batch_size_per_gpu={by['actor.infer'].micro_batch}"]
    r = by.get("reference.infer")  # None: no KL term, verl builds no reference model
    if r is not None and backend == "megatron":
        ov += megatron(f"{arr}.ref", r, False)
    elif r is not None and backend == "fsdp":
        ov += [f"{arr}.ref.ulysses_sequence_parallel_size=1"]
    if r is not None:
        ov += [f"{arr}.ref.log_prob_micro_batch_size_per_gpu={r.micro_batch}",
               f"{arr}.ref.log_prob_use_dynamic_bsz=False"]
    ov += [f"{arr}.rollout.log_prob_use_dynamic_bsz=False"]
    ov += [f"{arr}.rollout.tensor_model_parallel_size={g.tp}",
           f"{arr}.rollout.gpu_memory_utilization={_fraction(job, (g,))}",
           f"{arr}.rollout.max_num_seqs={g.concurrency}",
           f"{arr}.rollout.free_cache_engine={_tf(g.offload == 'drop')}"]
    if "critic.train" in by:
        ct = by["critic.train"]
        ov += megatron("critic", ct, True) if backend == "megatron" else fsdp("critic", "critic.fsdp", "critic.model", ct)
        ov += ["critic.use_dynamic_bsz=False"]
        if backend == "fsdp":  # ppo_megatron_trainer's critic has no forward micro-batch key
            ov += [f"critic.forward_micro_batch_size_per_gpu={by['critic.infer'].micro_batch}"]
    if "reward.infer" in by:
        rw = by["reward.infer"]
        ov += ["reward.reward_model.enable=True",
               f"reward.reward_model.rollout.tensor_model_parallel_size={rw.tp}",
               f"reward.reward_model.rollout.free_cache_engine={_tf(rw.offload == 'host')}"]
    return ov


def _changes(best: Plan, cands) -> list[str]:
    out = []
    by = {c.model_stage: c for c in cands}
    for b in best.candidates:
        c = by.get(b.model_stage)
        if c is None:
            continue
        diffs = [f"{k} {getattr(b, k)} -> {getattr(c, k)}" for k in
                 ("tp", "pp", "dp", "micro_batch", "grad_accum", "recompute", "concurrency", "zero", "offload", "vpp")
                 if getattr(b, k) != getattr(c, k)]
        if sorted(b.gpus) != sorted(c.gpus):
            from nereus.planner.notation import format_gpus
            diffs.append(f"GPUs {format_gpus(b.gpus)} -> {format_gpus(c.gpus)}")
        if diffs:
            out.append(f"{b.model_stage}: " + ", ".join(diffs))
    return out


def _infer_zero(train: Candidate) -> int:
    """ZeRO stage of the forward passes run on a training engine: 3 on a FULL_SHARD (ZeRO-3) engine
    with more than one rank, else 0 (their weights are whole on each GPU)."""
    return 3 if train.zero == 3 and train.dp > 1 else 0


def verl_expressible(job: JobSpec, cands, backend: str) -> str | None:
    """Why placed candidates are not a layout verl's ``backend`` runs with the hybrid engine, or None:
    every model-stage on the whole pool; ``actor.infer`` on the actor's engine (its TP/PP, its offload)
    and ``critic.infer`` on the critic's (also its micro-batch); training offload ``none``/``host``,
    ZeRO 0/1 (Megatron) or 2/3 with TP = PP = 1 and recompute none/full (FSDP); the reference
    ``none``/``host`` (FSDP: ``host``); generation ``none``/``drop`` and the reward engine
    ``none``/``host``, both without PP; interleaving for training only."""
    pool = tuple(range(job.cluster.num_gpus))
    by = {c.model_stage: c for c in cands}
    for c in cands:
        if tuple(sorted(c.gpus)) != pool:
            return f"{c.model_stage} is not on all {len(pool)} GPUs (verl's one resource pool)"
        if c.model_stage in ("actor.generate", "reward.infer") and c.pp > 1:
            return f"{c.model_stage} has pp={c.pp} (verl's inference engines are TP groups)"
        if backend == "fsdp" and c.model_stage not in ("actor.generate", "reward.infer") and c.tp * c.pp > 1:
            return f"{c.model_stage} has tp={c.tp} pp={c.pp} (FSDP engines are data-parallel)"
    allowed = {"actor.generate": ("none", "drop"), "reward.infer": ("none", "host"),
               "reference.infer": ("host",) if backend == "fsdp" else ("none", "host")}
    for name, c in by.items():
        if c.offload not in allowed.get(name, ("none", "host")):
            return f"{name} has offload {c.offload!r} (verl: {', '.join(allowed.get(name, ('none', 'host')))})"
    for name, c in by.items():
        want = 3 if name == "reference.infer" and backend == "fsdp" and c.dp > 1 else 0
        if not name.endswith(".train") and c.zero != want and name not in ("actor.infer", "critic.infer"):
            return f"{name} has zero={c.zero} (verl {backend}: {want})"
    for role in ("actor", "critic"):
        t, i = by.get(f"{role}.train"), by.get(f"{role}.infer")
        if t is None:
            continue
        if (i.tp, i.pp, i.offload, i.zero) != (t.tp, t.pp, t.offload, _infer_zero(t)) or \
                (role == "critic" and i.micro_batch != t.micro_batch):
            return (f"{role}.infer does not run on {role}.train's engine (its TP/PP, offload, ZeRO-3 sharding"
                    f"{', micro-batch' if role == 'critic' else ''})")
        zeros = (0, 1) if backend == "megatron" else (2, 3)
        if t.zero not in zeros:
            return f"{role}.train has zero={t.zero} (verl {backend}: {zeros})"
        if backend == "fsdp" and (t.recompute == "selective" or t.vpp > 1):
            return f"{role}.train has recompute {t.recompute!r} / vpp {t.vpp} (FSDP: gradient checkpointing only)"
    return None


def merge_overrides(user, mine) -> list[str]:
    """The user's overrides whose keys Nereus does not set (in their order: data files, model paths, KL,
    reward, logging...), then Nereus's."""
    keys = {o.partition("=")[0].lstrip("+") for o in mine}
    return [o for o in user if o.partition("=")[0].lstrip("+") not in keys] + list(mine)


def export_verl(job: JobSpec, best: Plan, headroom: float | None = None, model_path: str | None = None,
                backends=DEFAULT_BACKENDS, user: dict | None = None) -> dict:
    """Nereus's plan ``best`` as verl overrides: the closest layout verl can express (over
    ``backends``: ``("megatron", "fsdp")`` searches both and ``config_name`` says which config the
    overrides apply to; the default is Megatron only, the config ``nereus plan --export verl``
    prints), what changed, and both predicted step times. When ``best`` itself is a layout a backend
    runs (:func:`verl_expressible`) under that backend's framework and is faster, it is exported as is
    (the planner searches micro-batches and concurrencies the export's grid does not). ``user``
    (``{"config": name, "overrides": [...]}`` of an imported launch line): the export stays on the
    user's backend and config and keeps every override whose key it does not set
    (:func:`merge_overrides`). JSON-ready but
    for ``layout`` and ``evaluation``; ``framework_spec`` is the framework the prediction used
    (:func:`verl_job`)."""
    backend, vjob, cands = closest_verl_layout(job, headroom, backends)
    ev = evaluate_layout(vjob, cands, headroom)
    if user is not None:  # the user's backend and every setting Nereus does not change
        backends = ("fsdp",) if "fsdp" in job.framework.name else ("megatron",)
        backend, vjob, cands = closest_verl_layout(job, headroom, backends)
        ev = evaluate_layout(vjob, cands, headroom)
    for b in backends:
        bjob = verl_job(job, b)
        if bjob.framework != job.framework or verl_expressible(bjob, best.candidates, b) is not None:
            continue
        mine = tuple(c.with_gpus(range(job.cluster.num_gpus)) for c in best.candidates)
        bjob = with_fraction(bjob, _fraction(bjob, mine))
        e2 = evaluate_layout(bjob, mine, headroom)
        if e2.fits and e2.l_step < ev.l_step:
            backend, vjob, cands, ev = b, bjob, mine, e2
    what = ("Megatron engines (distributed optimizer = ZeRO-1)" if backend == "megatron" else
            "FSDP engines (reshard_after_forward = ZeRO-3, else ZeRO-2)")
    ov = verl_overrides(vjob, cands, None if user else model_path, backend)
    config = CONFIG_NAMES[backend]
    if user is not None:
        ov, config = merge_overrides(user.get("overrides", ()), ov), user.get("config") or config
    else:  # verl builds a reference model only for a KL term (the user's own KL keys are kept above)
        ov.append(f"actor_rollout_ref.actor.use_kl_loss={_tf(job.workload.reference_model)}")
    return {"framework": "verl", "backend": backend, "config_name": config,
            "overrides": ov,
            "layout": list(cands), "evaluation": ev, "framework_spec": vjob.framework.to_dict(), "nereus_l_step": best.l_step,
            "l_step": ev.l_step, "changes": _changes(best, cands),
            "note": (f"verl runs every model-stage on all GPUs of one resource pool (hybrid engine), one after "
                     f"another; {what}; predicted with the model-stages of a stage summed on the shared GPUs"),
            "slowdown": ev.l_step / best.l_step if best.l_step > 0 else math.nan}
