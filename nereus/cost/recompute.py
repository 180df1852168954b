"""What selective activation recompute re-runs in backward, per attention kernel.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022, arXiv:2205.05198)
§5 defines selective recompute for attention that materialises its scores (Megatron's core attention
without flash kernels): only the *core attention* is checkpointed, "the QK^T matrix multiply, softmax,
softmax dropout, and attention over V", whose stored activations are the ``5as²b`` term of their
Table 2; Q, K, V and every other activation stay stored (``34sbh/t`` per layer with sequence
parallelism). The re-run costs that forward once more: the two batched GEMMs ``QK^T`` and ``PV``
(``2·2·b·s²·h`` FLOPs per layer, the whole square as computed) and the softmax and dropout kernels
over the scores, against a layer's ``72·b·s·h² + 12·b·s²·h`` training FLOPs (the paper's FLOP count,
§6.1, per layer); the QKV projection is not re-run.

FlashAttention stores no ``s²`` term (its backward recomputes the scores tile by tile, Dao et al.
2022 §3.1), so that definition saves nothing; the flash-era selective recompute of this cost model
re-runs each layer's attention block instead (norm, QKV projection, core attention and, with sequence
parallelism, the all-gather of its input) and keeps only the block's input
(:func:`nereus.cost.memory.activation_bytes_per_layer`), which is what the kernels ``flash`` (None)
and ``flash_triton`` get here.

Elementwise over NumPy arrays; op-class seconds of the re-run per micro-batch over ``layers`` layers.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.kernels import attention_times, gemm_time

__all__ = ["selective_recompute_times", "UNFUSED_KERNELS"]

#: attention kernels that materialise their scores (``WorkloadSpec.attention_kernel``)
UNFUSED_KERNELS = ("unfused", "unfused_dropout")


def selective_recompute_times(model, kernel, links, tp, tokens, seq, layers, sp, gpu, eff, gcls) -> dict:
    """Op-class seconds of what selective recompute re-runs in one micro-batch's backward.

    ``kernel`` in :data:`UNFUSED_KERNELS`: the core attention's forward
    (:func:`nereus.cost.kernels.attention_times` with one forward: its batched GEMMs and the softmax /
    dropout traffic), nothing else. Otherwise (flash kinds, None): the attention block's forward: core
    attention, the QKV projection ``2·h·(q_dim + 2·kv_dim·rep)/tp`` FLOPs per token (``rep`` KV heads
    replicated when ``tp`` exceeds them) at the ``gcls`` GEMM class, and with ``sp`` and ``tp > 1`` the
    all-gather of the block's input (``2·tokens·h`` bytes) over ``links``
    (:class:`nereus.cost.latency.LinkModel`). ``tokens = s·b`` per micro-batch, ``seq = s``."""
    out = dict(attention_times(model, kernel, tp, tokens, seq, layers, 1, 0, gpu, eff))
    if kernel in UNFUSED_KERNELS:
        return out
    tp = np.asarray(tp)
    kv_rep = np.maximum(tp // model.num_kv_heads, 1)
    qkv = model.hidden_size * (model.q_dim + 2 * model.kv_dim * kv_rep) / tp
    out[gcls] = out.get(gcls, 0.0) + gemm_time(2.0 * qkv * np.asarray(tokens) * layers, 3 * layers, gpu, eff, gcls)
    if sp:
        for cls, t in links.time("allgather", 2.0 * np.asarray(tokens) * model.hidden_size, tp).items():
            out[cls] = out.get(cls, 0.0) + np.where(tp > 1, t * layers, 0.0)
    return out
