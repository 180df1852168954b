"""Time per model-stage replica by op class (DESIGN.md §4.2; cost-model.md §2.1, §2.5-2.7).

Work is counted from shapes and turned into seconds with ``work / (peak · efficiency(op class))``:

* GEMM FLOPs ``2·N_gemm_rank`` per token forward (backward 2x; full recompute adds a forward of the
  transformer layers, not of the LM/value head, which is never checkpointed;
  Megatron/PaLM accounting, cost-model.md §2.1); causal attention ``2·a·d·s/tp`` FLOPs per token per
  layer forward (half of PaLM's ``4·a·d·s`` term, as flash-attention executes it), its backward 2.5
  forwards (flash-attention recomputes the scores: 5 matmuls to the forward's 2; Dao 2023,
  FlashAttention-2 §3.1). Attention's efficiency falls at short sequences and small head dimensions
  (:func:`~nereus.cost.efficiency.attention_seq_factor`, :func:`~nereus.cost.efficiency.attention_head_factor`). With ``gemm_precision="fp8"`` the GEMMs
  run on the FP8 peak as op class ``gemm_fp8``.
  Other attention kernels (``WorkloadSpec.attention_kernel``, :func:`nereus.cost.kernels.attention_times`): FlashAttention
  in Triton takes :data:`~nereus.cost.efficiency.TRITON_FA_SLOWDOWN` times as long per pass; unfused
  attention computes the full ``s x s`` scores of every head (the causal mask is applied after)
  with batched GEMMs and reads and writes them through HBM.
* Memory-bound kernels between them (norms, residual adds, the MLP activation; forward and backward;
  :func:`elementwise_bytes_per_token`) and the fused softmax cross-entropy of the LM head, as HBM
  traffic in op class ``memory_bound``.
* TP: 2 all-reduces of ``b·s·h`` activations per layer forward, 2 backward (+2 with full recompute)
  (Shoeybi et al. 2019), on NVLink when the TP group fits in a node, else on the NIC.
* PP: a point-to-point of ``b·s·h/tp`` activations per micro-batch and boundary each way (Megatron
  scatter-gather); pipeline time for m micro-batches ``Σ_i t_i + (m-1)·max_i t_i`` (Narayanan et al.
  2021; the unbalanced form used by Alpa and Metis), reported as ``m·t_max`` of work plus a
  ``bubble`` term.
* DP: ring all-reduce of the gradients of the most loaded GPU once per optimizer step, hierarchical
  (NVLink inside a node, each rank's share over its own NIC) when the replicas span nodes
  (:class:`LinkModel`); ZeRO stages replace it with reduce-scatter and all-gather
  (:func:`dp_sync_time`); with the framework's ``overlap_grad_reduce`` the cost model hides it
  behind backward (``max(0, T_dp - T_bwd)``), otherwise it is fully exposed.
* Offload of idle state over PCIe (:func:`offload_times`).
* Optimizer step: HBM-bound, 36 bytes per parameter read or written (bf16 weight, fp32 grad, master,
  exp_avg, exp_avg_sq).
* Generation: prefill is compute-bound; each decode step reads the replica's weights and the KV cache
  of the concurrent sequences (HBM-bound) or is compute-bound, whichever is slower, plus 2 TP
  all-reduces per layer; more sequences than the concurrency run in waves. Every response is taken
  at the workload's (mean) response length.

Stage times are dicts ``op class → seconds`` for one micro-batch on a middle pipeline rank
(``mid``: its layers only) and on the last rank (``last``: layers plus the head), since with ``pp``
dividing the layers the last rank is the slowest.

Every function is elementwise over NumPy arrays: ``tp``, ``pp``, micro-batch, recompute code and
the per-row batch sizes may all be arrays of one shape (the planner evaluates thousands of
candidates in one call); scalars work too. Op classes that some rows do not use hold zeros there.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.collectives import allgather_time, allreduce_time, broadcast_time, p2p_time
from nereus.cost.efficiency import OVERLAP_COMPUTE_SLOWDOWN, EfficiencyTable
from nereus.cost.fp8 import fp8_cast_times
from nereus.cost.kernels import ACT_BYTES, attention_times, gemm_class, gemm_peak, gemm_rank_params, gemm_time
from nereus.cost.memory import RC_FULL, RC_NONE, RC_SELECTIVE, recompute_code
from nereus.cost.recompute import selective_recompute_times
from nereus.cost.shapes import kv_bytes_per_token_rank, max_layers_rank, params_rank
from nereus.spec.hardware import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["LinkModel", "microbatch_stage_times", "decode_step_times", "prefill_stage_times",
           "dp_sync_time", "optimizer_time", "offload_times", "weight_sync_times",
           "elementwise_bytes_per_token"]

OPT_BYTES_PER_PARAM = 36


class LinkModel:
    """Bandwidth, latency and op class of the link a group of GPUs uses.

    A group that spans at most one node's GPUs (groups are placed node-aligned) uses the scale-up
    link. A group across nodes runs its all-reduce, all-gather and reduce-scatter hierarchically,
    as NCCL does over rail-optimized clusters (one NIC per GPU; a channel per NIC): with ``k`` of
    its ``n`` ranks on each of ``N = n/k`` nodes (``k = n · gpus_per_node / span``), the part inside
    a node moves over the scale-up link as a collective among ``k`` ranks, and each rank sends only
    its ``1/k`` share of the message across nodes, on its own NIC, as a collective among ``N``
    ranks: all-reduce ``2(k-1)/k·S / B_up + 2(N-1)/N·(S/k) / B_out`` (the 2D ring/tree bound; a
    group with one rank per node, ``k = 1``, is the flat ring over NICs of cost-model.md §2.7).
    Broadcast and point-to-point across nodes use one NIC. The effective bandwidth of each part is the
    link's peak times the efficiency of the op class ``<collective>@<link>``.
    """

    def __init__(self, cluster: ClusterSpec, eff: EfficiencyTable):
        self.cluster, self.eff, self.gpu = cluster, eff, cluster.gpu

    def _one(self, kind: str, size, n, link: str, bw: float, alpha: float):
        b = bw * self.eff.get(f"{kind}@{link}", self.gpu)
        if kind == "allreduce":
            return allreduce_time(size, n, b, alpha)
        if kind in ("allgather", "reducescatter"):
            return allgather_time(size, n, b, alpha)
        if kind == "broadcast":
            return broadcast_time(size, n, b, alpha)
        if kind == "p2p":
            return p2p_time(size, b, alpha)
        raise ValueError(f"unknown collective {kind!r}")

    def time(self, kind: str, size, n, span=None, force_scaleout: bool = False) -> dict:
        """``{op class: seconds}`` of collective ``kind`` of ``size`` bytes among ``n`` ranks whose
        group spans ``span`` GPUs (defaults to ``n``); arrays allowed."""
        g, gpn = self.gpu, self.cluster.gpus_per_node
        span = n if span is None else span
        inside = np.asarray(span) <= gpn
        if force_scaleout:
            inside = np.zeros_like(inside, dtype=bool)
        out: dict = {}
        up, down = (g.scaleup_link, g.scaleup_bandwidth, g.scaleup_latency), \
            (g.scaleout_link, g.scaleout_bandwidth, g.scaleout_latency)

        def add(link, t, mask):
            cls = f"{kind}@{link}"
            v = np.where(mask, t, 0.0) if np.ndim(mask) else (t if mask else 0.0)
            out[cls] = out.get(cls, 0.0) + v

        if np.any(inside):
            add(up[0], self._one(kind, size, n, *up), inside)
        if np.any(~inside):
            if kind in ("allreduce", "allgather", "reducescatter") and not force_scaleout:
                nn = np.asarray(n, dtype=float)
                k = np.clip(np.floor(nn * gpn / np.maximum(np.asarray(span, dtype=float), 1.0)), 1.0, nn)
                nodes = np.ceil(nn / k)
                add(up[0], self._one(kind, size, k, *up), ~inside)
                add(down[0], self._one(kind, np.asarray(size, dtype=float) / k, nodes, *down), ~inside)
            else:
                add(down[0], self._one(kind, size, n, *down), ~inside)
        return {c: (float(v) if np.ndim(v) == 0 else v) for c, v in out.items()}


def elementwise_bytes_per_token(model: ModelSpec, tp, sp=False) -> tuple:
    """HBM bytes per token per layer of the memory-bound kernels between the GEMMs and attention,
    ``(forward, backward)``, on one TP rank (bf16 activations, :data:`ACT_BYTES` each).

    Counted kernel by kernel, each reading its inputs and writing its outputs once (h = hidden size,
    F = MLP width): forward: two norms (read h, write h each: 4h), two residual adds (read 2h, write
    h each: 6h), the gated activation (read the gate and up projections 2F, write F: 3F), i.e.
    ``10h + 3F`` elements; backward: two norm backwards (read x and dy, write dx: 6h), two residual
    gradient adds (6h), the activation backward (read 2F and dy F, write 2F: 5F), i.e. ``12h + 5F``.
    MPT and GPT-3's ungated GELU over 4h moves 8h forward, the same as the gated form with
    F = 8h/3 that represents them. Not counted: bias adds and dropout (fused into the GEMM or absent
    in LLM pretraining), rotary embeddings (fused into attention or QKV in Megatron and
    Transformer Engine), the norm weights (h per layer, not per token). The h-sized terms run on every
    TP rank in full unless sequence parallelism splits them (Korthikanti et al. 2022 §4.2.2); the
    F-sized ones are split by TP.
    """
    tp = np.asarray(tp, dtype=float)
    h, f = float(model.hidden_size), float(model.intermediate_size)
    hs = np.where(np.asarray(sp, dtype=bool), tp, 1.0)
    fwd = (10.0 * h / hs + 3.0 * f / tp) * ACT_BYTES
    bwd = (12.0 * h / hs + 5.0 * f / tp) * ACT_BYTES
    return fwd, bwd


def _add(d: dict, cls: str, t) -> None:
    d[cls] = d.get(cls, 0.0) + t


def _merge(*ds) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            _add(out, k, v)
    return out


def _scale(d: dict, k) -> dict:
    return {c: v * k for c, v in d.items()}


def _layers(model: ModelSpec, pp):
    """Layers on the most loaded pipeline rank (``ceil(L/pp)``; the slowest rank sets the pace)."""
    return max_layers_rank(model, pp)


def _layer_pass(model, tp, tokens, ctx_len, layers, mult, cluster, eff, links, n_ar,
                gcls="gemm", passes=(1, 0), sp=False, attn_kernel=None) -> dict:
    """Time of ``layers`` layers over ``tokens`` tokens, ``mult`` forward-equivalents of GEMM compute,
    ``n_ar`` TP all-reduces per layer, and the attention (``attn_kernel``, :func:`attention_times`)
    and memory-bound kernels of ``passes = (forward passes, backward passes)``."""
    out: dict = {}
    gpu = cluster.gpu
    gemm_flops = 2.0 * gemm_rank_params(model, tp) * tokens * layers * mult
    _add(out, gcls, gemm_time(gemm_flops, 7 * layers * mult, gpu, eff, gcls))
    for cls, t in attention_times(model, attn_kernel, tp, tokens, ctx_len, layers, passes[0], passes[1],
                                  gpu, eff).items():
        _add(out, cls, t)
    fwd_b, bwd_b = elementwise_bytes_per_token(model, tp, sp)
    ew = (np.asarray(passes[0]) * fwd_b + np.asarray(passes[1]) * bwd_b) * tokens * layers
    _add(out, "memory_bound", ew / (gpu.hbm_bandwidth * eff.get("memory_bound", gpu)))
    for cls, t in links.time("allreduce", 2.0 * tokens * model.hidden_size, tp).items():
        _add(out, cls, t * n_ar * layers)
    return out


def _head_pass(model, tp, tokens, mult, cluster, eff, gcls="gemm") -> dict:
    """The LM (or value) head's GEMM over ``tokens``, ``mult`` forward-equivalents, and its softmax
    cross-entropy as one fused kernel (flash-attention's and Megatron's vocab-parallel fused
    cross-entropy): the forward reads the logits once, the backward writes their gradient once
    (``ACT_BYTES`` per logit each, vocabulary split by TP)."""
    tp = np.asarray(tp)
    flops = 2.0 * model.hidden_size * model.head_out_dim / tp * tokens * mult
    out = {gcls: gemm_time(flops, mult, cluster.gpu, eff, gcls)}
    if model.head_out_dim > 1:
        ways = 2.0 if mult >= 3 else 1.0
        ce = ways * ACT_BYTES * model.head_out_dim / tp * np.asarray(tokens, dtype=float)
        out["memory_bound"] = ce / (cluster.gpu.hbm_bandwidth * eff.get("memory_bound", cluster.gpu))
    return out


def _overlap_tp(parts: dict, share: float = 1.0) -> dict:
    """TP collectives overlapped with the GEMMs of the same pass (Megatron ``tp_comm_overlap``):
    hidden ``H = min(share · T_tp, T_gemm)``, exposed ``T_tp - H`` (each TP class scaled down by the
    same factor), and the GEMMs they overlap slowed by ``overlap = s · H`` (``s`` =
    :data:`~nereus.cost.efficiency.OVERLAP_COMPUTE_SLOWDOWN`). ``share`` is the part of the TP
    communication the implementation can hide (1: all of it, as Transformer Engine's userbuffers;
    ``EngineCosts.tp_overlap_share`` for others)."""
    tp_classes = [k for k in parts if k.startswith(("allreduce@", "allgather@"))]
    if not tp_classes:
        return parts
    total = sum(np.asarray(parts[k], dtype=float) for k in tp_classes)
    gemm = np.asarray(parts.get("gemm", 0.0), dtype=float) + np.asarray(parts.get("gemm_fp8", 0.0), dtype=float)
    hidden = np.minimum(share * total, gemm)
    keep = np.where(total > 0, (total - hidden) / np.where(total > 0, total, 1.0), 0.0)
    out = {k: (v * keep if k in tp_classes else v) for k, v in parts.items()}
    _add(out, "overlap", OVERLAP_COMPUTE_SLOWDOWN * hidden)
    return out


def microbatch_stage_times(stage: str, model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec,
                           eff: EfficiencyTable, tp, pp, micro_batch, recompute="none", vpp=1, sp=False,
                           overlap_tp=False) -> tuple[dict, dict]:
    """(mid, last) per-micro-batch stage times by op class for ``train`` or ``infer``.

    ``vpp`` (interleaved pipeline, array allowed) multiplies the point-to-point traffic by ``v``
    (Narayanan et al. 2021 §2.2); ``sp`` (sequence parallelism) keeps the TP volume (all-gather +
    reduce-scatter instead of all-reduce, cost-model.md §2.5); ``overlap_tp`` hides TP collectives
    behind the pass's GEMMs (:func:`_overlap_tp`; a number in (0, 1] instead of True: the share of
    them it can hide). Selective recompute re-runs each layer's
    attention block in backward: its QKV projection, the core attention, and with SP the all-gather
    of its input; with an unfused attention kernel only the core attention (Korthikanti et al. 2022
    §5; :mod:`nereus.cost.recompute`; :func:`nereus.cost.memory.activation_bytes_per_layer` says what
    it saves).
    """
    links = LinkModel(cluster, eff)
    tp, pp = np.asarray(tp), np.asarray(pp)
    s = workload.seq_len
    tokens = s * np.asarray(micro_batch)
    layers = _layers(model, pp)
    gcls = gemm_class(workload)
    if stage == "train":
        rc = recompute_code(recompute)
        mult = np.where(rc == RC_FULL, 4, 3)
        n_ar = np.where(rc == RC_FULL, 6, 4)
        passes = (mult - 2, 1)  # forwards (2 with full recompute) and one backward
    else:
        rc, mult, n_ar, passes = RC_NONE, 1, 2, (1, 0)
    body = _layer_pass(model, tp, tokens, s, layers, mult, cluster, eff, links, n_ar, gcls, passes, sp,
                       workload.attention_kernel)
    if stage == "train":
        for cls, t in fp8_cast_times(model, workload, cluster.gpu, eff, tp, tokens, layers).items():
            _add(body, cls, t)
    if stage == "train" and np.any(rc == RC_SELECTIVE):
        sel = rc == RC_SELECTIVE
        for cls, t in selective_recompute_times(model, workload.attention_kernel, links, tp, tokens, s, layers, sp,
                                                cluster.gpu, eff, gcls).items():
            _add(body, cls, np.where(sel, t, 0.0))
    if np.any(pp > 1):
        p2p = links.time("p2p", 2.0 * tokens * model.hidden_size / tp, 2, span=tp * 2)
        chunks = np.asarray(vpp) if stage == "train" else 1
        for cls, t in p2p.items():
            _add(body, cls, np.where(pp > 1, t, 0.0) * (2 if stage == "train" else 1) * chunks)
    if overlap_tp:
        body = _overlap_tp(body, 1.0 if overlap_tp is True else float(overlap_tp))
    # The head is outside the recomputed layers (Megatron checkpoints transformer layers only), so it
    # runs forward + backward (3 forward-equivalents) whatever the recompute mode.
    head_mult = 3 if stage == "train" else 1
    last = _merge(body, _head_pass(model, tp, tokens, head_mult, cluster, eff, gcls))
    return body, last


def prefill_stage_times(model, workload, cluster, eff, tp, pp, seqs) -> tuple[dict, dict]:
    """(mid, last) stage times of prefilling ``seqs`` prompts (array allowed) as one micro-batch."""
    links = LinkModel(cluster, eff)
    tokens = np.asarray(seqs, dtype=float) * workload.prompt_len
    layers = _layers(model, pp)
    gcls = gemm_class(workload)
    body = _layer_pass(model, np.asarray(tp), tokens, workload.prompt_len, layers, 1, cluster, eff, links, 2,
                       gcls=gcls)  # vLLM's prefill runs its own fused attention whatever the training engine's
    last = _merge(body, _head_pass(model, tp, np.asarray(seqs, dtype=float), 1, cluster, eff, gcls))
    return body, last


def decode_step_times(model, workload, cluster, eff, tp, pp, seqs) -> dict:
    """Op-class seconds of one decode step for ``seqs`` concurrent sequences (array allowed) on one
    replica. Each rank is busy ``max(HBM time, compute time)`` per step: it reads its weights once per
    micro-batch (``m = min(pp, seqs)`` micro-batches) and the KV cache of all sequences of its
    layers. A full pipeline (m = pp) steps at one rank's busy time; with m < pp it waits pp/m times
    longer."""
    links = LinkModel(cluster, eff)
    gpu = cluster.gpu
    tp, pp = np.asarray(tp), np.asarray(pp)
    seqs = np.asarray(seqs, dtype=float)
    m = np.minimum(pp, np.maximum(seqs, 1))
    layers = _layers(model, pp)
    params = params_rank(model, tp, pp)
    ctx = workload.prompt_len + workload.response_len / 2.0
    kv_tok = kv_bytes_per_token_rank(model, workload.kv_bytes, tp, pp)
    hbm = (m * params * workload.param_bytes + seqs * ctx * kv_tok) / (gpu.hbm_bandwidth * eff.get("memory_bound", gpu))
    flops = 2.0 * params * seqs + 2.0 * model.q_dim / tp * ctx * seqs * layers
    gcls = gemm_class(workload)
    comp = flops / (gemm_peak(gpu, gcls) * eff.get(gcls, gpu))
    fill = np.maximum(1.0, pp / m)  # a pipeline with fewer micro-batches than ranks idles
    mem_bound = hbm >= comp
    out: dict = {"memory_bound": np.where(mem_bound, hbm, 0.0) * fill,
                 gcls: np.where(mem_bound, 0.0, comp) * fill}
    for cls, t in links.time("allreduce", 2.0 * (seqs / m) * model.hidden_size, tp).items():
        _add(out, cls, t * 2 * layers * m * fill)
    if np.any(pp > 1):
        for cls, t in links.time("p2p", 2.0 * (seqs / m) * model.hidden_size / tp, 2, span=tp * 2).items():
            _add(out, cls, np.where(pp > 1, t, 0.0) * m * fill)
    return out


def dp_sync_time(model, workload, cluster, eff, tp, pp, dp, zero=0, micro_batches=1, reduce_bytes=None) -> dict:
    """DP communication for one optimizer step over ``dp`` replicas (arrays allowed), by op class,
    before any overlap with backward (cost-model.md §2.3, §2.7; Rajbhandari et al. SC'20):

    * ZeRO-0: all-reduce of the gradients ``G = params_rank · reduce_bytes``;
    * ZeRO-1 (Megatron's distributed optimizer): reduce-scatter of ``G`` and all-gather of the
      updated bf16 weights ``W`` (same volume as the all-reduce when ``reduce_bytes`` equals the
      weight bytes);
    * ZeRO-2: a reduce-scatter of ``G`` per micro-batch (gradients are kept sharded, so each
      micro-batch's gradients are reduced as they are produced) and one all-gather of ``W``;
    * ZeRO-3 / FSDP: per micro-batch, all-gather ``W`` for forward and again for backward and
      reduce-scatter ``G`` (1.5x the ZeRO-1 volume per micro-batch).

    ``reduce_bytes``: bytes per gradient element on the wire (default ``workload.grad_bytes``).
    """
    links = LinkModel(cluster, eff)
    tp, pp, dp = np.asarray(tp), np.asarray(pp), np.asarray(dp)
    zero, m = np.asarray(zero), np.asarray(micro_batches)
    rb = workload.grad_bytes if reduce_bytes is None else reduce_bytes
    params = params_rank(model, tp, pp)
    g, w = params * rb, params * workload.param_bytes
    span = tp * pp * dp
    out = {k: np.where(zero == 0, v, 0.0) for k, v in links.time("allreduce", g, dp, span=span).items()}
    rs = links.time("reducescatter", g, dp, span=span)
    ag = links.time("allgather", w, dp, span=span)
    for k, v in rs.items():
        _add(out, k, np.where(zero == 0, 0.0, v * np.where(zero >= 2, m, 1)))
    for k, v in ag.items():
        _add(out, k, np.where(zero == 0, 0.0, v * np.where(zero >= 3, 2 * m, 1)))
    return out


def optimizer_time(model, workload, cluster, eff, tp, pp, dp=1, zero=0):
    """HBM-bound Adam step: 36 bytes read or written per parameter on the most loaded GPU; with
    ZeRO >= 1 each rank updates only its ``1/dp`` shard."""
    shard = np.where(np.asarray(zero) >= 1, np.asarray(dp), 1)
    return params_rank(model, tp, pp) * OPT_BYTES_PER_PARAM / shard / (cluster.gpu.hbm_bandwidth * eff.get("memory_bound", cluster.gpu))


def offload_times(state_bytes, offload, cluster, eff, *, frozen: bool, derived_sync=None) -> dict:
    """Per-step seconds of an idle-state mode (codes of :data:`nereus.cost.memory.OFFLOAD_CODES`):
    ``host`` copies ``state_bytes`` (weights and optimizer state per GPU) to host memory after the
    model-stage runs and back before it runs next (``2·S / B_host``); ``drop`` frees them and
    reloads: a frozen model from its host copy (``S / B_host``), a derived copy (the actor's
    generation or inference weights, the critic's inference weights) by a weight sync
    (``derived_sync``, op-class dict; none for ``actor.generate``, whose sync is charged anyway).
    ``B_host`` is the GPU's PCIe ``host_bandwidth`` times the efficiency of op class
    ``offload@pcie``."""
    code = np.asarray(offload)
    bw = cluster.gpu.host_bandwidth * eff.get("offload@pcie", cluster.gpu)
    ways = np.where(code == 1, 2.0, np.where(code == 2, 1.0 if frozen else 0.0, 0.0))
    out = {"offload@pcie": ways * np.asarray(state_bytes, dtype=float) / bw}
    if derived_sync and not frozen:
        for k, v in derived_sync.items():
            _add(out, k, np.where(code == 2, v, 0.0))
    return out


def weight_sync_times(model, workload, cluster, eff, tp, pp, side: str, multi_node: bool) -> dict:
    """One side of the per-step actor weight sync (DESIGN.md §4.1).

    ``side="send"`` (training layout): all-gather the full weights inside the replica's TP/PP group.
    ``side="recv"`` (generation layout): each GPU receives its ``W/(tp·pp)`` shard, over the NIC when
    the pool spans several nodes. Summing both sides keeps the step latency separable per layout.
    """
    links = LinkModel(cluster, eff)
    w = model.num_params * workload.param_bytes
    k = np.asarray(tp) * np.asarray(pp)
    if side == "send":
        return links.time("allgather", w, k)
    return links.time("broadcast", w / k, 2, force_scaleout=multi_node)
