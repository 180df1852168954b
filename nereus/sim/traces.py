"""Trace loaders: GPU availability (spot / preemptible pools) and per-step response lengths.

Formats (``../shared/traces/SOURCES.md``):

* **event log** (Bamboo, Oobleck): CSV rows ``time_ms,add|remove,nodeN``; rows may be unsorted.
* **count series** (Parcae ``p3.csv``, Bamboo ``aws_2020_doc_data``): CSV rows ``t,n``. The time unit
  differs by source (ms, s or h); pass ``time_unit`` or let :func:`~nereus.sim.trace_formats.infer_time_unit` infer it. The
  inferred unit is never silent: the trace records it and how it was inferred
  (``AvailabilityTrace.time_note``), and ``nereus simulate`` prints it.
* **gcloud polling** (Bamboo ``gcloud/*.txt``): ``YYYY-MM-DD, HH:MM:SS, n``; timestamps may step
  backwards, so rows are sorted and deduplicated.
* **JSON lines** (SpotServe, Parcae segments): ``[t_ms, "add"|"remove"|"no-op"|"DONE", {"nodes": [...]}]``.
* **SkyPilot JSON**: ``{"metadata": {"gap_seconds": G}, "data": [n0, n1, ...]}``.

Availability traces become an :class:`AvailabilityTrace`: a step function of instance counts over
time (seconds). :meth:`AvailabilityTrace.scaled` maps it onto a cluster of ``num_gpus`` GPUs.
Response-length traces are verl CSVs with columns ``step`` and ``mean_response_length``.

Every loader raises ``ValueError`` naming the file, the line and what was expected. The per-format
parsers are in :mod:`nereus.sim.trace_formats`.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from nereus.sim.trace_formats import (
    load_count_csv,
    load_event_csv,
    load_gcloud,
    load_jsonl,
    load_skypilot,
    read_text,
)

__all__ = ["AvailabilityTrace", "LengthTrace", "load_availability", "load_response_lengths",
           "shipped_trace", "SHIPPED_TRACES", "DEFAULT_TRACE", "LENGTH_SCALES"]

#: Trace files shipped inside the package (``nereus/data/traces``; licenses in ``SOURCES.md`` there).
SHIPPED_TRACES = {
    "bamboo-p3": "bamboo/p3-trace.csv",
    "bamboo-g4dn": "bamboo/g4dn-trace.csv",
    "bamboo-gcp-a100": "bamboo/gcloud/a100x1-east1b.txt",
    "bamboo-gcp-v100": "bamboo/gcloud/v100x1-east1c.txt",
    "parcae-p3": "parcae/p3.csv",
    "parcae-hh": "parcae/segments_gpt-1.5b/trace_hh_55_65.txt",
    "parcae-hl": "parcae/segments_gpt-1.5b/trace_hl_15_25.txt",
    "parcae-lh": "parcae/segments_gpt-1.5b/trace_lh_80_90.txt",
    "parcae-ll": "parcae/segments_gpt-1.5b/trace_ll_10_11.txt",
    "spotserve-a": "spotserve/trace_0304_real.txt",
    "spotserve-b": "spotserve/trace_0506_real.txt",
    "oobleck-p3": "oobleck/scaled/scale_p3-trace.csv",
    "oobleck-gcp": "oobleck/scaled/scale_gcp-trace.csv",
}
DEFAULT_TRACE = "bamboo-p3"
#: how :meth:`LengthTrace.normalized` scales a response-length log to the job
LENGTH_SCALES = ("none", "mean", "max")


@dataclass(frozen=True)
class AvailabilityTrace:
    """A step function: ``counts[i]`` instances are available from ``times[i]`` until ``times[i+1]``.

    Attributes:
        name: file or preset name, for display.
        times: seconds from trace start, strictly increasing, ``times[0] == 0``.
        counts: available instances (or GPUs after :meth:`scaled`), non-negative integers.
        end: seconds; the trace holds its last value until ``end`` (and beyond, when replayed longer).
        unit: ``"instances"`` or ``"gpus"``.
        source: where the data comes from.

    Raises:
        ValueError: empty series, unsorted times or a negative count.
    """

    name: str
    times: tuple[float, ...]
    counts: tuple[int, ...]
    end: float
    unit: str = "instances"
    source: str = ""
    time_note: str = ""

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.counts):
            raise ValueError(f"availability trace {self.name!r}: empty series or times/counts of "
                             f"different lengths ({len(self.times)} vs {len(self.counts)})")
        if any(b <= a for a, b in zip(self.times, self.times[1:])):
            raise ValueError(f"availability trace {self.name!r}: times must be strictly increasing")
        neg = [c for c in self.counts if c < 0]
        if neg:
            raise ValueError(f"availability trace {self.name!r}: negative count {neg[0]}; counts must be >= 0")
        if max(self.counts) == 0:
            raise ValueError(f"availability trace {self.name!r}: no instance is ever available")

    def count_at(self, t: float) -> int:
        """Instances available at time ``t`` seconds (the first value before 0)."""
        i = bisect.bisect_right(self.times, t) - 1
        return self.counts[max(i, 0)]

    def next_change(self, t: float) -> float:
        """Time of the first change strictly after ``t`` (``math.inf`` if none)."""
        i = bisect.bisect_right(self.times, t)
        return self.times[i] if i < len(self.times) else math.inf

    @property
    def num_changes(self) -> int:
        return len(self.times) - 1

    def scaled(self, num_gpus: int) -> AvailabilityTrace:
        """Map the trace's largest count onto ``num_gpus`` GPUs: ``floor(n · num_gpus / max n)``.

        Proportional scaling keeps the relative size and timing of every change (Oobleck rescales
        the same traces to its cluster the same way, SOURCES.md A5).

        Raises:
            ValueError: ``num_gpus`` not a positive integer.
        """
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus <= 0:
            raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        top = max(self.counts)
        return _from_points(self.name, [(t, (c * num_gpus) // top) for t, c in zip(self.times, self.counts)],
                            self.end, unit="gpus", source=self.source, time_note=self.time_note)

    def clipped(self, hours: float) -> AvailabilityTrace:
        """The first ``hours`` of the trace."""
        return self.window(0.0, hours)

    def window(self, start_h: float = 0.0, hours: float | None = None) -> AvailabilityTrace:
        """``hours`` of the trace from ``start_h`` hours in, re-based to start at 0 (``hours`` None:
        to the end). The count at ``start_h`` holds from 0.

        Raises:
            ValueError: a negative start, a start at or after the trace's end, or ``hours`` <= 0.
        """
        if not start_h >= 0:
            raise ValueError(f"trace start must be >= 0 hours, got {start_h!r}")
        s0 = start_h * 3600.0
        if s0 > 0 and s0 >= self.end:
            raise ValueError(f"trace start {start_h:g} h is at or after the end of trace {self.name!r} "
                             f"({self.end / 3600:.2f} h); valid: 0 <= start < {self.end / 3600:.2f}")
        if hours is not None and not hours > 0:
            raise ValueError(f"trace window must be > 0 hours, got {hours!r}")
        end = self.end if hours is None else s0 + hours * 3600.0
        pts = [(0.0, self.count_at(s0))] + [(t - s0, c) for t, c in zip(self.times, self.counts) if s0 < t < end]
        return _from_points(self.name, pts, end - s0, unit=self.unit, source=self.source, time_note=self.time_note)

    def to_dict(self) -> dict:
        return {"name": self.name, "unit": self.unit, "source": self.source, "end": self.end, "time_note": self.time_note,
                "times": list(self.times), "counts": list(self.counts)}


@dataclass(frozen=True)
class LengthTrace:
    """Mean response length (tokens) per RL step; step ``i`` of a run uses ``lengths[i % len]``.

    Attributes:
        name: file name or scenario name.
        lengths: tokens per step, positive.
        synthetic: True for generated scenarios (always labelled so in reports).
        source: provenance text.

    Raises:
        ValueError: empty series or a non-positive length.
    """

    name: str
    lengths: tuple[float, ...]
    synthetic: bool = False
    source: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError(f"length trace {self.name!r} is empty: at least one step is needed")
        bad = [x for x in self.lengths if not (x > 0 and math.isfinite(x))]
        if bad:
            raise ValueError(f"length trace {self.name!r}: response lengths must be positive, got {bad[0]!r}")

    def at(self, step: int) -> float:
        """Length at RL step ``step`` (0-based); a trace shorter than the run is repeated."""
        return self.lengths[step % len(self.lengths)]

    @property
    def label(self) -> str:
        return f"{self.name} (SYNTHETIC)" if self.synthetic else self.name

    def normalized(self, mode: str, tokens: float) -> LengthTrace:
        """The trace scaled by one factor so that its ``mode`` (``mean`` or ``max``) is ``tokens``;
        ``none`` returns it unchanged. A log from another model (a 0.5B model's 150-token answers)
        then keeps its shape (noise, trend) at the job's length scale.

        Raises:
            ValueError: an unknown mode or ``tokens`` <= 0.
        """
        if mode == "none":
            return self
        if mode not in LENGTH_SCALES:
            raise ValueError(f"length scale mode must be one of {', '.join(LENGTH_SCALES)}, got {mode!r}")
        if not (tokens > 0 and math.isfinite(tokens)):
            raise ValueError(f"length scale target must be > 0 tokens, got {tokens!r}")
        ref = max(self.lengths) if mode == "max" else sum(self.lengths) / len(self.lengths)
        f = tokens / ref
        return LengthTrace(name=self.name, lengths=tuple(x * f for x in self.lengths), synthetic=self.synthetic,
                           source=self.source, meta=self.meta | {"scale": f, "scale_mode": mode,
                                                                 "scale_tokens": tokens, "scale_from": ref})


# ---------------------------------------------------------------------------------------------------
def _from_points(name, points, end, unit="instances", source="", time_note="") -> AvailabilityTrace:
    """Collapse (t, n) points (sorted by t; later points at the same t win) into a step function."""
    times: list[float] = []
    counts: list[int] = []
    for t, c in points:
        if times and t == times[-1]:
            counts[-1] = c
        else:
            times.append(float(t))
            counts.append(int(c))
    if not times:
        raise ValueError(f"availability trace {name!r} is empty: no data rows")
    t0 = times[0]
    times = [t - t0 for t in times]
    # drop points that do not change the value
    keep_t, keep_c = [times[0]], [counts[0]]
    for t, c in zip(times[1:], counts[1:]):
        if c != keep_c[-1]:
            keep_t.append(t)
            keep_c.append(c)
    return AvailabilityTrace(name=name, times=tuple(keep_t), counts=tuple(keep_c),
                             end=max(end - t0, keep_t[-1]), unit=unit, source=source, time_note=time_note)


def load_availability(path: str | Path, time_unit: str | None = None) -> AvailabilityTrace:
    """Load any availability trace format listed in the module docstring (detected from content).

    Args:
        path: a file path, or the name of a shipped trace (:data:`SHIPPED_TRACES`).
        time_unit: ``ms``, ``s`` or ``h`` for two-column count CSVs; guessed when None.

    Returns:
        the trace in instances (call :meth:`AvailabilityTrace.scaled` for GPUs).

    Raises:
        ValueError: missing or empty file, unknown format, wrong columns, negative counts.
    """
    if str(path) in SHIPPED_TRACES:
        return shipped_trace(str(path))
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"availability trace {str(path)!r}: no such file; give a file path or a shipped trace "
                         f"name {sorted(SHIPPED_TRACES)}")
    text = read_text(p)
    stripped = text.lstrip()
    end = 0.0
    time_note = ""
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON: {e}") from e
        pts = load_skypilot(p, doc)
        end = pts[-1][0] + doc["metadata"]["gap_seconds"]
        source = "SkyPilot spot-traces (no license stated; not shipped)"
        time_note = f"ticks of metadata.gap_seconds = {doc['metadata']['gap_seconds']:g} s"
    elif stripped.startswith("["):
        pts, end = load_jsonl(p, text)
        source = "JSON-lines replay segment (SpotServe / Parcae)"
        time_note = "time unit ms (JSON-lines format)"
    else:
        rows = [(i, [c.strip() for c in r]) for i, r in enumerate(csv.reader(text.splitlines()), 1)
                if r and any(c.strip() for c in r)]
        if rows and not any(c.lstrip("+-").replace(".", "", 1).isdigit() for c in rows[0][1]):  # a header: time,gpus
            rows = rows[1:]
        if not rows:
            raise ValueError(f"trace file {str(p)!r} has no data rows")
        first = rows[0][1]
        if len(first) == 3 and first[1] in ("add", "remove"):
            pts = load_event_csv(p, rows)
            source = "event log time_ms,add|remove,node (Bamboo / Oobleck)"
            time_note = "time unit ms (event-log format)"
        elif len(first) == 3 and "-" in first[0]:
            pts = load_gcloud(p, rows)
            source = "GCP preemptible polling (Bamboo gcloud)"
            time_note = "dates and times of day"
        elif len(first) == 2:
            pts, time_note = load_count_csv(p, rows, time_unit)
            source = "count series t,n"
        else:
            raise ValueError(f"{p}:1: unknown trace format: expected 'time_ms,add|remove,node', 't,count', "
                             f"'YYYY-MM-DD, HH:MM:SS, n', JSON lines or SkyPilot JSON; got {','.join(first)!r}")
    if not pts:
        raise ValueError(f"trace file {str(p)!r} has no data rows")
    end = max(end, pts[-1][0])
    return _from_points(p.name, pts, end, source=source, time_note=time_note)


def shipped_trace(name: str) -> AvailabilityTrace:
    """A trace shipped in ``nereus/data/traces`` by short name (see :data:`SHIPPED_TRACES`).

    Raises:
        ValueError: unknown name.
    """
    if name not in SHIPPED_TRACES:
        raise ValueError(f"unknown shipped trace {name!r}; valid: {sorted(SHIPPED_TRACES)} or a file path")
    ref = resources.files("nereus") / "data" / "traces" / SHIPPED_TRACES[name]
    with resources.as_file(ref) as p:
        tr = load_availability(p)
    return AvailabilityTrace(name=name, times=tr.times, counts=tr.counts, end=tr.end, unit=tr.unit,
                             source=f"{tr.source}; shipped file {SHIPPED_TRACES[name]}", time_note=tr.time_note)


def load_response_lengths(path: str | Path) -> LengthTrace:
    """Per-step mean response length from a verl log CSV (columns ``step``, ``mean_response_length``).

    Raises:
        ValueError: missing file, missing columns, a non-numeric or non-positive length, no rows.
    """
    p = Path(path)
    text = read_text(p)
    reader = csv.DictReader(text.splitlines())
    need = {"step", "mean_response_length"}
    if not reader.fieldnames or not need <= set(reader.fieldnames):
        raise ValueError(f"{p}: response-length CSV needs columns {sorted(need)}, has {reader.fieldnames}")
    rows = []
    for i, r in enumerate(reader, 2):
        try:
            rows.append((float(r["step"]), float(r["mean_response_length"])))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}:{i}: step and mean_response_length must be numbers, got "
                             f"{r.get('step')!r}, {r.get('mean_response_length')!r}") from e
    if not rows:
        raise ValueError(f"{p}: response-length CSV has no data rows")
    rows.sort()
    return LengthTrace(name=p.name, lengths=tuple(x for _, x in rows),
                       source=f"verl training log {p.name} (no license stated; read from the user's path)")
