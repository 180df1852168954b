"""Plans as data: a candidate per model-stage with its GPU set, and the predicted costs.

These types sit in :mod:`nereus.spec`, below both the cost model (:mod:`nereus.cost`, which fills
:class:`StageEstimate` and :class:`Plan`) and the planner (:mod:`nereus.planner`, which searches
over :class:`Candidate`).

GPU-set convention (used by placement, the transition planner and the runtime): a candidate with
degrees (tp, pp, dp) owns ``gpus``, a tuple of ``tp·pp·dp`` global GPU ids ordered replica-major,
then pipeline rank, then tensor rank::

    gpus[(d * pp + p) * tp + t]   is DP replica d, PP rank p, TP rank t.

So replica ``d`` (one EMU) owns ``gpus[d*tp*pp : (d+1)*tp*pp]``.

Plans serialize to JSON (``nereus plan --json`` writes them; ``nereus transition`` reads them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from nereus.spec.framework import OFFLOAD_MODES

__all__ = ["Candidate", "StageEstimate", "Plan", "load_plan", "read_plan_document"]


@dataclass(frozen=True)
class Candidate:
    """``π_M = <tp, pp, dp, R>`` for one model-stage, plus its batch choices.

    Attributes:
        model_stage: e.g. ``"actor.train"``.
        tp, pp, dp: tensor, pipeline and data parallel degrees.
        micro_batch: per-replica micro-batch ``b`` (train/infer); 0 for generation.
        grad_accum: gradient-accumulation steps ``a`` per mini-batch (train); ``dp·b·a`` is the
            mini-batch. 0 when not training.
        recompute: ``none``, ``selective`` or ``full`` (train); ``none`` otherwise.
        concurrency: generation only: most sequences one replica decodes at once (KV-cache bound).
        zero: ZeRO stage of a training model-stage across its DP group (0: none; 1: optimizer
            sharded; 2: and gradients; 3: and parameters, FSDP FULL_SHARD); 0 otherwise.
        offload: where the model-stage's state lives: ``none`` (resident on its GPUs), ``host``
            (offloaded to host memory while idle and reloaded), ``drop`` (freed while idle and
            reloaded) or ``cpu_adam`` (training only: weights resident, optimizer state in host
            memory with the Adam step on the CPU, ZeRO-Offload).
        vpp: interleaved pipeline: model chunks per pipeline rank (``v``; 1 = plain 1F1B).
        gpus: the GPU set ``R`` in the order above; empty before placement.
        cp: sequence-split degree of a training or inference model-stage (verl's Ulysses
            ``ulysses_sequence_parallel_size``, Megatron's ``context_parallel_size``;
            :mod:`nereus.cost.seqpar`): each sequence is cut over ``cp`` GPUs, so a replica has
            ``tp·pp·cp`` GPUs and ``dp`` counts replicas (verl: ``dp = N / (tp·pp·cp)``). 1 = none.
            The planner does not search it; imports of users' layouts set it.

    Raises:
        ValueError: degrees not positive, an unknown zero/offload value, or a GPU set of the wrong
            size or with repeats.
    """

    model_stage: str
    tp: int
    pp: int
    dp: int
    micro_batch: int = 0
    grad_accum: int = 0
    recompute: str = "none"
    concurrency: int = 0
    zero: int = 0
    offload: str = "none"
    vpp: int = 1
    gpus: tuple[int, ...] = ()
    cp: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "vpp", "cp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"candidate {self.model_stage}: {f} must be a positive integer, got {v!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"candidate {self.model_stage}: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"candidate {self.model_stage}: offload must be one of {list(OFFLOAD_MODES)}, "
                             f"got {self.offload!r}")
        if self.offload == "cpu_adam" and not self.model_stage.endswith(".train"):
            raise ValueError(f"candidate {self.model_stage}: offload 'cpu_adam' keeps an optimizer on the CPU and "
                             f"applies to training model-stages only; valid here: 'none', 'host', 'drop'")
        if self.cp > 1 and self.model_stage.endswith(".generate"):
            raise ValueError(f"candidate {self.model_stage}: cp={self.cp}: generation engines do not split "
                             f"sequences; valid: cp=1")
        if self.gpus:
            if len(self.gpus) != self.num_gpus:
                raise ValueError(f"candidate {self.model_stage}: GPU set has {len(self.gpus)} ids, "
                                 f"tp*pp*dp{'*cp' if self.cp > 1 else ''} = {self.num_gpus}")
            if len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"candidate {self.model_stage}: GPU set repeats an id: {self.gpus}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def idle_off_gpu(self) -> bool:
        """Whether the model-stage's state leaves its GPUs between runs (``offload`` ``host`` or
        ``drop``); ``cpu_adam`` keeps the weights on the GPUs."""
        return self.offload in ("host", "drop")

    @property
    def layout(self) -> tuple[int, int]:
        """The layout ``T = (tp, pp)`` of one replica."""
        return (self.tp, self.pp)

    def replica_gpus(self, d: int) -> tuple[int, ...]:
        """GPU ids of replica ``d`` (pp-major, then tp)."""
        k = self.tp * self.pp * self.cp
        return self.gpus[d * k:(d + 1) * k]

    def gpu_of(self, d: int, p: int, t: int) -> int:
        return self.gpus[(d * self.pp + p) * self.tp + t]

    def with_gpus(self, gpus) -> Candidate:
        return replace(self, gpus=tuple(int(g) for g in gpus))

    def key(self) -> tuple:
        """Identity without the GPU set."""
        return (self.model_stage, self.tp, self.pp, self.dp, self.micro_batch, self.grad_accum,
                self.recompute, self.concurrency, self.zero, self.offload, self.vpp) + ((self.cp,) if self.cp > 1 else ())

    def short(self) -> str:
        """Degrees and batch choices, ``tp2 pp1 dp2 b4 rc:full z1 off:host v2`` (with GPUs:
        :func:`nereus.planner.notation.format_candidate`)."""
        s = f"tp{self.tp} pp{self.pp} dp{self.dp}"
        if self.micro_batch:
            s += f" b{self.micro_batch}"
        if self.concurrency:
            s += f" c{self.concurrency}"
        if self.recompute != "none":
            s += f" rc:{self.recompute}"
        if self.zero:
            s += f" z{self.zero}"
        if self.offload != "none":
            s += f" off:{self.offload}"
        if self.vpp > 1:
            s += f" v{self.vpp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        return s


@dataclass(frozen=True)
class StageEstimate:
    """Predicted cost of one model-stage under its candidate.

    Attributes:
        time: seconds per RL step (slowest replica plus DP synchronization; for ``actor.train``
            and ``actor.generate`` it includes their side of the weight sync).
        breakdown: seconds per op class (``gemm``, ``attention``, ``memory_bound``,
            ``allreduce@nvlink``...) plus ``bubble``.
        memory: bytes per GPU by term (``weights``, ``gradients``, ``optimizer``, ``activations``,
            ``logits``, ``kv_cache``), for the most loaded pipeline rank.
        resident: bytes per GPU kept between stages (weights, optimizer state).
        transient: bytes per GPU needed only while the model-stage runs.
    """

    time: float
    breakdown: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    resident: float = 0.0
    transient: float = 0.0

    @property
    def peak_own(self) -> float:
        return self.resident + self.transient


@dataclass(frozen=True)
class Plan:
    """One candidate per model-stage, with predicted latency and memory.

    Attributes:
        candidates: in workflow order.
        estimates: model-stage name → :class:`StageEstimate`.
        l_step: predicted RL-step latency in seconds (critical path).
        peak_memory: model-stage name → predicted peak bytes per GPU including co-resident state and
            workspace (the largest over its GPUs).
        gpu_memory: GPU id → predicted peak bytes (after placement).
        throughput: response tokens per second.
        capacity: usable bytes per GPU (capacity minus headroom) the plan was checked against.
    """

    candidates: tuple[Candidate, ...]
    estimates: dict = field(default_factory=dict)
    l_step: float = 0.0
    peak_memory: dict = field(default_factory=dict)
    gpu_memory: dict = field(default_factory=dict)
    throughput: float = 0.0
    capacity: float = 0.0

    def __getitem__(self, model_stage: str) -> Candidate:
        for c in self.candidates:
            if c.model_stage == model_stage:
                return c
        raise KeyError(f"plan has no model-stage {model_stage!r}; it has "
                       f"{[c.model_stage for c in self.candidates]}")

    def __contains__(self, model_stage: str) -> bool:
        return any(c.model_stage == model_stage for c in self.candidates)

    @property
    def model_stages(self) -> tuple[str, ...]:
        return tuple(c.model_stage for c in self.candidates)

    def gpus_used(self) -> frozenset[int]:
        return frozenset(g for c in self.candidates for g in c.gpus)

    def same_layouts(self, other: Plan) -> bool:
        """Same candidates (ignoring GPU sets)."""
        return sorted(c.key() for c in self.candidates) == sorted(c.key() for c in other.candidates)

    def to_dict(self) -> dict:
        return {
            "l_step": self.l_step,
            "throughput": self.throughput,
            "capacity": self.capacity,
            "candidates": [_candidate_dict(c) for c in self.candidates],
            "estimates": {k: asdict(v) for k, v in self.estimates.items()},
            "peak_memory": self.peak_memory,
            "gpu_memory": {str(k): v for k, v in self.gpu_memory.items()},
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output.

        Raises:
            ValueError: missing ``candidates`` or a malformed candidate.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a plan must be a mapping with a 'candidates' list, got {d!r}"[:300])
        if not isinstance(d.get("candidates"), list) or not d["candidates"]:
            raise ValueError("plan JSON has no 'candidates' list (one entry per model-stage; docs/files.md)")
        cands = [_candidate_from_dict(c) for c in d["candidates"]]
        names = [c.model_stage for c in cands]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"plan lists model-stage(s) {dup} more than once")
        for k in ("l_step", "throughput", "capacity"):
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"plan field {k!r} must be a number >= 0, got {v!r}")
        ests = {}
        est_doc = d.get("estimates", {})
        if not isinstance(est_doc, dict):
            raise ValueError(f"plan field 'estimates' must map model-stage names to estimates, got {est_doc!r}"[:300])
        for k, v in est_doc.items():
            try:
                ests[k] = StageEstimate(**v)
            except TypeError as e:
                raise ValueError(f"plan field 'estimates' of {k!r} is malformed (valid keys: time, breakdown, "
                                 f"memory, resident, transient): {v!r}"[:300]) from e
        maps = {}
        for k in ("peak_memory", "gpu_memory"):
            v = d.get(k, {})
            if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   for x in v.values()):
                raise ValueError(f"plan field {k!r} must map names or GPU ids to bytes, got {v!r}"[:300])
            maps[k] = v
        try:
            gpu_memory = {int(k): v for k, v in maps["gpu_memory"].items()}
        except ValueError as e:
            raise ValueError(f"plan field 'gpu_memory' keys must be GPU ids, got {list(maps['gpu_memory'])[:5]}") from e
        return cls(candidates=tuple(cands), estimates=ests, l_step=float(d.get("l_step", 0.0)),
                   peak_memory=dict(maps["peak_memory"]), gpu_memory=gpu_memory,
                   throughput=float(d.get("throughput", 0.0)), capacity=float(d.get("capacity", 0.0)))


_CANDIDATE_INTS = ("tp", "pp", "dp", "micro_batch", "grad_accum", "concurrency", "zero", "vpp", "cp")


def _candidate_dict(c: Candidate) -> dict:
    """A candidate as a plan document's mapping (``cp`` only when it splits sequences)."""
    d = asdict(c) | {"gpus": list(c.gpus)}
    if c.cp == 1:
        del d["cp"]
    return d


def _candidate_from_dict(c) -> Candidate:
    """One candidate of a plan document, every field type-checked (``docs/files.md``)."""
    if not isinstance(c, dict):
        raise ValueError(f"a plan candidate must be a mapping (model_stage, tp, pp, dp, ...), got {c!r}"[:300])
    known = set(Candidate.__dataclass_fields__)
    unknown = sorted(str(k) for k in set(c) - known)
    if unknown:
        raise ValueError(f"plan candidate has unknown field(s) {unknown}; valid: {sorted(known)}")
    ms = c.get("model_stage")
    if not isinstance(ms, str) or "." not in ms:
        raise ValueError(f"plan candidate field 'model_stage' must look like 'actor.train', got {ms!r}")
    for k in ("tp", "pp", "dp"):
        if k not in c:
            raise ValueError(f"plan candidate {ms}: missing field {k!r}")
    for k in _CANDIDATE_INTS:
        v = c.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"plan candidate {ms}: field {k!r} must be an integer >= 0, got {v!r}")
    rc = c.get("recompute", "none")
    if rc not in ("none", "selective", "full"):
        raise ValueError(f"plan candidate {ms}: field 'recompute' must be 'none', 'selective' or 'full', "
                         f"got {rc!r}")
    off = c.get("offload", "none")
    if off not in ("none", "host", "drop"):
        raise ValueError(f"plan candidate {ms}: field 'offload' must be 'none', 'host' or 'drop', got {off!r}")
    gpus = c.get("gpus", [])
    if not isinstance(gpus, (list, tuple)) or not all(isinstance(g, int) and not isinstance(g, bool)
                                                       for g in gpus):
        raise ValueError(f"plan candidate {ms}: field 'gpus' must be a list of GPU ids, got {gpus!r}"[:300])
    return Candidate(**(dict(c) | {"gpus": tuple(gpus)}))


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``nereus plan --json`` (the plan may sit under a ``"plan"`` key).

    Raises:
        ValueError: missing file or malformed JSON.
    """
    return read_plan_document(path)[0]


def read_plan_document(path: str | Path) -> tuple[Plan, dict | None]:
    """Read a plan file: the plan and, when the document carries it (``nereus plan --json`` does),
    its job as a mapping (build it with ``JobSpec.from_dict``). Format: ``docs/files.md``.

    Raises:
        ValueError: missing or unreadable file, malformed JSON, a document without a plan (an
            infeasible ``nereus plan --json`` output says why), or a malformed field (named, with
            the file).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"plan file {str(p)!r} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"plan file {str(p)!r} is not valid JSON: {e}") from e
    except OSError as e:
        raise ValueError(f"plan file {str(p)!r} cannot be read: {e.strerror or e}") from e
    job = None
    if isinstance(d, dict) and d.get("feasible") is False:
        raise ValueError(f"plan file {str(p)!r} holds no plan: nereus plan found none "
                         f"({str(d.get('reason', '')).splitlines()[0] if d.get('reason') else 'no reason given'})")
    if isinstance(d, dict) and "plan" in d:
        job = d.get("job")
        if job is not None and not isinstance(job, dict):
            raise ValueError(f"plan file {str(p)!r}: field 'job' must be a job mapping, got {job!r}"[:300])
        d = d["plan"]
    try:
        return Plan.from_dict(d), job
    except ValueError as e:
        raise ValueError(f"plan file {str(p)!r}: {e}") from e
