"""Training memory of the ``nereus run`` runtime's own engine (``WorkloadSpec.activation_model = "runtime"``).

:mod:`nereus.cost.memory` charges a Megatron-style engine (Korthikanti et al. 2022's activations,
fused kernels, bf16). The runtime (``nereus/runtime/model/llama.py``, ``worker/engine.py``,
``worker/zero.py``, ``worker/zero3.py``) holds a different set, which this module counts tensor by
tensor, in bytes, for one micro-batch of ``b`` sequences of ``s`` tokens (``R`` of them response) on
one TP rank (``t``), with ``w`` the weights' width (4 fp32, 2 bf16). The runtime's meter
(``comm/instrument.py``) counts each storage autograd saves once, so these are storages:

Per decoder layer and token (``h`` hidden, ``d`` head dim, ``a_t = a/t`` query heads, ``F`` MLP width):

* each of the two RMSNorms (``rms_norm``): its input in fp32 (``x.float()``, ``4h``; in fp32 the
  residual stream itself), the normalized ``y`` and the weighted output (the projections' input),
  ``w·h`` each, and ``rsqrt`` (4): ``4h + 2wh + 4``;
* attention: the rotated ``q`` and the SDPA output ``w·a_t·d`` each (``o_proj`` reads a view of the
  output), the SDPA's ``k`` and ``v``, ``w·a_t·d`` each when KV heads are repeated for GQA
  (``repeat_interleave`` makes new tensors), else ``w·g_t·d``, and its log-sum-exp (``4·a_t``, fp32);
* MLP (SwiGLU): the gate and up projections, ``act(gate)`` and their product: ``4·w·F/t`` (``relu``:
  3, it saves its output only);

plus per layer and micro-batch RoPE's ``cos`` and ``sin`` for ``q`` and ``k`` (``4·w·s·d``) and the
attention mask as the CPU SDPA kernel keeps it (``w·s²``). The first PP rank adds the embedding's
ids and mask (``8 + w`` per token); the last rank the final norm (``4h + 2wh + 4``) and the loss: the
policy loss keeps ``z`` and ``exp(z)`` of the vocab-parallel log-softmax over the response positions
(``8·V/t`` per response token) plus :data:`ACTOR_LOSS_BYTES` per response token, the value loss
:data:`CRITIC_LOSS_BYTES`, and both views of :data:`BATCH_FIELDS` of the replica's ``[n, R]`` batch
fields (``4·n·R`` each, ``n = mini_batch / dp``). Full recompute (ZeRO-3 runs every part under activation checkpointing) keeps
each checkpointed part's input (ids ``8``, each layer's and the head's input ``w·h``) and, while a
layer is recomputed in backward, that layer's tensors. (Measured on the runtime: ``tests/test_runtime_memory_model.py``.)

Gradients: plain DP one flat fp32 buffer of the shard's ``N`` parameters (``4N``); ZeRO-1 the buffer
padded to ``dp·k`` (``k = ceil(N/dp)``) and, while the reduce-scatter's output ``4k`` exists, the buffer
too (no activations left then); ZeRO-2/3 the fp32 slices ``4·Σ k_u`` over units ``u`` (embedding,
layers, head; ``k_u = ceil(N_u/dp)``). ZeRO-2 reduce-scatters a unit once its gradients are complete:
its pending gradients and their flat copy (``2·4·N_u``), the padded copy (``4·dp·k_u``) and the output
(``4·k_u``) coexist, charged for the largest unit on top of the activations (an upper bound: by then
the last layer's activations are freed). ZeRO-3 holds ``w·Σ k_u`` of weights (resident) and, while it
runs, one gathered unit, twice while the all-gather's receive buffers and the flat unit coexist:
``2·w·dp·k_u`` for the largest unit (transient: an idle ZeRO-3 engine holds no gathered unit, so
unlike :func:`nereus.cost.memory.stage_memory`'s two gathered layers it is not charged as resident).

Elementwise over NumPy arrays like :func:`nereus.cost.memory.stage_memory`.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.shapes import layer_params_rank, max_layers_rank
from nereus.spec.model import ModelSpec

__all__ = ["ACTOR_LOSS_BYTES", "CRITIC_LOSS_BYTES", "BATCH_FIELDS", "layer_bytes", "train_terms", "unit_sizes"]

#: bytes per response token of a micro-batch the PPO policy loss keeps besides the log-softmax's
#: two ``[b, R, V/t]`` tensors: the gathered target index (int64, 8) and five fp32 ``[b, R]`` tensors
ACTOR_LOSS_BYTES = 28
#: the same for the clipped value loss: five fp32 ``[b, R]`` tensors
CRITIC_LOSS_BYTES = 20
#: fp32 ``[n, R]`` fields of the replica's batch (``n`` sequences per update) that the losses save
#: views of, so whole: two for the policy loss, one for the value loss (``kl_coef = 0``)
BATCH_FIELDS = {"lm": 2, "value": 1}


def _heads(model: ModelSpec, tp):
    tp = np.asarray(tp)
    aq = model.num_attention_heads / tp
    kv = np.maximum(model.num_kv_heads // tp, 1)
    return aq, np.where(aq > kv, aq, kv)


def _norm(model: ModelSpec, w):
    return 4.0 * model.hidden_size + 2.0 * w * model.hidden_size + 4.0


def layer_bytes(model: ModelSpec, b, s, tp, w, selective=False):
    """Bytes one decoder layer keeps for backward for ``b`` sequences of ``s`` tokens on one TP rank
    (module docstring); ``selective``: the SDPA runs under checkpointing, its log-sum-exp is not kept."""
    aq, kvs = _heads(model, tp)
    d, f = model.head_dim, model.intermediate_size / np.asarray(tp)
    mlp = (3.0 if model.hidden_act == "relu" else 4.0) * w * f
    lse = np.where(np.asarray(selective, dtype=bool), 0.0, 4.0 * aq)
    per_token = 2 * _norm(model, w) + 2.0 * w * aq * d + 2.0 * w * kvs * d + lse + mlp
    return np.asarray(b) * s * per_token + 4.0 * w * s * d + w * s * s


def unit_sizes(model: ModelSpec, tp, pp) -> dict:
    """Parameters per ZeRO-2/3 unit on the most loaded rank: ``embed`` (first PP rank), ``layer``, ``head``
    (last PP rank) and ``layers`` (their count), as ``worker/zero3.py`` groups them."""
    tp = np.asarray(tp)
    h = model.hidden_size
    vocab = -(-model.vocab_size // tp) * h  # a vocab-parallel shard (padded to a multiple of tp)
    head = h + (h + 1.0 if model.head == "value" else (0.0 if model.tie_word_embeddings else vocab))
    return {"embed": vocab, "layer": layer_params_rank(model, tp), "head": head, "layers": max_layers_rank(model, pp)}


def train_terms(model: ModelSpec, workload, tp, pp, micro_batch, recompute, inflight, dp, zero, params) -> dict:
    """``{"activations", "logits", "gradients", "reduce", "bucket", "weights", "gathered"}``: bytes per GPU of one
    training replica as the runtime holds them (module docstring). ``recompute`` is a code
    (``nereus.cost.memory.RC_*``: 0 none, 1 selective, 2 full), ``params`` the parameters on the rank
    (``nereus.cost.shapes.params_rank``). ``reduce``: bytes of the gradient reduction that coexist with
    the gradients but not with the activations (ZeRO-1: the reduce-scatter's output), ``bucket``: on top
    of both (ZeRO-2's unit reduce-scatter); ``weights``: the resident weights (ZeRO-3: the slices);
    ``gathered``: ZeRO-3's gathered unit, transient (only the running model-stage's exists).
    """
    tp, pp, dp, zero = np.asarray(tp), np.asarray(pp), np.asarray(dp), np.asarray(zero)
    w = float(workload.param_bytes)
    b, s = np.asarray(micro_batch, dtype=float), workload.memory_seq_len
    r = workload.memory_response_len
    rc = np.asarray(recompute)
    layers = max_layers_rank(model, pp)
    layer = layer_bytes(model, b, s, tp, w, rc == 1)
    tokens = b * s
    full = rc == 2
    sharded = (zero >= 3) & (dp > 1)
    # full recompute: the checkpointed parts' inputs; ZeRO-3 checkpoints the embedding and head too
    inputs = layers * tokens * w * model.hidden_size
    embed = np.where(full & sharded, 8.0 * tokens, (8.0 + w) * tokens)
    head_in = np.where(full & sharded, tokens * w * model.hidden_size, tokens * _norm(model, w))
    n_rep = max(workload.mini_batch_size, 1) / dp  # sequences of the replica per update
    loss = np.where(model.head == "value", CRITIC_LOSS_BYTES * b * r,
                    b * r * (8.0 * (-(-model.vocab_size // tp)) + ACTOR_LOSS_BYTES))
    loss = loss + 4.0 * BATCH_FIELDS[model.head] * np.maximum(n_rep, b) * r
    inflight = np.asarray(inflight)
    first = np.where(full, inputs * inflight + layer, layers * layer * inflight) + embed
    last = np.where(full, inputs + layer, layers * layer) + head_in + loss
    acts = np.where(pp > 1, np.maximum(first, last), first + head_in + loss)
    units = unit_sizes(model, tp, pp)
    n = np.asarray(params, dtype=float)
    k = np.ceil(n / dp)
    ku = {u: np.ceil(units[u] / dp) for u in ("embed", "layer", "head")}
    slices = 4.0 * (ku["layer"] * units["layers"] + np.where(pp > 1, np.maximum(ku["embed"], ku["head"]),
                                                             ku["embed"] + ku["head"]))
    grads = np.where(zero >= 2, np.where(dp > 1, slices, 4.0 * n), np.where(zero == 1, 4.0 * dp * k, 4.0 * n))
    reduce = np.where((zero == 1) & (dp > 1), 4.0 * k, 0.0)
    big = units["layer"]
    bucket = np.where((zero == 2) & (dp > 1), 4.0 * (2.0 * big + dp * np.ceil(big / dp) + np.ceil(big / dp)), 0.0)
    gathered = np.where(sharded, 2.0 * w * dp * np.ceil(big / dp), 0.0)
    return {"activations": acts, "logits": 0.0 * acts, "gradients": grads, "reduce": reduce, "bucket": bucket,
            "weights": np.where(sharded, w * (slices / 4.0), n * w), "gathered": gathered}
