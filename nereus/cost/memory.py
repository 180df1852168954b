"""Peak memory per GPU of one model-stage replica, by term (cost-model.md §2.2-2.4, §2.8).

All results are bytes on the most loaded GPU of a (tp, pp) replica. Terms:

* weights ``params·param_bytes``; optimizer ``params·optimizer_bytes`` (Adam: fp32 master,
  exp_avg, exp_avg_sq = 12 B); gradients ``params·grad_bytes`` (Megatron keeps fp32 main grads);
  ``params`` from :func:`nereus.cost.shapes.max_params_per_gpu`. ZeRO across the DP group
  (Rajbhandari et al. SC'20; cost-model.md §2.3): stage 1 divides the optimizer state by ``dp``
  (Megatron's distributed optimizer: ``6 + 12/dp`` bytes per parameter with fp32 main gradients),
  stage 2 also the gradients, stage 3 (FSDP FULL_SHARD) also the weights plus two gathered layers.
* activations per layer and micro-batch, Llama adaptation of Korthikanti et al. 2022 Table 2
  (cost-model.md §2.2; flash-attention, no dropout):
  ``s·b·(8h + (4h + 4h·g/a + 6F)/t)`` bytes (norm inputs, QKV and MLP inputs replicated; Q, K, V,
  attention output, gate/up/down inputs sharded); with sequence parallelism the replicated part is
  divided by ``t`` too (``s·b·(12h + 4h·g/a + 6F)/t``, the table's ``34·s·b·h/t`` for GPT).
  Llama-3.1-8B at t=1: 34·s·b·h, the reference's figure. Full recompute keeps only each layer's
  input ``2·s·b·h`` (``/t`` with SP) plus one layer's working set. Selective recompute re-runs the
  attention block and keeps only its input: ``s·b·(6h + 6F/t)`` (flash-attention stores no s²
  term, so the attention block's projections are what there is to save). 1F1B keeps ``min(pp, m)``
  micro-batches in flight on the first rank, ``1 + (p-1)/(p·v)`` times more when interleaved.
* logits and cross-entropy on the last pipeline rank: ``4·s·b·(h + V)/t`` (Megatron
  ``theoretical_memory_usage.py``); a value head keeps ``4·s·b·h/t``; with bf16 logits and
  flash-attn's cross-entropy (``workload.logits_kernel``) less (:mod:`nereus.cost.logits`).
* KV cache: ``concurrency · (prompt + response) · kv_bytes_per_token(tp) · layers_on_rank / L``
  (vLLM ``CacheEngine``); prefill activations with vLLM's chunked prefill of 8,192 tokens.

Sequence length: ``prompt_len + response_len_max`` when the workload sets it (a micro-batch may hold
the longest responses; vLLM's KV cache must hold them), else the mean; time stays at the mean.

Resident bytes stay on the GPU between stages (weights, and optimizer state for training);
transient bytes exist only while the model-stage runs (gradients, activations, logits, KV cache,
and the weights and optimizer state of a model-stage whose idle state is offloaded or dropped).
With ``cpu_adam`` (ZeRO-Offload, Ren et al. USENIX ATC'21 §4) the optimizer state lives in host
memory for good: no optimizer term on the GPU. With ZeRO-2/3 its gradient partitions are in host
memory too (DeepSpeed ``stage3.py``: the grad partition buffer is on ``'cpu'`` when
``offload_optimizer`` is set; ``stage_1_and_2.py`` copies each reduced bucket into the CPU fp32
partition): the GPU keeps the reduce bucket, ``DS_REDUCE_BUCKET_ELEMS`` gradient elements in the
weights' dtype (or the rank's whole gradient when smaller); with ZeRO-0/1 the gradients stay on the GPU.
DeepSpeed's ZeRO-1/2 optimizer keeps further buffers of its own under offload (a resident buffer of the
largest parameter, gradient copies, the step's fp32 partition): :mod:`nereus.cost.zero_offload`.
With ``workload.activation_model = "runtime"`` the training terms are those of the ``nereus run``
runtime's own engine (:mod:`nereus.cost.runtime_memory`: its saved tensors, gradient buffers and
ZeRO reduce buffers, counted as its meter counts them).
A constant per-GPU ``WORKSPACE_BYTES`` (CUDA context 0.3-0.6 GiB, NCCL buffers, cuBLAS workspace,
allocator slack; cost-model.md §2.8) is added once per GPU by the plan-level check.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.logits import infer_logits_bytes, train_logits_bytes
from nereus.cost.lora import trainable_params_rank
from nereus.cost.runtime_memory import train_terms
from nereus.cost.shapes import kv_bytes_per_token_rank, layer_params_rank, max_layers_rank, params_rank
from nereus.spec.framework import OFFLOAD_MODES
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["WORKSPACE_BYTES", "PREFILL_CHUNK_TOKENS", "activation_bytes_per_layer", "stage_memory",
           "recompute_code", "offload_code", "RC_NONE", "RC_SELECTIVE", "RC_FULL", "OFFLOAD_CODES",
           "OFF_NONE", "OFF_HOST", "OFF_DROP", "OFF_CPU_ADAM"]

GIB = 1024**3
WORKSPACE_BYTES = 1.5 * GIB
PREFILL_CHUNK_TOKENS = 8192
#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements; DeepSpeed configuration
#: docs, ``deepspeed/runtime/zero/config.py``). OpenRLHF passes ``"auto"``; the default is taken as
#: the bound, so the ZeRO-Offload gradient term is at most 5e8 x 2 B = 1 GB.
DS_REDUCE_BUCKET_ELEMS = 5e8
RC_NONE, RC_SELECTIVE, RC_FULL = 0, 1, 2
#: offload modes of a model-stage by code (:data:`nereus.spec.framework.OFFLOAD_MODES`)
OFFLOAD_CODES = OFFLOAD_MODES
OFF_NONE, OFF_HOST, OFF_DROP, OFF_CPU_ADAM = range(4)
#: recompute modes by code (``RC_NONE``, ``RC_SELECTIVE``, ``RC_FULL``)
RECOMPUTE_CODES = ("none", "selective", "full")


def _code(field: str, value, modes: tuple[str, ...]):
    """A mode name as its index in ``modes``; an int or array of codes passes through."""
    if isinstance(value, str):
        if value not in modes:
            raise ValueError(f"{field} must be one of {list(modes)}, got {value!r}")
        return modes.index(value)
    return np.asarray(value)


def recompute_code(recompute):
    """``none``/``selective``/``full`` (or an array of codes) as integer codes (``RC_*``).

    Raises:
        ValueError: unknown mode.
    """
    return _code("recompute", recompute, RECOMPUTE_CODES)


def offload_code(offload):
    """``none``/``host``/``drop``/``cpu_adam`` (or an array of codes) as integer codes of
    :data:`OFFLOAD_CODES`.

    Raises:
        ValueError: unknown mode.
    """
    return _code("offload", offload, OFFLOAD_CODES)


#: bytes per attention-score element an unfused attention stores for backward (Korthikanti et al.
#: 2022 Table 2): the softmax output (2, bf16); with attention dropout also its mask (1) and output (2)
SCORE_BYTES = {"unfused": 2.0, "unfused_dropout": 5.0}


def activation_bytes_per_layer(model: ModelSpec, tokens, tp, sp=False, selective=False, seq=None, kernel=None):
    """Stored activation bytes of one layer for ``tokens = s·b`` tokens on one TP rank, elementwise.

    Replicated over TP: the two norm inputs and the QKV and MLP inputs, ``8h`` bytes per token (``/tp``
    with sequence parallelism). Sharded: Q, attention output ``4h``, K and V ``4h·g/a``, the MLP's
    gate/up/down inputs ``6F``. Selective recompute re-runs the attention block (norm, QKV projection,
    core attention) in backward and keeps only its input, dropping the QKV input, Q, K, V and the
    attention output: ``6h`` replicated and ``6F`` sharded remain (Llama adaptation of Korthikanti et
    al. 2022 Table 2; cost-model.md §2.2).

    An unfused attention ``kernel`` (``WorkloadSpec.attention_kernel``) also stores the ``a/t``
    heads' ``s x s`` scores of every sequence: ``SCORE_BYTES · a·s²·b/t`` (``2as²b/t`` for the
    softmax output, ``5as²b/t`` with dropout: the table's term), ``seq`` = ``s``; selective
    recompute then re-runs only the core attention and drops only them, keeping the rest (Korthikanti
    et al. 2022 §5: "34sbh/t"; :mod:`nereus.cost.recompute`). FlashAttention stores no score term.
    """
    h, f = model.hidden_size, model.intermediate_size
    ga = model.num_kv_heads / model.num_attention_heads
    sel = np.asarray(selective, dtype=bool)
    block = sel & (kernel not in SCORE_BYTES)  # the flash-era definition drops the attention block's tensors
    rep = np.where(block, 6.0 * h, 8.0 * h)
    sharded = np.where(block, 6.0 * f, 4 * h + 4 * h * ga + 6.0 * f)
    tp = np.asarray(tp)
    rep = np.where(np.asarray(sp, dtype=bool) & (tp > 1), rep / tp, rep)
    out = tokens * (rep + sharded / tp)
    if kernel in SCORE_BYTES and seq is not None:
        out = out + np.where(sel, 0.0, SCORE_BYTES[kernel] * model.num_attention_heads * seq * tokens / tp)
    return out


def _weights(model: ModelSpec, workload: WorkloadSpec, params, tp, zero, dp):
    """Weight bytes per GPU: whole, or with ZeRO-3 over ``dp > 1`` a ``1/dp`` shard plus two gathered
    layers (the one running and the one prefetched). At ``dp = 1`` ZeRO-3 shards nothing and gathers
    nothing (the whole weights are already local), so the weights are counted once."""
    whole = params * workload.param_bytes
    sharded = whole / dp + 2.0 * layer_params_rank(model, tp) * workload.param_bytes
    return np.where((zero >= 3) & (dp > 1), sharded, whole)


def stage_memory(stage: str, model: ModelSpec, workload: WorkloadSpec, tp, pp, *,
                 micro_batch=1, recompute="none", inflight=1, concurrency=0, dp=1, zero=0, offload=0,
                 vpp=1, sp=False, chunked=True) -> dict:
    """Bytes per GPU by term for one replica of a ``generate``, ``infer`` or ``train`` model-stage.

    Elementwise over arrays: ``tp``, ``pp``, ``micro_batch``, ``recompute`` (a mode or an array of
    codes, see :func:`recompute_code`), ``inflight`` (train: micro-batches in flight, ``min(pp, m)``),
    ``concurrency`` (generate), ``dp``, ``zero`` (ZeRO stage 0-3, train; 0 or 3, infer), ``offload`` (codes of
    :data:`OFFLOAD_CODES`) and ``vpp`` (interleaving) may be arrays of one shape; ``sp`` (sequence
    parallelism) is a flag; ``chunked`` (generate): vLLM's chunked prefill of at most
    :data:`PREFILL_CHUNK_TOKENS` tokens, else one pass over all ``concurrency x prompt_len`` prompt
    tokens (Hugging Face ``generate`` on a training engine). Each term is taken on its most loaded pipeline rank (the first holds the
    most activations, the last the logits; the larger of the two is kept).

    Terms (cost-model.md §2.2-2.3):

    * ZeRO over ``dp``: stage >= 1 divides the optimizer state, >= 2 also the gradients, 3 also the
      weights, which then need two gathered layers in flight (forward and backward prefetch,
      llm-analysis's ``unsharded_layer x (fwd_prefetch + bwd_prefetch)``); at ``dp = 1`` there is
      nothing to shard or gather and the weights count once. An ``infer``
      model-stage run by a ZeRO-3 / FSDP engine (OpenRLHF's DeepSpeed reference and reward models
      and its actor's log-prob pass, verl's FSDP ref and ``compute_log_prob``) holds ``1/dp`` of
      its weights and two gathered layers: the one running and the one prefetched (FSDP
      ``forward_prefetch``, DeepSpeed ``stage3_prefetch_bucket_size``); other stages are ignored.
    * Interleaved 1F1B keeps ``1 + (p-1)/(p·v)`` times the first rank's activations (Korthikanti
      et al. 2022 §4.2.3).
    * LoRA (``workload.lora_rank``, :mod:`nereus.cost.lora`): gradients and optimizer state of the
      adapters only; the frozen base weights plus the adapters' weights.
    * Offload ``host`` or ``drop``: the weights and optimizer state are not resident between runs;
      they are transient, on the GPU only while the model-stage runs. ``cpu_adam`` (train): the
      optimizer state is in host memory, never on the GPU (``optimizer`` is 0); with ZeRO >= 2 the
      gradients on the GPU are the reduce bucket only (module docstring).

    Returns:
        dict with ``weights, optimizer, gradients, activations, logits, kv_cache`` and the sums
        ``resident`` and ``transient``.

    Raises:
        ValueError: unknown stage or recompute mode.
    """
    tp, pp = np.asarray(tp), np.asarray(pp)
    params = params_rank(model, tp, pp)
    layers = max_layers_rank(model, pp)
    s = workload.memory_seq_len  # the response length memory is sized for (max or a percentile)
    out = {"weights": params * workload.param_bytes, "optimizer": 0.0, "gradients": 0.0,
           "activations": 0.0, "logits": 0.0, "kv_cache": 0.0}
    if stage == "train":
        rc = recompute_code(recompute)
        zero, dp = np.asarray(zero), np.asarray(dp)
        on_host = np.asarray(offload) == OFF_CPU_ADAM
        trainable = trainable_params_rank(model, workload.lora_rank, tp, pp)
        out["optimizer"] = np.where(on_host, 0.0, trainable * workload.optimizer_bytes / np.where(zero >= 1, dp, 1))
        out["gradients"] = np.where(on_host & (zero >= 2),  # ZeRO-Offload: partitions on the host, bucket here
                                    np.minimum(trainable, DS_REDUCE_BUCKET_ELEMS) * workload.param_bytes,
                                    trainable * workload.grad_bytes / np.where(zero >= 2, dp, 1))
        out["weights"] = _weights(model, workload, params, tp, zero, dp)
        if workload.lora_rank:  # the adapters' own weights, next to the frozen base
            out["weights"] = out["weights"] + trainable * workload.param_bytes
        tokens = s * np.asarray(micro_batch)
        per_layer = activation_bytes_per_layer(model, tokens, tp, sp, rc == RC_SELECTIVE, s, workload.attention_kernel)
        inputs_only = 2.0 * tokens * model.hidden_size * layers / np.where(sp & (tp > 1), tp, 1)
        full = rc == RC_FULL
        vpp = np.asarray(vpp)
        interleave = np.where(vpp > 1, 1.0 + (pp - 1) / (pp * np.maximum(vpp, 1)), 1.0)
        first = np.where(full, inputs_only * np.asarray(inflight) * interleave + per_layer,
                         per_layer * layers * np.asarray(inflight) * interleave)
        logits = train_logits_bytes(model, tokens, tp, workload.logits_kernel)
        last = np.where(full, inputs_only + per_layer, per_layer * layers) + logits
        # pp = 1: one rank holds both; pp > 1: the larger of the first and the last rank.
        out["activations"] = np.where(pp > 1, np.maximum(first, last), first)
        out["logits"] = np.where(pp > 1, 0.0, logits)
        if workload.activation_model == "runtime":  # the nereus runtime's own engine (cost/runtime_memory.py)
            rt = train_terms(model, workload, tp, pp, micro_batch, rc, inflight, dp, zero, params)
            out.update({k: rt[k] for k in ("activations", "logits", "gradients", "reduce", "bucket", "weights",
                                           "gathered")})
    elif stage == "infer":
        zero, dp = np.asarray(zero), np.asarray(dp)
        out["weights"] = _weights(model, workload, params, tp, zero, dp)
        tokens = s * np.asarray(micro_batch)
        out["activations"] = 2 * activation_bytes_per_layer(model, tokens, tp, sp, seq=s, kernel=workload.attention_kernel)
        out["logits"] = infer_logits_bytes(model, tokens, tp, workload.logits_kernel)
    elif stage == "generate":
        c = np.asarray(concurrency)
        out["kv_cache"] = c * s * kv_bytes_per_token_rank(model, workload.kv_bytes, tp, pp)
        chunk = np.minimum(c * workload.prompt_len, PREFILL_CHUNK_TOKENS) if chunked else c * workload.prompt_len
        out["activations"] = 2 * activation_bytes_per_layer(model, chunk, tp)
        out["logits"] = 6.0 * c * model.vocab_size / tp
    else:
        raise ValueError(f"stage must be 'generate', 'infer' or 'train', got {stage!r}")
    state = out["weights"] + out["optimizer"]
    moved = (np.asarray(offload) == OFF_HOST) | (np.asarray(offload) == OFF_DROP)
    out["resident"] = np.where(moved, 0.0, state)
    # the runtime's ZeRO-1 reduce-scatter output coexists with the gradients, not the activations
    live = np.maximum(out["activations"] + out["logits"] + out.get("bucket", 0.0), out.get("reduce", 0.0))
    out["transient"] = out["gradients"] + live + out.get("gathered", 0.0) + out["kv_cache"] + np.where(moved, state, 0.0)
    if np.ndim(out["resident"]) == 0:
        out["resident"], out["transient"] = float(out["resident"]), float(out["transient"])
    return out
