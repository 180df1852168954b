"""Checkpoint/restart cost model for the simulator (what a static plan pays to change, and the fallback).

A restart from a checkpoint costs ``process restart + state load + warm-up`` and re-executes the steps
since the last checkpoint; every policy also pays a periodic checkpoint save. Assumptions:

* **state**: trainable models (actor, critic) save weights and Adam state, ``num_params ·
  (param_bytes + optimizer_bytes)`` = 2 + 12 = 14 bytes/param (cost-model.md §2.3; gradients are not
  saved); frozen models (reference, reward) load ``num_params · param_bytes`` from storage.
* **storage**: ``STORAGE_BW`` = 2 GB/s per node to shared storage, nodes in parallel (typical
  NFS/Lustre client throughput; an assumption, not a measurement).
* **process restart**: 60 s (job relaunch, Ray/torch.distributed and NCCL init). Sia measured
  restart penalties of 25–250 s per job on a physical cluster (default 30 s; cost-model.md §4).
* **warm-up**: 60 s (vLLM engine start, KV-cache allocation, CUDA-graph capture; allocator warm-up),
  or the rollout engine's start at TP = GPUs per node when that is longer
  (``nereus.controller.engine_start.engine_start_s``: 3.5 min for a 70B model at TP 8).
* Together with the load, an 8B PPO job on 4 nodes restarts in about 150 s plus lost progress, the
  range of Tenplex's measured reconfiguration costs (70–195 s for GPT-3 XL; resharding.md §7) and
  below Tenplex's reported checkpoint/restart overhead (+360 s).
* **checkpoint interval** (``checkpoint_rule``): ``young`` (the default, issue 29): Young's interval
  ``sqrt(2 · C · M)`` from the measured save cost and the failures seen (``nereus.sim.checkpoint``);
  ``fixed``: every ``checkpoint_every`` = 25 RL steps (the rule before issue 29). Saved synchronously.
  ``checkpoint_every`` also sets how often ``elastic`` re-evaluates its plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.job import JobSpec
from nereus.workflow import workflow_for

__all__ = ["RestartCost", "STORAGE_BW", "CHECKPOINT_RULES"]

STORAGE_BW = 2e9
#: ``young``: Young's adaptive interval (``nereus.sim.checkpoint``); ``fixed``: every ``checkpoint_every`` steps
CHECKPOINT_RULES = ("young", "fixed")


@dataclass(frozen=True)
class RestartCost:
    """Checkpoint/restart times (seconds) from bytes and fixed costs (module docstring).

    Raises:
        ValueError: a non-positive bandwidth or interval, or a negative fixed cost.
    """

    storage_bandwidth: float = STORAGE_BW
    process_restart_s: float = 60.0
    warmup_s: float = 60.0
    checkpoint_every: int = 25
    checkpoint_rule: str = "young"

    def __post_init__(self) -> None:
        if self.checkpoint_rule not in CHECKPOINT_RULES:
            raise ValueError(f"restart field 'checkpoint_rule' must be one of {list(CHECKPOINT_RULES)}, "
                             f"got {self.checkpoint_rule!r}")
        if self.storage_bandwidth <= 0:
            raise ValueError(f"restart field 'storage_bandwidth' must be > 0 B/s, got {self.storage_bandwidth!r}")
        if self.checkpoint_every <= 0:
            raise ValueError(f"restart field 'checkpoint_every' must be > 0 steps, got {self.checkpoint_every!r}")
        for f in ("process_restart_s", "warmup_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"restart field {f!r} must be >= 0 s, got {getattr(self, f)!r}")

    @staticmethod
    def _models(job: JobSpec):
        wf = workflow_for(job.workload)
        trained = sorted({m.model for m in wf.model_stages if m.stage == "train"})
        frozen = sorted({m.model for m in wf.model_stages} - set(trained) - {"actor"})
        return trained, frozen

    def state_bytes(self, job: JobSpec) -> float:
        """Bytes a checkpoint holds: weights and optimizer state of every trained model."""
        w = job.workload
        trained, _ = self._models(job)
        return sum(job.model(m).num_params * (w.param_bytes + w.optimizer_bytes) for m in trained)

    def load_bytes(self, job: JobSpec) -> float:
        """Bytes read at restart: the checkpoint plus the frozen models' weights."""
        _, frozen = self._models(job)
        return self.state_bytes(job) + sum(job.model(m).num_params * job.workload.param_bytes for m in frozen)

    def save_s(self, job: JobSpec, num_nodes: int) -> float:
        return self.state_bytes(job) / (self.storage_bandwidth * max(1, num_nodes))

    def restart_s(self, job: JobSpec, num_nodes: int) -> float:
        """Process restart + load + warm-up (lost progress is added by the simulator)."""
        load = self.load_bytes(job) / (self.storage_bandwidth * max(1, num_nodes))
        return self.process_restart_s + load + self.warmup(job)

    def warmup(self, job: JobSpec) -> float:
        """Warm-up seconds: ``warmup_s`` or the actor's engine start at TP = GPUs per node, the larger."""
        from nereus.controller.engine_start import engine_start_s

        return max(self.warmup_s, engine_start_s(job.model("actor"), job.cluster.gpus_per_node))
