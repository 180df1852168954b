"""``runtime/transit/buffer_pool.BufferPool``: which block serves which buffer, and what is kept.

Block identity by ``data_ptr`` and sizes in bytes: exact. That pooled buffers never leak bytes
between transfers is checked by the executor's bit-exactness tests (``tests/test_runtime_executor.py``),
whose transitions reuse the blocks of the ones before.
"""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.transit.buffer_pool import SLACK_BYTES, BufferPool

MiB = 1 << 20


def test_a_released_block_serves_the_next_buffer_that_fits():
    pool = BufferPool()
    a = pool.take(8 * MiB, "cpu")
    ptr = a.data_ptr()
    assert a.numel() == 8 * MiB and a.dtype == torch.uint8 and (pool.allocated, pool.reused) == (1, 0)
    pool.release()
    assert pool.kept_bytes == 8 * MiB
    b = pool.take(6 * MiB, "cpu")  # 8 MiB <= 2·6 MiB + 1 MiB: reused, a view of its first 6 MiB
    assert b.data_ptr() == ptr and b.numel() == 6 * MiB and (pool.allocated, pool.reused) == (1, 1)
    c = pool.take(6 * MiB, "cpu")  # the block is taken until release: a new one
    assert c.data_ptr() != ptr and pool.allocated == 2
    pool.release()
    d = pool.take(MiB, "cpu")  # 8 MiB and 6 MiB blocks are > 2·1 MiB + 1 MiB: not used for 1 MiB
    assert d.data_ptr() not in (ptr, c.data_ptr()) and pool.allocated == 3
    assert 2 * MiB + SLACK_BYTES == 3 * MiB


def test_smallest_fitting_block_and_the_byte_cap():
    pool = BufferPool(max_bytes=20 * MiB)
    big, small = pool.take(12 * MiB, "cpu"), pool.take(7 * MiB, "cpu")
    p_big, p_small = big.data_ptr(), small.data_ptr()
    pool.release()
    assert pool.kept_bytes == 19 * MiB
    assert pool.take(6 * MiB, "cpu").data_ptr() == p_small  # both fit; the smaller one serves
    pool.release()
    assert pool.take(9 * MiB, "cpu").data_ptr() == p_big  # 7 MiB too small; 12 <= 2·9 + 1: the 12 MiB block
    pool.release()
    assert pool.kept_bytes == 19 * MiB and pool.allocated == 2  # 12 + 7 MiB kept, under the cap
    pool.take(15 * MiB, "cpu")  # fits no kept block: a new one; at release 19 + 15 > 20: oldest dropped
    pool.release()
    assert pool.kept_bytes <= 20 * MiB and pool.kept_bytes == 15 * MiB
    assert p_big not in [b.data_ptr() for b in pool.free]


def test_discard_never_hands_a_failed_exchanges_blocks_out_again():
    pool = BufferPool()
    pool.take(4 * MiB, "cpu")
    pool.discard()
    pool.release()
    assert pool.kept_bytes == 0
    pool.take(4 * MiB, "cpu")
    assert (pool.allocated, pool.reused) == (2, 0)


def test_other_devices_are_not_pooled_and_bad_input_is_named():
    pool = BufferPool()
    t = pool.take(1024, "meta")
    assert t.device.type == "meta" and t.numel() == 1024 and pool.taken == [] and pool.allocated == 0
    with pytest.raises(ValueError, match="max_bytes"):
        BufferPool(max_bytes=-1)
    with pytest.raises(ValueError, match="nbytes"):
        pool.take(-1, "cpu")
