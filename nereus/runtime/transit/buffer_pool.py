"""A CPU worker's transit buffers, kept and reused across primitives, transitions and weight syncs.

Source: ours (issue 26). The executor packs each receiver's bytes into one send buffer and
receives each sender's into one receive buffer (``transit/packing.py``). Freshly allocated, a
buffer of 32 MiB or more is a fresh ``mmap`` on every use (glibc, mallopt(3)) and one under that
is fresh whenever the process's heap had no free chunk for it: the kernel then faults in and
zeroes every 4 KiB page on the first write, which measured here took a 28.6 MB packing from 7 ms
to 19.5-21.5 ms, in some runs of ``benchmarks/bench_live_transition.py`` and not in others
(docs/live-transition.md). PyTorch's CUDA caching allocator keeps freed device memory for reuse,
so GPU buffers never pay this; :class:`BufferPool` gives CPU buffers the same: a block released
at the end of one exchange serves the next that fits, so after a worker's first transitions no
transit buffer faults, and the transition cost model prices no fresh buffers
(``CostParams.fresh_buffer_bytes`` infinite, as for GPUs).

Memory: while a primitive runs, its buffers are what the planner's memory check already counts
(``transition/buffers.py``); between primitives the pool keeps the blocks, at most
:data:`POOL_BYTES` in all (the oldest dropped first), as the CUDA caching allocator keeps reserved
blocks. A block is handed out only between :meth:`BufferPool.take` and :meth:`BufferPool.release`
of one exchange; every byte of a taken buffer is written before it is read (a send buffer by
``pack``, a receive buffer by the collective), so reuse never leaks bytes between transfers.
Only ``cpu`` buffers are pooled; other devices (``cuda``: the caching allocator; ``meta``) get a
plain ``torch.empty``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["BufferPool", "POOL_BYTES", "SLACK_BYTES"]

#: most bytes the pool keeps between exchanges (1 GiB: above any one transition's buffers of the
#: CPU runtime's models, whose largest train model-stage state is tens of MB)
POOL_BYTES = 1 << 30
#: a kept block serves a buffer of ``n`` bytes only if it is at most ``2·n + SLACK_BYTES``
SLACK_BYTES = 1 << 20


class BufferPool:
    """uint8 CPU blocks reused as transit buffers (module docstring).

    Args:
        max_bytes: most bytes kept between exchanges, >= 0 (0: nothing kept, every buffer fresh).

    Raises:
        ValueError: ``max_bytes`` not an integer >= 0.
    """

    def __init__(self, max_bytes: int = POOL_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"buffer pool: max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.free: list[torch.Tensor] = []  # released blocks, oldest first
        self.taken: list[torch.Tensor] = []  # blocks handed out since the last release
        self.reused = 0  # buffers served from a kept block (counts; tests and reports)
        self.allocated = 0  # buffers that needed a new block
        self._lock = threading.Lock()

    def take(self, nbytes: int, device) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on ``device``: on ``cpu`` a view of the smallest kept block
        that holds it and is at most twice its size plus 1 MiB (so a small buffer does not take a
        large block a later buffer of the same exchange needs), else of a new block of exactly
        ``nbytes``; elsewhere ``torch.empty``.
        Its contents are undefined.

        Raises:
            ValueError: ``nbytes`` < 0.
        """
        if nbytes < 0:
            raise ValueError(f"buffer pool: nbytes must be >= 0, got {nbytes!r}")
        if torch.device(device).type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            fits = [b for b in self.free if nbytes <= b.numel() <= 2 * nbytes + SLACK_BYTES]
            if fits:
                block = min(fits, key=lambda b: b.numel())
                self.free = [b for b in self.free if b is not block]
                self.reused += 1
            else:
                block = torch.empty(nbytes, dtype=torch.uint8)
                self.allocated += 1
            self.taken.append(block)
        return block[:nbytes]

    def release(self) -> None:
        """Return every block taken since the last release (call once no buffer of them is in use:
        transfers waited for, assembly done); then drop the oldest kept blocks past ``max_bytes``."""
        with self._lock:
            self.free.extend(self.taken)
            self.taken = []
            while self.free and sum(b.numel() for b in self.free) > self.max_bytes:
                self.free.pop(0)

    def discard(self) -> None:
        """Forget the blocks taken since the last release without keeping them (an exchange that
        failed: a transfer still under way may write them)."""
        with self._lock:
            self.taken = []

    @property
    def kept_bytes(self) -> int:
        """Bytes of the blocks kept between exchanges."""
        return sum(b.numel() for b in self.free)
