"""Evaluating cost terms once per distinct row (:meth:`nereus.cost.model.CostModel.candidate_arrays`).

The planner's candidate arrays repeat combinations: a per-micro-batch time depends on (TP, PP,
micro-batch, recompute, interleaving) only, not on the replica count; a wave of generation on (TP,
PP, concurrency). :func:`unique_rows` finds the distinct combinations of some integer columns,
:func:`rows_of` restricts columns to them, and :func:`expand` spreads per-combination results back
over every row. Every cost term is elementwise, so the expanded arrays are bit-identical to a
per-row evaluation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unique_rows", "rows_of", "expand"]


def unique_rows(shape, *cols):
    """``(first, inv)`` for the distinct combinations of the integer columns ``cols`` (scalars or
    arrays broadcast to ``shape``): ``first`` indexes one row of each combination, ``inv`` maps every
    row to its combination. A wide column is replaced by the rank of its value (counted over the
    value range, no sort), then the mixed-radix key of the columns is counted the same way when its range
    is small (the usual case: TP, PP, micro-batch, concurrency, codes), else ``np.unique``. Below 64
    rows every row is its own combination (nothing to save)."""
    n = int(np.prod(shape))
    if n < 64:
        idx = np.arange(n)
        return idx, idx
    key = np.zeros(n, dtype=np.int64)
    span = 1
    for c in cols:
        if np.ndim(c) == 0:
            continue
        c = np.asarray(c, dtype=np.int64)
        c = (c if c.shape == tuple(shape) else np.broadcast_to(c, shape)).reshape(-1)
        lo, hi = int(c.min()), int(c.max())
        if hi == lo:
            continue
        if hi - lo < 64:  # a narrow column (TP, PP, codes): its value is its digit
            key = key * (hi - lo + 1) + (c - lo)
            span *= hi - lo + 1
            continue
        d = c - lo
        present = np.zeros(hi - lo + 1, dtype=np.int64)
        present[d] = 1
        rank = np.cumsum(present)
        k = int(rank[-1])
        key = key * k + (rank[d] - 1)
        span *= k
    if span == 1:
        return np.zeros(1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if span <= max(4 * n, 1 << 16):
        present = np.zeros(span, dtype=bool)
        present[key] = True
        rank = np.cumsum(present) - 1
        inv = rank[key]
        first = np.empty(int(rank[-1]) + 1, dtype=np.int64)
        first[inv] = np.arange(n)
        return first, inv
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def rows_of(first, *cols):
    """Columns (scalars or arrays over all rows) restricted to the rows ``first``."""
    return [c if np.ndim(c) == 0 else np.asarray(c).reshape(-1)[first] for c in cols]


def expand(d: dict, inv) -> dict:
    """Op-class (or memory-term) values computed on distinct rows, back over all rows."""
    return {k: (v[inv] if np.ndim(v) else v) for k, v in d.items()}
