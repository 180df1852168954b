"""Calibrating the transition cost model from executed transitions (DESIGN.md §4.3, §4.6).

The transition cost (``cost.duration``) prices a primitive as three terms: a fixed *setup*
(communicators and whatever else a primitive costs whatever its size), a *copy* term (the bytes its
busiest receiver takes, packed at the senders and assembled at it, over ``CostParams.copy_bandwidth``)
and a *wire* term (those bytes over the link bandwidth). After each live transition the executor
reports, per primitive, its wall seconds (first worker's start to last worker's end), the transfer
seconds and the pack + assembly seconds of its slowest worker, and the bytes each worker received.
:class:`TransitionCalibration` turns those into the constants over a window of the most recent
primitives (``window``; ratios of sums and a mean over it, not an exponential moving average: on a
shared machine one transition's seconds swing several-fold, and an average over many primitives
follows the machine without jumping with each of them). Over the primitives that move bytes between
workers (Split, Merge, Extend, Load from a train model-stage):

* link bandwidth (bytes/s per worker per direction) = Σ busiest-receiver bytes / Σ transfer seconds,
  a ratio of sums so that tiny primitives do not dominate;
* copy bandwidth (bytes/s) = Σ copy bytes / Σ copy seconds (pack + assembly), the copy bytes being
  the planner's ``cost.copy_bytes`` of each primitive (a record's ``copy_bytes``; its busiest
  receiver's bytes when absent): what the busiest worker packs and writes, local re-slicing included;
* setup (seconds) = mean over those primitives of ``wall − transfer − copy`` (at least 0): the
  communicator setup where one is built, dispatch and planning everywhere; a primitive whose
  communicator was reused (``runtime/comm/cache.py``) counts with its smaller value, so the mean
  is the expected fixed cost of a primitive in this job;

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
        window: how many of the most recent byte-moving primitives (and Destroys) the constants
            average over, >= 1.
        bandwidth: bytes/s per worker per direction, None before any measurement.
        setup_s: fixed seconds per primitive that moves bytes (module docstring), None before any
            measurement.
        copy_bandwidth: bytes/s of packing plus assembly, None before any measurement.
        teardown_s: seconds of a Destroy, None before any measurement.
        history: one ``{"bandwidth", "copy_bandwidth", "setup_s", "teardown_s", "primitives"}`` per
            :meth:`observe` that measured (that transition's own values).

    Raises:
        ValueError: ``window`` not an integer >= 1.
    """

    window: int = 64
    bandwidth: float | None = None
    setup_s: float | None = None
    copy_bandwidth: float | None = None
    teardown_s: float | None = None
    history: list = field(default_factory=list)
    rows: list = field(default_factory=list, repr=False)  # (busiest, transfer s, copy bytes, copy s, setup s)
    teardowns: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"calibration field 'window' must be an integer >= 1, got {self.window!r}")

    def observe(self, records) -> None:
        """Fold one transition's per-primitive records in.

        Args:
            records: dicts (or objects with these attributes) with ``kind``, ``received``
                (worker → bytes), ``transfer_s`` and ``setup_s`` (seconds, slowest worker) and,
                optionally, ``copy_s`` (pack + assembly seconds, slowest worker), ``copy_bytes``
                (the planner's, ``cost.copy_bytes``) and ``measured_s`` (wall seconds of the primitive).
        """
        rows, teardowns = [], []
        for r in records:
            get = (lambda k, d=None, _r=r: _r.get(k, d)) if isinstance(r, dict) else \
                (lambda k, d=None, _r=r: getattr(_r, k, d))
            kind = get("kind")
            if kind == "destroy" and get("measured_s") is not None:
                teardowns.append(float(get("measured_s")))
            if kind not in LINK_KINDS:
                continue
            busiest = max((get("received") or {}).values(), default=0)
            transfer, copy = float(get("transfer_s") or 0.0), float(get("copy_s", 0.0) or 0.0)
            wall = get("measured_s")
            setup = max(0.0, float(wall) - transfer - copy) if wall is not None else float(get("setup_s") or 0.0)
            rows.append((busiest, transfer, float(get("copy_bytes", 0) or busiest), copy, setup))
        if rows or teardowns:
            self.history.append({**self._fit(rows, teardowns), "primitives": len(rows)})
        self.rows = (self.rows + rows)[-self.window:]
        self.teardowns = (self.teardowns + teardowns)[-self.window:]
        fit = self._fit(self.rows, self.teardowns)
        for k, v in fit.items():
            if v is not None:
                setattr(self, k, v)

    @staticmethod
    def _fit(rows, teardowns) -> dict:
        """The four constants from rows and Destroy seconds (None where nothing measured one)."""
        wire = [(b, t) for b, t, _, _, _ in rows if b > 0 and t > 0]
        copy = [(k, c) for b, _, k, c, _ in rows if b > 0 and k > 0 and c > 0]
        return {"bandwidth": sum(b for b, _ in wire) / sum(t for _, t in wire) if wire else None,
                "copy_bandwidth": sum(k for k, _ in copy) / sum(c for _, c in copy) if copy else None,
                "setup_s": sum(r[4] for r in rows) / len(rows) if rows else None,
                "teardown_s": sum(teardowns) / len(teardowns) if teardowns else None}

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
