"""What a training engine keeps on the GPU between its runs, beyond :mod:`nereus.cost.memory`'s
default terms: two framework facts (:class:`~nereus.spec.framework.FrameworkSpec` flags) of the
engines verl runs.

* ``persistent_grads`` (Megatron-Core DDP; verl's Megatron workers). ``DistributedDataParallel``
  allocates one contiguous gradient buffer per model chunk when it wraps the model
  (NVIDIA/Megatron-LM ``megatron/core/distributed/param_and_grad_buffer.py``,
  ``_ParamAndGradBuffer.__init__``: ``self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype)``;
  ``distributed_data_parallel.py``: ``grad_dtype = torch.float if ddp_config.grad_reduce_in_fp32
  else param.dtype``), every parameter's ``main_grad`` is a view into it, and between steps
  ``zero_grad_buffer`` zeroes it in place: it is never freed. With the distributed optimizer each DP
  rank still holds the whole buffer of its (tp, pp) shard (the reduce-scatter writes the rank's
  shard in place and ``optimizer/distrib_optimizer.py`` reads that shard as the fp32 main params'
  gradient), so the ``grad_bytes · params / (tp·pp)`` term is not divided by DP at ZeRO-1. verl wraps
  with ``grad_reduce_in_fp32=True`` (``verl/utils/megatron_utils.py``, 4 B per parameter) and frees
  the buffer only with ``param_offload`` (``offload_megatron_model_to_cpu`` moves the parameter and
  gradient buffers to the host; ``verl/trainer/config/engine/megatron.yaml``: "offload model
  parameters to CPU and release gradient buffers while inactive"). So the gradients are resident:
  on the GPU while vLLM generates and while the other models run, and at vLLM's start-up.
* ``fp32_train_params`` (verl's FSDP workers). The actor and critic are loaded in fp32
  (``verl/workers/fsdp_workers.py``: ``torch_dtype = torch.float32 if self._is_actor``; the critic's
  ``fsdp_config.model_dtype`` defaults to ``fp32``; TinyZero's verl 0.1 alike, Jiayi-Pan/TinyZero@95df88f)
  and wrapped with ``MixedPrecision(param_dtype=torch.bfloat16)``: the resident flat parameter is the
  fp32 tensor the optimizer steps, i.e. Adam's fp32 master copy (the 4 of the 12 B per parameter
  of ``optimizer_bytes``), and a bf16 copy exists only unsharded while an FSDP unit runs. The bf16
  weight term is then not resident; two gathered bf16 layers (the running and the prefetched unit)
  are transient, or the whole bf16 weights when the strategy keeps them unsharded through forward and
  backward (ZeRO-2 / ``SHARD_GRAD_OP`` at DP > 1). Not applied with LoRA (the adapters' base weights
  follow :mod:`nereus.cost.lora`).

Both leave ``workload.activation_model == "runtime"`` (Nereus's own engine) alone. DeepSpeed's
ZeRO-Offload buffers (``zero_offload_buffers``) are applied after them (:mod:`nereus.cost.zero_offload`).
"""

from __future__ import annotations

import numpy as np

from nereus.cost.shapes import layer_params_rank, params_rank
from nereus.cost.zero_offload import zero_offload_state

__all__ = ["engine_train_state"]

_HOST, _DROP = 1, 2  # offload codes of nereus.cost.memory.OFFLOAD_CODES ("host", "drop")


def engine_train_state(mem: dict, fw, model, workload, tp, pp, dp, zero, offload) -> dict:
    """``mem`` (:func:`nereus.cost.memory.stage_memory` of a ``train`` model-stage, bytes per GPU)
    with the framework's training-state facts applied (module docstring), elementwise over the
    arrays ``tp``, ``pp``, ``dp``, ``zero`` and ``offload`` (codes).

    * ``fw.persistent_grads``: ``gradients`` move from the transient to the resident bytes (and back
      with the rest of the state when the model-stage is offloaded, ``host``).
    * ``fw.fp32_train_params`` (no LoRA): ``weights`` becomes 0 and ``gathered`` gains the bf16
      copies in flight, ``2 · layer_params · param_bytes`` (ZeRO-3, or DP = 1), else the whole
      ``params · param_bytes``.

    * ``fw.zero_offload_buffers``: :func:`nereus.cost.zero_offload.zero_offload_state` last.

    Returns:
        a new dict of the same keys (``gathered`` added when needed) with ``resident`` and
        ``transient`` recomputed; ``mem`` itself when no flag applies.
    """
    fp32 = bool(getattr(fw, "fp32_train_params", False)) and not workload.lora_rank
    keep = bool(getattr(fw, "persistent_grads", False))
    if not (fp32 or keep) or workload.activation_model == "runtime":
        return zero_offload_state(mem, fw, model, workload, tp, pp, dp, zero, offload)
    off = np.asarray(offload)
    moved = (off == _HOST) | (off == _DROP)
    out = dict(mem)
    grads = np.asarray(mem["gradients"], dtype=float)
    delta_state = np.zeros_like(np.asarray(mem["resident"], dtype=float)) + (grads if keep else 0.0)
    added = 0.0
    if fp32:
        tp, pp, dp, zero = np.asarray(tp), np.asarray(pp), np.asarray(dp), np.asarray(zero)
        layers = 2.0 * layer_params_rank(model, tp) * workload.param_bytes
        whole = params_rank(model, tp, pp) * workload.param_bytes
        added = np.where((zero >= 3) | (dp <= 1), layers, whole)
        delta_state = delta_state - np.asarray(mem["weights"], dtype=float)
        out["weights"] = np.zeros_like(np.asarray(mem["weights"], dtype=float))
        out["gathered"] = np.asarray(mem.get("gathered", 0.0), dtype=float) + added
    state = np.asarray(mem["weights"], dtype=float) + np.asarray(mem["optimizer"], dtype=float) + delta_state
    out["resident"] = np.where(moved, 0.0, state)
    out["transient"] = (np.asarray(mem["transient"], dtype=float) - (grads if keep else 0.0) + added
                        + np.where(moved, delta_state, 0.0))
    if np.ndim(out["resident"]) == 0:
        out["resident"], out["transient"] = float(out["resident"]), float(out["transient"])
    return zero_offload_state(out, fw, model, workload, tp, pp, dp, zero, offload)
