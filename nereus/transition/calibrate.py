"""Calibrating the transition cost model from executed transitions (DESIGN.md §4.3, §4.6).

The transition cost (``cost.duration``) prices a primitive as communicator setup plus the bytes
its busiest receiver takes over the link bandwidth. After each live transition the executor reports,
per primitive, the setup seconds of its slowest worker, the transfer seconds of its slowest worker
and the bytes each worker received. :class:`TransitionCalibration` turns those into the two
constants the model uses, the same way op-class efficiencies are calibrated from step timings: an
exponential moving average of measured values, consulted by the next estimate.

* link bandwidth (bytes/s per worker per direction) = Σ busiest-receiver bytes / Σ transfer seconds
  over the primitives that moved bytes over links (Split, Merge, Extend, Load from a train
  model-stage), a ratio of sums so that tiny primitives do not dominate;
* communicator setup (seconds) = mean setup of the primitives that built a communicator.

Both replace the cluster's scale-up and scale-out bandwidth and ``CostParams.comm_setup_*`` in the
estimates that follow (:meth:`TransitionCalibration.apply`). Pure: no runtime import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nereus.spec.hardware import GPUSpec
from nereus.spec.job import JobSpec
from nereus.transition.cost import CostParams

__all__ = ["TransitionCalibration", "LINK_KINDS"]

#: primitive kinds whose time is bytes over a worker-to-worker link
LINK_KINDS = ("split", "merge", "extend", "load", "sync")


@dataclass
class TransitionCalibration:
    """Measured transition constants (module docstring).

    Attributes:
        weight: EMA weight of a new measurement, in (0, 1].
        bandwidth: bytes/s per worker per direction, None before any measurement.
        setup_s: seconds per communicator setup, None before any measurement.
        history: one ``{"bandwidth", "setup_s", "primitives"}`` per :meth:`observe` that measured.

    Raises:
        ValueError: ``weight`` outside (0, 1].
    """

    weight: float = 0.5
    bandwidth: float | None = None
    setup_s: float | None = None
    history: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"calibration field 'weight' must be in (0, 1], got {self.weight!r}")

    def observe(self, records) -> None:
        """Fold one transition's per-primitive records in.

        Args:
            records: dicts (or objects with these attributes) with ``kind``, ``received``
                (worker → bytes), ``transfer_s`` and ``setup_s`` (seconds, slowest worker).
        """
        nbytes = secs = 0.0
        setups = []
        for r in records:
            get = r.get if isinstance(r, dict) else lambda k, _r=r: getattr(_r, k)
            if get("kind") not in LINK_KINDS:
                continue
            recv = get("received") or {}
            busiest = max(recv.values(), default=0)
            if busiest > 0 and get("transfer_s") > 0:
                nbytes += busiest
                secs += get("transfer_s")
            if get("setup_s") > 0:
                setups.append(get("setup_s"))
        bw = nbytes / secs if secs > 0 else None
        st = sum(setups) / len(setups) if setups else None
        if bw is not None:
            self.bandwidth = bw if self.bandwidth is None else (1 - self.weight) * self.bandwidth + self.weight * bw
        if st is not None:
            self.setup_s = st if self.setup_s is None else (1 - self.weight) * self.setup_s + self.weight * st
        if bw is not None or st is not None:
            self.history.append({"bandwidth": bw, "setup_s": st, "primitives": len(setups)})

    def gpu(self, gpu: GPUSpec) -> GPUSpec:
        """``gpu`` with the measured bandwidth as its scale-up and scale-out link rates."""
        if self.bandwidth is None:
            return gpu
        return replace(gpu, scaleup_bandwidth=self.bandwidth, scaleout_bandwidth=self.bandwidth)

    def params(self, base: CostParams | None = None) -> CostParams:
        """``base`` with the measured communicator setup, inside and across nodes."""
        base = base or CostParams()
        if self.setup_s is None:
            return base
        return replace(base, comm_setup_intra_s=self.setup_s, comm_setup_inter_s=max(self.setup_s,
                                                                                    base.comm_setup_inter_s))

    def apply(self, job: JobSpec) -> JobSpec:
        """``job`` on a cluster whose devices have the measured link bandwidth."""
        if self.bandwidth is None:
            return job
        return replace(job, cluster=replace(job.cluster, gpu=self.gpu(job.cluster.gpu)))
