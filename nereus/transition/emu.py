"""EMUs: one replica of one model-stage, holding its TP x PP shards on ``tp*pp`` GPUs.

Source: paper §5 (the EMU boundary; ``Φ(π)``), DESIGN.md §2 and §4.6.

An EMU's GPUs follow the plan convention (``nereus/spec/plan.py``): ``gpus[p*tp + t]`` is pipeline
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

from nereus.cost.shapes import params_on_rank
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec

__all__ = ["EMU", "check_zero", "state_bytes_per_param", "state_parts", "model_of", "stage_of", "shard_bytes",
           "zero_shard_bytes", "phi", "t_sub", "sub_units", "aligned_gpus",
           "parts_of", "STAGE_ORDER"]

#: Stage tie-break order of the global DAG (paper §6.1): generation → inference → training.
STAGE_ORDER = {"generate": 0, "infer": 1, "train": 2}
#: the host side of host-memory ``pairs`` of a primitive (Offload, Restore, a Load from a host EMU;
#: ``transition/staging.py``).
HOST_ID = -1


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


def state_parts(job: JobSpec, model_stage: str) -> tuple[int, int]:
    """``(weight bytes, optimizer bytes)`` per parameter of a model-stage's transition state.

    ``(workload.param_bytes, workload.optimizer_bytes)`` for training, ``(param_bytes, 0)`` otherwise;
    their sum is :func:`state_bytes_per_param`. ZeRO shards the two parts differently (stage 1-2 the
    optimizer only, stage 3 both), so sharded EMUs need them apart.
    """
    w = job.workload
    return (w.param_bytes, w.optimizer_bytes if stage_of(model_stage) == "train" else 0)


def parts_of(bytes_per_param) -> tuple[int, int, int]:
    """``(total, weights, optimizer)`` bytes per parameter from an int (all weights-like, i.e. never
    sharded apart) or a ``(weights, optimizer)`` pair (:func:`state_parts`).

    Raises:
        ValueError: a pair with a negative entry.
    """
    if isinstance(bytes_per_param, tuple):
        pb, ob = bytes_per_param
        if pb < 0 or ob < 0:
            raise ValueError(f"bytes per parameter must be >= 0, got {bytes_per_param}")
        return pb + ob, pb, ob
    return bytes_per_param, bytes_per_param, 0


@functools.lru_cache(maxsize=4096)
def shard_bytes(model: ModelSpec, tp: int, pp: int, bytes_per_param: int) -> tuple[int, ...]:
    """Bytes on one GPU at each pipeline rank of a ``(tp, pp)`` replica, rounded up; shape ``[pp]``."""
    return tuple(math.ceil(params_on_rank(model, tp, pp, p) * bytes_per_param) for p in range(pp))


@functools.lru_cache(maxsize=4096)
def zero_shard_bytes(model: ModelSpec, tp: int, pp: int, param_bytes: int, optimizer_bytes: int, zero: int,
                     z: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes per GPU of a ZeRO group of degree ``z`` at each pipeline rank, and the sharded bytes.

    With ``tot = ceil(params·(pb + ob))`` (the unsharded shard, :func:`shard_bytes`), ``rep`` the
    replicated part (``ceil(params·pb)`` for ZeRO-1/2, 0 for ZeRO-3) and ``shd = tot - rep`` the part
    split over the group: a GPU holds ``rep + ceil(shd / z)`` (``nereus.cost.memory``: stage >= 1
    optimizer ``/dp``, 3 weights ``/dp``; gradients are empty at a step boundary, so ZeRO-2 holds
    what ZeRO-1 holds). ``z = 1`` gives :func:`shard_bytes` exactly.

    Returns:
        ``(per_gpu, sharded)``, both shape ``[pp]``; ``sharded[p]`` is ``shd`` (whole group).
    """
    per, shd = [], []
    for p in range(pp):
        params = params_on_rank(model, tp, pp, p)
        tot = math.ceil(params * (param_bytes + optimizer_bytes))
        rep = math.ceil(params * param_bytes) if zero < 3 else 0
        if z == 1 or zero == 0:
            rep = tot
        per.append(rep + -(-(tot - rep) // z))
        shd.append(tot - rep)
    return tuple(per), tuple(shd)


@dataclass(frozen=True)
class EMU:
    """One replica of one model-stage (paper §5), or one ZeRO-sharded DP group (ours).

    Attributes:
        uid: unique name, e.g. ``"actor.train#1"`` (current), ``"actor.train#1/s2"`` (split output),
            ``"actor.train*0/1"`` (target slot), ``"actor.train*0"`` (target).
        model_stage: e.g. ``"actor.train"``.
        tp, pp: the layout ``T``.
        gpus: ``tp*pp*z`` GPU ids, ``gpus[(r*pp + p)*tp + t]`` (sharding rank ``r``).
        shard_bytes: bytes per GPU at each pipeline rank, shape ``[pp]``.
        host: a copy staged in host memory (an Offload's output, or a model-stage whose idle state
            is offloaded, ``Candidate.offload == "host"``): it keeps the layout and GPU ids it came
            from (its shards sit in those GPUs' hosts) but holds no GPU memory and owns no GPU.
        z: sharding degree: the ZeRO group spans ``z`` DP ranks, each holding ``1/z`` of the sharded
            part of every ``(p, t)`` shard (1: an ordinary replica).
        zero: ZeRO stage of the group (1-2: optimizer state sharded, 3: weights too); 0 when ``z == 1``.
        sharded: bytes of the sharded part of one whole ``(p, t)`` shard at each pipeline rank, shape
            ``[pp]`` (``()`` when ``z == 1``); a GPU holds ``shard_bytes[p] - ceil(sharded[p]/z)``
            replicated bytes plus its ``1/z`` slice (:func:`zero_shard_bytes`).

    Sharding ranks own contiguous slices of the sharded buffer (Megatron's distributed optimizer and
    DeepSpeed/FSDP partition a flat buffer the same way): rank ``r`` holds ``[r/z, (r+1)/z)``.

    Raises:
        ValueError: wrong GPU count, repeated GPUs, a ``shard_bytes`` of the wrong length, or a
            ``z``/``zero``/``sharded`` that do not agree.
    """

    uid: str
    model_stage: str
    tp: int
    pp: int
    gpus: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    host: bool = False
    z: int = 1
    zero: int = 0
    sharded: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.z < 1 or (self.z == 1) != (self.zero == 0) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"EMU {self.uid}: z={self.z} and zero={self.zero} disagree (a ZeRO group has "
                             "z > 1 and zero in 1..3; a replica z = 1, zero = 0)")
        if len(self.gpus) != self.tp * self.pp * self.z:
            raise ValueError(f"EMU {self.uid}: gpus has {len(self.gpus)} ids, tp*pp*z = {self.tp * self.pp * self.z}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"EMU {self.uid}: gpus repeat an id: {self.gpus}")
        if len(self.shard_bytes) != self.pp:
            raise ValueError(f"EMU {self.uid}: shard_bytes has {len(self.shard_bytes)} entries, pp = {self.pp}")
        if len(self.sharded) != (self.pp if self.z > 1 else 0):
            raise ValueError(f"EMU {self.uid}: sharded has {len(self.sharded)} entries, needs "
                             f"{self.pp if self.z > 1 else 0}")

    @property
    def layout(self) -> tuple[int, ...]:
        """``(tp, pp)`` for a replica; ``(tp, pp, z, zero)`` for a ZeRO group."""
        return (self.tp, self.pp) if self.z == 1 else (self.tp, self.pp, self.z, self.zero)

    @property
    def stage(self) -> str:
        return stage_of(self.model_stage)

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {g: i for i, g in enumerate(self.gpus)}

    def position(self, gpu: int) -> tuple[int, int]:
        """``(p, t)`` of ``gpu`` in this EMU."""
        return divmod(self._index[gpu] % (self.tp * self.pp), self.tp)

    def rank(self, gpu: int) -> int:
        """Sharding rank ``r`` of ``gpu`` (0 in a replica)."""
        return self._index[gpu] // (self.tp * self.pp)

    def gpu_at(self, p: int, t: int, r: int = 0) -> int:
        return self.gpus[(r * self.pp + p) * self.tp + t]

    def block(self, r: int) -> tuple[int, ...]:
        """The ``tp*pp`` GPUs of sharding rank ``r`` (one DP replica's GPUs), plan order."""
        k = self.tp * self.pp
        return self.gpus[r * k:(r + 1) * k]

    def shard_on(self, gpu: int) -> int:
        """Bytes of this EMU's shard on ``gpu`` wherever it is kept (GPU or host memory); 0 off it."""
        i = self._index.get(gpu)
        return 0 if i is None else self.shard_bytes[(i % (self.tp * self.pp)) // self.tp]

    def bytes_on(self, gpu: int) -> int:
        """State bytes this EMU keeps on ``gpu`` (0 when not on it, or staged in host memory)."""
        return 0 if self.host else self.shard_on(gpu)

    @property
    def total_bytes(self) -> int:
        """Bytes over all GPUs (one full copy plus replicated norms/KV heads, and for a ZeRO group the
        replicated part ``z`` times)."""
        return self.tp * self.z * sum(self.shard_bytes)

    def signature(self) -> tuple:
        """Identity without the uid: what 'ends in exactly the target EMUs' compares."""
        base = (self.model_stage, self.tp, self.pp, self.gpus)
        return base if self.z == 1 else base + (self.z, self.zero)

    def to_dict(self) -> dict:
        d = {"uid": self.uid, "model_stage": self.model_stage, "tp": self.tp, "pp": self.pp,
             "gpus": list(self.gpus), "shard_bytes": list(self.shard_bytes)}
        if self.z > 1:
            d |= {"z": self.z, "zero": self.zero, "sharded": list(self.sharded)}
        if self.host:
            d["host"] = True
        return d


def check_zero(model_stage: str, zero: int) -> None:
    """Raise ValueError unless ``zero`` fits ``model_stage``'s stage: any stage 0-3 for training,
    0 or 3 for inference (only weights to shard), 0 for generation."""
    st = stage_of(model_stage)
    ok = (0, 1, 2, 3) if st == "train" else (0, 3) if st == "infer" else (0,)
    if zero not in ok:
        raise ValueError(f"candidate {model_stage}: zero={zero} is not a ZeRO stage {st} model-stages can have; "
                         f"valid: {', '.join(map(str, ok))}")


def phi(job: JobSpec, candidate, prefix: str = "#") -> tuple[EMU, ...]:
    """``Φ(π)``: the EMUs of a candidate at a step boundary, uids ``f"{model_stage}{prefix}{d}"``.

    * ``zero == 0`` (or ``dp == 1``): one EMU per DP replica, a full copy each (paper §5).
    * a training candidate with ``zero >= 1``, or an inference one with ``zero == 3`` (a ZeRO-3 /
      FSDP engine's forward passes: weights sharded), and ``dp > 1``: ONE EMU, the ZeRO group,
      layout ``(tp, pp, z = dp)`` on all its GPUs in the plan order (replica ``d`` is sharding rank
      ``d``), bytes per GPU :func:`zero_shard_bytes` (ours, issue 13).
    * ``offload == "host"``: the same EMUs with ``host=True`` (the idle state sits in host memory:
      no GPU bytes, no GPU owned); ``offload == "drop"``: none (the state is re-created at the
      model-stage's next run, from storage or its ``*.train``).

    Raises:
        ValueError: the candidate has no GPU set (not placed), or a ``zero`` its stage cannot have
            (:func:`check_zero`).
    """
    if not candidate.gpus:
        raise ValueError(f"candidate {candidate.model_stage}: gpus is empty; Φ needs a placed candidate")
    zero = getattr(candidate, "zero", 0)
    offload = getattr(candidate, "offload", "none")
    check_zero(candidate.model_stage, zero)
    if offload == "drop":
        return ()
    host = offload == "host"
    model = model_of(job, candidate.model_stage)
    if zero and candidate.dp > 1:
        pb, ob = state_parts(job, candidate.model_stage)
        per, shd = zero_shard_bytes(model, candidate.tp, candidate.pp, pb, ob, zero, candidate.dp)
        return (EMU(f"{candidate.model_stage}{prefix}0", candidate.model_stage, candidate.tp, candidate.pp,
                    tuple(candidate.gpus), per, host=host, z=candidate.dp, zero=zero, sharded=shd),)
    sb = shard_bytes(model, candidate.tp, candidate.pp, state_bytes_per_param(job, candidate.model_stage))
    return tuple(EMU(f"{candidate.model_stage}{prefix}{d}", candidate.model_stage, candidate.tp,
                     candidate.pp, candidate.replica_gpus(d), sb, host=host) for d in range(candidate.dp))


def t_sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Largest layout both ``a`` and ``b`` split into: ``(gcd(tp, tp*), gcd(pp, pp*))`` (paper §6.1).

    Layouts are :attr:`EMU.layout` tuples. Along the sharding dimension (ours) the common layout is
    ``(tp, pp, gcd(z, z*), zero)`` only when both are ZeRO groups of one stage with the same
    ``(tp, pp)``: a ZeRO slice is a slice of one ``(tp, pp)`` shard's flat buffer, so slices of
    different TP/PP layouts (or stages) are not nested and the common layout is unsharded (``z = 1``).
    """
    tp, pp = math.gcd(a[0], b[0]), math.gcd(a[1], b[1])
    if len(a) > 2 and len(b) > 2 and a[:2] == b[:2] and a[3] == b[3]:
        z = math.gcd(a[2], b[2])
        if z > 1:
            return (tp, pp, z, a[3])
    return (tp, pp)


def _check_divides(layout: tuple[int, ...], sub: tuple[int, ...]) -> tuple[int, int, int]:
    tp, pp = layout[:2]
    tps, pps = sub[:2]
    z = layout[2] if len(layout) > 2 else 1
    zs = sub[2] if len(sub) > 2 else 1
    if tps <= 0 or pps <= 0 or tp % tps or pp % pps or zs <= 0 or z % zs:
        raise ValueError(f"T_sub={sub} must divide the layout {layout} (tp'|tp, pp'|pp, z'|z)")
    if zs > 1 and (sub[:2] != layout[:2] or sub[3] != layout[3]):
        raise ValueError(f"T_sub={sub}: a sharded sub-layout needs the layout's tp, pp and ZeRO stage ({layout})")
    return tp // tps, pp // pps, z // zs


def sub_units(emu: EMU, sub: tuple[int, ...], model: ModelSpec, bytes_per_param,
              prefix: str = "/s") -> tuple[EMU, ...]:
    """The ``k`` units of layout ``sub`` that a Split of ``emu`` yields (or a Merge into it consumes).

    With ``a = tp/tp'``, ``b = pp/pp'``, ``c = z/z'``, unit ``(i, j, l)`` is named
    ``f"{emu.uid}{prefix}{(l*b + j)*a + i}"`` and holds sub-rank ``(r', q, t')`` on the GPU at
    ``(r, p, t) = (r'*c + l, q*b + j, t'*a + i)`` (module docstring; along the sharding dimension the
    same strided rule: unit ``l`` takes ranks ``l, l+c, ...``, and the all-gather group of a GPU is
    the ``c`` consecutive ranks whose slices form its new slice). ``bytes_per_param`` is an int or
    ``(weights, optimizer)`` (needed when ``sub`` is sharded, :func:`state_parts`).

    Raises:
        ValueError: ``sub`` does not divide the EMU's layout, or a sharded ``sub`` with an int
            ``bytes_per_param``.
    """
    a, b, c = _check_divides(emu.layout, sub)
    tps, pps = sub[:2]
    zs = sub[2] if len(sub) > 2 else 1
    total, pb, ob = parts_of(bytes_per_param)
    kw: dict = {}
    if zs > 1:
        if not isinstance(bytes_per_param, tuple):
            raise ValueError(f"sub_units of {emu.uid} into {sub}: a sharded layout needs (weights, optimizer) "
                             "bytes per parameter")
        sb, shd = zero_shard_bytes(model, tps, pps, pb, ob, sub[3], zs)
        kw = {"z": zs, "zero": sub[3], "sharded": shd}
    else:
        sb = shard_bytes(model, tps, pps, total)
    out = []
    for m in range(c):
        for j in range(b):
            for i in range(a):
                gpus = tuple(emu.gpu_at(q * b + j, t * a + i, r * c + m)
                             for r in range(zs) for q in range(pps) for t in range(tps))
                out.append(EMU(f"{emu.uid}{prefix}{(m * b + j) * a + i}", emu.model_stage, tps, pps, gpus, sb, **kw))
    return tuple(out)


def aligned_gpus(units: list[EMU] | tuple[EMU, ...], layout: tuple[int, ...]) -> tuple[int, ...]:
    """GPU order of the EMU of ``layout`` that merges ``units`` without copying any shard.

    ``units[(l*b + j)*a + i]`` takes the place of sub-unit ``(i, j, l)`` (the inverse of
    :func:`sub_units`). Placement can use it to make Merge free (paper §6.3, "shards already
    resident are not copied").

    Raises:
        ValueError: wrong number of units or units of different layouts.
    """
    if not units:
        raise ValueError("aligned_gpus needs at least one unit")
    sub = units[0].layout
    a, b, c = _check_divides(layout, sub)
    if len(units) != a * b * c or any(u.layout != sub for u in units):
        raise ValueError(f"merging into {layout} needs {a * b * c} units of layout {sub}, got "
                         f"{[u.layout for u in units]}")
    tp, pp = layout[:2]
    z = layout[2] if len(layout) > 2 else 1
    zs = sub[2] if len(sub) > 2 else 1
    out = [0] * (tp * pp * z)
    for m in range(c):
        for j in range(b):
            for i in range(a):
                u = units[(m * b + j) * a + i]
                for r in range(zs):
                    for q in range(sub[1]):
                        for t in range(sub[0]):
                            out[((r * c + m) * pp + q * b + j) * tp + t * a + i] = u.gpu_at(q, t, r)
    return tuple(out)
