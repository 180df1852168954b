"""One row's full estimate from the arrays the cost model's array API already computed.

:meth:`nereus.cost.model.CostModel.candidate_arrays` evaluates many candidates at once and keeps
their op-class terms and memory terms as arrays; the planner needs the whole
:class:`~nereus.spec.plan.StageEstimate` (breakdown and memory terms) of only the row it chose.
:class:`RowDetail` holds references to those arrays (no copy) and builds that estimate for one row,
with the same values :meth:`~nereus.cost.model.CostModel.estimate_candidate` computes for the row
(every term is elementwise, so a row's value does not depend on the other rows).
"""

from __future__ import annotations

import numpy as np

from nereus.spec.plan import StageEstimate

__all__ = ["RowDetail"]


def _at(v, i: int) -> float:
    """Element ``i`` of a per-row array, or the value broadcast to every row."""
    a = np.asarray(v).reshape(-1)
    return float(a[i] if a.size > 1 else a[0])


class RowDetail:
    """Op-class terms and memory terms of the rows of one array-API call.

    Args:
        parts: op class -> seconds, per row (or per distinct row, with ``inv``).
        memory: memory term -> bytes per row, before the memory correction.
        corr: the model-stage's memory correction (multiplies every memory term).
        inv: row -> index into ``parts`` when ``parts`` hold distinct rows only.
        extra: op class -> seconds per row added to ``parts`` (the offload terms); no key of
            ``parts``.
    """

    def __init__(self, parts: dict, memory: dict, corr: float, inv=None, extra: dict | None = None):
        self.parts, self.memory, self.corr, self.inv, self.extra = parts, memory, corr, inv, extra or {}

    def estimate(self, i: int, time: float, resident: float, transient: float) -> StageEstimate:
        """Row ``i``'s estimate; ``time``, ``resident``, ``transient``: the row's values in the
        array API's result (seconds, bytes per GPU after the correction)."""
        j = int(self.inv[i]) if self.inv is not None else i
        bd = {k: _at(v, j) for k, v in self.parts.items()}
        bd.update({k: _at(v, i) for k, v in self.extra.items()})
        mem = {k: _at(v, i) * self.corr for k, v in self.memory.items() if k not in ("resident", "transient")}
        return StageEstimate(time=float(time), breakdown={k: v for k, v in bd.items() if v > 0}, memory=mem,
                             resident=float(resident), transient=float(transient))
