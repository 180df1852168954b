"""Calibrating the transition cost model from executed transitions (DESIGN.md §4.3, §4.6).

The transition cost (``cost.duration``) prices a primitive as three terms: a fixed *setup*
(communicators and whatever else a primitive costs whatever its size), a *copy* term (the bytes its
busiest receiver takes, packed at the senders and assembled at it, over ``CostParams.copy_bandwidth``)
and a *wire* term (those bytes over the link bandwidth). After each live transition the executor
reports, per primitive, its wall seconds (first worker's start to last worker's end), the transfer
seconds and the pack + assembly seconds of its slowest worker, and the bytes each worker received.
:class:`TransitionCalibration` turns those into the constants, the same way op-class efficiencies
are calibrated from step timings: an exponential moving average of measured values, consulted by
the next estimate. Over the primitives that move bytes between workers (Split, Merge, Extend,
Load from a train model-stage):

* link bandwidth (bytes/s per worker per direction) = Σ busiest-receiver bytes / Σ transfer seconds,
  a ratio of sums so that tiny primitives do not dominate;
* copy bandwidth (bytes/s) = Σ busiest-receiver bytes / Σ copy seconds (pack + assembly);
* setup (seconds) = mean over those primitives of ``wall − transfer − copy`` (at least 0): the
  communicator setup where one is built, dispatch and planning everywhere; a primitive whose
  communicator was reused (``runtime/comm/cache.py``) counts with its smaller value, so the mean
  is the expected fixed cost of a primitive in this job.

and Destroy's wall seconds give ``CostParams.teardown_s``. They replace the cluster's scale-up and
scale-out bandwidth and ``CostParams.comm_setup_*``, ``copy_bandwidth``, ``teardown_s`` in the
estimates that follow (:meth:`TransitionCalibration.apply`, :meth:`TransitionCalibration.params`).
Records without ``measured_s`` (older callers) use ``setup_s`` as the setup. Pure: no runtime import.
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
        setup_s: fixed seconds per primitive that moves bytes (module docstring), None before any
            measurement.
        copy_bandwidth: bytes/s of packing plus assembly, None before any measurement.
        teardown_s: seconds of a Destroy, None before any measurement.
        history: one ``{"bandwidth", "setup_s", "primitives"}`` per :meth:`observe` that measured.

    Raises:
        ValueError: ``weight`` outside (0, 1].
    """

    weight: float = 0.5
    bandwidth: float | None = None
    setup_s: float | None = None
    copy_bandwidth: float | None = None
    teardown_s: float | None = None
    history: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"calibration field 'weight' must be in (0, 1], got {self.weight!r}")

    def observe(self, records) -> None:
        """Fold one transition's per-primitive records in.

        Args:
            records: dicts (or objects with these attributes) with ``kind``, ``received``
                (worker → bytes), ``transfer_s`` and ``setup_s`` (seconds, slowest worker) and,
                optionally, ``copy_s`` (pack + assembly seconds, slowest worker) and ``measured_s``
                (wall seconds of the primitive).
        """
        nbytes = secs = cbytes = csecs = 0.0
        setups, teardowns = [], []
        for r in records:
            get = (lambda k, d=None, _r=r: _r.get(k, d)) if isinstance(r, dict) else \
                (lambda k, d=None, _r=r: getattr(_r, k, d))
            kind = get("kind")
            if kind == "destroy" and get("measured_s") is not None:
                teardowns.append(float(get("measured_s")))
            if kind not in LINK_KINDS:
                continue
            recv = get("received") or {}
            busiest = max(recv.values(), default=0)
            transfer, copy = float(get("transfer_s") or 0.0), float(get("copy_s", 0.0) or 0.0)
            if busiest > 0 and transfer > 0:
                nbytes += busiest
                secs += transfer
            if busiest > 0 and copy > 0:
                cbytes += busiest
                csecs += copy
            wall = get("measured_s")
            if wall is not None:
                setups.append(max(0.0, float(wall) - transfer - copy))
            elif get("setup_s") > 0:
                setups.append(get("setup_s"))
        bw = nbytes / secs if secs > 0 else None
        cbw = cbytes / csecs if csecs > 0 else None
        st = sum(setups) / len(setups) if setups else None
        td = sum(teardowns) / len(teardowns) if teardowns else None
        self.bandwidth = self._ema(self.bandwidth, bw)
        self.copy_bandwidth = self._ema(self.copy_bandwidth, cbw)
        self.setup_s = self._ema(self.setup_s, st)
        self.teardown_s = self._ema(self.teardown_s, td)
        if any(x is not None for x in (bw, cbw, st, td)):
            self.history.append({"bandwidth": bw, "copy_bandwidth": cbw, "setup_s": st, "teardown_s": td,
                                 "primitives": len(setups)})

    def _ema(self, old: float | None, new: float | None) -> float | None:
        if new is None:
            return old
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def gpu(self, gpu: GPUSpec) -> GPUSpec:
        """``gpu`` with the measured bandwidth as its scale-up and scale-out link rates."""
        if self.bandwidth is None:
            return gpu
        return replace(gpu, scaleup_bandwidth=self.bandwidth, scaleout_bandwidth=self.bandwidth)

    def params(self, base: CostParams | None = None) -> CostParams:
        """``base`` with the measured setup (inside and across nodes), copy bandwidth and teardown;
        without ``base``, the defaults with the runtime executor's buffers counted in the memory
        check (``CostParams.transit_buffers``: these constants describe that executor)."""
        base = base or CostParams(transit_buffers=True)
        out = base
        if self.setup_s is not None:
            out = replace(out, comm_setup_intra_s=self.setup_s,
                          comm_setup_inter_s=max(self.setup_s, base.comm_setup_inter_s))
        if self.copy_bandwidth is not None:
            out = replace(out, copy_bandwidth=self.copy_bandwidth)
        if self.teardown_s is not None:
            out = replace(out, teardown_s=self.teardown_s)
        return out

    def apply(self, job: JobSpec) -> JobSpec:
        """``job`` on a cluster whose devices have the measured link bandwidth."""
        if self.bandwidth is None:
            return job
        return replace(job, cluster=replace(job.cluster, gpu=self.gpu(job.cluster.gpu)))
