"""Collective and point-to-point times in the α-β model (cost-model.md §2.5-2.7).

Bandwidth terms follow nccl-tests ``doc/PERFORMANCE.md``: ring all-reduce moves ``2(n-1)/n·S``
bytes per rank, all-gather ``(n-1)/n·S`` (S the full output), broadcast and point-to-point ``S``;
``B`` is the per-rank bottleneck bandwidth of the link times the efficiency of the op class.
Latency terms use ``2·ceil(log2 n)·α`` for all-reduce (NCCL switches to tree/LL protocols for small
messages, so the ring's ``2(n-1)α`` overstates small-message latency) and ``ceil(log2 n)·α`` for
all-gather/broadcast, ``α`` for point-to-point.

All functions take bytes (scalars or NumPy arrays) and bytes/s and return seconds; ``n <= 1`` or an
empty message costs nothing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["allreduce_time", "allgather_time", "broadcast_time", "p2p_time"]


def _nz(size, t):
    """``t`` where ``size > 0``, else 0 (keeps scalars scalar)."""
    out = np.where(np.asarray(size) > 0, t, 0.0)
    return float(out) if out.ndim == 0 else out


def _lg(n):
    n = np.asarray(n, dtype=float)
    return np.maximum(1.0, np.ceil(np.log2(np.maximum(n, 1.0))))


def allreduce_time(size: float, n: int, bandwidth: float, alpha: float) -> float:
    """Ring all-reduce of ``size`` bytes over ``n`` ranks: ``2·lg(n)·α + 2(n-1)/n·S/B``."""
    n = np.asarray(n, dtype=float)
    return _nz(size * (n > 1), 2 * _lg(n) * alpha + 2.0 * (n - 1) / n * np.asarray(size) / bandwidth)


def allgather_time(size: float, n: int, bandwidth: float, alpha: float) -> float:
    """All-gather producing ``size`` bytes on every rank: ``lg(n)·α + (n-1)/n·S/B``."""
    n = np.asarray(n, dtype=float)
    return _nz(size * (n > 1), _lg(n) * alpha + (n - 1) / n * np.asarray(size) / bandwidth)


def broadcast_time(size: float, n: int, bandwidth: float, alpha: float) -> float:
    """Pipelined broadcast of ``size`` bytes to ``n-1`` ranks: ``lg(n)·α + S/B``."""
    n = np.asarray(n, dtype=float)
    return _nz(size * (n > 1), _lg(n) * alpha + np.asarray(size) / bandwidth)


def p2p_time(size: float, bandwidth: float, alpha: float) -> float:
    """One send/recv of ``size`` bytes: ``α + S/B``."""
    return _nz(size, alpha + np.asarray(size) / bandwidth)
