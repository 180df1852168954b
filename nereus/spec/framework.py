"""What the user's training/serving framework can do: the options the planner may choose among.

A :class:`FrameworkSpec` is a flag set of the job. Each feature either is a flag that applies
whenever it helps (it never makes a plan slower or larger, so it is not searched) or a dimension
of the search (the planner picks per model-stage among the values the framework allows):

=========================  =========  ============================================================
feature                    kind       cost-model consequence (``nereus.cost``)
=========================  =========  ============================================================
``zero_stages``            searched   ZeRO-1 shards the optimizer over DP, ZeRO-2 also gradients,
                                      ZeRO-3/FSDP also parameters (Rajbhandari et al. SC'20; the
                                      Megatron distributed optimizer is ZeRO-1); reduce-scatter /
                                      all-gather instead of the all-reduce, per micro-batch for
                                      ZeRO-2/3 (cost-model.md §2.3, §2.7)
``sequence_parallel``      flag       Megatron SP with TP > 1: the replicated activations
                                      (norm and projection inputs) are sharded over TP; the TP
                                      all-reduce becomes reduce-scatter + all-gather of the same
                                      volume (Korthikanti et al. 2022 Table 2)
``max_virtual_stages``     searched   interleaved 1F1B with ``v`` model chunks per pipeline rank:
                                      bubble ``/v``, point-to-point ``x v``, first-rank activations
                                      ``x (1 + (p-1)/(p·v))`` (Narayanan et al. 2021 §2.2)
``overlap_grad_reduce``    flag       the DP gradient reduce (and ZeRO gathers) overlap with
                                      backward: exposed ``max(0, T_dp - T_bwd)`` (cost-model.md
                                      §2.7, the DDP/ZeRO overlap form), the overlapped compute
                                      18.9% slower (Lee et al. 2025, arXiv:2507.03114)
``overlap_tp_comm``        flag       TP collectives overlap with the layer's GEMMs: exposed
                                      ``max(0, T_tp - T_gemm)`` (Megatron ``tp_comm_overlap``),
                                      the GEMMs it overlaps 18.9% slower
``grad_reduce_bytes``      flag       bytes per gradient element on the wire (2: bf16 reduce, as
                                      Megatron-Core's default ``grad_reduce_in_fp32=False``; 4: fp32)
``offload``                searched   what an idle model-stage does between its runs: ``none`` keeps
                                      weights (and optimizer state) resident, ``host`` offloads them
                                      to host memory and reloads (PCIe both ways), ``drop`` frees
                                      them and reloads (frozen: from a host copy, one way; the
                                      actor's derived copies: re-synced from actor.train). verl's
                                      ``param_offload``/``optimizer_offload`` and vLLM sleep mode.
                                      ``cpu_adam`` (training model-stages only) keeps the optimizer
                                      state in host memory for good and runs the Adam step on the
                                      CPU (ZeRO-Offload, Ren et al. USENIX ATC'21; DeepSpeed
                                      ``offload_optimizer``, OpenRLHF ``--adam_offload``,
                                      Megatron ``--optimizer-cpu-offload``): gradients go to the
                                      host and updated weights come back every optimizer step
``colocate``               searched   model-stages of one stage may run one after another on the same
                                      GPUs (verl's hybrid engine) instead of concurrently on disjoint
                                      GPUs: ``never``, ``auto`` (the search picks per stage) or
                                      ``always``
``model_parallel_train``   flag       whether training may use TP/PP (verl's FSDP and OpenRLHF's
                                      DeepSpeed backends train with DP/ZeRO only)
``pipeline_parallel``      flag       whether the training engine's passes (training, inference)
                                      may use PP (verl FSDP and OpenRLHF DeepSpeed: no)
``uneven_pp``              flag       pipeline ranks may hold unequal layer counts (Megatron
                                      ``decoder_first/last_pipeline_num_layers``); otherwise PP must
                                      divide the layers
``even_dp``                flag       a batch's rows split evenly over the DP replicas of inference and
                                      generation (``nereus run``'s rule, ``run/driver.py``
                                      ``_check_batches``): their dp divides the rows (generation: the
                                      prompts and the rollouts; inference: the global batch; ReMax's
                                      reward pass also the prompts); otherwise any dp (the last
                                      replica takes the remainder)
``persistent_grads``       flag       the training engine's gradient buffer is allocated once and never
                                      freed (Megatron-Core DDP's ``grad_data``): the gradient term is
                                      resident, not transient (:mod:`nereus.cost.train_state`)
``fp32_train_params``      flag       training parameters are held in fp32 as the optimizer's own
                                      master copy, bf16 only per gathered layer (verl's FSDP workers):
                                      no resident bf16 weight term (:mod:`nereus.cost.train_state`)
``train_engine_generation`` flag      generation by the actor's training engine (Hugging Face
                                      ``generate`` on OpenRLHF's non-Ray ``train_ppo`` DeepSpeed
                                      actor), not a vLLM engine: an ``actor.generate`` on
                                      ``actor.train``'s GPUs keeps no weight copy of its own
                                      (:func:`nereus.cost.step.engine_owned`), receives no weight
                                      sync, and prefills the whole micro-batch's prompts in one
                                      pass (no chunked prefill)
``zero_offload_buffers``   flag       DeepSpeed's ZeRO-1/2 optimizer under ``offload_optimizer`` (``cpu_adam``
                                      at ZeRO 1-2) keeps GPU buffers of its own: a resident buffer of
                                      the largest parameter, the reduce buckets, fp64/fp32 gradient
                                      copies and the step's fp32 partition (:mod:`nereus.cost.zero_offload`)
``ref_in_actor``           flag       ``reference.infer`` runs on ``actor.train``'s engine with the LoRA
                                      adapters disabled (verl >= 0.4.0 with LoRA, ``ref_in_actor`` of
                                      ``verl/trainer/ppo/ray_trainer.py``): on the actor's GPUs and
                                      degrees it keeps no weights of its own
                                      (:func:`nereus.cost.step.engine_owned`); its time is counted
``zero3_impl``             flag       how the ZeRO-3 engine moves parameters (:mod:`nereus.cost.zero3`):
                                      ``fsdp`` (default; FSDP/FSDP2: one flat all-gather per wrapped
                                      block, prefetched in forward and backward), ``deepspeed``
                                      (per-parameter gathers as flat rings across nodes, prefetched),
                                      ``deepspeed-2021`` (also fetched on demand in forward, as the
                                      DeepSpeed ZeRO-3 of Narayanan et al. SC'21 Table 2)
=========================  =========  ============================================================

Presets (:data:`FRAMEWORK_PRESETS`), each with its source:

* ``nereus``: the paper's plan space: no ZeRO, no SP, no interleaving, no offload, concurrent
  model-stages on disjoint GPUs (the library's ``FrameworkSpec()`` default, so the paper's results
  and the tests written for them keep their space).
* ``runtime`` (:data:`DEFAULT_FRAMEWORK`, the commands' default): what ``nereus run`` executes and
  ``nereus run --adaptive`` transitions: ZeRO 0-3 for training and ZeRO-3 for infer passes
  (``worker/zero.py``, ``worker/zero3.py``), idle state offloaded to host memory or dropped
  (``worker/memory_pool.py``), colocation (model-stages of a stage taking turns on the same
  workers), inference and generation dp dividing their rows (``even_dp``); no SP, no interleaving, no overlap. Live transitions move ZeRO-1/2/3 slices (DP, TP
  and PP changes), host-pool copies and colocated state (``runtime/transit/flat.py``, ``regroup.py``,
  ``residency.py``); a change the live executor cannot make (ZeRO-1 slices meeting ZeRO-2/3 slices)
  goes through the durable checkpoint.
* ``megatron``: Megatron-LM / Megatron-Core (verl's and NeMo-RL's Megatron backends): distributed
  optimizer (ZeRO-1), SP, interleaving, overlapped grad reduce in bf16, param/optimizer offload
  (verl ``actor.megatron.param_offload``), colocation (verl hybrid engine).
* ``fsdp``: verl's FSDP/FSDP2 backend: FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP-like ZeRO-2, fp32
  reduce (verl ``mixed_precision.reduce_dtype=fp32``), overlapped, param/optimizer offload,
  colocation, no TP/PP for training.
* ``deepspeed``: OpenRLHF's DeepSpeed backend: ZeRO 0-3 (``--zero_stage``), overlapped reduce in
  bf16, ZeRO-3 parameter gathers as DeepSpeed issues them (``zero3_impl="deepspeed"``), Adam offload
  (``--adam_offload``: ``cpu_adam``), colocation (``--colocate_all_models``), vLLM sleep
  (``--vllm_enable_sleep``), no TP/PP for training.
* ``generic``: every feature (the widest space).

Raises: every constructor validates its fields (ValueError naming the field, the value and what
is valid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from nereus.spec.engine import EngineCosts

__all__ = ["FrameworkSpec", "FRAMEWORK_PRESETS", "get_framework", "OFFLOAD_MODES", "COLOCATE_MODES",
           "ZERO_STAGES", "ZERO3_IMPLS", "DEFAULT_FRAMEWORK"]

OFFLOAD_MODES = ("none", "host", "drop", "cpu_adam")
COLOCATE_MODES = ("never", "auto", "always")
ZERO_STAGES = (0, 1, 2, 3)
ZERO3_IMPLS = ("fsdp", "deepspeed", "deepspeed-2021")


@dataclass(frozen=True)
class FrameworkSpec:
    """Features the user's framework supports (see the module docstring for each one's meaning).

    Attributes:
        name: preset name or ``custom``.
        zero_stages: ZeRO stages training may use (subset of 0-3, searched).
        sequence_parallel: Megatron sequence parallelism whenever TP > 1.
        max_virtual_stages: largest interleaving degree ``v`` (1: plain 1F1B).
        overlap_grad_reduce: DP/ZeRO communication overlapped with backward.
        overlap_tp_comm: TP collectives overlapped with GEMMs.
        grad_reduce_bytes: bytes per gradient element reduced across DP; None: the workload's
            ``grad_bytes`` (fp32 main gradients reduced as stored).
        offload: state-placement modes model-stages may use (subset of ``none, host, drop, cpu_adam``,
            searched; ``cpu_adam`` applies to training model-stages only).
        colocate: ``never``, ``auto`` or ``always`` (model-stages of one stage sharing GPUs in turn).
        model_parallel_train: whether training may use TP > 1 or PP > 1.
        uneven_pp: PP degrees that do not divide the layers are allowed (the first ranks hold one
            layer more).
        shared_engine: an inference model-stage of a trained model (``actor.infer``, ``critic.infer``)
            runs on that model's training engine when it has the same GPUs (verl's workers,
            OpenRLHF's DeepSpeed actor and critic): its weights are the training engine's, not a
            second resident copy.
        pipeline_parallel: whether training and inference model-stages (the training engine's passes)
            may use PP > 1 (verl's FSDP and OpenRLHF's DeepSpeed engines have no pipeline; generation
            is vLLM's and keeps its own degrees).
        drop_model_stages: the model-stages that may use ``drop`` when ``offload`` allows it (None:
            every non-training model-stage; verl, for example, frees only the rollout engine's
            weights, so its frameworks list ``("actor.generate",)``).
        even_dp: inference and generation dp must divide their rows (module docstring).
        train_engine_generation: generation runs on the actor's training engine (module docstring).
        ref_in_actor: ``reference.infer`` runs on ``actor.train``'s engine, LoRA adapters disabled
            (module docstring).
        zero3_impl: the ZeRO-3 implementation's parameter-traffic schedule, one of
            :data:`ZERO3_IMPLS` (:mod:`nereus.cost.zero3`; ``fsdp``: the default model).
        persistent_grads: the gradient buffer stays allocated between steps (resident gradients).
        zero_offload_buffers: DeepSpeed ZeRO-1/2 ZeRO-Offload's own GPU buffers are counted.
        fp32_train_params: training parameters are fp32 (the optimizer's master copy); bf16 copies
            exist per gathered layer only.
        engine: the engines' behaviour and fixed costs (:class:`nereus.spec.engine.EngineCosts`:
            generation to the longest response, per-decode-step and per-call overheads, per-layer
            launch latency, padding, fixed per-step cost); None: none of them (the old model).

    Raises:
        ValueError: a field outside its valid values.
    """

    name: str = "nereus"
    zero_stages: tuple = (0,)
    sequence_parallel: bool = False
    max_virtual_stages: int = 1
    overlap_grad_reduce: bool = False
    overlap_tp_comm: bool = False
    grad_reduce_bytes: int | None = None
    offload: tuple = ("none",)
    colocate: str = "never"
    model_parallel_train: bool = True
    uneven_pp: bool = False
    drop_model_stages: tuple | None = None
    pipeline_parallel: bool = True
    shared_engine: bool = False
    train_engine_generation: bool = False
    ref_in_actor: bool = False
    zero3_impl: str = "fsdp"
    even_dp: bool = False
    persistent_grads: bool = False
    fp32_train_params: bool = False
    zero_offload_buffers: bool = False
    engine: EngineCosts | None = None

    def __post_init__(self) -> None:
        if self.engine is not None and not isinstance(self.engine, EngineCosts):
            object.__setattr__(self, "engine", EngineCosts.from_dict(self.engine))
        if self.drop_model_stages is not None:
            if isinstance(self.drop_model_stages, str) or not all(
                    isinstance(m, str) and "." in m and not m.endswith(".train") for m in self.drop_model_stages):
                raise ValueError(f"framework field 'drop_model_stages' must be a list of non-training model-stage "
                                 f"names such as 'actor.generate', or null, got {self.drop_model_stages!r}")
            object.__setattr__(self, "drop_model_stages", tuple(self.drop_model_stages))
        object.__setattr__(self, "zero_stages", tuple(self.zero_stages))
        object.__setattr__(self, "offload", tuple(self.offload))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"framework field 'name' must be a non-empty string, got {self.name!r}")
        if not self.zero_stages or any(z not in ZERO_STAGES or isinstance(z, bool) for z in self.zero_stages):
            raise ValueError(f"framework field 'zero_stages' must be a non-empty subset of {list(ZERO_STAGES)}, "
                             f"got {list(self.zero_stages)!r}")
        if not self.offload or any(o not in OFFLOAD_MODES for o in self.offload):
            raise ValueError(f"framework field 'offload' must be a non-empty subset of {list(OFFLOAD_MODES)}, "
                             f"got {list(self.offload)!r}")
        if self.zero3_impl not in ZERO3_IMPLS:
            raise ValueError(f"framework field 'zero3_impl' must be one of {list(ZERO3_IMPLS)}, "
                             f"got {self.zero3_impl!r}")
        if self.colocate not in COLOCATE_MODES:
            raise ValueError(f"framework field 'colocate' must be one of {list(COLOCATE_MODES)}, "
                             f"got {self.colocate!r}")
        v = self.max_virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"framework field 'max_virtual_stages' must be an integer >= 1, got {v!r}")
        g = self.grad_reduce_bytes
        if g is not None and (isinstance(g, bool) or g not in (2, 4)):
            raise ValueError(f"framework field 'grad_reduce_bytes' must be 2 (bf16), 4 (fp32) or null, got {g!r}")
        for f in ("sequence_parallel", "overlap_grad_reduce", "overlap_tp_comm", "model_parallel_train",
                  "uneven_pp", "pipeline_parallel", "shared_engine", "train_engine_generation", "ref_in_actor",
                  "even_dp", "persistent_grads", "fp32_train_params", "zero_offload_buffers"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"framework field {f!r} must be true or false, got {getattr(self, f)!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["zero_stages"] = list(self.zero_stages)
        d["offload"] = list(self.offload)
        if self.drop_model_stages is not None:
            d["drop_model_stages"] = list(self.drop_model_stages)
        if self.pipeline_parallel:  # the defaults: left out so existing documents read the same
            del d["pipeline_parallel"]
        if not self.shared_engine:
            del d["shared_engine"]
        if self.zero3_impl == "fsdp":
            del d["zero3_impl"]
        for f in ("even_dp", "persistent_grads", "fp32_train_params", "train_engine_generation", "ref_in_actor",
                  "zero_offload_buffers"):
            if not d[f]:
                del d[f]
        if self.engine is None:
            d.pop("engine")
        return d

    @classmethod
    def from_dict(cls, d) -> FrameworkSpec:
        """From a preset name or a mapping (``{"preset": "megatron", ...overrides}`` or all fields).

        Raises:
            ValueError: unknown preset or field, or an invalid value.
        """
        if isinstance(d, str):
            return get_framework(d)
        if not isinstance(d, dict):
            raise ValueError(f"job section 'framework' must be a preset name {sorted(FRAMEWORK_PRESETS)} or a "
                             f"mapping of framework fields, got {d!r}")
        d = dict(d)
        base = get_framework(d.pop("preset")) if "preset" in d else cls()
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise ValueError(f"unknown framework field(s) {unknown}; valid: ['preset'] + {sorted(known)}")
        for k in ("zero_stages", "offload") + (("drop_model_stages",) if d.get("drop_model_stages") is not None else ()):
            if k in d and not isinstance(d[k], (list, tuple)):
                raise ValueError(f"framework field {k!r} must be a list, got {d[k]!r}")
        if "name" not in d and d:
            d["name"] = "custom" if base.name == "nereus" else f"{base.name}+custom"
        return replace(base, **d)

    def allows_offload(self) -> bool:
        return any(o != "none" for o in self.offload)

    def offload_modes(self, model_stage: str) -> tuple[str, ...]:
        """Offload modes ``model_stage`` may use: the framework's ``offload`` less ``drop`` for
        training model-stages (their state is the run's only copy) and for model-stages outside
        ``drop_model_stages``, and less ``cpu_adam`` for model-stages that do not train (no
        optimizer)."""
        train = model_stage.endswith(".train")
        return tuple(o for o in self.offload
                     if (o != "drop" or (not train and (self.drop_model_stages is None
                                                         or model_stage in self.drop_model_stages)))
                     and (o != "cpu_adam" or train))


FRAMEWORK_PRESETS: dict[str, FrameworkSpec] = {
    "nereus": FrameworkSpec(),
    "runtime": FrameworkSpec(name="runtime", zero_stages=(0, 1, 2, 3), offload=("none", "host", "drop"), colocate="auto",
                             even_dp=True),
    "megatron": FrameworkSpec(name="megatron", zero_stages=(0, 1), sequence_parallel=True, max_virtual_stages=4,
                              overlap_grad_reduce=True, grad_reduce_bytes=2, offload=("none", "host", "drop"),
                              colocate="auto", uneven_pp=True),
    "fsdp": FrameworkSpec(name="fsdp", zero_stages=(2, 3), overlap_grad_reduce=True, grad_reduce_bytes=4,
                          offload=("none", "host", "drop"), colocate="auto", model_parallel_train=False,
                          pipeline_parallel=False),
    "deepspeed": FrameworkSpec(name="deepspeed", zero_stages=(0, 1, 2, 3), overlap_grad_reduce=True,
                               grad_reduce_bytes=2, offload=("none", "host", "drop", "cpu_adam"), colocate="auto",
                               model_parallel_train=False, pipeline_parallel=False, zero3_impl="deepspeed",
                               zero_offload_buffers=True),
    "generic": FrameworkSpec(name="generic", zero_stages=(0, 1, 2, 3), sequence_parallel=True, max_virtual_stages=4,
                             overlap_grad_reduce=True, overlap_tp_comm=True, grad_reduce_bytes=2,
                             offload=("none", "host", "drop", "cpu_adam"), colocate="auto", uneven_pp=True),
}


#: the plan space ``nereus plan``, ``nereus simulate`` and ``nereus run`` use unless ``--framework``
#: (or a job file's ``framework``) says otherwise: what the runtime executes and live-transitions
DEFAULT_FRAMEWORK = "runtime"


def get_framework(name: str) -> FrameworkSpec:
    """Preset by name.

    Raises:
        ValueError: unknown name (the valid ones are listed).
    """
    if name not in FRAMEWORK_PRESETS:
        raise ValueError(f"unknown framework {name!r}; valid: {sorted(FRAMEWORK_PRESETS)}")
    return FRAMEWORK_PRESETS[name]
