"""HBM traffic of the FP8 cast kernels of torchao's float8 training recipes (``WorkloadSpec.fp8_recipe``).

A float8 linear (torchao ``Float8Linear``) runs its three GEMMs (``input @ weight^T``, ``grad_output
@ weight``, ``input^T @ grad_output``) on FP8 operands: every operand is scaled and cast from bf16
before its GEMM, and those casts are memory-bound kernels the bf16 linear does not run. The two
recipes differ in where scales are taken (torchao ``Float8LinearRecipeName``: ``TENSORWISE``, one
scale per tensor, cuBLAS tensorwise kernel; ``ROWWISE``, one scale per row, CUTLASS rowwise kernel)
and so in which casts can be shared: a tensorwise-scaled tensor is written once row-major and once
column-major from one read, while a rowwise-scaled tensor needs its other-axis copy re-scaled from
the bf16 values. The bytes per linear, of a forward and backward with ``M`` tokens, ``K`` input and
``N`` output features (torchao ``torchao/testing/training/roofline_utils.py``,
``get_tensor_memory_traffic_ovhd_s``, with ``enable_fusion_modeling``: the reads of the input and of
the output gradient fused with the kernels that produce them, the weight's not):

============  ==========================  ==========================  ==========================
recipe        input (``M·K``)              weight (``K·N``)             grad_output (``M·N``)
============  ==========================  ==========================  ==========================
tensorwise    write fp8 twice: ``2``       amax ``2`` + two casts of   write fp8 twice: ``2``
              + the cast's bf16 read      ``2 + 1`` each: ``8``        + the cast's read ``2``:
              ``2``: ``4``                                             ``4``
rowwise       fp8 and bf16 transposed     cast ``3``, transpose       ``6`` (as the input)
              ``1 + 2``, second cast      ``2 + 2``, second cast
              ``2 + 1``: ``6``            ``3``: ``10``
============  ==========================  ==========================  ==========================

i.e. ``a·M·K + w·K·N + a·M·N`` bytes with ``(a, w) = (4, 8)`` tensorwise and ``(6, 10)`` rowwise, at
the ``memory_bound`` efficiency of HBM. Transformer Engine (``fp8_recipe`` None, the NeMo/Megatron
rows) fuses its casts into the neighbouring LayerNorm, activation and transpose kernels
(``te.LayerNormLinear``, ``cast_transpose``), which the cost model does not charge.

Per layer the linears are Llama's seven (torchtitan ``wq, wk, wv, wo, w1, w3, w2``), each cast on
its own: ``(K, N)`` = ``(h, q)``, ``(h, kv)`` twice, ``(q, h)``, ``(h, F)`` twice, ``(F, h)``, the
sharded dimension over TP. The LM head stays in bf16 (torchao converts ``nn.Linear`` modules and
torchtitan filters ``output``). Not modelled: the GEMM kernels' own speed difference (cuBLAS vs
CUTLASS; torchao's roofline charges both at one achievable FLOP/s), the recomputed forward's casts
with full recompute, inference passes, and FP8 all-gathers of the tensorwise recipe.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FP8_CAST_BYTES", "fp8_cast_bytes", "fp8_cast_times"]

#: bytes per element of (input and grad_output, weight) per linear per training pass (module docstring)
FP8_CAST_BYTES = {"tensorwise": (4.0, 8.0), "rowwise": (6.0, 10.0)}


def fp8_cast_bytes(model, recipe: str, tp, tokens) -> np.ndarray:
    """HBM bytes of one layer's FP8 casts in one training pass (forward and backward) of ``tokens``
    tokens on one TP rank (elementwise over ``tp``, ``tokens``).

    Raises:
        ValueError: ``recipe`` is not ``tensorwise`` or ``rowwise``.
    """
    if recipe not in FP8_CAST_BYTES:
        raise ValueError(f"workload field 'fp8_recipe' must be one of {sorted(FP8_CAST_BYTES)}, got {recipe!r}")
    a, w = FP8_CAST_BYTES[recipe]
    tp = np.asarray(tp, dtype=float)
    m = np.asarray(tokens, dtype=float)
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.intermediate_size
    kv_rep = np.maximum(tp // model.num_kv_heads, 1)
    shapes = [(h, q / tp), (h, kv * kv_rep / tp), (h, kv * kv_rep / tp), (q / tp, h), (h, f / tp), (h, f / tp),
              (f / tp, h)]
    return sum(a * m * k + w * k * n + a * m * n for k, n in shapes)


def fp8_cast_times(model, workload, gpu, eff, tp, tokens, layers) -> dict:
    """``{"memory_bound": seconds}`` of ``layers`` layers' casts in one training micro-batch of
    ``tokens`` tokens, or ``{}`` when the workload's GEMMs are not FP8 or its ``fp8_recipe`` is None."""
    if workload.gemm_precision != "fp8" or workload.fp8_recipe is None:
        return {}
    bw = gpu.hbm_bandwidth * eff.get("memory_bound", gpu)
    return {"memory_bound": fp8_cast_bytes(model, workload.fp8_recipe, tp, tokens) * np.asarray(layers) / bw}
