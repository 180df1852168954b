"""GPU buffers of DeepSpeed's ZeRO-1/2 optimizer with ``offload_optimizer: cpu`` (ZeRO-Offload,
``offload='cpu_adam'`` at ``zero`` 1 or 2) beyond :mod:`nereus.cost.memory`'s reduce bucket: the
framework flag ``zero_offload_buffers`` (the ``deepspeed`` preset and OpenRLHF's DeepSpeed backend).

Read from microsoft/DeepSpeed@v0.15.0 (55b4cae8, the release OpenRLHF v0.4.5, v0.5.0 and v0.5.4 pin;
``deepspeed/runtime/zero/stage_1_and_2.py``, ``DeepSpeedZeroOptimizer``; the same code in v0.14.4
through v0.16.4, the range ``openrlhf.cli.train_ppo``'s releases pin). ``n`` is the largest single
trainable parameter tensor (``largest_param_numel``: the embedding or an untied LM head ``V·h``, else
a layer's widest matrix ``h·F``; with LoRA the widest adapter ``r·max(h, F)``), ``P`` the rank's flat
partition of the parameters (``trainable / dp``; OpenRLHF's no-decay group of norm weights is a second,
much smaller group), ``B`` the reduce bucket (:data:`nereus.cost.memory.DS_REDUCE_BUCKET_ELEMS`:
DeepSpeed's ``reduce_bucket_size`` default, which OpenRLHF's ``"auto"`` resolves to because
``DeepSpeedConfigModel.__init__`` drops ``"auto"`` values, ``deepspeed/runtime/config_utils.py``),
``pb`` the weights' bytes (bf16: 2):

* **Resident** ``n·pb``: ``temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel,
  device=<GPU>, dtype=self.dtype)`` (``__init__``, L476), allocated with the engine and never freed
  (the accumulation of micro-batch gradients from the host goes through it).
* **Reduce buckets**: ``backward()`` allocates one ``ipg_buffer`` of ``B`` elements, two with
  ``overlap_comm`` (L2046-2057; DeepSpeed's default for stages 1-2 is off,
  ``zero/config.py::overlap_comm_valid``; OpenRLHF's ``--overlap_comm`` sets it; here the framework's
  ``overlap_grad_reduce``), released at the end of the backward (``_release_ipg_buffers``, L669).
* **Reducing a bucket** (ZeRO-2, during the backward, the activations still held): the all-reduce
  flattens the bucket's per-rank slices (``allreduce_bucket``: ``tensor = self.flatten(bucket)``, L1489: a
  copy when the bucket spans two ranks' partitions, which only ``dp > 1`` has; counted there, ``B·pb``); then, at the
  gradient-accumulation boundary, each parameter of the rank's partition gets its gradient norm from
  an fp64 copy (``set_norm_for_param_grad_in_gpu``: ``accumulated_grad.data.double().norm(2)``, L1265, 8 B
  an element) and is copied to the host through an fp32 copy (``async_inplace_copy_grad_to_fp32_buffer
  _from_gpu``: ``src_tensor.float()``, L1280, 4 B): one parameter at a time, so ``8·min(n_A, P)``. A
  parameter larger than ``B`` is not copied into the bucket (``extra_large_param_to_reduce``, L951) and its
  own gradient ``n_A·pb`` is held too. ``n_A``: the largest parameter whose gradient arrives while the
  activations are held: an untied LM head (the backward's first gradient), else a layer's widest
  matrix; the embedding's gradient (and a tied head's) arrives last, the activations freed: it is
  reduced at the backward's end with the buckets alone (``8·min(n, P)`` and, when ``n > B``, ``n·pb``).
  At ZeRO-1 the norms and copies are taken after the backward (``reduce_gradients`` at the boundary).
* **Optimizer step**: the updated fp32 partition comes back through a GPU fp32 copy
  (``bit16_partitions[partition_id].data.copy_(fp32_partition.to(<GPU>).data)``, L1878-1879, since
  microsoft/DeepSpeed#5301): ``4·P``, the backward's tensors freed.

The logits' buffers are not held at the reductions (the LM head's matmul backward has consumed them);
a trainer that keeps the forward's output alive through the backward (OpenRLHF's
``training_step_actor`` holds ``output``) holds its bf16 logits there too: not counted.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.lora import trainable_params_rank
from nereus.cost.memory import DS_REDUCE_BUCKET_ELEMS

__all__ = ["largest_param_numel", "zero_offload_state"]

_CPU_ADAM = 3  # offload code of "cpu_adam" (nereus.cost.memory.OFFLOAD_CODES)


def largest_param_numel(model, lora_rank, tp, lm_head_first: bool = False):
    """Elements of the largest trainable parameter tensor on one TP rank (module docstring ``n``), or
    with ``lm_head_first`` the largest whose gradient arrives before the activations are freed
    (``n_A``: an untied LM head, else a layer's widest matrix). Elementwise over ``tp``."""
    tp = np.asarray(tp, dtype=float)
    h, f = model.hidden_size, model.intermediate_size
    if lora_rank:
        return lora_rank * float(max(h, f, model.q_dim)) + 0.0 * tp
    layer = max(h * f, h * model.q_dim) / tp
    vocab = -(-model.vocab_size // tp) * tp * h / tp
    if lm_head_first:
        return np.where(model.head == "lm" and not model.tie_word_embeddings, np.maximum(vocab, layer), layer)
    return np.maximum(vocab, layer)


def zero_offload_state(mem: dict, fw, model, workload, tp, pp, dp, zero, offload,
                       bucket_elems: float = DS_REDUCE_BUCKET_ELEMS) -> dict:
    """``mem`` (a ``train`` model-stage's :func:`nereus.cost.memory.stage_memory`, bytes per GPU) with
    DeepSpeed's ZeRO-Offload buffers (module docstring) where ``fw.zero_offload_buffers`` is set and a row
    has ``offload`` ``cpu_adam`` at ``zero`` 1 or 2; elementwise over ``tp``, ``pp``, ``dp``, ``zero``,
    ``offload`` (codes). Adds ``offload_buffer`` (resident), ``reduce_copies`` and ``step_copy`` (the
    largest transient of each phase beyond the buckets) and recomputes ``resident`` and ``transient``:
    ``transient = other + max(buckets + max(activations + logits, reduce_A), buckets + reduce_end,
    step_copy)`` with ``other`` the rest of the old transient (the three terms are 0 where a row does
    not apply). ``mem`` itself when the flag is off or the runtime's own engine is modelled.
    """
    if not getattr(fw, "zero_offload_buffers", False) or workload.activation_model == "runtime":
        return mem
    zero, dp, off = np.asarray(zero), np.asarray(dp), np.asarray(offload)
    rows = (off == _CPU_ADAM) & (zero >= 1) & (zero <= 2)
    if not np.any(rows):  # the same keys whichever rows a batch holds (the planner's arrays, one estimate)
        return dict(mem, offload_buffer=0.0 * rows, reduce_copies=0.0 * rows, step_copy=0.0 * rows) \
            if np.ndim(rows) else dict(mem, offload_buffer=0.0, reduce_copies=0.0, step_copy=0.0)
    pb = workload.param_bytes
    trainable = np.asarray(trainable_params_rank(model, workload.lora_rank, tp, pp), dtype=float)
    part = trainable / np.maximum(dp, 1)
    n = np.minimum(largest_param_numel(model, workload.lora_rank, tp), trainable)
    n_a = np.minimum(largest_param_numel(model, workload.lora_rank, tp, lm_head_first=True), trainable)
    bucket = np.minimum(trainable, bucket_elems)
    ipg = bucket * pb * (2.0 if fw.overlap_grad_reduce else 1.0)
    flatten = np.where(dp > 1, bucket * pb, 0.0)
    reduce_a = 8.0 * np.minimum(n_a, part) + np.where(n_a > bucket_elems, n_a * pb, 0.0)
    reduce_end = 8.0 * np.minimum(n, part) + np.where(n > bucket_elems, n * pb, 0.0)
    z2 = zero >= 2
    act = np.asarray(mem["activations"], dtype=float) + np.asarray(mem["logits"], dtype=float)
    grads = np.asarray(mem["gradients"], dtype=float)
    other = np.asarray(mem["transient"], dtype=float) - grads - act
    held = np.where(z2, 0.0, grads)  # ZeRO-1: the whole gradients stay until the boundary's reduce
    during = np.where(z2, np.maximum(act, np.asarray(mem["activations"], dtype=float) + np.maximum(flatten, reduce_a)),
                      act)
    step = 4.0 * part
    new_tr = other + np.maximum(np.maximum(held + ipg + during, held + ipg + reduce_end), step)
    out = dict(mem)
    out["offload_buffer"] = np.where(rows, n * pb, 0.0)
    out["reduce_copies"] = np.where(rows, np.maximum(np.where(z2, np.maximum(flatten, reduce_a), 0.0), reduce_end), 0.0)
    out["step_copy"] = np.where(rows, step, 0.0)
    out["gradients"] = np.where(rows, held + ipg, grads)
    out["resident"] = np.asarray(mem["resident"], dtype=float) + out["offload_buffer"]
    out["transient"] = np.where(rows, new_tr, np.asarray(mem["transient"], dtype=float))
    if np.ndim(out["resident"]) == 0:
        for k in ("resident", "transient", "offload_buffer", "reduce_copies", "step_copy", "gradients"):
            out[k] = float(out[k])
    return out
