"""How the cost and transition planners see this runtime's devices: the ``cpu`` preset with a
measured matmul rate and a per-worker memory budget, and the job with the bytes the runtime really
holds per parameter in its precision (used by the adaptive run, the executor's tests and the
benchmarks)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from nereus.spec.framework import DEFAULT_FRAMEWORK, get_framework
from nereus.spec.hardware import GIB, GPU_PRESETS, ClusterSpec, GPUSpec
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["measure_matmul_flops", "cpu_gpu_spec", "runtime_job", "worker_cores"]


def worker_cores() -> int | None:
    """CPU cores the runtime's CPU workers share, or None when the workers compute on CUDA devices
    (each has its own engines: no sharing). The cores this process may run on
    (``os.sched_getaffinity(0)``; the workers are started on this machine and inherit its
    affinity; ``os.cpu_count()`` where affinity is not available). Each CPU worker is one
    single-threaded process (``OMP_NUM_THREADS=1``), so more busy workers than this share cores
    (``transition/sharing.py``, ``TransitionCalibration.cores``)."""
    if torch.cuda.is_available():
        return None
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def measure_matmul_flops(n: int = 256, reps: int = 5) -> float:
    """FLOP/s of an ``n×n`` float32 matmul on one thread (best of ``reps``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / max(best, 1e-9)


def cpu_gpu_spec(memory_bytes: int = 2 * GIB, measure: bool = True) -> GPUSpec:
    """The ``cpu`` preset with ``memory_bytes`` as the per-worker budget and, when ``measure``, the
    peak FLOP/s of a float32 matmul measured now (the preset's 20 GFLOP/s is an assumption)."""
    base = GPU_PRESETS["cpu"]
    flops = measure_matmul_flops() if measure else base.peak_flops
    src = base.source + (f"; peak_flops measured at start-up: {flops / 1e9:.1f} GFLOP/s (256x256 fp32 "
                         "matmul, 1 thread)" if measure else "")
    return replace(base, peak_flops=flops, memory_bytes=int(memory_bytes), source=src)


def runtime_job(spec: ModelSpec, workload: WorkloadSpec, num_workers: int, gpu: GPUSpec | None = None,
                num_nodes: int = 1, precision: str = "fp32", framework: str = DEFAULT_FRAMEWORK) -> JobSpec:
    """The job as the cost and transition planners see this runtime: ``num_workers`` devices of
    ``gpu`` (default: the ``cpu`` preset) on one node, and the bytes the runtime really holds in
    ``precision`` (``precision.workload_bytes``): ``fp32``: fp32 weights and KV cache (4 B), and for
    training only Adam's two moments on top (8 B): the fp32 weights are Adam's master weights, so
    there is no separate master copy; ``bf16``: bf16 weights and KV cache (2 B) and for training a
    12 B fp32 master and moments (``WorkloadSpec``'s GPU default). Fp32 gradients (4 B) in both.
    Training memory is the runtime engine's own (``activation_model="runtime"``,
    :mod:`nereus.cost.runtime_memory`: its saved tensors, gradient buffers and ZeRO buffers).
    The plan space is ``framework`` (default: the ``runtime`` preset, what the runtime executes and
    transitions: ZeRO-1, offload, colocation; ``nereus.spec.framework``).

    Raises:
        ValueError: workers not splitting evenly over nodes, an unknown precision or framework."""
    from nereus.runtime.model.precision import workload_bytes

    gpu = gpu or GPU_PRESETS["cpu"]
    if num_workers % num_nodes:
        raise ValueError(f"{num_workers} workers do not split evenly over {num_nodes} nodes")
    return JobSpec(spec, ClusterSpec(gpu, num_nodes, num_workers // num_nodes),
                   replace(workload, **workload_bytes(precision), activation_model="runtime"),
                   framework=get_framework(framework))
