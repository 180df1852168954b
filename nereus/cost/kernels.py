"""Compute-kernel time: the linear layers' GEMMs and attention (the kernels whose time is FLOPs at
an efficiency), used by :mod:`nereus.cost.latency` for every pass.

* GEMMs: ``flops / (peak · e · size/(size + half))``, ``e`` the op class's efficiency (``gemm``, or
  ``gemm_fp8`` on the FP8 peak when the workload runs its GEMMs in FP8) and the size curve of
  :mod:`nereus.cost.efficiency` (``GPUSpec.gemm_half_flops``);
* attention: :func:`attention_times` for each ``WorkloadSpec.attention_kernel`` (FlashAttention-2
  class, FlashAttention in Triton, unfused with or without dropout).
"""

from __future__ import annotations

import numpy as np

from nereus.cost.efficiency import (
    TRITON_FA_SLOWDOWN,
    EfficiencyTable,
    attention_head_factor,
    attention_seq_factor,
)
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["ACT_BYTES", "ATTN_BWD_EXTRA", "UNFUSED_SCORE_BYTES", "gemm_rank_params", "gemm_class", "gemm_peak",
           "gemm_time", "attention_time", "attention_times"]

#: bytes per activation element of the memory-bound kernels (bf16)
ACT_BYTES = 2
#: flash-attention backward in forward-equivalents beyond the GEMMs' 2 (2.5 - 2; FlashAttention-2 §3.1)
ATTN_BWD_EXTRA = 0.5
#: unfused attention: HBM bytes per score element (one head, one query, one key) of the kernels
#: between its batched GEMMs, ``(forward, backward)``, without and with dropout on the probabilities
#: (bf16 scores, a 1-byte dropout mask; see :func:`attention_times`)
UNFUSED_SCORE_BYTES = {False: (2 * ACT_BYTES, 3 * ACT_BYTES),
                       True: (2 * ACT_BYTES + 2 * ACT_BYTES + 1, 3 * ACT_BYTES + 2 * ACT_BYTES + 1)}



def gemm_rank_params(model: ModelSpec, tp):
    """GEMM parameters of one layer on one TP rank (KV projections replicated when tp > KV heads)."""
    h = model.hidden_size
    tp = np.asarray(tp)
    kv_rep = np.maximum(tp // model.num_kv_heads, 1)
    return (2 * h * model.q_dim + 2 * h * model.kv_dim * kv_rep + 3 * h * model.intermediate_size) / tp


def gemm_class(workload: WorkloadSpec) -> str:
    """Op class of the linear layers' GEMMs: ``gemm_fp8`` when the workload runs them in FP8, else ``gemm``."""
    return "gemm_fp8" if workload.gemm_precision == "fp8" else "gemm"


def gemm_peak(gpu, cls: str) -> float:
    if cls == "gemm_fp8":
        if not gpu.peak_flops_fp8 > 0:
            raise ValueError(f"workload field 'gemm_precision'='fp8' needs a GPU with FP8 tensor cores; "
                             f"GPU {gpu.name!r} has peak_flops_fp8=0")
        return gpu.peak_flops_fp8
    return gpu.peak_flops


def gemm_time(flops, calls, gpu, eff: EfficiencyTable, cls: str = "gemm"):
    flops = np.asarray(flops, dtype=float)
    size = np.maximum(flops / np.maximum(calls, 1), 1.0)
    e = eff.get(cls, gpu) * size / (size + gpu.gemm_half_flops)
    return flops / (gemm_peak(gpu, cls) * e)


def attention_time(flops, ctx_len, gpu, eff: EfficiencyTable, head_dim: int = 128):
    """Seconds of ``flops`` of attention whose queries attend ``ctx_len`` keys: the class efficiency
    times the sequence-length and head-dimension curves of :mod:`nereus.cost.efficiency`
    (:func:`~nereus.cost.efficiency.attention_seq_factor`, :func:`~nereus.cost.efficiency.attention_head_factor`)."""
    e = eff.get("attention", gpu) * attention_seq_factor(ctx_len) * attention_head_factor(head_dim)
    return np.asarray(flops, dtype=float) / (gpu.peak_flops * e)


def attention_times(model: ModelSpec, kernel, tp, tokens, ctx_len, layers, fwd, bwd, gpu,
                    eff: EfficiencyTable) -> dict:
    """Op-class seconds of ``fwd`` forward and ``bwd`` backward passes of attention over ``tokens``
    tokens whose queries attend ``ctx_len`` keys, on ``layers`` layers of one TP rank, for
    ``kernel`` (``WorkloadSpec.attention_kernel``; arrays allowed for the counts):

    * ``flash`` / None: causal FLOPs ``2·q_dim/tp·ctx`` per token forward, the backward 2.5 forwards,
      at the ``attention`` efficiency (:func:`attention_time`);
    * ``flash_triton``: the same, each forward taking ``TRITON_FA_SLOWDOWN[0]`` and each backward
      ``TRITON_FA_SLOWDOWN[1]`` times as long (FlashAttention-2 paper §4.1);
    * ``unfused`` / ``unfused_dropout`` (Megatron-LM's core attention without flash-attention:
      ``baddbmm`` for ``QK^T``, the fused scale-mask-softmax, ``bmm`` with V): with
      ``E = tokens·ctx·heads/tp`` score elements per layer, each of the batched GEMMs (2 forward:
      ``QK^T``, ``PV``; 4 backward: ``dP``, ``dV``, ``dQ``, ``dK``) does ``2·E·head_dim`` FLOPs (the full
      square: the causal mask is applied to the computed scores) and writes or reads the ``E``
      scores once (``ACT_BYTES`` each); a GEMM takes the longer of its FLOPs at the ``gemm``
      efficiency (bf16 peak, size curve) and that traffic at the ``memory_bound`` efficiency (op
      class ``gemm`` or ``memory_bound``, whichever binds). Between them, as ``memory_bound``
      traffic per score element (:data:`UNFUSED_SCORE_BYTES`): the softmax reads the scores and
      writes the probabilities (``2·ACT_BYTES``), its backward reads the probabilities and their
      gradient and writes the score gradient (``3·ACT_BYTES``); with dropout on the probabilities
      the dropout kernel reads them, writes them and a 1-byte mask, and its backward reads the
      gradient and the mask and writes the gradient (``2·ACT_BYTES + 1`` each way). Not counted: the
      GEMMs' reads of Q, K, V (``s·d`` per head against ``s²``).
    """
    fwd = np.asarray(fwd, dtype=float)
    bwd = np.asarray(bwd, dtype=float)
    tp = np.asarray(tp, dtype=float)
    base = 2.0 * model.q_dim / tp * np.asarray(ctx_len, dtype=float) * np.asarray(tokens, dtype=float) * layers
    if kernel in (None, "flash", "flash_triton"):
        slow_f, slow_b = TRITON_FA_SLOWDOWN if kernel == "flash_triton" else (1.0, 1.0)
        fe = base * (fwd * slow_f + (2.0 + ATTN_BWD_EXTRA) * bwd * slow_b)
        return {"attention": attention_time(fe, ctx_len, gpu, eff, model.head_dim)}
    if kernel not in ("unfused", "unfused_dropout"):
        raise ValueError(f"workload field 'attention_kernel' must be one of flash, flash_triton, unfused, "
                         f"unfused_dropout or null, got {kernel!r}")
    elems = base / (2.0 * model.head_dim)  # score elements per pass over all layers
    n_mm = 2.0 * fwd + 4.0 * bwd
    mm_flops = 2.0 * elems * model.head_dim * n_mm
    t_flops = gemm_time(mm_flops, n_mm * layers, gpu, eff, "gemm")
    hbm = gpu.hbm_bandwidth * eff.get("memory_bound", gpu)
    t_io = ACT_BYTES * elems * n_mm / hbm
    f_b, b_b = UNFUSED_SCORE_BYTES[kernel == "unfused_dropout"]
    t_ew = (fwd * f_b + bwd * b_b) * elems / hbm
    compute_bound = t_flops >= t_io
    return {"gemm": np.where(compute_bound, t_flops, 0.0),
            "memory_bound": np.where(compute_bound, 0.0, t_io) + t_ew}
