"""How an RL framework's engines behave beyond the kernels: the terms that make real RL steps slower
than the roofline (issue 27), as a flag set of the job's framework (``FrameworkSpec.engine``).

Every field defaults to *off* (the old behaviour: generation at the mean response length, no fixed
costs), so jobs that do not set an :class:`EngineCosts` keep their times; the ``cpu`` GPU preset of
the Nereus runtime never gets one. :mod:`nereus.cost.engine_terms` turns these into op-class seconds;
each overhead is its own op class with efficiency 1 by default, so calibration scales it like any
other class (``time = base / efficiency``).

=====================  ====================================================================
field                  meaning (units)
=====================  ====================================================================
``generation``         ``mean``: every response at the workload's mean length (old model);
                       ``longest``: a synchronous batch ends with its longest response
                       (``WorkloadSpec.response_len_max``) and the engine batches
                       continuously: ``max(L_max, ceil(n·L_mean/c))`` decode steps for ``n``
                       sequences at concurrency ``c``
``decode_step_s``      engine seconds per decode step outside the GPU kernels (scheduler,
                       sampler, kernel launches in eager mode); op class ``decode_overhead``
``decode_seq_s``       engine seconds per running sequence per decode step (per-sequence
                       CPU work: sampling, log-probs, output processing); ``decode_overhead``
``generate_call_s``    seconds per generate call per step (engine wake / KV-cache re-init,
                       loading the synced weights into the engine); op class ``engine``
``layer_pass_s``       seconds per layer per micro-batch pass in training/inference
                       engines (eager launch and framework hooks: a fixed latency per layer
                       call that small micro-batches do not hide); op class ``launch``
``step_s``             fixed seconds per RL step (data collation, reward, advantages, Ray
                       dispatch); op class ``framework``
``tp_overlap_share``   the share of TP communication an overlapped implementation can hide
                       (1: all, as Transformer Engine's userbuffers; torch's async TP in
                       torchtitan: :data:`ASYNC_TP_SHARE`)
``pad_to``             training/inference passes compute on this many tokens per sequence
                       (verl ``use_remove_padding=False`` pads to ``max_prompt_length +
                       max_response_length``); None: the mean sequence length
=====================  ====================================================================

Raises: the constructor validates every field (ValueError naming the field, the value and what is
valid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["EngineCosts", "GENERATION_MODES", "ASYNC_TP_SHARE", "ENGINE_PRESETS", "get_engine"]

GENERATION_MODES = ("mean", "longest")
#: share of the TP communication torch's async TP hides in torchtitan (Llama3 70B on 256 H100,
#: FSDP 32 x TP 8, full activation checkpointing, local batch 16: 597.3 tokens/s with vanilla TP,
#: 652.4 with async TP, pytorch/torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``):
#: the cost model gives that step 25.5 s with 6.7 s of exposed TP all-reduces, and the measured
#: 1.092x speedup hides 2.6 s of them net of the overlap slowdown: 0.39. The same table's 8B row
#: (measured 1.10x) is predicted at 1.12x with it.
ASYNC_TP_SHARE = 0.39
_SECONDS = ("decode_step_s", "decode_seq_s", "generate_call_s", "layer_pass_s", "step_s")


@dataclass(frozen=True)
class EngineCosts:
    """Engine behaviour and fixed costs of an RL framework (module docstring: each field).

    Raises:
        ValueError: a field outside its valid values.
    """

    generation: str = "mean"
    decode_step_s: float = 0.0
    decode_seq_s: float = 0.0
    generate_call_s: float = 0.0
    layer_pass_s: float = 0.0
    step_s: float = 0.0
    pad_to: int | None = None
    tp_overlap_share: float = 1.0
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.generation not in GENERATION_MODES:
            raise ValueError(f"engine field 'generation' must be one of {list(GENERATION_MODES)}, "
                             f"got {self.generation!r}")
        for f in _SECONDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"engine field {f!r} must be a number of seconds >= 0, got {v!r}")
        t = self.tp_overlap_share
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"engine field 'tp_overlap_share' must be a number in (0, 1], got {t!r}")
        p = self.pad_to
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p <= 0):
            raise ValueError(f"engine field 'pad_to' must be a positive integer (tokens) or null, got {p!r}")

    @property
    def active(self) -> bool:
        """Whether any term differs from the old model."""
        return self != replace(EngineCosts(), name=self.name)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> EngineCosts:
        """From a preset name or a mapping (``{"preset": name, ...overrides}`` or fields).

        Raises:
            ValueError: unknown preset or field, or an invalid value.
        """
        if isinstance(d, str):
            return get_engine(d)
        if not isinstance(d, dict):
            raise ValueError(f"framework field 'engine' must be a preset name {sorted(ENGINE_PRESETS)} or a "
                             f"mapping of engine fields, got {d!r}")
        d = dict(d)
        base = get_engine(d.pop("preset")) if "preset" in d else cls()
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise ValueError(f"unknown engine field(s) {unknown}; valid: ['preset'] + {sorted(known)}")
        return replace(base, **d)


#: Presets. ``verl-eager``: verl with vLLM in eager mode (``enforce_eager=True``,
#: ``free_cache_engine=True``, verl <= 0.2 defaults), FSDP training engines. Figures:
#:
#: * ``decode_step_s`` 2 ms, ``generate_call_s`` 12.5 s: the two Qwen2.5-0.5B PPO logs of
#:   ``eric-haibin-lin/verl-data`` (identical settings but the response cap, 256 vs 512, and the
#:   longest response hits the cap nearly every step) measured 17.2 and 17.7 s of ``timing/gen``
#:   (medians over steps): ``F + 256·s`` and ``F + 512·s`` give ``s`` = 2 ms per decode step and
#:   ``F`` = 16.7 s per call. That timer also covers the old-log-prob forward (3.6 s in the cost
#:   model) and the GPU's prefill and decode (about 0.6 s), leaving 12.5 s for the engine's wake
#:   (KV-cache re-allocation) and weight loading. 2 ms per step is also what eager-mode launches
#:   cost: 24 layers x ~15 kernels x ~5 us;
#: * ``layer_pass_s`` 1.7 ms: the four forward and training stages of the cap-256 log (reference
#:   forward 4.5 s, values 6.0 s, critic update 16.0 s, actor update 20.4 s; 64-128 micro-batches of
#:   2-4 x 768 padded tokens) exceed the cost model's kernel time by 1.4, 1.6, 1.8 and 2.1 ms per
#:   layer per pass (HF layers in eager PyTorch under FSDP): their median;
#: * ``step_s`` 0.5 s: ``timing/adv`` (0.05-0.9 s in these logs) and the gap between the printed
#:   step and the sum of its stages (0.0-0.1 s).
#:
#: ``verl-eager-rocm``: the same on AMD GPUs (vLLM's ROCm build), plus ``decode_seq_s`` 0.107 ms
#: per running sequence per decode step: the two deepseek-llm-7b-chat logs on 8 MI300X of
#: ``yushengsu-thu/verl_training_log`` (PPO, rollout TP 4, 512 sequences per engine; GRPO, TP 2,
#: 1280 per engine) measured 7.3 s and 18.4 s of generation beyond the terms above over ``S·r`` =
#: 497 x 140 and 675 x 248 sequence-steps (the cost model's ``S`` and ``r``): 0.105 and 0.110 ms
#: each, a per-sequence cost of the engine loop the CUDA 0.5B logs do not show (their generation
#: time does not grow with the response cap).
#:
#: These presets are fitted on the validation runs (benchmarks/validate_rl_steps.py says so
#: in its report); a job on other hardware should calibrate them (their op classes are calibrated
#: like any other).
ENGINE_PRESETS: dict[str, EngineCosts] = {
    "none": EngineCosts(name="none"),
    "verl-eager": EngineCosts(name="verl-eager", generation="longest", decode_step_s=2e-3, generate_call_s=12.5,
                              layer_pass_s=1.7e-3, step_s=0.5),
}
ENGINE_PRESETS["verl-eager-rocm"] = replace(ENGINE_PRESETS["verl-eager"], name="verl-eager-rocm", decode_seq_s=0.107e-3)


def get_engine(name: str) -> EngineCosts:
    """Preset by name.

    Raises:
        ValueError: unknown name (the valid ones are listed).
    """
    if name not in ENGINE_PRESETS:
        raise ValueError(f"unknown engine preset {name!r}; valid: {sorted(ENGINE_PRESETS)}")
    return ENGINE_PRESETS[name]
