"""Efficiency per op class: the shortfall of achieved rates against peak (DESIGN.md §4.2-4.3).

Time of an op = work / (peak rate · efficiency of its op class). Op classes are ``gemm``,
``attention``, ``memory_bound`` and one per (collective, link), e.g. ``allreduce@nvlink``,
``allreduce@ib``, ``p2p@ib``, ``allgather@nvlink``, ``broadcast@ib``. One efficiency per class is
shared by every plan that uses the class; unseen classes start at a conservative default.

GEMMs also lose efficiency when small; the class efficiency multiplies a fixed size curve
``size / (size + half)`` with ``half`` = the device's ``gemm_half_flops`` (1 GFLOP per call for
data-centre GPUs: the form suggested in cost-model.md §3 after Calculon's H100 preset, which gives
0.6 at 1 GFLOP and 0.9 at 16 GFLOP), so calibration moves one scalar per class.

Defaults (conservative, cost-model.md §5 "achievable fractions"): GEMM 0.6, attention 0.45,
HBM-bound 0.7, NVLink/xGMI collectives 0.6 (Calculon NVLink 0.6; 8xA100 sendrecv 65% of peak),
NIC collectives 0.75 (Calculon IB 0.9, lowered for contention), host-device copies over PCIe 0.8
(pinned ``cudaMemcpyAsync`` reaches 25-26 GB/s of Gen4's 32, as CUDA's ``bandwidthTest`` sample
reports), anything unseen 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EfficiencyTable", "DEFAULT_EFFICIENCY", "GEMM_SIZE_HALF"]

#: Default FLOPs per GEMM call at which the size curve reaches half of the class efficiency
#: (devices override it with ``GPUSpec.gemm_half_flops``).
GEMM_SIZE_HALF = 1e9

DEFAULT_EFFICIENCY: dict[str, float] = {
    "gemm": 0.6,
    "attention": 0.45,
    "memory_bound": 0.7,
}
_LINK_DEFAULT = {"nvlink": 0.6, "xgmi": 0.6, "ib": 0.75, "slingshot": 0.75, "pcie": 0.8}
UNSEEN_DEFAULT = 0.5


@dataclass
class EfficiencyTable:
    """Mutable table ``op class → efficiency in (0, 1.5]``; the planner always reads the current one.

    ``update`` is the calibration step: given the time measured for a class and the time the model
    predicted with the current efficiency, it moves the efficiency towards
    ``eff · predicted / measured`` (an exponential moving average with weight ``alpha``).
    """

    values: dict = field(default_factory=dict)
    alpha: float = 0.5
    updates: dict = field(default_factory=dict)

    def get(self, op_class: str) -> float:
        if op_class in self.values:
            return self.values[op_class]
        if op_class in DEFAULT_EFFICIENCY:
            return DEFAULT_EFFICIENCY[op_class]
        _, _, link = op_class.partition("@")
        return _LINK_DEFAULT.get(link, UNSEEN_DEFAULT)

    def set(self, op_class: str, eff: float) -> None:
        if not 0 < eff <= 1.5:
            raise ValueError(f"efficiency of {op_class!r} must be in (0, 1.5], got {eff!r}")
        self.values[op_class] = float(eff)

    def update(self, op_class: str, measured_s: float, predicted_s: float) -> float:
        """Calibrate ``op_class`` from one measurement; returns the new efficiency.

        Raises:
            ValueError: non-positive times.
        """
        if measured_s <= 0 or predicted_s <= 0:
            raise ValueError(f"calibration of {op_class!r} needs positive times, got measured="
                             f"{measured_s!r}, predicted={predicted_s!r}")
        old = self.get(op_class)
        target = old * predicted_s / measured_s
        new = min(max((1 - self.alpha) * old + self.alpha * target, 1e-3), 1.5)
        self.values[op_class] = new
        self.updates[op_class] = self.updates.get(op_class, 0) + 1
        return new

    def copy(self) -> EfficiencyTable:
        return EfficiencyTable(values=dict(self.values), alpha=self.alpha, updates=dict(self.updates))

    def to_dict(self) -> dict:
        return {"values": dict(self.values), "alpha": self.alpha}

    @classmethod
    def from_dict(cls, d: dict) -> EfficiencyTable:
        t = cls(alpha=float(d.get("alpha", 0.5)))
        for k, v in d.get("values", {}).items():
            t.set(k, float(v))
        return t
