"""CPU workers keep freed host memory for reuse, as PyTorch's CUDA caching allocator keeps device memory.

Source: ours (issue 26). glibc's malloc adjusts two thresholds as a process runs (mallopt(3),
"M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"): each time a mmapped chunk is freed, the mmap threshold
rises to that chunk's size (at most ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit) and the trim
threshold to twice that, and free memory at the top of a heap beyond the trim threshold is given
back to the kernel. Whether a 28 MB transition buffer reuses memory the process has already
touched, or is faulted in and zeroed page by page (about 2x the copy's seconds, measured here:
``transition/copy_cost.py``), therefore depended on which buffers the process had freed before:
over three runs of ``benchmarks/bench_live_transition.py`` the same Merge's send buffer faulted
in every page in one run's typical repetition and in none in the next two's, which moved the
measured ``L_tran`` of a case by up to 1.7x between runs of the same code.

:func:`cache_host_frees` fixes both thresholds (fixing either turns glibc's dynamic adjustment
off): the mmap threshold at its largest value, :data:`MMAP_THRESHOLD_BYTES` (= ``copy_cost.
FRESH_BUFFER_BYTES``), and the trim threshold at :data:`TRIM_THRESHOLD_BYTES` (1 GiB), so that a
process keeps the heap memory it frees and reuses it. What this leaves is what the transition cost
model assumes (``copy_cost.fresh_bytes``): an allocation of at least 32 MiB that no free heap
chunk fits is a fresh ``mmap`` each time (its first touch priced by ``φ``), a smaller one reuses
memory once the process has reached its high-water mark. Not always a hole of its own size: glibc
before 2.38 serves torch's 64-byte-aligned requests only from a free chunk of at least size +
alignment + MINSIZE (``_int_memalign``), so a same-size buffer reuses a freed one's memory only
when that hole coalesced with a neighbour or the heap's top, which varies with the heap's layout
from run to run; the transition's own buffers are therefore reused explicitly
(``transit/buffer_pool.py``). A worker's resident memory then stays at
its peak instead of shrinking after a shard is freed; the memory is reused by the same process,
as the CUDA caching allocator's reserved-but-free blocks are (and, like those, is not what the
planner's per-device memory check counts: it checks the peak, which this does not raise).

Only on glibc (Linux); elsewhere nothing changes. GPU workers call it too: their host-side
buffers (pinned offload copies, DCP staging) get the same reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from nereus.transition.copy_cost import FRESH_BUFFER_BYTES

__all__ = ["cache_host_frees", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "M_TRIM_THRESHOLD",
           "M_MMAP_THRESHOLD"]

#: ``mallopt`` parameter numbers (glibc ``malloc.h``)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the mmap threshold: glibc's largest (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit; mallopt rejects more)
MMAP_THRESHOLD_BYTES = FRESH_BUFFER_BYTES
#: free memory at a heap's top kept before glibc gives it back (1 GiB: above any one transition
#: buffer of the CPU runtime's models, within mallopt's ``int`` argument)
TRIM_THRESHOLD_BYTES = 1 << 30


def cache_host_frees() -> bool:
    """Fix glibc's mmap and trim thresholds in this process (module docstring).

    Returns:
        True when both were set; False on a C library that is not glibc, or when ``mallopt``
        refused a value (it returns 0 then), in which case the process keeps glibc's defaults.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok)
