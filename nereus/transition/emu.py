"""EMUs: one replica of one model-stage, holding its TP x PP shards on ``tp*pp`` GPUs.

Source: paper §5 (the EMU boundary; ``Φ(π)``), DESIGN.md §2 and §4.6.

An EMU's GPUs follow the plan convention (``nereus/planner/plan.py``): ``gpus[p*tp + t]`` is pipeline
rank ``p``, tensor rank ``t``. Every GPU at pipeline rank ``p`` holds the same number of bytes,
``shard_bytes[p]``: parameters on that rank (``nereus.cost.shapes.params_on_rank``) times the bytes
per parameter of the model-stage's state (:func:`state_bytes_per_param`).

Sub-units (Split outputs and Merge inputs) follow the position-wise all-gather of paper §6.3:
splitting layout ``(tp, pp)`` into ``T_sub = (tp', pp')`` with ``a = tp/tp'`` and ``b = pp/pp'``
gives ``k = a*b`` units; unit ``(i, j)`` (index ``j*a + i``) holds sub-rank ``(q, t')`` on the GPU at
``(p, t) = (q*b + j, t'*a + i)``. The all-gather group of a GPU is the ``a x b`` block of ranks with
the same ``(p // b, t // a)``: contiguous ranks whose shards together form one ``T_sub`` shard.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from nereus.cost.shapes import _layer_params_per_tp_rank, layers_of_rank, params_on_rank, replicated_per_layer
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec

__all__ = ["EMU", "state_bytes_per_param", "model_of", "stage_of", "shard_bytes", "phi", "t_sub",
           "sub_units", "aligned_gpus", "resident_bytes", "STAGE_ORDER"]

#: Stage tie-break order of the global DAG (paper §6.1): generation → inference → training.
STAGE_ORDER = {"generate": 0, "infer": 1, "train": 2}


def stage_of(model_stage: str) -> str:
    """``"actor.train"`` → ``"train"``.

    Raises:
        ValueError: not ``<model>.<stage>`` with a stage in generate/infer/train.
    """
    model, _, stage = model_stage.partition(".")
    if not model or stage not in STAGE_ORDER:
        raise ValueError(f"model_stage {model_stage!r} must look like '<model>.<stage>' with stage in "
                         f"{list(STAGE_ORDER)}")
    return stage


@functools.lru_cache(maxsize=256)
def model_of(job: JobSpec, model_stage: str) -> ModelSpec:
    """The model shapes of a model-stage (``"X.stage"`` uses ``job.model("X")``)."""
    stage_of(model_stage)
    return job.model(model_stage.partition(".")[0])


def state_bytes_per_param(job: JobSpec, model_stage: str) -> int:
    """Bytes of transition state per parameter of a model-stage.

    Generation and inference hold weights only (``workload.param_bytes``, 2 B for bf16); training
    also holds Adam state (``workload.optimizer_bytes``, 12 B: fp32 master, exp_avg, exp_avg_sq).
    Gradients are empty at a safe boundary (paper §6.3) and are not moved.
    """
    w = job.workload
    return w.param_bytes + (w.optimizer_bytes if stage_of(model_stage) == "train" else 0)


@functools.lru_cache(maxsize=4096)
def shard_bytes(model: ModelSpec, tp: int, pp: int, bytes_per_param: int) -> tuple[int, ...]:
    """Bytes on one GPU at each pipeline rank of a ``(tp, pp)`` replica, rounded up; shape ``[pp]``."""
    return tuple(math.ceil(params_on_rank(model, tp, pp, p) * bytes_per_param) for p in range(pp))


@dataclass(frozen=True)
class EMU:
    """One replica of one model-stage (paper §5).

    Attributes:
        uid: unique name, e.g. ``"actor.train#1"`` (current), ``"actor.train#1/s2"`` (split output),
            ``"actor.train*0/1"`` (target slot), ``"actor.train*0"`` (target).
        model_stage: e.g. ``"actor.train"``.
        tp, pp: the layout ``T``.
        gpus: ``tp*pp`` GPU ids, ``gpus[p*tp + t]``.
        shard_bytes: bytes per GPU at each pipeline rank, shape ``[pp]``.
        host: a copy staged in host memory (an Offload's output): it keeps the layout and GPU ids
            it came from (its shards sit in those GPUs' hosts) but holds no GPU memory and owns no GPU.

    Raises:
        ValueError: wrong GPU count, repeated GPUs or a ``shard_bytes`` of the wrong length.
    """

    uid: str
    model_stage: str
    tp: int
    pp: int
    gpus: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    host: bool = False

    def __post_init__(self) -> None:
        if len(self.gpus) != self.tp * self.pp:
            raise ValueError(f"EMU {self.uid}: gpus has {len(self.gpus)} ids, tp*pp = {self.tp * self.pp}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"EMU {self.uid}: gpus repeat an id: {self.gpus}")
        if len(self.shard_bytes) != self.pp:
            raise ValueError(f"EMU {self.uid}: shard_bytes has {len(self.shard_bytes)} entries, pp = {self.pp}")

    @property
    def layout(self) -> tuple[int, int]:
        return (self.tp, self.pp)

    @property
    def stage(self) -> str:
        return stage_of(self.model_stage)

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {g: i for i, g in enumerate(self.gpus)}

    def position(self, gpu: int) -> tuple[int, int]:
        """``(p, t)`` of ``gpu`` in this EMU."""
        return divmod(self._index[gpu], self.tp)

    def gpu_at(self, p: int, t: int) -> int:
        return self.gpus[p * self.tp + t]

    def bytes_on(self, gpu: int) -> int:
        """State bytes this EMU keeps on ``gpu`` (0 when not on it, or staged in host memory)."""
        if self.host:
            return 0
        i = self._index.get(gpu)
        return 0 if i is None else self.shard_bytes[i // self.tp]

    @property
    def total_bytes(self) -> int:
        """Bytes over all GPUs (one full copy plus replicated norms/KV heads)."""
        return self.tp * sum(self.shard_bytes)

    def signature(self) -> tuple:
        """Identity without the uid: what 'ends in exactly the target EMUs' compares."""
        return (self.model_stage, self.tp, self.pp, self.gpus)

    def to_dict(self) -> dict:
        return {"uid": self.uid, "model_stage": self.model_stage, "tp": self.tp, "pp": self.pp,
                "gpus": list(self.gpus), "shard_bytes": list(self.shard_bytes)}


def phi(job: JobSpec, candidate, prefix: str = "#") -> tuple[EMU, ...]:
    """``Φ(π)``: the EMUs of a candidate (one per DP replica), uids ``f"{model_stage}{prefix}{d}"``.

    Raises:
        ValueError: the candidate has no GPU set (not placed).
    """
    if not candidate.gpus:
        raise ValueError(f"candidate {candidate.model_stage}: gpus is empty; Φ needs a placed candidate")
    model = model_of(job, candidate.model_stage)
    sb = shard_bytes(model, candidate.tp, candidate.pp, state_bytes_per_param(job, candidate.model_stage))
    return tuple(EMU(f"{candidate.model_stage}{prefix}{d}", candidate.model_stage, candidate.tp,
                     candidate.pp, candidate.replica_gpus(d), sb) for d in range(candidate.dp))


def t_sub(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Largest layout both ``a`` and ``b`` split into: ``(gcd(tp, tp*), gcd(pp, pp*))`` (paper §6.1)."""
    return (math.gcd(a[0], b[0]), math.gcd(a[1], b[1]))


def _check_divides(layout: tuple[int, int], sub: tuple[int, int]) -> tuple[int, int]:
    tp, pp = layout
    tps, pps = sub
    if tps <= 0 or pps <= 0 or tp % tps or pp % pps:
        raise ValueError(f"T_sub={sub} must divide the layout {layout} (tp'|tp and pp'|pp)")
    return tp // tps, pp // pps


def sub_units(emu: EMU, sub: tuple[int, int], model: ModelSpec, bytes_per_param: int,
              prefix: str = "/s") -> tuple[EMU, ...]:
    """The ``k`` units of layout ``sub`` that a Split of ``emu`` yields (or a Merge into it consumes).

    Unit ``(i, j)`` is named ``f"{emu.uid}{prefix}{j*a + i}"``; see the module docstring for placement.

    Raises:
        ValueError: ``sub`` does not divide the EMU's layout.
    """
    a, b = _check_divides(emu.layout, sub)
    tps, pps = sub
    sb = shard_bytes(model, tps, pps, bytes_per_param)
    out = []
    for j in range(b):
        for i in range(a):
            gpus = tuple(emu.gpu_at(q * b + j, t * a + i) for q in range(pps) for t in range(tps))
            out.append(EMU(f"{emu.uid}{prefix}{j * a + i}", emu.model_stage, tps, pps, gpus, sb))
    return tuple(out)


def aligned_gpus(units: list[EMU] | tuple[EMU, ...], layout: tuple[int, int]) -> tuple[int, ...]:
    """GPU order of the EMU of ``layout`` that merges ``units`` without copying any shard.

    ``units[j*a + i]`` takes the place of sub-unit ``(i, j)`` (the inverse of :func:`sub_units`).
    Placement can use it to make Merge free (paper §6.3, "shards already resident are not copied").

    Raises:
        ValueError: wrong number of units or units of different layouts.
    """
    if not units:
        raise ValueError("aligned_gpus needs at least one unit")
    sub = units[0].layout
    a, b = _check_divides(layout, sub)
    if len(units) != a * b or any(u.layout != sub for u in units):
        raise ValueError(f"merging into {layout} needs {a * b} units of layout {sub}, got "
                         f"{[u.layout for u in units]}")
    tp, pp = layout
    out = [0] * (tp * pp)
    for j in range(b):
        for i in range(a):
            u = units[j * a + i]
            for q in range(sub[1]):
                for t in range(sub[0]):
                    out[(q * b + j) * tp + t * a + i] = u.gpu_at(q, t)
    return tuple(out)


def _tp_overlap(src: tuple[int, int], dst: tuple[int, int]) -> float:
    """Fraction of tensor slice ``dst = (t, tp)`` covered by slice ``src = (t', tp')``."""
    (ts, ns), (td, nd) = src, dst
    lo = max(ts / ns, td / nd)
    hi = min((ts + 1) / ns, (td + 1) / nd)
    return max(0.0, hi - lo) * nd


def resident_bytes(model: ModelSpec, bytes_per_param: int, src: tuple[int, int, int, int],
                   dst: tuple[int, int, int, int]) -> int:
    """Bytes of shard ``dst = (tp, pp, p, t)`` already present on a GPU holding shard ``src``.

    Split weights count by the overlap of the pipeline layer ranges times the overlap of the tensor
    slices; RMSNorm weights and a value head are replicated, so they count whenever the layer (or the
    last rank) is shared. The embedding sits on the first rank, the head and final norm on the last.
    KV heads replicated under ``tp > num_kv_heads`` are counted like split weights (errs towards
    moving a few more bytes).
    """
    tps, pps, ps, tsrc = src
    tpd, ppd, pd, tdst = dst
    f = _tp_overlap((tsrc, tps), (tdst, tpd))
    h = model.hidden_size
    ld = layers_of_rank(model.num_layers, ppd, pd)
    ls = layers_of_rank(model.num_layers, pps, ps)
    common = max(0, min(ld.stop, ls.stop) - max(ld.start, ls.start))
    norms = replicated_per_layer(model)
    n = common * ((_layer_params_per_tp_rank(model, tpd) - norms) * f + norms)
    vocab_rows = -(-model.vocab_size // tpd)  # padded vocabulary / tp
    if pd == 0 and ps == 0:
        n += vocab_rows * h * f
    if pd == ppd - 1 and ps == pps - 1:
        n += h  # final norm
        if model.head == "value":
            n += h + 1
        elif not model.tie_word_embeddings or ppd > 1:
            n += vocab_rows * h * f
    need = math.ceil(params_on_rank(model, tpd, ppd, pd) * bytes_per_param)
    return min(round(n * bytes_per_param), need)
