"""DP communication overlapped with backward compute (cost-model.md §2.7), used by
:class:`nereus.cost.model.CostModel` for training and ZeRO-3 inference rows."""

from __future__ import annotations

import numpy as np

from nereus.cost.efficiency import OVERLAP_COMPUTE_SLOWDOWN

__all__ = ["overlap_dp", "COMPUTE_CLASSES"]

#: op classes whose seconds are compute a DP collective can hide behind
COMPUTE_CLASSES = ("gemm", "gemm_fp8", "attention", "memory_bound")


def overlap_dp(comm: dict, last: dict, zero, m) -> dict:
    """DP communication overlapped with backward (cost-model.md §2.7, ``T_comp + max(0, T_dp -
    T_bwd)``): ZeRO-0/1 reduce during the last micro-batch's backward (2/3 of its compute, Megatron's
    bucketed ``overlap_grad_reduce``); ZeRO-2/3 communicate per micro-batch, prefetched behind
    every micro-batch's forward and backward (FSDP's prefetch). The compute the communication
    overlaps runs slower: ``overlap = s · min(T_dp, window)`` more seconds, ``s`` =
    :data:`~nereus.cost.efficiency.OVERLAP_COMPUTE_SLOWDOWN` (a key of its own, not an op class)."""
    if not comm:
        return comm
    compute = sum(np.asarray(last.get(k, 0.0), dtype=float) for k in COMPUTE_CLASSES)
    window = np.where(np.asarray(zero) >= 2, np.asarray(m) * compute, compute * 2.0 / 3.0)
    total = sum(np.asarray(v, dtype=float) for v in comm.values())
    keep = np.where(total > 0, np.maximum(total - window, 0.0) / np.where(total > 0, total, 1.0), 0.0)
    out = {k: v * keep for k, v in comm.items()}
    out["overlap"] = OVERLAP_COMPUTE_SLOWDOWN * np.minimum(total, window)
    return out
