"""Run precisions and the state they hold per parameter, without importing torch (the CLI's
pre-run memory check and the cost model's byte counts use it before anything starts)."""

from __future__ import annotations

__all__ = ["PRECISIONS", "TRAIN_KINDS", "WEIGHT_KINDS", "train_kinds", "workload_bytes"]

#: state kinds a training EMU may hold (``params`` in the engine's dtype; ``master``: the fp32 master
#: weights of a bf16 run; Adam's fp32 moments) and the kinds of a weight copy. Which of
#: ``TRAIN_KINDS`` a run's training EMUs really hold depends on its precision (:func:`train_kinds`).
TRAIN_KINDS = ("params", "master", "exp_avg", "exp_avg_sq")
WEIGHT_KINDS = ("params",)
#: run precisions: ``fp32`` (fp32 weights are Adam's master weights) and ``bf16`` (Megatron's mixed
#: precision: bf16 weights and compute, fp32 master weights, gradients and moments)
PRECISIONS = ("fp32", "bf16")


def train_kinds(precision: str) -> tuple[str, ...]:
    """The state kinds of a training EMU under ``precision``: ``("params", "exp_avg", "exp_avg_sq")``
    in fp32 (4 + 8 bytes per parameter), ``("params", "master", "exp_avg", "exp_avg_sq")`` in bf16
    (2 + 4 + 8 bytes: what ``WorkloadSpec``'s ``param_bytes + optimizer_bytes`` = 2 + 12 counts).

    Raises:
        ValueError: ``precision`` not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return TRAIN_KINDS if precision == "bf16" else tuple(k for k in TRAIN_KINDS if k != "master")


def workload_bytes(precision: str) -> dict[str, int]:
    """``WorkloadSpec`` byte fields of what a run of ``precision`` holds per parameter / KV element:
    fp32 ``param_bytes=4, kv_bytes=4, optimizer_bytes=8`` (two moments; the weights are the master),
    bf16 ``param_bytes=2, kv_bytes=2, optimizer_bytes=12`` (fp32 master and two moments); both keep
    ``grad_bytes=4`` (fp32 gradients, transient).

    Raises:
        ValueError: ``precision`` not in :data:`PRECISIONS`.
    """
    n = sum(4 for k in train_kinds(precision) if k != "params")
    p = 2 if precision == "bf16" else 4
    return {"param_bytes": p, "kv_bytes": p, "optimizer_bytes": n, "grad_bytes": 4}
