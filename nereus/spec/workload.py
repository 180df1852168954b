"""The RL workload: algorithm, batch sizes, lengths, precision and recompute options.

Batch terms (the field's usual meaning, as in Megatron-LM and verl):

* global batch: ``prompts_per_step · samples_per_prompt`` sequences trained on per RL step;
* mini-batch: ``mini_batch_size`` sequences per optimizer update (global, across DP);
* micro-batch: sequences one replica processes in one forward/backward (``b``); a replica does
  ``a`` gradient-accumulation micro-batches per mini-batch, with ``dp · b · a = mini_batch_size``;
* updates per step: ``ppo_epochs · global_batch / mini_batch_size``.

ReMax adds one greedy rollout per prompt during generation (its baseline), not to training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["WorkloadSpec", "ALGORITHMS", "RECOMPUTE_MODES"]

ALGORITHMS = ("ppo", "grpo", "remax")
RECOMPUTE_MODES = ("none", "selective", "full", "auto")


@dataclass(frozen=True)
class WorkloadSpec:
    """One RL job's per-step work.

    Attributes:
        algorithm: ``ppo``, ``grpo`` or ``remax``.
        prompts_per_step: prompts sampled per RL step.
        samples_per_prompt: responses per prompt (``n``; GRPO groups).
        prompt_len, response_len: tokens (mean lengths; response length drifts during a run).
        mini_batch_size: sequences per optimizer update; divides the global batch.
        micro_batch_size: largest per-replica training micro-batch ``b`` the planner may pick.
        infer_micro_batch_size: largest per-replica forward-only micro-batch.
        ppo_epochs: passes over the global batch per step.
        recompute: activation recomputation for training: ``none``, ``selective``, ``full`` or
            ``auto`` (the planner chooses per candidate).
        reward_model: whether ``reward.infer`` runs a reward model (else a rule-based reward on CPU).
        asynchronous: overlap generation of step k+1 with training of step k (one-step off-policy).
        param_bytes, grad_bytes: bytes per parameter of weights and gradients (bf16 weights, fp32
            main gradients as Megatron keeps them).
        optimizer_bytes: Adam state per parameter (fp32 master, exp_avg, exp_avg_sq = 12).
        kv_bytes: bytes per KV-cache element (bf16 = 2).

    Raises:
        ValueError: at construction, naming the field, the value and what would be valid.
    """

    algorithm: str = "ppo"
    prompts_per_step: int = 256
    samples_per_prompt: int = 4
    prompt_len: int = 1024
    response_len: int = 2048
    mini_batch_size: int = 256
    micro_batch_size: int = 4
    infer_micro_batch_size: int = 8
    ppo_epochs: int = 1
    recompute: str = "auto"
    reward_model: bool = True
    asynchronous: bool = False
    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    kv_bytes: int = 2

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"workload field 'algorithm' must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"workload field 'recompute' must be one of {RECOMPUTE_MODES}, "
                             f"got {self.recompute!r}")
        for f in ("prompts_per_step", "samples_per_prompt", "prompt_len", "response_len",
                  "mini_batch_size", "micro_batch_size", "infer_micro_batch_size", "ppo_epochs",
                  "param_bytes", "grad_bytes", "optimizer_bytes", "kv_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"workload field {f!r} must be a positive integer, got {v!r}")
        for f in ("reward_model", "asynchronous"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"workload field {f!r} must be a JSON boolean (true or false), got "
                                 f"{getattr(self, f)!r}")
        if self.global_batch % self.mini_batch_size != 0:
            raise ValueError(
                f"workload field 'mini_batch_size'={self.mini_batch_size} must divide the global batch "
                f"prompts_per_step*samples_per_prompt={self.global_batch}")
        if self.algorithm == "grpo" and self.samples_per_prompt < 2:
            raise ValueError("workload field 'samples_per_prompt' must be >= 2 for GRPO "
                             "(group-normalized advantages need a group)")

    @property
    def global_batch(self) -> int:
        """Sequences trained on per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def rollouts_per_step(self) -> int:
        """Sequences generated per step (ReMax adds one greedy rollout per prompt)."""
        extra = self.prompts_per_step if self.algorithm == "remax" else 0
        return self.global_batch + extra

    @property
    def seq_len(self) -> int:
        """Prompt plus response tokens."""
        return self.prompt_len + self.response_len

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step."""
        return self.ppo_epochs * self.global_batch // self.mini_batch_size

    def with_response_len(self, response_len: int) -> WorkloadSpec:
        """A copy with another response length (the drifting signal)."""
        return replace(self, response_len=int(response_len))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> WorkloadSpec:
        """Build from a mapping of the fields above; missing fields take their defaults.

        Raises:
            ValueError: not a mapping, an unknown field, or a bad value (named).
        """
        if not isinstance(d, dict):
            raise ValueError(f"job section 'workload' must be a mapping of workload fields, got {d!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise ValueError(f"unknown workload field(s) {unknown}; valid: {sorted(known)}")
        return cls(**d)
