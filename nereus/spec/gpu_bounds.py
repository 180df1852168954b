"""Plausibility bounds for a custom GPU's fields (a JSON file or inline mapping given to ``--gpu``):
a value far outside what any accelerator has is almost always a figure in another unit (80 for 80 GiB,
3350 for 3,350 GB/s, 989 for 989 TFLOP/s), which would otherwise plan "16 GPU(s) of 0.0 GiB" silently.

The bounds are deliberately wide (a factor of 10 or more beyond the extremes of today's parts), so
only a wrong unit trips them:

* ``memory_bytes`` in [1 GiB, 16 TiB]: the smallest data-centre GPUs have 16 GB (T4, V100-16GB), the
  largest 288 GB (MI355X, B300 datasheets).
* ``peak_flops`` / ``peak_flops_fp8`` (dense FLOP/s) in [1e9, 1e17]: a B200 has 2.25e15 dense BF16
  (NVIDIA datasheet); the low end admits the ``cpu`` preset (20e9, the runtime's CPU test device);
  ``peak_flops_fp8`` may be 0 (no FP8 tensor cores).
* ``hbm_bandwidth`` (bytes/s) in [1e9, 1e15]: a B200 has 8 TB/s; the ``cpu`` preset 5 GB/s.
* ``scaleup_bandwidth``, ``scaleout_bandwidth``, ``host_bandwidth``, ``host_memory_bandwidth`` (bytes/s)
  in [1e8, 1e14]: from 1 GbE (125 MB/s) to well past NVLink 5's 900 GB/s per direction.
* ``scaleup_latency``, ``scaleout_latency`` (seconds) at most 0.01: NVLink and InfiniBand take a few
  microseconds per message (a value in microseconds, 5 for 5e-6 s, is the usual mistake).
"""

from __future__ import annotations

__all__ = ["check_plausible", "BOUNDS"]

GIB = 1024**3

#: field -> (low, high, what the unit is, the likely mistaken unit: (name, factor to bytes/FLOP/s/s))
BOUNDS = {
    "memory_bytes": (GIB, 16 * 1024 * GIB, "bytes", ("GiB", GIB)),
    "peak_flops": (1e9, 1e17, "FLOP/s", ("TFLOP/s", 1e12)),
    "peak_flops_fp8": (1e9, 1e17, "FLOP/s", ("TFLOP/s", 1e12)),
    "hbm_bandwidth": (1e9, 1e15, "bytes/s", ("GB/s", 1e9)),
    "scaleup_bandwidth": (1e8, 1e14, "bytes/s", ("GB/s", 1e9)),
    "scaleout_bandwidth": (1e8, 1e14, "bytes/s", ("GB/s", 1e9)),
    "host_bandwidth": (1e8, 1e14, "bytes/s", ("GB/s", 1e9)),
    "host_memory_bandwidth": (1e8, 1e14, "bytes/s", ("GB/s", 1e9)),
    "scaleup_latency": (0.0, 0.01, "seconds", ("microseconds", 1e-6)),
    "scaleout_latency": (0.0, 0.01, "seconds", ("microseconds", 1e-6)),
}


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def check_plausible(d: dict) -> None:
    """Refuse a custom GPU field (of mapping ``d``) outside :data:`BOUNDS`, naming the field, the value,
    the valid range and the value it likely meant in the field's unit.

    Raises:
        ValueError: the first implausible field.
    """
    for k, (lo, hi, unit, (alt, factor)) in BOUNDS.items():
        v = d.get(k)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # missing or mistyped: GPUSpec's own checks name it
        if k == "peak_flops_fp8" and v == 0:
            continue  # no FP8 tensor cores
        if lo <= v <= hi or v <= 0 and lo > 0:
            continue  # in range, or not positive (GPUSpec says "must be > 0")
        meant = v * factor
        hint = f"; did you mean {_fmt(v)} {alt} = {_fmt(meant)} {unit}?" if lo <= meant <= hi else ""
        side = "below" if v < lo else "above"
        rng = "[1 GiB, 16 TiB]" if k == "memory_bytes" else f"[{lo:g}, {hi:g}] {unit}"
        raise ValueError(f"GPU field {k!r} = {_fmt(v)} {unit} is {side} the plausible range {rng} "
                         f"(every accelerator's figure lies inside it; the field is in {unit}){hint}")
