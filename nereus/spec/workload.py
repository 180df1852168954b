"""The RL workload: algorithm, batch sizes, lengths, precision and recompute options.

Batch terms (the field's usual meaning, as in Megatron-LM and verl):

* global batch: ``prompts_per_step · samples_per_prompt`` sequences trained on per RL step;
* mini-batch: ``mini_batch_size`` sequences per optimizer update (global, across DP);
* micro-batch: sequences one replica processes in one forward/backward (``b``); a replica does
  ``a`` gradient-accumulation micro-batches per mini-batch, with ``dp · b · a = mini_batch_size``;
* updates per step: ``ppo_epochs · global_batch / mini_batch_size``.

ReMax adds one greedy rollout per prompt during generation (its baseline), not to training.

Lengths: time is taken at the mean ``response_len``; memory at ``response_len_max`` when set (the
longest response a micro-batch or a KV cache must hold: the maximum, or a percentile of a length
distribution, :func:`response_len_stats`), else at the mean. ``memory_fraction`` is the share of
each GPU's memory a plan may use (vLLM's ``gpu_memory_utilization``); unset, the cost model keeps
10% free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["WorkloadSpec", "ACTIVATION_MODELS", "ALGORITHMS", "GEMM_PRECISIONS", "FP8_RECIPES", "ATTENTION_KERNELS",
           "VLLM_MEMORY_RULES", "LOGITS_KERNELS", "RECOMPUTE_MODES", "OPTIONAL_FIELDS", "read_response_lengths",
           "response_len_stats"]

ALGORITHMS = ("ppo", "grpo", "remax")
RECOMPUTE_MODES = ("none", "selective", "full", "auto")
#: fields left out of :meth:`WorkloadSpec.to_dict` while unset (None)
OPTIONAL_FIELDS = ("response_len_max", "memory_fraction", "gemm_precision", "attention_kernel", "lora_rank",
                   "rollout_memory_fraction", "fp8_recipe", "vllm_memory_rule", "activation_model",
                   "logits_kernel")
#: values of ``activation_model`` (None = Korthikanti et al.'s accounting, ``nereus.cost.memory``)
ACTIVATION_MODELS = ("runtime",)
#: values of ``gemm_precision`` (None = bf16)
GEMM_PRECISIONS = ("bf16", "fp8")
#: values of ``fp8_recipe`` (None = Transformer Engine: casts fused into the neighbouring kernels)
FP8_RECIPES = ("tensorwise", "rowwise")
#: values of ``attention_kernel`` (None = flash)
ATTENTION_KERNELS = ("flash", "flash_triton", "unfused", "unfused_dropout")
#: values of ``vllm_memory_rule`` (None = startup_check; :mod:`nereus.cost.vllm_startup`)
VLLM_MEMORY_RULES = ("startup_check", "device_total", "free_share")
#: values of ``logits_kernel`` (None = fp32 logits and cross-entropy; :mod:`nereus.cost.logits`)
LOGITS_KERNELS = ("flash_ce", "flash_ce_entropy")


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
        reference_model: whether ``reference.infer`` runs (a frozen reference model's log-probs for a
            KL term). False where the framework builds no reference: verl without
            ``actor.use_kl_loss`` and ``algorithm.use_kl_in_reward`` (``need_reference_policy`` in
            ``verl/trainer/ppo/utils.py``), OpenRLHF with ``--algo.kl.init_coef`` 0
            (``openrlhf/cli/train_ppo_ray.py`` builds ``ref_model`` only for ``init_coef > 0``). Left out
            of :meth:`to_dict` while True (the default).
        asynchronous: overlap generation of step k+1 with training of step k (one-step off-policy).
        param_bytes, grad_bytes: bytes per parameter of weights and gradients (bf16 weights, fp32
            main gradients as Megatron keeps them).
        optimizer_bytes: Adam state per parameter (fp32 master, exp_avg, exp_avg_sq = 12).
        kv_bytes: bytes per KV-cache element (bf16 = 2).
        response_len_max: response tokens memory is sized for (>= ``response_len``); None: the mean.
        memory_fraction: share of each GPU's memory a plan may use, in (0, 1] (vLLM's
            ``gpu_memory_utilization``); None: the cost model's default headroom (10%).
        gemm_precision: precision of the linear layers' GEMMs in training and inference: ``bf16``
            (None, the default) or ``fp8`` (Transformer Engine style: GEMM inputs in FP8 on the GPU's
            FP8 peak, op class ``gemm_fp8``; attention, memory-bound kernels, weights, gradients and
            optimizer state stay as above, so memory is unchanged).
        fp8_recipe: with ``gemm_precision="fp8"``, how the GEMM operands are scaled and cast
            (:mod:`nereus.cost.fp8`): None (Transformer Engine: casts fused into neighbouring
            kernels, not charged), ``tensorwise`` or ``rowwise`` (torchao ``Float8LinearConfig``
            recipes: their cast kernels' HBM traffic is charged, rowwise's larger).
        attention_kernel: how the training engine's passes (training and inference
            model-stages) compute attention; generation (vLLM) always runs its own fused kernel:
            ``flash`` (None, the default: a FlashAttention-2-class fused kernel),
            ``flash_triton`` (FlashAttention written in Triton, e.g. llm-foundry's
            ``attn_impl: triton``), ``unfused`` (the score matrix is materialised in HBM: batched
            GEMMs and a fused scale-mask-softmax, as Megatron-LM without flash-attention) or
            ``unfused_dropout`` (the same with dropout on the attention probabilities).
            :mod:`nereus.cost.latency` says what each costs; the unfused ones also store the
            ``s x s`` scores (:func:`nereus.cost.memory.activation_bytes_per_layer`).
        lora_rank: LoRA adapters of this rank on every linear layer of the trained models (verl
            ``actor_rollout_ref.model.lora_rank``, OpenRLHF ``--lora_rank``; target ``all-linear``;
            Hu et al. 2021): the base weights are frozen, gradients and optimizer state exist for the
            adapters only, and the weight sync moves the adapters (:mod:`nereus.cost.lora`). None:
            full fine-tuning.
        rollout_memory_fraction: vLLM's ``gpu_memory_utilization`` of the generation engine as the
            user set it: the engine pre-allocates this share of each GPU's memory (weights, profiled
            activations, KV blocks) whatever the batch needs, and its concurrency is capped by the KV
            blocks that fit, the rest waiting (preempted) for blocks (:mod:`nereus.cost.vllm_memory`).
            None: the engine is sized to what its concurrency needs (an export sets the fraction).
        vllm_memory_rule: what the vLLM version the job runs does with the memory co-located
            model-stages hold when it starts (:mod:`nereus.cost.vllm_startup`): ``startup_check``
            (None: vLLM >= 0.9.1 holds ``f·M`` and refuses to start with less free),
            ``device_total`` (vLLM 0.8: fills the device up to ``f·M`` counting what is there) or
            ``free_share`` (verl's patched vLLM <= 0.6.3: the KV cache is ``f`` of what is left).
        activation_model: which tensors a training engine holds for backward and for its gradient
            reduction: None (Korthikanti et al. 2022's accounting of a Megatron-style engine,
            :func:`nereus.cost.memory.activation_bytes_per_layer`) or ``runtime`` (the ``nereus run``
            runtime's own Llama shard and gradient buffers, :mod:`nereus.cost.runtime_memory`; set by
            ``nereus.runtime.run.device_model.runtime_job``).
        logits_kernel: how the training engine's passes hold the language-model head's logits
            (:mod:`nereus.cost.logits`): None (fp32 logits and cross-entropy, Megatron's
            accounting), ``flash_ce`` (bf16 logits read by flash-attn's Triton cross-entropy, the
            entropy by a ``torch.compile``-fused reduction, the gradient written in place: verl's
            FSDP engine with padding removal) or ``flash_ce_entropy`` (the same with an entropy term
            in the loss, whose gradient and the cross-entropy's are separate buffers).

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
    reference_model: bool = True
    asynchronous: bool = False
    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    kv_bytes: int = 2
    response_len_max: int | None = None
    memory_fraction: float | None = None
    gemm_precision: str | None = None
    attention_kernel: str | None = None
    lora_rank: int | None = None
    rollout_memory_fraction: float | None = None
    fp8_recipe: str | None = None
    vllm_memory_rule: str | None = None
    activation_model: str | None = None
    logits_kernel: str | None = None

    def __post_init__(self) -> None:
        if self.logits_kernel is not None and self.logits_kernel not in LOGITS_KERNELS:
            raise ValueError(f"workload field 'logits_kernel' must be one of {LOGITS_KERNELS} or null "
                             f"(fp32 logits), got {self.logits_kernel!r}")
        if self.vllm_memory_rule is not None and self.vllm_memory_rule not in VLLM_MEMORY_RULES:
            raise ValueError(f"workload field 'vllm_memory_rule' must be one of {VLLM_MEMORY_RULES} or null "
                             f"(startup_check), got {self.vllm_memory_rule!r}")
        if self.activation_model is not None and self.activation_model not in ACTIVATION_MODELS:
            raise ValueError(f"workload field 'activation_model' must be one of {ACTIVATION_MODELS} or null "
                             f"(Korthikanti et al.), got {self.activation_model!r}")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"workload field 'fp8_recipe' must be one of {FP8_RECIPES} or null (Transformer "
                             f"Engine), got {self.fp8_recipe!r}")
        if self.attention_kernel is not None and self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"workload field 'attention_kernel' must be one of {ATTENTION_KERNELS} or null "
                             f"(flash), got {self.attention_kernel!r}")
        if self.gemm_precision is not None and self.gemm_precision not in GEMM_PRECISIONS:
            raise ValueError(f"workload field 'gemm_precision' must be one of {GEMM_PRECISIONS} or null (bf16), "
                             f"got {self.gemm_precision!r}")
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
        for f in ("reward_model", "reference_model", "asynchronous"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"workload field {f!r} must be a JSON boolean (true or false), got "
                                 f"{getattr(self, f)!r}")
        if self.global_batch % self.mini_batch_size != 0:
            raise ValueError(
                f"workload field 'mini_batch_size'={self.mini_batch_size} must divide the global batch "
                f"prompts_per_step*samples_per_prompt={self.global_batch}")
        m = self.response_len_max
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < self.response_len):
            raise ValueError(f"workload field 'response_len_max' must be an integer >= response_len "
                             f"({self.response_len}) or null, got {m!r}")
        f = self.memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"workload field 'memory_fraction' must be a number in (0, 1] (the share of each "
                             f"GPU's memory a plan may use) or null, got {f!r}")
        r = self.lora_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"workload field 'lora_rank' must be an integer >= 1 (LoRA adapter rank) or null "
                             f"(full fine-tuning), got {r!r}")
        f = self.rollout_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1):
            raise ValueError(f"workload field 'rollout_memory_fraction' must be a number in (0, 1) (vLLM's "
                             f"gpu_memory_utilization) or null, got {f!r}")

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
    def memory_response_len(self) -> int:
        """Response tokens memory is sized for: ``response_len_max`` when set, else the mean."""
        return self.response_len_max if self.response_len_max is not None else self.response_len

    @property
    def memory_seq_len(self) -> int:
        """Prompt plus the response tokens memory is sized for."""
        return self.prompt_len + self.memory_response_len

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step."""
        return self.ppo_epochs * self.global_batch // self.mini_batch_size

    def with_response_len(self, response_len: int) -> WorkloadSpec:
        """A copy with another (mean) response length (the drifting signal); a set
        ``response_len_max`` is raised to it if the mean grows past it."""
        r = int(response_len)
        m = None if self.response_len_max is None else max(self.response_len_max, r)
        return replace(self, response_len=r, response_len_max=m)

    def to_dict(self) -> dict:
        """The fields as a mapping; unset optional fields (:data:`OPTIONAL_FIELDS`) and
        ``reference_model`` while True are left out."""
        return {k: v for k, v in asdict(self).items()
                if not (k in OPTIONAL_FIELDS and v is None) and not (k == "reference_model" and v)}

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


def read_response_lengths(path: str | Path) -> list[int]:
    """Per-sample response lengths (tokens) from a file: one integer per line, or a CSV whose header
    has a ``response_length`` (or ``response_len``) column. Blank lines and ``#`` comments are skipped.

    Raises:
        ValueError: missing file, no lengths, or a value that is not an integer >= 1 (file and line named).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"response-length file {str(p)!r} does not exist")
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"response-length file {str(p)!r} cannot be read as text: {e}") from e
    col, out = None, []
    for i, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")]
        if col is None and not out and not cells[0].lstrip("-").isdigit():
            names = [c.lower() for c in cells]
            col = next((names.index(n) for n in ("response_length", "response_len") if n in names), None)
            if col is None:
                raise ValueError(f"response-length file {str(p)!r} line {i}: header {line!r} has no "
                                 "'response_length' column (or give one integer per line)")
            continue
        v = cells[col if col is not None else 0] if len(cells) > (col or 0) else ""
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"response-length file {str(p)!r} line {i}: response length {v!r} must be an "
                             "integer >= 1")
        out.append(int(v))
    if not out:
        raise ValueError(f"response-length file {str(p)!r} holds no response lengths")
    return out


def response_len_stats(lengths, percentile: float = 100.0) -> tuple[int, int]:
    """``(mean rounded to the nearest token, nearest-rank percentile)`` of response lengths: the
    ``ceil(p/100 · n)``-th smallest (``p = 100``: the maximum).

    Raises:
        ValueError: no lengths or a percentile outside (0, 100].
    """
    xs = sorted(int(x) for x in lengths)
    if not xs:
        raise ValueError("response lengths: need at least one length")
    if isinstance(percentile, bool) or not 0 < percentile <= 100:
        raise ValueError(f"response-length percentile must be in (0, 100], got {percentile!r}")
    rank = max(1, math.ceil(percentile / 100.0 * len(xs)))
    mean = int(math.floor(sum(xs) / len(xs) + 0.5))
    return mean, max(xs[rank - 1], mean)
