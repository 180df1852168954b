"""Calibrating the transition cost model from executed transitions (DESIGN.md §4.3, §4.6).

The transition cost (``cost.duration``) prices a primitive as three terms: a *fixed* term (group
setup, call round trips, dispatch: what a primitive costs whatever its size), a *copy* term (the
bytes packed at the slowest sender plus those written at the slowest receiver, ``cost.copy_bytes``,
over ``CostParams.copy_bandwidth``) and a *wire* term (the busiest receiver's bytes over the link
bandwidth). After each live transition the executor reports, per primitive, its span (the last of
its workers to start, to the last to end: the time all its workers were in it), the slowest
worker's packing and the slowest worker's assembly seconds, the transfer seconds, and the bytes
each worker received. :class:`TransitionCalibration` turns those into the constants over a window
of the most recent primitives (``window``; fits over it, not an exponential moving average). The
fits are medians: on a shared machine one transition's seconds swing several-fold, and only ever
upwards (a primitive is slowed by other work, never sped up), so a mean or a ratio of sums follows
the slow tail and over-predicts the typical transition; a median over many primitives follows the
machine without jumping with each of them.

Workers that share cores (``cores``, the CPU workers' core budget): a primitive measured while
more workers were busy than there are cores ran slower than its own speed by the factor
``sharing.share_factors`` finds from the spans; its seconds are divided by that factor first (the
inverse of the planner's ``sharing.shared_schedule``). Then, over the primitives that move bytes
between workers (Split, Merge, Extend, Load from a train model-stage):

* the copy term (:func:`fit_copy`), from each primitive's packing and assembly measured apart
  (the slowest worker's of each, against the planner's largest send and largest new-shard bytes
  of one worker): the copy bandwidth ``C`` (bytes/s), a byte-weighted median over the plain
  one-worker phases (weighted so that tiny primitives do not dominate, :func:`weighted_median`),
  then the per-byte surcharges of column-slice copies and freshly mapped send buffers and the
  cores concurrent copy phases share (``transition/copy_cost.py``), each a median over the phases
  that have them (the last ``window`` primitives with such phases are kept apart from the window,
  so that a run of DP moves does not leave the surcharges to one or two samples); ``φ`` also
  pools each worker process's direct measurement of a fresh 64 MiB buffer's first touch
  (``runtime/transit/fault_probe.py``), so that it never rests on one primitive's sample;
* fixed seconds ``F`` and link bandwidth ``B`` (bytes/s per worker per direction): a robust line
  ``span − copy = F + bytes / B`` over those primitives (the busiest receiver's bytes; Theil–Sen,
  :func:`fit_line`), so a transition of many small primitives is priced by ``F`` and one large
  primitive by ``B`` (a bandwidth alone would fold every primitive's fixed cost into the per-byte
  rate), after taking out of ``span − copy`` and the wire seconds what the copy term prices on
  the wire's path (``φ·R_r / C``: a fresh receive buffer's page faults). ``F`` is held at >= 0 (through the origin otherwise); with fewer than 3 primitives, bytes
  that barely vary (relative spread under ``MIN_SPREAD``) or a slope <= 0: ``B`` = the
  byte-weighted median of bytes / wire seconds and ``F`` = the median of ``span − wire − copy``
  (at least 0), the wire seconds being the slowest worker's transfer seconds less the slowest
  sender's packing (a receiver's wait starts with its sender's packing, which the copy term
  already prices: counted twice, it halved ``B`` for a 28 MB Split on this machine);

and the Destroys (their spans, against the most tensors one of their workers freed,
``freed_tensors``) give ``CostParams.teardown_s`` and ``teardown_tensor_s``
(``transition/teardown.py``, :func:`fit_teardown`: a Theil–Sen line
with the allocator's warm-up discounted). They replace the cluster's scale-up and
scale-out bandwidth and ``CostParams.comm_setup_*`` (the fixed term, paid once per primitive),
``copy_bandwidth``, ``teardown_s`` in the estimates that follow (:meth:`TransitionCalibration.apply`,
:meth:`TransitionCalibration.params`), with ``serial_workers`` (the executor runs one primitive at a
time per worker) and ``worker_cores``. Records without spans use ``measured_s``; without
``measured_s`` (older callers), ``setup_s`` as the fixed term. Pure: no runtime import.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from nereus.spec.hardware import GPUSpec
from nereus.spec.job import JobSpec
from nereus.transition.copy_cost import FAULT_PROBE_BYTES
from nereus.transition.cost import CostParams
from nereus.transition.sharing import share_factors
from nereus.transition.teardown import trend_slope

__all__ = ["TransitionCalibration", "LINK_KINDS", "MIN_SPREAD", "fit_line", "fit_copy", "fit_teardown", "weighted_median"]

#: primitive kinds whose time is bytes over a worker-to-worker link
LINK_KINDS = ("split", "merge", "extend", "load", "sync")
#: below this relative spread (standard deviation / mean) of the bytes, a line fit has no leverage
MIN_SPREAD = 0.2


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The value at half the total weight (values sorted; where the cumulative weight meets half
    exactly, the mean of that value and the next: with equal weights, the ordinary median).

    Raises:
        ValueError: no values, lengths that differ, or a weight <= 0.
    """
    if not values or len(values) != len(weights) or any(not w > 0 for w in weights):
        raise ValueError(f"weighted_median: needs values with weights > 0 of the same length, got "
                         f"{len(values)} values and weights {list(weights)[:4]}")
    pairs = sorted(zip(values, weights))
    half, cum = sum(weights) / 2.0, 0.0
    for i, (v, w) in enumerate(pairs):
        cum += w
        if abs(cum - half) <= 1e-12 * max(1.0, half) and i + 1 < len(pairs):
            return (v + pairs[i + 1][0]) / 2.0
        if cum >= half:
            return v
    return pairs[-1][0]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Robust ``y = f + a·x`` with ``f >= 0`` and ``a > 0``: ``(f, a)``, or None when the points
    cannot give one (fewer than 3, ``x`` spread under :data:`MIN_SPREAD`, slope <= 0).

    Theil–Sen (Sen, JASA 1968): ``a`` the median of the slopes between points whose ``x`` differ by
    at least ``MIN_SPREAD`` of the mean ``x``, ``f`` the median of ``y − a·x``. A negative ``f``
    gives the line through the origin, ``a`` the ``x``-weighted median of ``y / x``. Medians, not
    least squares: on a shared machine the seconds have a heavy one-sided tail (a primitive is only
    ever slowed down), and the line should follow the typical primitive, not the slowest ones.
    """
    n = len(xs)
    if n < 3:
        return None
    mx = sum(xs) / n
    var = sum((x - mx) ** 2 for x in xs) / n
    if mx <= 0 or math.sqrt(var) / mx < MIN_SPREAD:
        return None
    gap = MIN_SPREAD * mx
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(n)
              if xs[j] - xs[i] >= gap]
    if not slopes:
        return None
    a = statistics.median(slopes)
    if a <= 0:
        return None
    f = statistics.median(y - a * x for x, y in zip(xs, ys))
    if f < 0:
        pos = [(y / x, x) for x, y in zip(xs, ys) if x > 0]
        f, a = 0.0, weighted_median([r for r, _ in pos], [x for _, x in pos])
        if a <= 0:
            return None
    return f, a


def fit_copy(rows, direct=()) -> dict:
    """Copy rate ``C`` (bytes/s), the surcharges ``σ``, ``φ`` and the copy cores ``c``
    (``transition/copy_cost.py``) from measured copy phases.

    Args:
        rows: ``(K, S, R, seconds, n)`` per measured copy phase: a primitive's packing (the largest
            send bytes of one worker, ``cost.copy_bytes``'s first part, the slowest worker's
            ``pack_s``) or its assembly (the largest new-shard bytes, the slowest ``assemble_s``),
            or both together for records without the split; ``S`` and ``R`` the strided and fresh
            bytes among ``K``; seconds already divided by the core-sharing factor; ``n`` the
            workers that ran the phase at once (``copy_cost.copy_workers``; 1 when unknown).
        direct: seconds per byte that first touching a fresh buffer adds, one per worker process
            (``runtime/transit/fault_probe.py``: a 64 MiB copy into a fresh buffer less the same
            copy into a touched one).

    Returns:
        ``{"copy_bandwidth", "strided_copy_factor", "fresh_copy_factor", "copy_cores"}``, each None
        when no row measures it. In order, each from the rows the earlier ones explain:

        * ``C``: the ``K``-weighted median of ``K / seconds`` over the plain phases (``S = R = 0``)
          of one worker (of any ``n`` when there is none; of every row, the rest then None);
        * ``σ``: the ``S``-weighted median of ``(seconds·C − K) / S`` over one-worker phases with
          ``S > 0``, ``R = 0``; ``φ`` the same with ``R`` over those with ``R > 0``, ``S = 0`` (each
          at least 0); each ``direct`` value ``t`` is one more sample of ``φ``, ``t·C``, of weight
          ``FAULT_PROBE_BYTES`` (the bytes it measured), so ``φ`` is the weighted median of both
          kinds of measurement of the same page faults (None without either);
        * ``c``: the median over the phases of ``n >= 2`` workers of the cores that explain how
          much slower than one worker's each ran, ``ρ = seconds·C / (K + σ·S + φ·R)``: ``n / ρ``
          (``copy_cost.crowd(n, n / ρ) = ρ`` for ``1 <= n / ρ``; 1 where ``ρ >= n``, every worker
          then serialized; infinite where ``ρ <= 1``).

        Medians: one slow primitive on a shared machine moves none of them. Phases apart, a TP
        re-cut's contiguous packing and a DP copy's plain assembly measure ``C`` even when every
        primitive has strided or fresh bytes somewhere.
    """
    rows = [(k, s, r, c, n) for k, s, r, c, n in rows if k > 0 and c > 0]
    none = {"copy_bandwidth": None, "strided_copy_factor": None, "fresh_copy_factor": None, "copy_cores": None}
    if not rows:
        return none
    plain = [(k, c) for k, s, r, c, n in rows if s <= 0 and r <= 0 and n <= 1] or \
        [(k, c) for k, s, r, c, n in rows if s <= 0 and r <= 0]
    if not plain:
        return {**none, "copy_bandwidth": weighted_median([x[0] / x[3] for x in rows], [x[0] for x in rows])}
    bw = weighted_median([k / c for k, c in plain], [k for k, _ in plain])

    def surcharge(xs: list[tuple[float, float, float]]) -> float | None:  # (K, extra bytes, seconds)
        return max(0.0, weighted_median([(c * bw - k) / x for k, x, c in xs], [x for _, x, _ in xs])) if xs else None

    sig = surcharge([(k, s, c) for k, s, r, c, n in rows if s > 0 and r <= 0 and n <= 1])
    # a direct value t as a phase of FAULT_PROBE_BYTES fresh bytes whose (seconds·C − K) / R is t·C
    phi = surcharge([(k, r, c) for k, s, r, c, n in rows if r > 0 and s <= 0 and n <= 1]
                    + [(0.0, FAULT_PROBE_BYTES, t * FAULT_PROBE_BYTES) for t in direct if t >= 0])
    crowd = []
    for k, s, r, c, n in rows:
        if n >= 2:
            rho = c * bw / (k + (sig or 0.0) * s + (phi or 0.0) * r)
            crowd.append(max(1.0, n / rho) if rho > 1.0 else math.inf)
    return {"copy_bandwidth": bw, "strided_copy_factor": sig, "fresh_copy_factor": phi,
            "copy_cores": statistics.median(crowd) if crowd else None}


def fit_teardown(points) -> tuple[float, float] | None:
    """``(teardown_s, teardown_tensor_s)`` from measured Destroys, or None without any.

    Args:
        points: ``(n, seconds)`` per Destroy, oldest first: the most tensors one of its workers
            freed (0 when unknown) and its span already divided by the core-sharing factor.

    Returns:
        In order:

        1. the line ``seconds = F + a·n`` (:func:`fit_line`, Theil–Sen, ``F >= 0``) when the
           ``n`` vary enough; else ``F = 0`` and ``a`` the median of ``seconds / n`` when every
           ``n > 0`` (a Destroy's work is its tensors); else ``F`` the median seconds and ``a = 0``;
        2. the warm-up discount: with ``r_i = ln(seconds_i / (F + a·n_i))`` and ``b =``
           ``teardown.trend_slope`` of the ``r_i`` (at least 3 points), when ``b < 0`` (Destroys getting
           faster: the allocator warming up, module docstring) both constants are multiplied by
           ``exp(median(r_i − b·i) + b·(m − 1))``, the trend's value at the newest of the ``m``
           points. A rising trend is not extrapolated: glibc's thresholds only rise, so Destroys
           get slower only under load, whose slowdowns do not persist (docs/live-transition.md).
    """
    pts = [(float(n), float(s)) for n, s in points if s > 0]
    if not pts:
        return None
    xs, ys = [n for n, _ in pts], [s for _, s in pts]
    line = fit_line(xs, ys)
    if line is not None:
        f, a = line
    elif all(n > 0 for n in xs):
        f, a = 0.0, statistics.median(s / n for n, s in pts)
    else:
        f, a = statistics.median(ys), 0.0
    r = [math.log(s / (f + a * n)) for n, s in pts if f + a * n > 0]
    if len(r) == len(pts) >= 3:
        b = trend_slope(r)
        if b < 0:
            k = math.exp(statistics.median(ri - b * i for i, ri in enumerate(r)) + b * (len(r) - 1))
            f, a = f * k, a * k
    return f, a


@dataclass
class TransitionCalibration:
    """Measured transition constants (module docstring).

    Attributes:
        window: how many of the most recent byte-moving primitives (and Destroys) the constants
            are fitted over, >= 1.
        cores: CPU cores the workers share (``CostParams.worker_cores``), > 0; None: each worker has
            its own (no sharing correction; GPUs).
        bandwidth: bytes/s per worker per direction, None before any measurement.
        setup_s: fixed seconds per primitive that moves bytes (module docstring, ``F``), None before
            any measurement.
        copy_bandwidth: bytes/s of packing plus assembly of contiguous bytes (:func:`fit_copy`), None
            before any measurement.
        strided_copy_factor, fresh_copy_factor: ``σ`` and ``φ`` of ``transition/copy_cost.py``
            (:func:`fit_copy`), None before a primitive with such bytes (or, for ``φ``, a worker's
            fault probe) was measured.
        fresh_buffer_bytes: ``CostParams.fresh_buffer_bytes`` of the executor measured, bytes > 0:
            infinite (the default) for the runtime's, whose CPU workers reuse their transit
            buffers (``runtime/transit/buffer_pool.py``) as GPUs' caching allocator does, so no
            buffer is freshly mapped and ``φ`` prices nothing; ``copy_cost.FRESH_BUFFER_BYTES`` for
            an executor that allocates each CPU buffer anew (``φ`` then applies from that size).
        copy_cores: ``CostParams.copy_cores`` (:func:`fit_copy`), None before a copy phase on two
            or more workers at once was measured.
        dispatch_s: ``CostParams.dispatch_s``: the median, over the window's primitives that had
            DAG predecessors, of their last worker's start less the latest end of what they waited
            for (those predecessors, and earlier primitives on their workers; records with
            ``preds`` and ``worker_ids``); None before one was measured.
        teardown_s, teardown_tensor_s: fixed seconds of a Destroy and its seconds per freed tensor
            (``fit_teardown``), None before any measurement.
        history: one ``{"bandwidth", "copy_bandwidth", "setup_s", "teardown_s", "primitives"}`` per
            :meth:`observe` that measured (that transition's own values).

    Raises:
        ValueError: ``window`` not an integer >= 1, ``cores`` not a number > 0.
    """

    window: int = 64
    cores: float | None = None
    bandwidth: float | None = None
    setup_s: float | None = None
    copy_bandwidth: float | None = None
    teardown_s: float | None = None
    teardown_tensor_s: float | None = None
    strided_copy_factor: float | None = None
    fresh_copy_factor: float | None = None
    fresh_buffer_bytes: float = math.inf
    copy_cores: float | None = None
    history: list = field(default_factory=list)
    # (busiest bytes, transfer s, copy bytes, copy s, old-style setup s, span - copy s or None,
    # copy phases: ((bytes, strided bytes, fresh bytes, seconds, workers), ...), fresh receive bytes), unshared
    rows: list = field(default_factory=list, repr=False)
    teardowns: list = field(default_factory=list, repr=False)
    dispatches: list = field(default_factory=list, repr=False)
    special: list = field(default_factory=list, repr=False)
    faults: dict = field(default_factory=dict)  # worker → fresh-buffer s/B (fault_probe), the latest
    dispatch_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"calibration field 'window' must be an integer >= 1, got {self.window!r}")
        if not (isinstance(self.fresh_buffer_bytes, (int, float)) and self.fresh_buffer_bytes > 0):
            raise ValueError(f"calibration field 'fresh_buffer_bytes' must be a number of bytes > 0, got "
                             f"{self.fresh_buffer_bytes!r}")
        if self.cores is not None and not (isinstance(self.cores, (int, float)) and self.cores > 0):
            raise ValueError(f"calibration field 'cores' must be a number > 0 or None, got {self.cores!r}")

    def observe(self, records) -> None:
        """Fold one transition's per-primitive records in.

        Args:
            records: dicts (or objects with these attributes) with ``kind``, ``received``
                (worker → bytes), ``transfer_s`` and ``setup_s`` (seconds, slowest worker) and,
                optionally, ``copy_s`` (pack + assembly seconds, slowest worker), ``pack_s`` and
                ``assemble_s`` (each the slowest worker's; their sum replaces ``copy_s``),
                ``copy_bytes`` (the planner's, ``cost.copy_bytes``), ``measured_s`` (wall seconds
                of the primitive), ``t_ready`` and ``t_end`` (its last worker's start and end,
                seconds on one clock; ``t_end − t_ready`` replaces ``measured_s``) and ``workers``
                (how many workers ran it: the core-sharing correction, with ``cores``) and
                ``fault_s_per_byte`` (worker → fresh-buffer seconds per byte, ``fit_copy``'s ``direct``).
        """
        recs = []
        for r in records:
            get = (lambda k, d=None, _r=r: _r.get(k, d)) if isinstance(r, dict) else \
                (lambda k, d=None, _r=r: getattr(_r, k, d))
            recs.append(get)
        spans = []
        for get in recs:
            t0, t1 = get("t_ready"), get("t_end")
            spans.append((float(t0), float(t1), int(get("workers") or 1)) if t0 is not None and t1 is not None
                         else None)
        known = [x for x in spans if x is not None]
        share = iter(share_factors(known, self.cores) if self.cores is not None else [1.0] * len(known))
        rows, teardowns = [], []
        # dispatch latency: from the latest end of what a primitive waited for (its DAG
        # predecessors, and earlier primitives on its workers) to its last worker's start
        ends = {get("pid"): (float(get("t_end")), set(get("worker_ids") or ())) for get in recs
                if get("pid") is not None and get("t_end") is not None}
        dispatches = []
        for get in recs:
            pr, t0 = [q for q in (get("preds") or ()) if q in ends], get("t_ready")
            if not pr or t0 is None:
                continue
            mine = set(get("worker_ids") or ())
            waited = [ends[q][0] for q in pr] + [e for q, (e, ws) in ends.items()
                                                 if q != get("pid") and ws & mine and e <= float(t0) + 1e-9]
            dispatches.append(max(0.0, float(t0) - max(waited)))
        for get in recs:  # each worker process's direct measurement of φ's page faults (fit_copy)
            self.faults.update({str(w): float(t) for w, t in (get("fault_s_per_byte") or {}).items()})
        for get, span in zip(recs, spans):
            s = next(share) if span is not None else 1.0
            kind = get("kind")
            wall = (span[1] - span[0]) if span is not None else get("measured_s")
            if kind == "destroy" and wall is not None:
                teardowns.append((float(get("freed_tensors") or 0), float(wall) / s))
            if kind not in LINK_KINDS:
                continue
            busiest = max((get("received") or {}).values(), default=0)
            transfer = float(get("transfer_s") or 0.0)
            pack, asm = get("pack_s"), get("assemble_s")
            copy = float(pack) + float(asm or 0.0) if pack is not None else float(get("copy_s", 0.0) or 0.0)
            if pack is not None:  # a receiver waits while its sender packs: the wire is what follows
                transfer = max(0.0, transfer - float(pack))
            setup = max(0.0, float(wall) - transfer - copy) if wall is not None else float(get("setup_s") or 0.0)
            rest = max(0.0, float(wall) - copy) / s if wall is not None else None
            f = lambda k, _get=get: float(_get(k, 0) or 0)  # noqa: E731
            if f("pack_bytes") or f("assemble_bytes"):  # the two phases apart (fit_copy)
                phases = ((f("pack_bytes"), f("pack_strided"), f("fresh_bytes"), f("pack_s") / s,
                           f("pack_workers") or 1.0),
                          (f("assemble_bytes"), f("assemble_strided"), 0.0, f("assemble_s") / s,
                           f("assemble_workers") or 1.0))
            else:
                phases = ((f("copy_bytes") or busiest, 0.0, 0.0, copy / s, 1.0),)
            rows.append((busiest, transfer / s, float(get("copy_bytes", 0) or busiest), copy / s, setup / s, rest,
                         phases, f("fresh_recv_bytes")))
        if rows or teardowns:
            self.history.append({**self._fit(rows, teardowns, (), self.faults), "primitives": len(rows)})
        self.rows = (self.rows + rows)[-self.window:]
        self.teardowns = (self.teardowns + teardowns)[-self.window:]
        self.dispatches = (self.dispatches + dispatches)[-self.window:]
        if self.dispatches:
            self.dispatch_s = statistics.median(self.dispatches)
        # the primitives with strided, fresh or concurrent copy phases are kept apart too, so that
        # the surcharges of copy_cost.py stay measured when a run of other primitives fills the window
        self.special = (self.special + [r for r in rows if any(ph[1] > 0 or ph[2] > 0 or ph[4] >= 2
                                                               for ph in r[6])])[-self.window:]
        fit = self._fit(self.rows, self.teardowns, [r for r in self.special if not any(r is x for x in self.rows)],
                        self.faults)
        for k, v in fit.items():
            if v is not None:
                setattr(self, k, v)

    @staticmethod
    def _fit(rows, teardowns, extra=(), faults=None) -> dict:
        """The constants from rows and Destroy seconds (None where nothing measured one); ``extra``:
        older rows with strided, fresh or concurrent copy phases that left the window; ``faults``:
        worker → fresh-buffer seconds per byte (``fit_copy``'s ``direct``)."""
        cp = fit_copy([ph for r in list(rows) + list(extra) if r[0] > 0 for ph in r[6]], list((faults or {}).values()))
        # a fresh receive buffer's page faults are priced by the copy term (copy_cost.fresh_recv_bytes)
        phi, bw = cp["fresh_copy_factor"] or 0.0, cp["copy_bandwidth"] or math.inf
        rows = [(r[0], max(0.0, r[1] - phi * r[7] / bw), *r[2:5],
                 None if r[5] is None else max(0.0, r[5] - phi * r[7] / bw)) for r in rows]
        wire = [(r[0], r[1]) for r in rows if r[0] > 0 and r[1] > 0]
        pts = [(r[0], r[5]) for r in rows if r[5] is not None]
        line = fit_line([b for b, _ in pts], [y for _, y in pts]) if len(pts) == len(rows) else None
        if line is not None:
            bandwidth, setup = 1.0 / line[1], line[0]
        else:
            bandwidth = weighted_median([b / t for b, t in wire], [b for b, _ in wire]) if wire else None
            setup = statistics.median(r[4] for r in rows) if rows else None
        td = fit_teardown(teardowns) or (None, None)
        return {"bandwidth": bandwidth, **cp, "setup_s": setup, "teardown_s": td[0], "teardown_tensor_s": td[1]}

    def gpu(self, gpu: GPUSpec) -> GPUSpec:
        """``gpu`` with the measured bandwidth as its scale-up and scale-out link rates."""
        if self.bandwidth is None:
            return gpu
        return replace(gpu, scaleup_bandwidth=self.bandwidth, scaleout_bandwidth=self.bandwidth)

    def params(self, base: CostParams | None = None) -> CostParams:
        """``base`` with the measured fixed term (inside and across nodes), copy bandwidth, teardown
        and, when set, ``cores`` as ``worker_cores``; without ``base``, the defaults with the
        runtime executor's buffers counted in the memory check (``CostParams.transit_buffers``) and
        one primitive at a time per worker (``CostParams.serial_workers``): these constants
        describe that executor."""
        base = base or CostParams(transit_buffers=True, serial_workers=True)
        out = base if self.cores is None else replace(base, worker_cores=float(self.cores))
        if self.setup_s is not None:
            out = replace(out, comm_setup_intra_s=self.setup_s,
                          comm_setup_inter_s=max(self.setup_s, base.comm_setup_inter_s))
        if self.copy_bandwidth is not None:
            out = replace(out, copy_bandwidth=self.copy_bandwidth)
        if self.strided_copy_factor is not None:
            out = replace(out, strided_copy_factor=self.strided_copy_factor)
        if self.copy_cores is not None:
            out = replace(out, copy_cores=self.copy_cores)
        if self.dispatch_s is not None:
            out = replace(out, dispatch_s=self.dispatch_s)
        if self.fresh_copy_factor is not None:
            out = replace(out, fresh_copy_factor=self.fresh_copy_factor, fresh_buffer_bytes=self.fresh_buffer_bytes)
        if self.teardown_s is not None:
            out = replace(out, teardown_s=self.teardown_s, teardown_tensor_s=self.teardown_tensor_s or 0.0)
        return out

    def apply(self, job: JobSpec) -> JobSpec:
        """``job`` on a cluster whose devices have the measured link bandwidth."""
        if self.bandwidth is None:
            return job
        return replace(job, cluster=replace(job.cluster, gpu=self.gpu(job.cluster.gpu)))
