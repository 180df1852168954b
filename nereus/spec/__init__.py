"""Typed, validated specs: model shapes, hardware and clusters, the RL workload, and the job."""

from nereus.spec.hardware import GPU_PRESETS, ClusterSpec, GPUSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.spec.presets import MODEL_PRESETS, get_model
from nereus.spec.workload import WorkloadSpec

__all__ = ["ModelSpec", "MODEL_PRESETS", "get_model", "GPUSpec", "GPU_PRESETS", "get_gpu",
           "ClusterSpec", "WorkloadSpec", "JobSpec"]
