"""The KV cache a vLLM engine allocates, and how many sequences it holds (vLLM 0.32's memory model).

vLLM pre-allocates its KV cache once at engine start: on a GPU the fraction ``gpu_memory_utilization``
of the device's memory minus what the profile run measured (weights, peak activations, non-torch
memory; :func:`gpu_kv_cache_bytes`), on CPU ``VLLM_CPU_KVCACHE_SPACE`` GiB, or ``kv_cache_memory_bytes``
on either when given. That space is cut into *blocks* of ``block_size`` tokens; one block holds the K
and V of ``block_size`` tokens for every attention layer of this TP rank (:func:`block_bytes`), so

    blocks = floor(kv_cache_bytes / (2 · L · g_local · d · bytes · block_size)),   g_local = max(1, g / tp)

(``vllm/v1/core/kv_cache_utils.py``: ``num_blocks = available_memory // bytes_per_block``; KV heads
are split over TP, replicated when ``tp > g``: ``vllm/model_executor/models/llama.py``). A sequence of
``s`` tokens takes ``ceil(s / block_size)`` blocks (no prefix sharing between RL samples assumed), so an
engine runs at most :func:`concurrent_sequences` at once, also capped by ``max_num_seqs``; a batch
larger than that runs in waves (:func:`waves`), and when decode outgrows the blocks vLLM *preempts* a
running sequence (frees its blocks and recomputes it later: ``vllm/v1/core/sched/scheduler.py``).

Defaults: block size 16 on GPUs, 128 on CPU (``vllm/platforms/cpu.py``). Checked against the blocks a
started engine reports in ``tests/test_runtime_vllm.py``.
"""

from __future__ import annotations

import math

__all__ = ["block_bytes", "kv_blocks", "gpu_kv_cache_bytes", "concurrent_sequences", "waves",
           "DEFAULT_BLOCK_SIZE"]

#: vLLM's default KV block size (tokens) by device kind
DEFAULT_BLOCK_SIZE = {"gpu": 16, "cpu": 128}


def _pos(name: str, v, allow_zero: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if allow_zero else v > 0):
        raise ValueError(f"vllm_kv: {name} must be a {'non-negative' if allow_zero else 'positive'} number, got {v!r}")


def block_bytes(spec, tp: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one KV block on one TP rank: ``2 · L · max(1, g/tp) · d · dtype_bytes · block_size``.

    Args:
        spec: the model (``num_layers``, ``num_kv_heads``, ``head_dim``).
        tp: the engine's tensor-parallel degree.
        block_size: tokens per block.
        dtype_bytes: bytes per KV element (the model dtype's, or the ``kv_cache_dtype``'s).

    Raises:
        ValueError: a non-positive argument.
    """
    for n, v in (("tp", tp), ("block_size", block_size), ("dtype_bytes", dtype_bytes)):
        _pos(n, v)
    g_local = max(1, spec.num_kv_heads // tp)
    return 2 * spec.num_layers * g_local * spec.head_dim * int(dtype_bytes) * int(block_size)


def kv_blocks(spec, tp: int, kv_cache_bytes: float, block_size: int, dtype_bytes: int) -> int:
    """Blocks an engine rank allocates in ``kv_cache_bytes`` (floor of the ratio, as vLLM)."""
    _pos("kv_cache_bytes", kv_cache_bytes, allow_zero=True)
    return int(kv_cache_bytes // block_bytes(spec, tp, block_size, dtype_bytes))


def gpu_kv_cache_bytes(device_bytes: float, utilization: float, weight_bytes: float, activation_bytes: float,
                       other_bytes: float = 0.0) -> float:
    """The KV space vLLM takes on a GPU: ``utilization · device_bytes − weights − peak activations −
    non-torch memory`` of its profile run (``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``),
    0 when negative (vLLM then refuses to start: no room for one block).

    Raises:
        ValueError: ``utilization`` outside (0, 1] or a negative byte count.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"vllm_kv: gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    for n, v in (("device_bytes", device_bytes), ("weight_bytes", weight_bytes),
                 ("activation_bytes", activation_bytes), ("other_bytes", other_bytes)):
        _pos(n, v, allow_zero=True)
    return max(0.0, utilization * device_bytes - weight_bytes - activation_bytes - other_bytes)


def concurrent_sequences(blocks: int, block_size: int, seq_len: int, max_num_seqs: int) -> int:
    """Sequences of ``seq_len`` tokens (prompt + response) the engine holds at once:
    ``min(max_num_seqs, floor(blocks / ceil(seq_len / block_size)))``."""
    for n, v in (("block_size", block_size), ("seq_len", seq_len), ("max_num_seqs", max_num_seqs)):
        _pos(n, v)
    _pos("blocks", blocks, allow_zero=True)
    return min(int(max_num_seqs), int(blocks) // math.ceil(seq_len / block_size))


def waves(n: int, blocks: int, block_size: int, seq_len: int, max_num_seqs: int) -> int:
    """Rounds of decoding ``n`` sequences need when at most :func:`concurrent_sequences` run at once.

    Raises:
        ValueError: not even one sequence fits (vLLM refuses a request longer than its KV cache).
    """
    c = concurrent_sequences(blocks, block_size, seq_len, max_num_seqs)
    if c < 1:
        raise ValueError(f"vllm_kv: a sequence of {seq_len} tokens needs {math.ceil(seq_len / block_size)} blocks, "
                         f"the engine has {blocks}")
    return math.ceil(int(n) / c)
