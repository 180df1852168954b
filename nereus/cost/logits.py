"""Bytes per GPU of the language-model head's logits in a training engine's passes, by logits kernel.

``T`` tokens of the micro-batch on the GPU, ``V`` vocabulary, ``h`` hidden size, ``t`` tensor
parallelism (the vocabulary split), bf16 = 2 bytes:

* ``None`` (fp32 logits and cross-entropy; Megatron-LM ``theoretical_memory_usage.py`` and its
  vocab-parallel cross-entropy in fp32): training ``4·T·(h + V)/t``; a forward-only pass
  ``6·T·V/t`` (the bf16 logits and their fp32 log-softmax: HuggingFace's ``log_softmax`` path).
* ``flash_ce``: verl's FSDP engine with padding removal (``use_remove_padding=True``, the default
  ``use_torch_compile=True``; volcengine/verl@b178a3cd5 ``verl/workers/actor/dp_actor.py``
  ``_forward_micro_batch`` rmpad branch, verl 0.9.1 ``verl/workers/engine/fsdp/transformer_impl.py``
  ``prepare_model_outputs``): the packed bf16 logits ``(total_nnz, V)`` are the only vocabulary-wide
  tensor. The log-probs come from flash-attn's Triton cross-entropy
  (``verl/utils/torch_functional.py::logprobs_from_logits``, ``flash_attn.ops.triton.cross_entropy``:
  per-token loss and log-sum-exp out, no fp32 copy), the entropy from ``entropy_from_logits`` under
  ``torch.compile`` (one fused reduction per row, no softmax tensor); with no entropy in the loss
  the cross-entropy's backward writes the logits' gradient into the logits buffer
  (``inplace_backward=True``). Forward-only ``2·T·V/t``; training ``2·T·(h + V)/t`` (the logits and
  the head's bf16 input kept for its backward).
* ``flash_ce_entropy``: the same with an entropy term in the update (verl: ``entropy_coeff != 0``
  or ``calculate_entropy``; then ``inplace_backward=False``): the cross-entropy's and the entropy's
  gradients are two more bf16 buffers next to the logits during the backward: training
  ``(6·V + 2·h)·T/t``; forward-only as ``flash_ce``.

A value head (``model.head == "value"``) keeps ``4·T·h/t`` in training and ``4·T`` (fp32 values)
forward-only, whatever the kernel. Elementwise over NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from nereus.spec.model import ModelSpec
from nereus.spec.workload import LOGITS_KERNELS

__all__ = ["train_logits_bytes", "infer_logits_bytes"]


def _check(kernel) -> None:
    if kernel is not None and kernel not in LOGITS_KERNELS:
        raise ValueError(f"logits kernel must be one of {LOGITS_KERNELS} or None (fp32), got {kernel!r}")


def train_logits_bytes(model: ModelSpec, tokens, tp, kernel: str | None = None):
    """Bytes per GPU of the head's logits and their gradient in a training micro-batch of
    ``tokens`` tokens at tensor parallelism ``tp`` (module docstring).

    Raises:
        ValueError: an unknown ``kernel``.
    """
    _check(kernel)
    tokens, tp = np.asarray(tokens, dtype=float), np.asarray(tp)
    h, v = model.hidden_size, model.vocab_size
    if model.head == "value":
        return 4.0 * tokens * h / tp
    if kernel == "flash_ce":
        return 2.0 * tokens * (h + v) / tp
    if kernel == "flash_ce_entropy":
        return tokens * (6.0 * v + 2.0 * h) / tp
    return 4.0 * tokens * (h + v) / tp


def infer_logits_bytes(model: ModelSpec, tokens, tp, kernel: str | None = None):
    """Bytes per GPU of the head's output in a forward-only micro-batch of ``tokens`` tokens at
    tensor parallelism ``tp`` (module docstring).

    Raises:
        ValueError: an unknown ``kernel``.
    """
    _check(kernel)
    tokens, tp = np.asarray(tokens, dtype=float), np.asarray(tp)
    if model.head != "lm":
        return 4.0 * tokens
    if kernel in ("flash_ce", "flash_ce_entropy"):
        return 2.0 * tokens * model.vocab_size / tp
    return 6.0 * tokens * model.vocab_size / tp
