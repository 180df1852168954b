"""LoRA training terms: adapter parameters, and what frozen base weights change in time and memory.

LoRA (Hu et al. 2021, arXiv:2106.09685 §4) adds to a linear layer ``W`` (``in x out``) a trainable
pair ``A`` (``r x in``) and ``B`` (``out x r``) and freezes ``W``. verl
(``actor_rollout_ref.model.lora_rank``, ``target_modules: all-linear``) and OpenRLHF
(``--lora_rank``, ``--target_modules all-linear``) put adapters on every linear layer of the
transformer blocks: q, k, v, o, gate, up, down (PEFT's ``all-linear`` leaves out the output head).

Parameters of one layer on one TP rank (Megatron-style splits: a column-parallel layer shards ``B``
by its output, a row-parallel one shards ``A`` by its input; the other factor is replicated)::

    r · (  h + q/t          q_proj (column)
         + 2·(h + kv·k/t)   k_proj, v_proj (column; KV heads replicated when t > g: k = max(t/g, 1))
         + q/t + h          o_proj (row)
         + 2·(h + F/t)      gate_proj, up_proj (column)
         + F/t + h )        down_proj (row)

At ``t = 1``: ``r·(7h + 2q + 2kv + 3F)`` (Llama-3.1-8B, r=8: 8·(7·4096 + 2·4096 + 2·1024 + 3·14336)
= 655,360 per layer, 20,971,520 for 32 layers, 0.26% of its 8.03 B).

What changes (``nereus.cost.memory.stage_memory``, ``nereus.cost.model.CostModel``):

* memory: the frozen base weights stay (``param_bytes`` each, sharded by ZeRO-3 like any weight);
  adapters add their weights, and the gradients and Adam state exist for the adapters only;
* compute: backward computes activation gradients through every frozen GEMM but no weight gradient,
  so a training pass does ``mult - 1`` forward-equivalents of GEMM work instead of ``mult`` (3 -> 2;
  4 -> 3 with full recompute) (:func:`frozen_gemm_scale`; the adapters' own GEMMs, ``2r/h`` of the
  base's, are left out);
* DP communication: gradients and ZeRO-1/2's weight all-gather carry the adapters only; ZeRO-3's
  per-micro-batch gathers still move the frozen shards (:func:`lora_dp_sync_time`);
* optimizer step over the adapters only; the weight sync to the rollout engine moves the adapters
  (verl loads them into vLLM as a LoRA adapter, OpenRLHF merges and syncs them).
"""

from __future__ import annotations

import numpy as np

from nereus.cost.shapes import max_layers_rank, params_rank
from nereus.spec.model import ModelSpec

__all__ = ["adapter_params_layer", "adapter_params_rank", "frozen_gemm_scale", "frozen_pass", "lora_dp_sync_time", "lora_sync_share", "trainable_share",
           "trainable_params_rank"]


def adapter_params_layer(model: ModelSpec, rank: int, tp) -> np.ndarray:
    """LoRA parameters of one transformer layer on one TP rank (formula above), elementwise in ``tp``."""
    tp = np.asarray(tp, dtype=float)
    h, f = model.hidden_size, model.intermediate_size
    kv_rep = np.maximum(tp // model.num_kv_heads, 1)
    per = (h + model.q_dim / tp) + 2 * (h + model.kv_dim * kv_rep / tp) + (model.q_dim / tp + h) \
        + 2 * (h + f / tp) + (f / tp + h)
    return rank * per


def adapter_params_rank(model: ModelSpec, rank: int, tp, pp):
    """LoRA parameters on the most loaded pipeline rank (``ceil(L/pp)`` layers), elementwise."""
    return adapter_params_layer(model, rank, tp) * max_layers_rank(model, pp)


def trainable_params_rank(model: ModelSpec, lora_rank: int | None, tp, pp):
    """Parameters with gradients and optimizer state on one GPU: every parameter without LoRA, the
    adapters (plus a value head, ``h + 1``) with it."""
    if not lora_rank:
        return params_rank(model, tp, pp)
    extra = model.hidden_size + 1 if model.head == "value" else 0
    return adapter_params_rank(model, lora_rank, tp, pp) + extra


def frozen_gemm_scale(mult) -> np.ndarray:
    """Share of a training pass's GEMM work left when the GEMM weights are frozen: ``(mult-1)/mult``
    for ``mult`` forward-equivalents (3, or 4 with full recompute): the weight-gradient GEMM (one
    forward-equivalent) is not computed."""
    mult = np.asarray(mult, dtype=float)
    return (mult - 1.0) / mult


def frozen_pass(parts: dict, recompute) -> dict:
    """Per-micro-batch op-class times of a training pass with its GEMM classes (``gemm``,
    ``gemm_fp8``) scaled by :func:`frozen_gemm_scale` (``recompute`` codes: 2 = full, 4 passes)."""
    k = frozen_gemm_scale(np.where(np.asarray(recompute) == 2, 4, 3))
    return {c: (v * k if c in ("gemm", "gemm_fp8") else v) for c, v in parts.items()}


def lora_dp_sync_time(links, model: ModelSpec, workload, tp, pp, dp, zero, micro_batches, reduce_bytes=None) -> dict:
    """DP communication of one optimizer step of a LoRA model-stage, by op class (the structure of
    :func:`nereus.cost.latency.dp_sync_time`): the gradient all-reduce / reduce-scatter and ZeRO-1/2's
    all-gather of the updated weights carry the adapters (``A = trainable_params_rank``); ZeRO-3's
    two gathers per micro-batch carry the frozen weights too (``W = params_rank + A``). ``links``: a
    :class:`nereus.cost.latency.LinkModel`."""
    tp, pp, dp = np.asarray(tp), np.asarray(pp), np.asarray(dp)
    zero, m = np.asarray(zero), np.asarray(micro_batches)
    rb = workload.grad_bytes if reduce_bytes is None else reduce_bytes
    a = trainable_params_rank(model, workload.lora_rank, tp, pp)
    g, wa = a * rb, a * workload.param_bytes
    wfull = (params_rank(model, tp, pp) + a) * workload.param_bytes
    span = tp * pp * dp
    out: dict = {}

    def add(k, v):
        out[k] = out.get(k, 0.0) + v

    for k, v in links.time("allreduce", g, dp, span=span).items():
        add(k, np.where(zero == 0, v, 0.0))
    for k, v in links.time("reducescatter", g, dp, span=span).items():
        add(k, np.where(zero == 0, 0.0, v * np.where(zero >= 2, m, 1)))
    for k, v in links.time("allgather", wa, dp, span=span).items():
        add(k, np.where((zero == 1) | (zero == 2), v, 0.0))
    for k, v in links.time("allgather", wfull, dp, span=span).items():
        add(k, np.where(zero >= 3, v * 2 * m, 0.0))
    return out


def lora_sync_share(model: ModelSpec, rank: int) -> float:
    """Share of the weight sync's bytes left when only the adapters travel: adapter parameters of
    all layers (at TP 1) over the model's parameters."""
    return float(adapter_params_layer(model, rank, 1)) * model.num_layers / model.num_params


def trainable_share(model: ModelSpec, lora_rank: int | None, tp, pp):
    """Share of a GPU's parameters the optimizer updates: 1, or the LoRA adapters' share."""
    if not lora_rank:
        return 1.0
    return trainable_params_rank(model, lora_rank, tp, pp) / params_rank(model, tp, pp)
