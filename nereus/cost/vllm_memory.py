"""vLLM's fixed pre-allocation: the generation engine takes ``gpu_memory_utilization`` of each GPU.

vLLM sizes its KV cache at start-up (``Worker.determine_num_available_blocks``; vLLM docs,
"Engine arguments", ``--gpu-memory-utilization``: "the fraction of GPU memory to be used for the model
executor"): it profiles one forward pass at ``max_num_seqs`` / ``max_num_batched_tokens`` and gives
the KV cache everything left of ``f · M`` after the weights, the profiled activations and its
non-torch memory (CUDA context, NCCL buffers). So the engine holds ``f · M`` whatever the batch
needs, and the number of sequences it decodes at once is capped by the KV blocks that fit; past
that cap vLLM preempts sequences (recompute) and the rest wait, i.e. it runs at the cap.

Terms here (per GPU; :mod:`nereus.cost.memory` gives weights, activations and logits):

* engine bytes beyond the per-GPU workspace (which the plan-level check adds once per GPU):
  ``E = f·M - workspace``;
* KV budget ``K = E - weights - activations - logits``; KV per sequence ``kv1 = s · kv_bytes_per_token``;
  the engine decodes at most ``floor(K / kv1_mean)`` sequences at once (the time; blocks are taken as
  sequences grow, so the mean length ``prompt + response`` sets the steady occupancy) and must hold one
  sequence of the memory length (``prompt + response_len_max``), else vLLM refuses to start
  ("max seq len is larger than the maximum number of tokens that can be stored in KV cache"):
  such rows get the device's whole memory plus the shortfall (never fit, and the excess says by how
  much);
* the engine's bytes are ``E``: resident between stages when it keeps its cache (no sleep mode: the
  KV blocks stay allocated), transient when it sleeps (``offload`` host/drop: verl
  ``free_cache_engine``, OpenRLHF ``--vllm_enable_sleep``).

The plan check ``workspace + Σ resident + max transient <= capacity`` then says what vLLM says at
start-up: the other model-stages' resident state must fit beside the fraction.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.memory import OFF_DROP, OFF_HOST, stage_memory
from nereus.cost.shapes import kv_bytes_per_token_rank

__all__ = ["engine_bytes", "kv_capacity", "preallocated_memory"]


def engine_bytes(fraction: float, device_bytes: float, workspace: float) -> float:
    """``E = f·M - workspace``: the engine's bytes beyond the per-GPU workspace."""
    return float(fraction) * float(device_bytes) - float(workspace)


def kv_capacity(model, workload, tp, pp, concurrency, fraction, device_bytes, workspace: float,
                mean: bool = True):
    """Sequences the pre-allocated KV cache holds at once (elementwise; 0 when none): ``floor(K /
    kv1)`` with ``K`` at ``concurrency`` (its activations and logits) and ``kv1`` at the mean length
    (``mean``) or the memory length. ``fraction`` None: the workload's ``rollout_memory_fraction``;
    ``device_bytes`` may be a :class:`~nereus.spec.hardware.GPUSpec` (its ``memory_bytes``)."""
    fraction = workload.rollout_memory_fraction if fraction is None else fraction
    device_bytes = getattr(device_bytes, "memory_bytes", device_bytes)
    m = stage_memory("generate", model, workload, tp, pp, concurrency=np.maximum(np.asarray(concurrency), 1))
    k = engine_bytes(fraction, device_bytes, workspace) - m["weights"] - m["activations"] - m["logits"]
    s = workload.seq_len if mean else workload.memory_seq_len
    kv1 = s * kv_bytes_per_token_rank(model, workload.kv_bytes, tp, pp)
    return np.maximum(np.floor(k / kv1), 0).astype(np.int64)


def preallocated_memory(mem: dict, fraction: float, device_bytes: float, workspace: float, offload,
                        concurrency) -> dict:
    """Generation rows' memory terms (:func:`nereus.cost.memory.stage_memory` output) as vLLM holds
    them: ``kv_cache`` = the KV budget, the engine's ``E`` resident (or transient when it sleeps);
    ``device_bytes + shortfall`` where the budget does not hold one sequence's KV at the memory length
    (vLLM refuses to start; ``mem`` was
    evaluated at ``concurrency``, which the caller capped with :func:`kv_capacity`)."""
    e = engine_bytes(fraction, device_bytes, workspace)
    out = dict(mem)
    budget = e - mem["weights"] - mem["activations"] - mem["logits"]
    one = mem["kv_cache"] / np.maximum(np.asarray(concurrency), 1)
    ok = budget >= one
    out["kv_cache"] = np.where(ok, budget, one)
    total = np.where(ok, e, float(device_bytes) + (one - budget))
    sleeps = (np.asarray(offload) == OFF_HOST) | (np.asarray(offload) == OFF_DROP)
    out["resident"] = np.where(sleeps, 0.0, total)
    out["transient"] = np.where(sleeps, total, 0.0)
    if np.ndim(out["resident"]) == 0:
        out["resident"], out["transient"] = float(out["resident"]), float(out["transient"])
    return out
