"""Which device a worker computes on and in which dtype each model-stage's state is held (DESIGN.md §4.7).

:func:`inventory` describes the worker's hardware (for the pool and the controller), :func:`select_device`
picks its CUDA device (or the CPU) from what Ray assigned, :func:`resolve_dtype` maps a run precision and a
model-stage to the dtype of its weights.
"""

from __future__ import annotations

import os

import torch

from nereus.runtime.model.precision import PRECISIONS

__all__ = ["inventory", "select_device", "resolve_dtype"]


def inventory() -> dict:
    """This machine's devices: ``{"cpus", "cuda_devices": [{"name", "memory_bytes"}], "ray": {...}}``.

    NVML (``pynvml``) is used when CUDA is present and it is installed; torch's device properties
    otherwise; CPU count always; Ray's cluster resources when Ray is initialized.
    """
    out: dict = {"cpus": os.cpu_count() or 1, "cuda_devices": [], "ray": {}}
    if torch.cuda.is_available():
        try:
            import pynvml

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                out["cuda_devices"].append({"name": str(pynvml.nvmlDeviceGetName(h)),
                                            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total)})
        except Exception:  # NVML absent or unusable: fall back to torch
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out["cuda_devices"].append({"name": p.name, "memory_bytes": int(p.total_memory)})
    try:
        import ray

        if ray.is_initialized():
            out["ray"] = {k: float(v) for k, v in ray.cluster_resources().items()}
    except ImportError:
        pass
    return out


def select_device(worker_id: int, cuda_count: int | None = None, ray_gpu_ids: list | None = None,
                  visible: str | None = None) -> str:
    """This worker's one device: ``cpu`` without CUDA; else ``cuda:<i>``.

    Under Ray (``ray_gpu_ids``: ``ray.get_gpu_ids()`` of an actor with ``num_gpus=1``) the assigned
    GPU's position in ``visible`` (``CUDA_VISIBLE_DEVICES``, which Ray sets to the assigned ids, so
    usually ``cuda:0``), or the id itself when ``visible`` does not list it; without Ray (local
    processes) worker ``i`` takes ``cuda:<i mod cuda_count>``. Arguments left None are read from
    torch, Ray and the environment.
    """
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0:
        return "cpu"
    if ray_gpu_ids is None:
        try:
            import ray

            ray_gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        except Exception:  # not in a Ray worker
            ray_gpu_ids = []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if ray_gpu_ids:
        gid = str(ray_gpu_ids[0])
        listed = [v.strip() for v in (visible or "").split(",") if v.strip()]
        return f"cuda:{listed.index(gid) if gid in listed else int(float(gid)) % cuda_count}"
    return f"cuda:{worker_id % cuda_count}"


def resolve_dtype(name: str, trainable: bool, device: str, precision: str = "fp32") -> torch.dtype:
    """The parameter dtype of an engine.

    ``precision="bf16"`` (mixed precision, ``worker/engine.py``): bf16 for every engine, trainable ones
    keeping fp32 master weights; ``name`` is then ignored. ``precision="fp32"``: fp32 on CPU; bf16 for
    forward-only model-stages on a device that supports it (``auto``).

    Raises:
        ValueError: an unknown name or precision, or ``bfloat16`` for a trainable stage in an fp32 run.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return torch.bfloat16
    if name == "auto":
        bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 and not trainable else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        if trainable:
            raise ValueError("dtype 'bfloat16' is for forward-only model-stages: training keeps fp32 "
                             "(master) weights; bf16 training is precision='bf16'")
        return torch.bfloat16
    raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")
