"""The RL hyper-parameters of a run (``nereus run``'s RL options) and the precision a device runs by default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.runtime.model.precision import PRECISIONS

__all__ = ["RLConfig", "default_precision", "ROLLOUTS"]

#: rollout engines of ``actor.generate``
ROLLOUTS = ("builtin", "vllm")


@dataclass(frozen=True)
class RLConfig:
    """RL hyper-parameters of a run.

    ``precision``: ``fp32`` (default) or ``bf16`` (bf16 weights and compute with fp32 master weights,
    gradients and Adam moments, ``worker/engine.py``), for every engine of the run; None picks
    :func:`default_precision` (bf16 on a CUDA device that supports it, fp32 on CPU).
    ``device_capacity``: bytes of device memory every worker may hold (0: unlimited); the worker's
    meter refuses more (``worker/memory_pool.py``), so a plan must fit by colocation, offload or ZeRO.

    Raises:
        ValueError: naming the field when a value is out of range.
    """

    temperature: float = 1.0
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    kl_coef: float = 0.0
    clip: float = 0.2
    value_clip: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    max_new_tokens: int = 0  # 0: the task's target length
    seed: int = 0
    timeout_s: float = 60.0
    precision: str | None = "fp32"
    rollout: str = "builtin"  # the generation engine: builtin (worker/rollout.py) or vllm (worker/vllm_engine.py)
    vllm: dict | None = None  # vLLM engine options (worker/vllm_engine.py VllmOptions)
    device_capacity: int = 0  # bytes of device memory each worker may account (0: unlimited)

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rl field 'rollout' must be one of {ROLLOUTS}, got {self.rollout!r}")
        if self.precision is None:  # the device's default: bf16 where CUDA supports it, else fp32
            object.__setattr__(self, "precision", default_precision())
        if self.precision not in PRECISIONS:
            raise ValueError(f"rl field 'precision' must be one of {PRECISIONS}, got {self.precision!r}")
        for f in ("temperature", "actor_lr", "critic_lr", "clip", "value_clip", "timeout_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"rl field {f!r} must be > 0, got {getattr(self, f)}")
        for f in ("gamma", "lam"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"rl field {f!r} must be in [0, 1], got {getattr(self, f)}")
        if isinstance(self.device_capacity, bool) or not isinstance(self.device_capacity, int) \
                or self.device_capacity < 0:
            raise ValueError(f"rl field 'device_capacity' must be a non-negative integer of bytes, "
                             f"got {self.device_capacity!r}")
        if self.kl_coef < 0 or self.max_new_tokens < 0:
            raise ValueError("rl fields 'kl_coef' and 'max_new_tokens' must be >= 0")


def default_precision() -> str:
    """``bf16`` when this process sees a CUDA device with bf16 support, else ``fp32`` (CPU runs stay
    fp32: bf16 matmuls there are emulated and slower)."""
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
