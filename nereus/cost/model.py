"""The cost model: time and memory of model-stage candidates, and ``L_step`` of a plan.

:class:`CostModel` ties together shapes (:mod:`nereus.cost.shapes`), memory
(:mod:`nereus.cost.memory`), op-class latencies (:mod:`nereus.cost.latency`) and the current
:class:`~nereus.cost.efficiency.EfficiencyTable`. Its array API (:meth:`CostModel.candidate_arrays`)
evaluates one (tp, pp, micro-batch, recompute, concurrency) class for many DP degrees at once; the
planner uses it. :meth:`CostModel.estimate` fills a placed :class:`~nereus.spec.plan.Plan` with
per-model-stage estimates, per-GPU peak memory and ``L_step``.

Per model-stage time (one RL step):

* train: ``updates · (m·t_last + (pp-1)·t_mid + t_dp + t_opt)`` with ``m = mini/(dp·b)`` (the
  candidate's ``grad_accum``); ``dp·b`` must divide the mini-batch and a set ``grad_accum`` must
  equal ``m``, else a ValueError names the values (no silently dropped sequences, no empty replicas);
* infer: ``m·t_last + (pp-1)·t_mid`` with ``m = ceil(ceil(B/dp)/b)`` (slowest replica);
* generate: ``waves · (prefill + response_len · t_decode)``, ``waves = ceil(ceil(R/dp)/c)``.

``actor.train`` adds the send side and ``actor.generate`` the receive side of the weight sync (none under
``train_engine_generation``). ``L_step``: synchronous: the stages run one after another and model-stages
of a stage in parallel, so the critical path of the execution-overlap graph is ``Σ_stage max_M t_M``;
asynchronous: generation of the next step overlaps inference and training, ``max(t_generate, t_infer + t_train)``.

Per-GPU peak memory: ``workspace + Σ resident of every model-stage on the GPU + the largest transient
among them`` (idle model-stages stay resident; ``shared_engine``: cost/step.py). A plan is feasible when
every GPU's peak fits ``(1 - headroom) · capacity``, ``1 - headroom`` the workload's ``memory_fraction``
when set (vLLM's ``gpu_memory_utilization``), else 0.9; memory terms at ``response_len_max`` when set
(:mod:`nereus.cost.memory`), times at the mean.
"""

from __future__ import annotations

import numpy as np

from nereus.cost import engine_terms as et
from nereus.cost import latency as lat
from nereus.cost.checks import check_candidate, check_train_batch
from nereus.cost.detail import RowDetail
from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.host_optimizer import cpu_adam_times
from nereus.cost.lora import frozen_pass, lora_dp_sync_time, lora_sync_share, trainable_share
from nereus.cost.memory import OFF_CPU_ADAM, WORKSPACE_BYTES, offload_code, recompute_code, stage_memory
from nereus.cost.rows import expand, rows_of, unique_rows
from nereus.cost.seqpar import with_seq_split
from nereus.cost.sharded_infer import infer_gather_times
from nereus.cost.step import engine_owned, stage_groups
from nereus.cost.train_state import engine_train_state
from nereus.cost.vllm_memory import kv_capacity, preallocated_memory
from nereus.cost.vllm_startup import apply_vllm_rule, gpu_excess
from nereus.cost.zero3 import zero3_infer_comm, zero3_train_comm
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan, StageEstimate
from nereus.workflow import ModelStage, Workflow, workflow_for

__all__ = ["CostModel", "default_headroom", "DEFAULT_HEADROOM", "FROZEN_MODELS"]

#: fraction of device memory kept free when neither the caller nor the job sets one
DEFAULT_HEADROOM = 0.1
#: models whose weights never change during the run (reloadable from a host copy)
FROZEN_MODELS = ("reference", "reward")


def _sum(d: dict):
    return sum(d.values()) if d else 0.0


def _scale(d: dict, k) -> dict:
    return {c: v * k for c, v in d.items()}


def _combine(*ds) -> dict:
    out: dict = {}
    for d in ds:
        for c, v in d.items():
            out[c] = out.get(c, 0.0) + v
    return out


class CostModel:
    """Predicts model-stage times, memory and ``L_step`` for one job.

    Args:
        job: models, cluster and workload.
        efficiency: op-class efficiencies (a fresh default table when None). Read on every call, so
            calibration updates take effect at once.
        memory_correction: model-stage name → multiplier on its predicted bytes (calibrated from
            measured peaks; DESIGN.md §4.3).
        headroom: fraction of capacity kept free; None: ``1 - workload.memory_fraction`` when the job
            sets it, else :data:`DEFAULT_HEADROOM` (10%).
        workspace: bytes per GPU for CUDA context, NCCL buffers, cuBLAS workspace.
        workflow: the model-stages to plan (defaults to the algorithm's workflow).

    Raises:
        ValueError: headroom outside [0, 1).
    """

    def __init__(self, job: JobSpec, efficiency: EfficiencyTable | None = None,
                 memory_correction: dict | None = None, headroom: float | None = None,
                 workspace: float = WORKSPACE_BYTES, workflow: Workflow | None = None):
        if headroom is None:
            headroom = default_headroom(job)
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
        self.job, self._workflow_override = job, workflow
        self.workflow: Workflow = workflow if workflow is not None else workflow_for(job.workload)
        self.eff = efficiency if efficiency is not None else EfficiencyTable()
        self.memory_correction = dict(memory_correction or {})
        self.headroom = headroom
        self.workspace = workspace

    # ------------------------------------------------------------------ basics
    @property
    def capacity(self) -> float:
        """Bytes per GPU a plan may use: ``(1 - headroom) · device memory``."""
        return (1.0 - self.headroom) * self.job.cluster.gpu.memory_bytes

    @property
    def usable(self) -> float:
        """Capacity left for model-stage state after the per-GPU workspace."""
        return self.capacity - self.workspace

    def model_of(self, ms: ModelStage):
        return self.job.model(ms.model)

    def with_job(self, job: JobSpec) -> CostModel:
        """The same calibration applied to another job (e.g. a new response length)."""
        return CostModel(job, self.eff, self.memory_correction, self.headroom, self.workspace,
                         self._workflow_override)

    # ------------------------------------------------------------------ arrays
    def candidate_arrays(self, ms: ModelStage, tp, pp, dp, *, micro_batch=1, recompute="none",
                         concurrency=0, zero=0, offload=0, vpp=1, multi_node: bool = False,
                         breakdown: bool = False, cp: int = 1) -> dict:
        """Time and memory of candidates of ``ms``, elementwise over arrays.

        ``tp``, ``pp``, ``dp``, ``micro_batch``, ``recompute`` (mode or codes), ``concurrency``,
        ``zero`` (ZeRO stage, train), ``offload`` (mode or codes of
        :data:`nereus.cost.memory.OFFLOAD_CODES`) and ``vpp`` (interleaving, train) may be scalars or
        arrays of one shape; the caller guarantees valid values (see :func:`check_candidate`). The
        job's framework flags (sequence parallelism, overlaps, reduce dtype) apply to every row.
        ``cp``: sequence split of train/infer rows (:mod:`nereus.cost.seqpar`; ``dp`` counts replicas of
        ``tp·pp·cp`` GPUs); LoRA and vLLM's fixed fraction: :mod:`nereus.cost.lora`, ``vllm_memory``.

        Returns:
            dict with ``time`` (seconds per step), ``resident`` and ``transient`` (bytes per GPU),
            ``memory`` (terms), and ``breakdown`` (op class → seconds) when asked; arrays over rows;
            ``detail``: a :class:`~nereus.cost.detail.RowDetail` giving one row's whole estimate.
        """
        w = self.job.workload
        model = self.model_of(ms)
        cl, eff = self.job.cluster, self.eff
        dp = np.atleast_1d(np.asarray(dp, dtype=np.int64))
        tp = np.broadcast_to(np.asarray(tp, dtype=np.int64), dp.shape)
        pp = np.broadcast_to(np.asarray(pp, dtype=np.int64), dp.shape)
        corr = self.memory_correction.get(ms.name, 1.0)
        fw, eng = self.job.framework, self.job.framework.engine
        off = offload_code(offload)
        if not breakdown and ms.stage != "train" and np.ndim(off) and dp.size >= 64 and cp == 1 \
                and w.rollout_memory_fraction is None:
            got = self._by_offload(ms, tp, pp, dp, micro_batch, concurrency, np.broadcast_to(off, dp.shape),
                                   multi_node, corr, np.broadcast_to(np.asarray(zero), dp.shape))
            if got is not None:
                return got
        if ms.stage == "train":
            micro_batch = np.asarray(micro_batch)
            check_train_batch(ms, w.mini_batch_size, tp, pp, dp, micro_batch)
            m = w.mini_batch_size // (dp * micro_batch)
            zero, vpp = np.asarray(zero), np.asarray(vpp)
            rc = recompute_code(recompute)
            # per-micro-batch times depend on (tp, pp, b, recompute, vpp) only: computed once per
            # distinct combination (elementwise, so bit-identical to the per-row computation)
            first, inv = unique_rows(dp.shape, tp, pp, micro_batch, rc, vpp)
            u = rows_of(first, tp, pp, micro_batch, rc, vpp)
            mid, last = lat.microbatch_stage_times("train", model, et.padded_workload(w, eng), cl, eff, u[0], u[1],
                                                   u[2] / cp, u[3], vpp=u[4], sp=fw.sequence_parallel,
                                                   overlap_tp=self._tp_overlap())
            if eng is not None and eng.layer_pass_s > 0:
                launch = et.layer_pass_times(lat.max_layers_rank(model, u[1]), np.where(u[3] == 2, 4, 3), eng, eff,
                                             cl.gpu)
                mid, last = _combine(mid, launch), _combine(last, launch)
            if w.lora_rank:  # frozen base weights: no weight-gradient GEMMs
                mid, last = frozen_pass(mid, u[3]), frozen_pass(last, u[3])
            mid, last = with_seq_split(self.job, eff, model, mid, last, u[0], u[1], u[2], u[3], cp, "train")
            mid, last = expand(mid, inv), expand(last, inv)
            dps = dp * cp  # gradients and ZeRO shard over every GPU of the sequence-split replicas
            comm = (lora_dp_sync_time(lat.LinkModel(cl, eff), model, w, tp, pp, dps, zero, m, fw.grad_reduce_bytes)
                    if w.lora_rank else lat.dp_sync_time(model, w, cl, eff, tp, pp, dps, zero=zero, micro_batches=m,
                                                         reduce_bytes=fw.grad_reduce_bytes))
            comm = zero3_train_comm(fw.zero3_impl, comm, last, model, w, cl, eff, tp, pp, dps, zero, m,
                                    fw.grad_reduce_bytes or w.grad_bytes, rc, fw.overlap_grad_reduce)
            adam = lat.optimizer_time(model, w, cl, eff, tp, pp, dps, zero) * trainable_share(model, w.lora_rank, tp, pp)
            gpu_adam = np.where(off == OFF_CPU_ADAM, 0.0, adam)
            per_mini = _combine(_scale(last, m), {"bubble": (pp - 1) * _sum(mid) / np.maximum(vpp, 1)}, comm,
                                {"memory_bound": gpu_adam}, _scale(cpu_adam_times(model, w, cl, eff, tp, pp, dps, zero, off),
                                                                   trainable_share(model, w.lora_rank, tp, pp)))
            parts = _scale(per_mini, w.updates_per_step)
            if ms.model == "actor":
                parts = _combine(parts, self._sync(model, tp, pp, dp.shape, "send", multi_node))
            off = np.where(off == 2, 1, off)  # training state cannot be dropped; treat as host offload
            mem = stage_memory("train", model, w, tp, pp, micro_batch=micro_batch / cp, recompute=recompute,
                               inflight=np.minimum(pp, m), dp=dps, zero=zero, offload=off, vpp=vpp,
                               sp=fw.sequence_parallel)
            mem = engine_train_state(mem, fw, model, w, tp, pp, dps, zero, off)  # Megatron grads, FSDP fp32
        elif ms.stage == "infer":
            micro_batch = np.asarray(micro_batch)
            seqs = -(-w.global_batch // dp)
            m = -(-seqs // micro_batch)
            first, inv = unique_rows(dp.shape, tp, pp, micro_batch)
            u = rows_of(first, tp, pp, micro_batch)
            mid, last = lat.microbatch_stage_times("infer", model, et.padded_workload(w, eng), cl, eff, u[0], u[1],
                                                   u[2] / cp, sp=fw.sequence_parallel, overlap_tp=self._tp_overlap())
            if eng is not None and eng.layer_pass_s > 0:
                launch = et.layer_pass_times(lat.max_layers_rank(model, u[1]), 1, eng, eff, cl.gpu)
                mid, last = _combine(mid, launch), _combine(last, launch)
            mid, last = with_seq_split(self.job, eff, model, mid, last, u[0], u[1], u[2], 0, cp, "infer")
            mid, last = expand(mid, inv), expand(last, inv)
            parts = _combine(_scale(last, m), {"bubble": (pp - 1) * _sum(mid)})
            zero = np.asarray(zero)
            if np.any(zero):  # a ZeRO-3 engine: the weights are gathered for every micro-batch
                comm = infer_gather_times(model, w, cl, eff, tp, pp, dp * cp, zero, m)
                parts = _combine(parts, zero3_infer_comm(fw.zero3_impl, comm, last, model, w, cl, eff, tp, pp, dp * cp,
                                                         zero, m, fw.overlap_grad_reduce))
            mem = self._infer_memory(model, tp, pp, micro_batch / cp if cp > 1 else micro_batch, off, zero, dp * cp)
        elif ms.stage == "generate":
            seqs = -(-w.rollouts_per_step // dp)
            c = np.minimum(concurrency, seqs)
            if w.rollout_memory_fraction is not None:  # the KV blocks that fit cap it; the rest are preempted
                c = np.maximum(np.minimum(c, kv_capacity(model, w, tp, pp, c, None, cl.gpu, self.workspace)), 1)
            waves = -(-seqs // c)
            longest = eng is not None and eng.generation == "longest"
            # one wave's time depends on (tp, pp, concurrency) only (and on the sequences per replica
            # when the batch ends with its longest response): computed once per combination
            first, inv = unique_rows(dp.shape, tp, pp, c, *((seqs,) if longest else ()))
            ut, up, uc = rows_of(first, tp, pp, c)
            mb = np.minimum(up, uc)
            pmid, plast = lat.prefill_stage_times(model, w, cl, eff, ut, up, uc / mb)
            prefill = _combine(_scale(plast, mb), {"bubble": (up - 1) * _sum(pmid)})
            if longest:
                parts = expand(self._longest_generation(model, ut, up, uc, prefill, rows_of(first, seqs)[0]), inv)
            else:
                decode = _scale(lat.decode_step_times(model, w, cl, eff, ut, up, uc), w.response_len)
                parts = _scale(expand(_combine(prefill, decode), inv), waves)
            if eng is not None and eng.generate_call_s > 0:
                parts = _combine(parts, et.generate_call_times(eng, eff, cl.gpu))
            if ms.model == "actor" and not fw.train_engine_generation:  # HF generate on the actor: no sync
                parts = _combine(parts, self._sync(model, tp, pp, dp.shape, "recv", multi_node))
            first, inv = unique_rows(dp.shape, tp, pp, c, off)
            u = rows_of(first, tp, pp, c, off)
            mem = expand(stage_memory("generate", model, w, u[0], u[1], concurrency=u[2], offload=u[3], chunked=not fw.train_engine_generation), inv)
            if w.rollout_memory_fraction is not None:  # vLLM takes its fraction whatever the batch needs
                mem = preallocated_memory(mem, w.rollout_memory_fraction, cl.gpu.memory_bytes, self.workspace,
                                          np.broadcast_to(off, dp.shape), np.broadcast_to(c, dp.shape))
        else:  # pragma: no cover - ModelStage validates stages
            raise ValueError(ms.stage)
        if np.any(off > 0):
            frozen = ms.model in FROZEN_MODELS
            sync = None
            if not frozen and ms.stage == "infer":
                sync = self._sync(model, tp, pp, dp.shape, "recv", multi_node)
            parts = _combine(parts, lat.offload_times(mem["weights"] + mem["optimizer"], off, cl, eff,
                                                      frozen=frozen, derived_sync=sync))

        def rows(v):
            return np.broadcast_to(np.asarray(v, dtype=float), dp.shape)

        out = {"time": rows(_sum(parts)), "resident": rows(mem["resident"] * corr),
               "transient": rows(mem["transient"] * corr), "memory": mem, "detail": RowDetail(parts, mem, corr)}
        if breakdown:
            out["breakdown"] = {k: rows(v) for k, v in parts.items()}
        return out

    def _by_offload(self, ms: ModelStage, tp, pp, dp, micro_batch, concurrency, off, multi_node: bool, corr,
                    zero):
        """:meth:`candidate_arrays` of inference or generation rows with several offload modes (the
        enumeration repeats every row once per mode): the time without the offload terms depends on
        the other columns only, so it is computed once per distinct row of them, and each row adds
        its mode's terms in the order the per-row sum would (bit-identical). None when the rows do
        not repeat or the offload terms share an op class with the others (then the per-row path)."""
        shape = dp.shape
        w, cl, eff = self.job.workload, self.job.cluster, self.eff
        model = self.model_of(ms)
        if ms.stage == "infer":
            load = np.asarray(micro_batch)
        else:
            load = np.minimum(concurrency, -(-w.rollouts_per_step // dp))  # the concurrency the rows run at
        first, inv = unique_rows(shape, tp, pp, dp, load, zero)
        if first.size * 2 > dp.size:
            return None
        u = rows_of(first, tp, pp, dp, np.broadcast_to(np.asarray(micro_batch), shape),
                     np.broadcast_to(np.asarray(concurrency), shape), zero)
        base = self.candidate_arrays(ms, u[0], u[1], u[2], micro_batch=u[3], concurrency=u[4], zero=u[5],
                                     offload=0, multi_node=multi_node, breakdown=True)
        if ms.stage == "infer":
            mem = self._infer_memory(model, tp, pp, load, off, zero, dp)
        else:
            mf, minv = unique_rows(shape, tp, pp, load, off)
            mt, mp, ml, mo = rows_of(mf, tp, pp, load, off)
            mem = expand(stage_memory("generate", model, w, mt, mp, concurrency=ml, offload=mo, chunked=not self.job.framework.train_engine_generation), minv)
        frozen = ms.model in FROZEN_MODELS
        sync = self._sync(model, tp, pp, shape, "recv", multi_node) if not frozen and ms.stage == "infer" else None
        extra = lat.offload_times(mem["weights"] + mem["optimizer"], off, cl, eff, frozen=frozen, derived_sync=sync)
        if set(extra) & set(base["breakdown"]):
            return None
        time = base["time"][inv]
        for v in extra.values():
            time = time + v

        def rows(v):
            return np.broadcast_to(np.asarray(v, dtype=float), shape)

        return {"time": rows(time), "resident": rows(mem["resident"] * corr),
                "transient": rows(mem["transient"] * corr), "memory": mem,
                "detail": RowDetail(base["breakdown"], mem, corr, inv=inv, extra=extra)}

    def _tp_overlap(self):
        """``overlap_tp`` of the passes: False, True, or the engine's ``tp_overlap_share``."""
        fw = self.job.framework
        if not fw.overlap_tp_comm or fw.engine is None or fw.engine.tp_overlap_share == 1.0:
            return fw.overlap_tp_comm
        return fw.engine.tp_overlap_share

    def _longest_generation(self, model, tp, pp, c, prefill: dict, seqs) -> dict:
        """Generation of ``seqs`` sequences per replica at concurrency ``c`` (distinct rows) when a
        synchronous batch ends with its longest response (:func:`nereus.cost.engine_terms.decode_steps`):
        the prompts prefilled in ``ceil(seqs/c)`` waves of ``c``, ``S`` decode steps at the mean
        running count ``r``, and the engine's per-step overhead."""
        w, cl, eff, eng = self.job.workload, self.job.cluster, self.eff, self.job.framework.engine
        steps, running = et.decode_steps(seqs, c, w.response_len, w.memory_response_len)
        decode = _scale(lat.decode_step_times(model, w, cl, eff, tp, pp, running), steps)
        waves = -(-np.asarray(seqs) // np.asarray(c))
        return _combine(_scale(prefill, waves), decode, et.decode_overhead_times(steps, running, eng, eff, cl.gpu))

    def _infer_memory(self, model, tp, pp, micro_batch, off, zero, dp) -> dict:
        """:func:`~nereus.cost.memory.stage_memory` of inference rows, once per distinct (tp, pp,
        micro-batch, offload, dp where ZeRO-3 shards the weights; the others do not depend on dp)."""
        dz = np.where(np.asarray(zero) >= 3, dp, 0)
        first, inv = unique_rows(dp.shape, tp, pp, micro_batch, off, dz)
        ut, up, ub, uo, ud = rows_of(first, tp, pp, micro_batch, off, dz)
        return expand(stage_memory("infer", model, self.job.workload, ut, up, micro_batch=ub, offload=uo,
                                   dp=np.maximum(ud, 1), zero=np.where(ud > 0, 3, 0),
                                   sp=self.job.framework.sequence_parallel), inv)

    def _sync(self, model, tp, pp, shape, side: str, multi_node: bool) -> dict:
        """:func:`nereus.cost.latency.weight_sync_times` per row, computed once per (tp, pp)."""
        first, inv = unique_rows(shape, tp, pp)
        ut, up = rows_of(first, tp, pp)
        sync = lat.weight_sync_times(model, self.job.workload, self.job.cluster, self.eff, ut, up, side, multi_node)
        lora = self.job.workload.lora_rank  # with LoRA only the adapters travel
        return expand(_scale(sync, lora_sync_share(model, lora)) if lora else sync, inv)

    def _estimate_key(self, cand: Candidate, multi_node: bool) -> tuple:
        """What :meth:`estimate_candidate` depends on besides the candidate's layout columns: the
        model's shapes, the stage, the weight-sync side (actor), frozenness where idle state is
        offloaded (frozen models re-load instead of re-syncing) and the memory correction."""
        ms = self.workflow.get(cand.model_stage)
        return (self.model_of(ms), ms.stage, ms.model == "actor" and ms.stage != "infer",
                cand.offload != "none" and ms.model in FROZEN_MODELS, self.memory_correction.get(ms.name, 1.0),
                cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.recompute, cand.concurrency, cand.zero,
                cand.offload, cand.vpp, cand.grad_accum, multi_node, cand.cp)

    # ------------------------------------------------------------------ one candidate
    def estimate_candidate(self, cand: Candidate, multi_node: bool = False) -> StageEstimate:
        """Seconds, op-class breakdown and bytes per GPU of one candidate.

        Raises:
            KeyError: the candidate names a model-stage outside this job's workflow.
            ValueError: the candidate is invalid for its model-stage (:func:`check_candidate`).
        """
        ms = self.workflow.get(cand.model_stage)
        check_candidate(self.job, ms, cand)
        a = self.candidate_arrays(ms, cand.tp, cand.pp, [cand.dp], micro_batch=max(cand.micro_batch, 1),
                                  recompute=cand.recompute, concurrency=max(cand.concurrency, 1),
                                  zero=cand.zero, offload=cand.offload, vpp=cand.vpp,
                                  multi_node=multi_node, breakdown=True, cp=cand.cp)
        corr = self.memory_correction.get(ms.name, 1.0)
        memory = {k: float(np.asarray(v).reshape(-1)[0]) * corr for k, v in a["memory"].items()
                  if k not in ("resident", "transient")}
        return StageEstimate(time=float(a["time"][0]),
                             breakdown={k: float(v[0]) for k, v in a["breakdown"].items() if float(v[0]) > 0},
                             memory=memory, resident=float(a["resident"][0]), transient=float(a["transient"][0]))

    # ------------------------------------------------------------------ plans
    def stage_latency(self, times: dict, groups=None) -> float:
        """``L_step`` from model-stage times (closed form of :func:`critical_path`); ``groups`` (see
        :func:`stage_groups`) are colocated model-stages whose times add."""
        group_of = {n: tuple(g) for g in (groups or ()) for n in g}
        totals: dict = {}
        for name, t in times.items():
            key = group_of.get(name, (name,))
            totals[key] = totals.get(key, 0.0) + t
        per_stage = {}
        for key, t in totals.items():
            st = ModelStage.parse(key[0]).stage
            per_stage[st] = max(per_stage.get(st, 0.0), t)
        fixed = et.step_overhead(self.job.framework.engine, self.eff, self.job.cluster.gpu)
        if self.workflow.asynchronous:
            return fixed + max(per_stage.get("generate", 0.0), per_stage.get("infer", 0.0) + per_stage.get("train", 0.0))
        return fixed + sum(per_stage.values())

    def estimate(self, plan: Plan, pool=None, known: dict | None = None) -> Plan:
        """A copy of ``plan`` with estimates, ``L_step``, per-GPU peak memory and throughput.

        ``pool`` (GPU ids) decides whether the weight sync crosses nodes; defaults to the GPUs the
        plan uses. ``known``: model-stage -> :class:`StageEstimate` already computed for its
        candidate under this pool (the planner's, from the search's arrays); the others are
        estimated here.
        """
        pool = frozenset(pool) if pool is not None else plan.gpus_used()
        multi = self.job.cluster.spans_nodes(pool) if pool else False
        ests: dict = {}
        seen: dict = {}
        for c in plan.candidates:  # same-shaped model-stages with one candidate cost the same
            if known and c.model_stage in known:
                ests[c.model_stage] = known[c.model_stage]
                continue
            key = self._estimate_key(c, multi)
            if key not in seen:
                seen[key] = self.estimate_candidate(c, multi)
            ests[c.model_stage] = seen[key]
        l_step = self.stage_latency({k: v.time for k, v in ests.items()}, stage_groups(plan, self.workflow))
        gpu_res: dict = {}
        gpu_tr: dict = {}
        owned = engine_owned(plan, self.job.framework)  # weights of a training engine's own passes count once
        ests = apply_vllm_rule(self.job, plan.candidates, ests, self.workspace, owned)  # vLLM beside others
        for c in plan.candidates:
            e, res = ests[c.model_stage], 0.0 if c.model_stage in owned else ests[c.model_stage].resident
            for g in c.gpus:
                gpu_res[g] = gpu_res.get(g, 0.0) + res
                gpu_tr[g] = max(gpu_tr.get(g, 0.0), e.transient)
        gpu_mem = {g: self.workspace + gpu_res[g] + gpu_tr[g] for g in gpu_res}
        peak = {c.model_stage: max((gpu_mem[g] for g in c.gpus), default=self.workspace + ests[c.model_stage].peak_own)
                for c in plan.candidates}
        tokens = self.job.workload.global_batch * self.job.workload.response_len
        return Plan(candidates=plan.candidates, estimates=ests, l_step=l_step, peak_memory=peak,
                    gpu_memory=gpu_mem, throughput=tokens / l_step if l_step > 0 else 0.0,
                    capacity=self.capacity)

    def memory_ok(self, plan: Plan) -> bool:
        """Every GPU's predicted peak fits ``(1 - headroom) · capacity`` (per-GPU peaks alone if no estimates)."""
        if not plan.gpu_memory:
            plan = self.estimate(plan)
        if not plan.candidates or any(c.model_stage not in plan.estimates for c in plan.candidates):
            return all(v <= self.capacity for v in plan.gpu_memory.values())
        over = gpu_excess(self.job, plan, self.headroom, self.workspace, engine_owned(plan, self.job.framework))
        return all(v <= 0 for v in over.values())


def default_headroom(job: JobSpec) -> float:
    """Headroom of ``job``: ``1 - workload.memory_fraction`` when set, else :data:`DEFAULT_HEADROOM`."""
    f = job.workload.memory_fraction
    return DEFAULT_HEADROOM if f is None else 1.0 - float(f)
