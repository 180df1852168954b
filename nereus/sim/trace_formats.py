"""Parsers of the published GPU-availability trace formats (the formats are listed in :mod:`nereus.sim.traces`):
each turns a file's rows into ``(t_seconds, count)`` points, raising ``ValueError`` naming the file, the
line and what was expected; :func:`~nereus.sim.traces.load_availability` detects the format and builds the
trace from the points. Sources of the formats: the shipped traces' ``SOURCES.md`` (``nereus/data/traces``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

__all__ = ["TIME_UNITS", "infer_time_unit", "read_text", "load_event_csv", "load_count_csv", "load_gcloud",
           "load_jsonl", "load_skypilot"]


TIME_UNITS = {"ms": 1e-3, "s": 1.0, "h": 3600.0}


#: a count series whose largest time is at least this is in ms or s (:func:`infer_time_unit`)
MS_MIN_TIME = 1e6


#: read as ms, the median gap between rows is at least this many seconds (else the file is in s)
MS_MIN_GAP_S = 10.0


def _replay_events(name, events) -> list[tuple[float, int]]:
    """Replay ``(t_seconds, action, nodes)`` events into (t, live node count) points."""
    live: set[str] = set()
    points = []
    for t, action, nodes in sorted(events, key=lambda e: e[0]):
        if action == "add":
            live |= set(nodes)
        elif action == "remove":
            live -= set(nodes)
        points.append((t, len(live)))
    return points


def read_text(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    text = path.read_text().replace("\r\n", "\n")
    if not text.strip():
        raise ValueError(f"trace file {str(path)!r} is empty")
    return text


def load_event_csv(path: Path, rows) -> list[tuple[float, int]]:
    events = []
    for i, row in rows:
        if len(row) != 3 or row[1].strip() not in ("add", "remove"):
            raise ValueError(f"{path}:{i}: expected 'time_ms,add|remove,node', got {','.join(row)!r}")
        try:
            t = float(row[0]) * 1e-3
        except ValueError as e:
            raise ValueError(f"{path}:{i}: time {row[0]!r} is not a number") from e
        if t < 0:
            raise ValueError(f"{path}:{i}: negative time {row[0]}")
        events.append((t, row[1].strip(), [row[2].strip()]))
    return _replay_events(path.name, events)


def load_count_csv(path: Path, rows, time_unit) -> list[tuple[float, int]]:
    pts = []
    for i, row in rows:
        if len(row) != 2:
            raise ValueError(f"{path}:{i}: expected 2 columns 't,count', got {len(row)}: {','.join(row)!r}")
        try:
            t, n = float(row[0]), float(row[1])
        except ValueError as e:
            raise ValueError(f"{path}:{i}: expected numbers 't,count', got {','.join(row)!r}") from e
        if n < 0 or n != int(n):
            raise ValueError(f"{path}:{i}: GPU/instance count must be a non-negative integer, got {row[1]!r}")
        pts.append((t, int(n)))
    if time_unit is None:
        time_unit, why = infer_time_unit([t for t, _ in pts], path.name)
        note = f"time unit {time_unit} (inferred: {why}; --time-unit to override)"
    else:
        note = f"time unit {time_unit} (given)"
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {time_unit!r}")
    scale = TIME_UNITS[time_unit]
    return sorted(((t * scale, n) for t, n in pts), key=lambda p: p[0]), note


def infer_time_unit(times, file_name: str = "") -> tuple[str, str]:
    """The time unit of a two-column count series, and why (returned, so it can be printed):

    * ``h`` when the file name says ``_scaled`` (Oobleck's rescaled traces) or the largest time is
      at most 200 (a few days in hours; 200 s or 200 ms would be a trace too short to use);
    * otherwise ``s`` when the largest time is below ``MS_MIN_TIME`` (1e6: 11.6 days in seconds,
      17 minutes in ms);
    * otherwise ``ms`` only if, read as ms, the median gap between distinct times is at least
      ``MS_MIN_GAP_S`` (10 s; availability is polled or changes seconds to hours apart), else ``s``:
      a month-long trace in seconds polled every 195 s (largest time 2.7e6) is read as 744 hours,
      not as 0.74 hours of sub-second changes.
    """
    ts = sorted(set(float(t) for t in times))
    tmax = ts[-1] if ts else 0.0
    if "_scaled" in file_name:
        return "h", "file name contains '_scaled'"
    if tmax <= 200:
        return "h", f"largest time {tmax:g} <= 200"
    if tmax < MS_MIN_TIME:
        return "s", f"largest time {tmax:.3g} < {MS_MIN_TIME:.0e}"
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    gap = gaps[len(gaps) // 2] if gaps else 0.0
    if gap * 1e-3 >= MS_MIN_GAP_S:
        return "ms", f"largest time {tmax:.3g} >= {MS_MIN_TIME:.0e} and median gap {gap:g} ms >= {MS_MIN_GAP_S:g} s"
    return "s", (f"largest time {tmax:.3g} >= {MS_MIN_TIME:.0e} but the median gap {gap:g} would be under "
                 f"{MS_MIN_GAP_S:g} s in ms")


def load_gcloud(path: Path, rows) -> list[tuple[float, int]]:
    pts = {}
    for i, row in rows:
        if len(row) != 3:
            raise ValueError(f"{path}:{i}: expected 'YYYY-MM-DD, HH:MM:SS, n', got {','.join(row)!r}")
        try:
            ts = datetime.strptime(f"{row[0].strip()} {row[1].strip()}", "%Y-%m-%d %H:%M:%S").timestamp()
            n = int(row[2])
        except ValueError as e:
            raise ValueError(f"{path}:{i}: expected 'YYYY-MM-DD, HH:MM:SS, n', got {','.join(row)!r}") from e
        if n < 0:
            raise ValueError(f"{path}:{i}: instance count must be >= 0, got {n}")
        pts[ts] = n  # duplicated timestamps from overlapping polls: keep the last
    return sorted(pts.items())


def load_jsonl(path: Path, text: str) -> tuple[list[tuple[float, int]], float]:
    events, end = [], 0.0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            t_ms, action, info = json.loads(line)
            t = float(t_ms) * 1e-3
            nodes = list(info.get("nodes", []))
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{i}: expected JSON '[t_ms, \"add\"|\"remove\"|\"no-op\", "
                             f"{{\"nodes\": [...]}}]', got {line[:80]!r}") from e
        end = max(end, t + float(info.get("duration", 0)) * 1e-3)
        if action in ("add", "remove", "no-op", "DONE"):
            events.append((t, action, nodes))
        else:
            raise ValueError(f"{path}:{i}: unknown action {action!r}; valid: add, remove, no-op, DONE")
    return _replay_events(path.name, events), end


def load_skypilot(path: Path, doc) -> list[tuple[float, int]]:
    if not isinstance(doc, dict) or "data" not in doc or "metadata" not in doc:
        raise ValueError(f"{path}: expected SkyPilot JSON {{'metadata': {{'gap_seconds': G}}, 'data': [...]}}")
    gap = doc["metadata"].get("gap_seconds")
    if not isinstance(gap, (int, float)) or gap <= 0:
        raise ValueError(f"{path}: metadata.gap_seconds must be > 0, got {gap!r}")
    pts = []
    for i, n in enumerate(doc["data"]):
        if not isinstance(n, (int, float)) or n < 0 or n != int(n):
            raise ValueError(f"{path}: data[{i}] must be a non-negative integer count, got {n!r}")
        pts.append((i * gap, int(n)))
    return pts
