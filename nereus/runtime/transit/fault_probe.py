"""The page-fault and zeroing cost of a freshly mapped CPU buffer, measured directly on a worker.

Source: ours (issue 26: the fresh-buffer surcharge ``φ`` of ``transition/copy_cost.py`` was fitted
from the few primitives with a send buffer of 32 MiB or more, one before the first DP case of a
run, so it rested on one noisy sample: 2.79 in one run, 0.96 in another).

A CPU allocation of at least glibc's largest mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB
on 64-bit, mallopt(3)) is a fresh anonymous ``mmap``: the kernel faults in and zeroes each 4 KiB
page on its first write. glibc raises its *dynamic* threshold to the size of each mmapped chunk it
frees, but never past that maximum, so a buffer of :data:`~nereus.transition.copy_cost.FAULT_PROBE_BYTES`
(64 MiB) is mapped fresh every time, like the executor's 57 MB Extend buffers. :func:`measure`
copies one touched source into a freshly allocated ``torch.empty`` buffer and into an already
touched one, alternately, and takes the median of the per-repetition differences: the seconds the
first touch adds, per byte. It also counts the minor page faults of each fresh copy
(``getrusage(RUSAGE_SELF).ru_minflt``): about ``bytes / 4096`` when the buffer really was fresh (one
per 4 KiB page; fewer with transparent huge pages, 0 when the allocator reused memory).

On GPUs (PyTorch's caching allocator reuses device memory) there is nothing to measure.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from nereus.transition.copy_cost import FAULT_PROBE_BYTES

__all__ = ["measure"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(nbytes: int = FAULT_PROBE_BYTES, reps: int = 3) -> dict:
    """First-touch cost of a fresh ``nbytes`` CPU buffer in this process.

    Args:
        nbytes: buffer size in bytes, >= 4096 (below ``FRESH_BUFFER_BYTES`` glibc may reuse heap).
        reps: fresh/touched copy pairs, >= 1.

    Returns:
        ``{"bytes", "fresh_s", "warm_s", "faults", "s_per_byte"}``: median seconds of the copy into
        a fresh buffer (its allocation included) and into a touched one, median minor faults of a
        fresh copy, and ``max(0, median(fresh_i − warm_i)) / nbytes`` (seconds per byte).

    Raises:
        ValueError: ``nbytes`` < 4096 or ``reps`` < 1.
    """
    if nbytes < 4096 or reps < 1:
        raise ValueError(f"fault_probe.measure: needs nbytes >= 4096 and reps >= 1, got nbytes={nbytes!r}, "
                         f"reps={reps!r}")
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    warm = torch.empty(nbytes, dtype=torch.uint8)
    warm.copy_(src)
    fresh_s, warm_s, faults = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        warm.copy_(src)
        warm_s.append(time.perf_counter() - t0)
        f0, t0 = _faults(), time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.copy_(src)
        fresh_s.append(time.perf_counter() - t0)
        faults.append(_faults() - f0)
        del buf
    extra = statistics.median(f - w for f, w in zip(fresh_s, warm_s))
    return {"bytes": int(nbytes), "fresh_s": statistics.median(fresh_s), "warm_s": statistics.median(warm_s),
            "faults": int(statistics.median(faults)), "s_per_byte": max(0.0, extra) / nbytes}
