"""vLLM's KV-cache memory model (``nereus/cost/vllm_kv.py``), hand-computed."""

from __future__ import annotations

import pytest

from nereus.cost.vllm_kv import block_bytes, concurrent_sequences, gpu_kv_cache_bytes, kv_blocks, waves
from nereus.spec.presets import get_model


def test_block_bytes_by_hand():
    llama8 = get_model("llama-3.1-8b")  # 32 layers, 8 KV heads of 128, bf16, block 16
    assert block_bytes(llama8, 1, 16, 2) == 2 * 32 * 8 * 128 * 2 * 16 == 2_097_152
    assert block_bytes(llama8, 4, 16, 2) == 2 * 32 * 2 * 128 * 2 * 16
    # tp above the KV heads: one head per rank (replicated), not a fraction
    assert block_bytes(llama8, 16, 16, 2) == 2 * 32 * 1 * 128 * 2 * 16


def test_kv_blocks_and_sequences_by_hand():
    llama8 = get_model("llama-3.1-8b")
    # 10 GiB of KV at TP 1, bf16, block 16: 10 * 2^30 / 2^21 = 5120 blocks = 81920 tokens
    assert kv_blocks(llama8, 1, 10 * 2**30, 16, 2) == 5120
    assert kv_blocks(llama8, 1, 10 * 2**30 - 1, 16, 2) == 5119  # floor
    # 2048-token sequences take 128 blocks: 40 at once; max_num_seqs caps it
    assert concurrent_sequences(5120, 16, 2048, 256) == 40
    assert concurrent_sequences(5120, 16, 2048, 32) == 32
    assert concurrent_sequences(5120, 16, 2049, 256) == 5120 // 129 == 39
    assert waves(100, 5120, 16, 2048, 256) == 3
    with pytest.raises(ValueError, match="needs 2 blocks"):
        waves(1, 1, 16, 17, 256)


def test_gpu_fraction_by_hand():
    # 80 GB device, 0.9: 72 GB, minus 16 GB weights, 4 GB activations, 1 GB non-torch = 51 GB
    assert gpu_kv_cache_bytes(80e9, 0.9, 16e9, 4e9, 1e9) == pytest.approx(51e9)
    assert gpu_kv_cache_bytes(10e9, 0.5, 16e9, 0) == 0.0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_kv_cache_bytes(80e9, 1.5, 0, 0)
    with pytest.raises(ValueError, match="weight_bytes"):
        gpu_kv_cache_bytes(80e9, 0.9, -1, 0)
