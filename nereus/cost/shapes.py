"""Where parameters live under a (tp, pp) layout: layers per pipeline rank and bytes per shard.

Pipeline ranks own contiguous layer ranges; the first rank also holds the input embedding, the last
the final norm and the head (Megatron's layout; cost-model.md §2.3). Layers are split as evenly as
possible with the remainder going to the earliest ranks. Under TP every weight is split by ``tp``
except the RMSNorm weights (replicated) and, when ``tp`` exceeds the KV heads, the k/v projections
(replicated per KV head; resharding.md §3). The vocabulary is padded to a multiple of ``tp``. q/k/v
biases (Qwen2) split like their weights' rows; an ``o_proj`` bias is replicated. Tied embeddings under
PP > 1: the last rank holds a copy of the embedding as its output layer (Megatron), so it counts a
vocabulary shard too.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from nereus.spec.model import ModelSpec

__all__ = ["replicated_per_layer", "layers_of_rank", "max_layers_rank", "layer_params_rank", "params_on_rank", "max_params_per_gpu", "params_rank", "kv_bytes_per_token_rank",
           "valid_tp", "valid_pp"]


def layers_of_rank(num_layers: int, pp: int, p: int) -> range:
    """Layer indices of pipeline rank ``p`` out of ``pp``.

    Raises:
        ValueError: ``pp`` not in 1..num_layers or ``p`` out of range.
    """
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} must be between 1 and the number of layers {num_layers}")
    if not 0 <= p < pp:
        raise ValueError(f"pipeline rank {p} out of range 0..{pp - 1}")
    base, rem = divmod(num_layers, pp)
    start = p * base + min(p, rem)
    return range(start, start + base + (1 if p < rem else 0))


def valid_tp(model: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``model``, or None when it can.

    TP must divide the query heads and the MLP width; it must divide the KV heads or be a multiple of
    them (KV heads then replicated, as vLLM does).
    """
    if tp < 1:
        return f"tp={tp} must be >= 1"
    if model.num_attention_heads % tp:
        return f"tp={tp} does not divide num_attention_heads={model.num_attention_heads}"
    if model.intermediate_size % tp:
        return f"tp={tp} does not divide intermediate_size={model.intermediate_size}"
    g = model.num_kv_heads
    if g % tp and tp % g:
        return f"tp={tp} neither divides nor is a multiple of num_key_value_heads={g}"
    return None


def valid_pp(model: ModelSpec, pp: int, uneven: bool = False) -> str | None:
    """Why ``pp`` cannot split ``model``, or None when it can.

    PP must divide the layers unless ``uneven`` (the framework allows unequal layer counts, e.g.
    Megatron's ``decoder_first_pipeline_num_layers``; the earliest ranks then take one layer more,
    :func:`layers_of_rank`)."""
    if pp < 1 or pp > model.num_layers:
        return f"pp={pp} must be between 1 and num_hidden_layers={model.num_layers}"
    if model.num_layers % pp and not uneven:
        return (f"pp={pp} does not divide num_hidden_layers={model.num_layers} (the job's framework does not "
                f"allow uneven pipeline stages)")
    return None


def max_layers_rank(model: ModelSpec, pp):
    """Layers on the most loaded pipeline rank, ``ceil(L/pp)``, elementwise."""
    return -(-model.num_layers // np.asarray(pp))


def layer_params_rank(model: ModelSpec, tp):
    """Parameters of one transformer layer on one TP rank, elementwise (ZeRO-3 gathers layer by layer)."""
    tp = np.asarray(tp)
    if tp.ndim == 0:
        return _layer_params_per_tp_rank(model, int(tp))
    uniq, inv = np.unique(tp, return_inverse=True)
    vals = np.array([_layer_params_per_tp_rank(model, int(t)) for t in uniq], dtype=float)
    return vals[inv.reshape(-1)].reshape(tp.shape)


def replicated_per_layer(model: ModelSpec) -> int:
    """Parameters of one layer every TP rank holds in full: the two RMSNorm weights, Qwen3's q/k norms
    ``2·d`` and an ``o_proj`` bias ``h`` (added after the row-parallel reduction)."""
    h = model.hidden_size
    return 2 * h + (2 * model.head_dim if model.qk_norm else 0) + (h if model.o_bias else 0)


def _layer_params_per_tp_rank(model: ModelSpec, tp: int) -> float:
    h = model.hidden_size
    kv_rep = max(tp // model.num_kv_heads, 1)  # >1 when KV heads are replicated
    q_o = 2 * h * model.q_dim / tp
    k_v = 2 * h * model.kv_dim * kv_rep / tp
    mlp = 3 * h * model.intermediate_size / tp
    # q/k/v biases split like their weight's dim 0 (k/v replicated per KV head like the weights)
    bias = (model.q_dim + 2 * model.kv_dim * kv_rep) / tp if model.qkv_bias else 0
    return q_o + k_v + mlp + bias + replicated_per_layer(model)


def params_on_rank(model: ModelSpec, tp: int, pp: int, p: int) -> float:
    """Parameters held by one GPU at pipeline rank ``p`` (any TP rank) of a (tp, pp) replica."""
    layers = len(layers_of_rank(model.num_layers, pp, p))
    n = layers * _layer_params_per_tp_rank(model, tp)
    vocab_pad = -(-model.vocab_size // tp) * tp
    if p == 0:
        n += vocab_pad * model.hidden_size / tp
    if p == pp - 1:
        n += model.hidden_size  # final norm
        if model.head == "value":
            n += model.hidden_size + 1
        elif not model.tie_word_embeddings or pp > 1:
            # untied head, or a tied head replicated on the last stage under PP
            n += vocab_pad * model.hidden_size / tp
    return n


@lru_cache(maxsize=4096)
def max_params_per_gpu(model: ModelSpec, tp: int, pp: int) -> float:
    """Parameters on the most loaded GPU of a (tp, pp) replica."""
    return max(params_on_rank(model, tp, pp, p) for p in range(pp))


def params_rank(model: ModelSpec, tp, pp):
    """Parameters on the most loaded GPU of a (tp, pp) replica, elementwise."""
    tp, pp = np.asarray(tp), np.asarray(pp)
    if tp.ndim == 0 and pp.ndim == 0:
        return max_params_per_gpu(model, int(tp), int(pp))
    tp, pp = np.broadcast_arrays(tp, pp)
    if tp.size == 1:
        return np.full(tp.shape, max_params_per_gpu(model, int(tp.flat[0]), int(pp.flat[0])))
    keys = tp.reshape(-1).astype(np.int64) * 1_000_003 + pp.reshape(-1)
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    tf, pf = tp.reshape(-1), pp.reshape(-1)
    vals = np.array([max_params_per_gpu(model, int(tf[i]), int(pf[i])) for i in first])
    return vals[inv.reshape(-1)].reshape(tp.shape)


def kv_bytes_per_token_rank(model: ModelSpec, kv_bytes: int, tp, pp):
    """KV-cache bytes per token on one GPU: ``2·ceil(L/pp)·max(g/tp, 1)·d·bytes`` (KV heads replicated
    when tp > g; the most loaded rank when pp does not divide the layers)."""
    tp = np.asarray(tp)
    kv_heads = np.maximum(model.num_kv_heads // tp, 1)
    return 2 * max_layers_rank(model, pp) * kv_heads * model.head_dim * kv_bytes
