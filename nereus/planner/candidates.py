"""Candidate enumeration and the latency-vs-GPUs frontier per model-stage (DESIGN.md §4.4 steps 1-2).

The plan space of one model-stage (the job's framework, :mod:`nereus.spec.framework`, gates the
features it names):

* TP: every degree that divides the query heads and the MLP width and divides, or is a multiple of,
  the KV heads (KV heads are then replicated); at most ``max(gpus_per_node, 8)`` so TP stays inside
  a node when nodes are large enough (groups that cross nodes pay the NIC in the cost model);
* PP: every degree dividing the layers, or every degree up to the layer count when the framework
  allows uneven stages (``uneven_pp``);
* training and inference (the training engine's passes) without ``model_parallel_train`` (verl FSDP,
  OpenRLHF DeepSpeed): TP = PP = 1; without ``pipeline_parallel``: PP = 1;
* DP: training needs ``dp·b·a = mini_batch``, with ``b`` any divisor of the per-replica batch
  ``mini/dp`` up to the workload's micro-batch; inference and generation take any DP (only those
  dividing their rows under ``FrameworkSpec.even_dp``), and among DP
  degrees that give the same per-replica load (``ceil(B/dp)``) only the smallest is kept, since the
  others add GPUs for no speed;
* inference micro-batch ``b`` up to the workload's: only the smallest ``b`` of each micro-batch count
  ``ceil(seqs/b)`` is kept (same count, smaller ``b``: no more time, no more memory);
* inference under a framework with ZeRO stage 3 (FSDP, DeepSpeed engines run the forward passes):
  each row with ``dp > 1`` also with ``z = 3`` (weights sharded over DP and gathered per
  micro-batch; the only inference row when the framework has no lower stage). The DP degrees are
  the inference ones above (the smallest of each per-replica load): a larger DP at the same load
  would shard the weights thinner for more GPUs; that trade is not searched;
* generation concurrency ``c``: any integer, reduced exactly to the smallest ``c`` of each wave count
  ``ceil(seqs/c)``: at a fixed wave count a larger ``c`` decodes a larger batch per step (no less
  time: the cost model's per-step time is non-decreasing in the batch, checked by
  ``tests/test_planner_space.py``) and holds a larger KV cache (more transient memory, same
  resident), so it is dominated in every plan: the search stays exact over all integer
  concurrencies with ``O(√seqs)`` rows per replica size instead of ``seqs``;
* training: recompute ``none`` or ``full`` when the workload says ``auto``; ZeRO stage ``z`` from the
  framework's ``zero_stages`` (``z > 0`` only with ``dp > 1``; ``dp = 1`` is ZeRO-0 whatever the
  stages, the same state); interleaving ``v`` in ``2..max_virtual_stages`` when ``pp > 1``, ``pp·v``
  divides the layers and the micro-batches per replica are a multiple of ``pp`` (Megatron's rule);
* idle state (``offload``): every mode the framework allows the model-stage
  (``FrameworkSpec.offload_modes``), ``drop`` never for training.

Candidates are held as NumPy columns (:class:`CandidateSet`) and evaluated by one elementwise call
of the cost model per model-stage. The frontier keeps candidates that fit memory on their own and
lie on the (GPUs, time) staircase of their memory class (same resident and transient bytes); the
memory columns stay because co-resident model-stages make them matter to the plan, and the search's
memory filters settle dominance across classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from nereus.cost.memory import OFFLOAD_CODES
from nereus.cost.model import FROZEN_MODELS, CostModel
from nereus.cost.shapes import valid_pp, valid_tp
from nereus.spec.plan import Candidate
from nereus.workflow import ModelStage

__all__ = ["CandidateSet", "enumerate_candidates", "even_dp_rows", "frontier", "latency_frontier", "RECOMPUTE_CODES",
           "COLUMNS"]

RECOMPUTE_CODES = ("none", "selective", "full")
#: every column of a :class:`CandidateSet`, in order
COLUMNS = ("tp", "pp", "dp", "b", "rc", "c", "n", "t", "r", "x", "z", "o", "v")
_INT_COLS = ("tp", "pp", "dp", "b", "rc", "c", "z", "o", "v")


@dataclass
class CandidateSet:
    """Columns of candidates of one model-stage (all arrays of equal length).

    ``z`` (ZeRO stage), ``o`` (index into :data:`OFFLOAD_CODES`) and ``v`` (virtual pipeline stages)
    default to 0, 0 and 1 when not given."""

    model_stage: str
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    b: np.ndarray
    rc: np.ndarray  # index into RECOMPUTE_CODES
    c: np.ndarray
    n: np.ndarray  # GPUs
    t: np.ndarray  # seconds per step
    r: np.ndarray  # resident bytes per GPU
    x: np.ndarray  # transient bytes per GPU
    z: np.ndarray | None = None  # ZeRO stage
    o: np.ndarray | None = None  # index into OFFLOAD_CODES
    v: np.ndarray | None = None  # virtual pipeline stages per rank
    #: the enumeration's :class:`~nereus.cost.detail.RowDetail` (op-class and memory terms per row);
    #: not carried by :meth:`take` (its rows are the enumeration's, see :meth:`estimate_of`)
    detail: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        k = self.n.shape[0]
        if self.z is None:
            self.z = np.zeros(k, dtype=np.int64)
        if self.o is None:
            self.o = np.zeros(k, dtype=np.int64)
        if self.v is None:
            self.v = np.ones(k, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.n.shape[0])

    def take(self, idx) -> CandidateSet:
        f = {k: getattr(self, k)[idx] for k in COLUMNS}
        return CandidateSet(self.model_stage, **f)

    def estimate_of(self, other: CandidateSet, i: int):
        """The :class:`~nereus.spec.plan.StageEstimate` of row ``i`` of ``other`` (a subset of these
        rows, e.g. a frontier) from this enumeration's :attr:`detail`; None without one or when
        the row is not one of these."""
        if self.detail is None:
            return None
        hit = np.ones(len(self), dtype=bool)
        for f in ("tp", "pp", "dp", "b", "rc", "c", "z", "o", "v"):
            hit &= getattr(self, f) == getattr(other, f)[i]
        j = np.flatnonzero(hit)
        if j.size == 0:
            return None
        j = int(j[0])
        return self.detail.estimate(j, self.t[j], self.r[j], self.x[j])

    def candidate(self, i: int, mini_batch: int) -> Candidate:
        """Row ``i`` as a :class:`Candidate` (without GPUs)."""
        stage = ModelStage.parse(self.model_stage).stage
        dp, b = int(self.dp[i]), int(self.b[i])
        return Candidate(self.model_stage, int(self.tp[i]), int(self.pp[i]), dp,
                         micro_batch=b if stage != "generate" else 0,
                         grad_accum=mini_batch // (dp * b) if stage == "train" else 0,
                         recompute=RECOMPUTE_CODES[int(self.rc[i])],
                         concurrency=int(self.c[i]) if stage == "generate" else 0,
                         zero=int(self.z[i]), offload=OFFLOAD_CODES[int(self.o[i])], vpp=int(self.v[i]))


def even_dp_rows(workload, model_stage: str) -> int:
    """The count every dp of ``model_stage`` must divide under ``FrameworkSpec.even_dp`` (the
    runtime's batch split, ``run/driver.py``): generation the prompts and the rollouts
    (``gcd(prompts, global batch)``; ReMax's greedy rollouts are one per prompt), inference the global
    batch, ReMax's ``reward.infer`` also the prompts (it scores the greedy baselines); training's rule
    is ``dp·b·a = mini_batch`` already."""
    w = workload
    if model_stage.endswith(".generate") or (model_stage == "reward.infer" and w.algorithm == "remax"):
        return math.gcd(w.global_batch, w.prompts_per_step)
    return w.global_batch


def _distinct_load_dps(total: int, max_dp: int, divide: int | None = None) -> np.ndarray:
    """Smallest dp for every distinct value of ``ceil(total/dp)``, dp in 1..max_dp; with ``divide``
    only the dp dividing it (``FrameworkSpec.even_dp``: every such dp has its own load)."""
    dps = np.arange(1, max(max_dp, 0) + 1)
    if divide is not None:
        dps = dps[divide % dps == 0]
    if dps.size == 0:
        return dps
    load = -(-total // dps)
    keep = np.ones_like(dps, dtype=bool)
    keep[1:] = load[1:] != load[:-1]
    return dps[keep]


def _per_count(seqs: np.ndarray, cap: int | None = None):
    """Pairs ``(i, v)``: for each ``seqs[i]``, the smallest ``v`` of every distinct count
    ``ceil(seqs[i]/v)`` with ``v`` in ``1..min(seqs[i], cap)``, i.e. ``v = ceil(seqs[i]/w)`` for
    every count ``w``; ``i`` ascending, ``v`` ascending within an ``i``.

    Those values are ``ceil(s/w)`` for ``w ≤ √s`` and, below ``√s + 1``, every ``v`` with
    ``v = ceil(s/ceil(s/v))`` (``O(√s)`` values, found without scanning ``1..s``)."""
    seqs = np.asarray(seqs, dtype=np.int64)
    if seqs.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    k = int(np.sqrt(int(seqs.max()))) + 2
    w = np.arange(1, k + 1)
    s = seqs[:, None]
    v = np.concatenate([-(-s // w[None, :]), np.broadcast_to(w[None, :], (seqs.size, k))], axis=1)
    ok = (v <= s) & (v == -(-s // (-(-s // np.maximum(v, 1)))))
    if cap is not None:
        ok &= v <= cap
    v = np.where(ok, v, np.iinfo(np.int64).max)
    v.sort(axis=1)
    keep = v != np.iinfo(np.int64).max
    keep[:, 1:] &= v[:, 1:] != v[:, :-1]
    ii, jj = np.nonzero(keep)
    return ii.astype(np.int64), v[ii, jj]


def _layouts(cost: CostModel, ms: ModelStage, num_gpus: int) -> list[tuple[int, int]]:
    """(tp, pp) pairs of ``ms`` within ``num_gpus`` GPUs (see the module docstring)."""
    job = cost.job
    fw = job.framework
    model = cost.model_of(ms)
    uneven = fw.uneven_pp
    tp_cap = max(job.cluster.gpus_per_node, 8)
    tps = [t for t in range(1, min(tp_cap, num_gpus) + 1) if valid_tp(model, t) is None]
    pps = [p for p in range(1, min(model.num_layers, num_gpus) + 1)
           if valid_pp(model, p, uneven=uneven) is None]
    if ms.stage == "train" and not fw.model_parallel_train:
        tps, pps = [1], [1]
    if ms.stage != "generate" and not fw.pipeline_parallel:  # the training engine's passes: no pipeline
        pps = [1]
    if ms.stage == "infer" and not fw.model_parallel_train:  # they run on the training engine: no TP either
        tps = [1]
    return [(t, p) for t in tps for p in pps if t * p <= num_gpus]


def _expand(layouts, tdp: np.ndarray, cols: dict, num_gpus: int) -> dict:
    """Rows ``(tp, pp) x template rows with dp ≤ num_gpus/(tp·pp)``; ``tdp`` sorted ascending."""
    tl = np.array([t for t, _ in layouts], dtype=np.int64)
    pl = np.array([p for _, p in layouts], dtype=np.int64)
    ks = np.searchsorted(tdp, num_gpus // (tl * pl), side="right")
    tot = int(ks.sum())
    starts = np.cumsum(ks) - ks
    idx = np.arange(tot) - np.repeat(starts, ks)
    out = {"tp": np.repeat(tl, ks), "pp": np.repeat(pl, ks), "dp": tdp[idx]}
    for k, v in cols.items():
        out[k] = v[idx]
    return out


def _infer_zero_rows(rows: dict, unsharded: bool) -> dict:
    """Inference rows of a framework with ZeRO-3: every row with ``dp > 1`` again with ``z = 3``
    (weights sharded over DP), next to the unsharded rows when the framework has a lower stage
    (``unsharded``), else instead of them (a ``dp = 1`` row is always ``z = 0``)."""
    k = rows["dp"].size
    if unsharded:
        idx = np.concatenate([np.arange(k), np.flatnonzero(rows["dp"] > 1)])
        z = np.r_[np.zeros(k, dtype=np.int64), np.full(idx.size - k, 3, dtype=np.int64)]
        return {c: v[idx] for c, v in rows.items()} | {"z": z}
    return rows | {"z": np.where(rows["dp"] > 1, 3, 0).astype(np.int64)}


def enumerate_candidates(cost: CostModel, ms: ModelStage, num_gpus: int, multi_node: bool,
                         recompute_modes: tuple[str, ...] | None = None,
                         min_micro_batch: int = 1, min_train_replicas: int = 1,
                         gpus_free: bool = False, drop_dominated: bool = False) -> CandidateSet:
    """All candidates of ``ms`` on at most ``num_gpus`` GPUs, with time and memory columns.

    ``recompute_modes`` overrides the workload's choice (the urgent path may force ``full``).
    ``gpus_free``: the caller only needs, of every candidate, one no slower and no larger in memory
    on at most ``num_gpus`` GPUs (a model-stage alone in its stage of a synchronous job: its GPU
    count only has to fit the pool). Generation then keeps, per layout, only the smallest replica
    count ``dp*`` of the least per-replica load ``s*`` the pool allows (its concurrencies reduced
    per wave count as usual). A row ``(dp, c)`` (load ``s ≥ s*``, ``c ≤ s``) is matched by a kept
    row of the same layout and offload: the time of one wave and the memory depend on (tp, pp, c,
    offload) only (:meth:`nereus.cost.model.CostModel.candidate_arrays`); with ``c ≤ s*``,
    ``(dp*, c)`` has the same wave and memory and no more waves (``ceil(s*/c) ≤ ceil(s/c)``); with
    ``c > s*``, ``(dp*, s*)`` runs one wave no longer than one of ``c`` and holds no more memory.
    Premises (checked by ``tests/test_planner_space.py``): one wave's time and the transient
    bytes are non-decreasing in the concurrency, and at a fixed wave count so is the time.
    ``drop_dominated``: leave out ``host`` offload where ``drop`` is allowed and never slower with
    the same GPUs and memory: frozen models (reload once, ``S/B`` against ``2·S/B``) and generation
    (its weights come back with the weight sync it pays anyway; :func:`nereus.cost.latency.offload_times`).
    """
    job = cost.job
    w = job.workload
    fw = job.framework
    model = cost.model_of(ms)
    train = ms.stage == "train"
    layouts = _layouts(cost, ms, num_gpus)
    if recompute_modes is None:
        recompute_modes = ("none", "full") if w.recompute == "auto" else (w.recompute,)
    rc_codes = [RECOMPUTE_CODES.index(r) for r in recompute_modes] if train else [0]
    offloads = sorted(OFFLOAD_CODES.index(o) for o in fw.offload_modes(ms.name))
    host, drop = OFFLOAD_CODES.index("host"), OFFLOAD_CODES.index("drop")
    if drop_dominated and host in offloads and drop in offloads and (
            ms.model in FROZEN_MODELS or ms.stage == "generate"):
        offloads.remove(host)
    zeros = sorted(set(fw.zero_stages) - {0}) if train and min_train_replicas <= 1 else []  # SearchOptions
    max_v = fw.max_virtual_stages if train else 1
    i64 = np.int64
    if not layouts:
        rows = None
    elif train:
        mini = w.mini_batch_size
        bmax = w.micro_batch_size
        bs = [b for b in range(1, bmax + 1) if not (b < min_micro_batch and b < bmax) and mini % b == 0]
        pairs = sorted((d, b) for b in bs for d in range(min_train_replicas, min(num_gpus, mini // b) + 1)
                       if (mini // b) % d == 0)
        if pairs:
            tdp = np.array([d for d, _ in pairs], dtype=i64)
            rows = _expand(layouts, tdp, {"b": np.array([b for _, b in pairs], dtype=i64)}, num_gpus)
            m = mini // (rows["dp"] * rows["b"])
            # ZeRO: stage 0 always (one replica shards nothing), the framework's stages with dp > 1
            # unless it lacks stage 0, then dp = 1 only keeps stage 0
            blocks = []
            z0 = np.ones(m.shape, bool) if 0 in fw.zero_stages else rows["dp"] == 1
            blocks.append((z0, 0, 1))
            for z in zeros:
                blocks.append((rows["dp"] > 1, z, 1))
            if max_v > 1:
                L = model.num_layers
                for v in range(2, max_v + 1):
                    ok_v = (rows["pp"] > 1) & (L % (rows["pp"] * v) == 0) & (m % rows["pp"] == 0)
                    if not ok_v.any():
                        continue
                    blocks.append((ok_v & z0, 0, v))
                    for z in zeros:
                        blocks.append((ok_v & (rows["dp"] > 1), z, v))
            sel = [np.nonzero(mask)[0] for mask, _, _ in blocks]
            idx = np.concatenate(sel)
            zc = np.concatenate([np.full(s.size, z, dtype=i64) for s, (_, z, _) in zip(sel, blocks)])
            vc = np.concatenate([np.full(s.size, v, dtype=i64) for s, (_, _, v) in zip(sel, blocks)])
            rows = {k: v[idx] for k, v in rows.items()} | {"z": zc, "v": vc}
        else:
            rows = None
    elif ms.stage == "infer":
        even = even_dp_rows(w, ms.name) if fw.even_dp else None
        dps = _distinct_load_dps(w.global_batch, num_gpus, even)
        ii, bb = _per_count(-(-w.global_batch // dps), w.infer_micro_batch_size)
        rows = _expand(layouts, dps[ii], {"b": bb}, num_gpus) if ii.size else None
        if rows is not None and 3 in fw.zero_stages:  # a ZeRO-3/FSDP engine may run the pass sharded
            rows = _infer_zero_rows(rows, any(z < 3 for z in fw.zero_stages))
    else:  # generate: every (dp, concurrency) pair, concurrency reduced per wave count
        even = even_dp_rows(w, ms.name) if fw.even_dp else None
        dps = _distinct_load_dps(w.rollouts_per_step, num_gpus, even)
        ii, cc = _per_count(-(-w.rollouts_per_step // dps))
        rows = _expand(layouts, dps[ii], {"c": cc}, num_gpus) if ii.size else None
        if rows is not None and gpus_free and rows["dp"].size:
            top = dps[np.searchsorted(dps, num_gpus // (rows["tp"] * rows["pp"]), side="right") - 1]
            keep = rows["dp"] == top  # dp*: the smallest replica count of the least load s*
            rows = {k: v[keep] for k, v in rows.items()}
    if rows is None or rows["dp"].size == 0:
        empty = np.zeros(0, dtype=i64)
        return CandidateSet(ms.name, *([empty] * 7), np.zeros(0), np.zeros(0), np.zeros(0))
    k = rows["dp"].size
    for col, default in (("b", 1), ("c", 0), ("z", 0), ("v", 1)):
        if col not in rows:
            rows[col] = np.full(k, default, dtype=i64)
    # recompute and offload modes multiply the rows
    reps = [(rc, o) for o in offloads for rc in rc_codes]
    cols = {c: np.tile(rows[c], len(reps)) for c in ("tp", "pp", "dp", "b", "c", "z", "v")}
    cols["rc"] = np.repeat(np.array([rc for rc, _ in reps], dtype=i64), k)
    cols["o"] = np.repeat(np.array([o for _, o in reps], dtype=i64), k)
    a = cost.candidate_arrays(ms, cols["tp"], cols["pp"], cols["dp"], micro_batch=cols["b"],
                              recompute=cols["rc"], concurrency=cols["c"], zero=cols["z"], offload=cols["o"],
                              vpp=cols["v"], multi_node=multi_node)
    return CandidateSet(ms.name, n=cols["tp"] * cols["pp"] * cols["dp"], t=np.array(a["time"], dtype=float),
                        r=np.array(a["resident"], dtype=float), x=np.array(a["transient"], dtype=float),
                        detail=a.get("detail"), **cols)


def frontier(cs: CandidateSet, usable: float, cross: bool = True, alone: bool = False) -> CandidateSet:
    """Candidates that fit ``usable`` bytes on their own and lie on the (GPUs, time) staircase of
    their memory class (same resident and transient bytes): within a class a candidate with no
    fewer GPUs and no less time is dominated. Across classes, a candidate is dropped when one of a
    class with no more resident and transient bytes has no more GPUs and time
    (:func:`_dominated_across_classes`; ``cross=False`` skips it: a model-stage alone in its stage
    gains little from it); the rest of the cross-class dominance is left to the search's memory
    filters. ``alone``: the model-stage is alone in its stage, where the search scans its rows once
    per transient bound with a (resident, time) running minimum: only the fit filter is applied
    (the staircases would cost more than they save). The result is sorted by GPUs, then time."""
    idx = np.flatnonzero((cs.r + cs.x) <= usable)
    if idx.size <= 1 or alone:
        return cs.take(idx[np.lexsort((cs.t[idx], cs.n[idx]))])
    r, x, n, t = cs.r[idx], cs.x[idx], cs.n[idx], cs.t[idx]
    # 2-D staircase per exact memory class (r, x): rows sorted by class, then GPUs, then time (one
    # integer key for class and GPUs), then a segmented running minimum of time.
    _, ri = np.unique(r, return_inverse=True)
    _, xi = np.unique(x, return_inverse=True)
    cls = ri.astype(np.int64) * (int(xi.max()) + 1) + xi
    key = cls * (int(n.max()) + 1) + n
    # rows by (class, GPUs) (a stable integer sort; rows of one key keep their order): in each
    # (class, GPUs) group only its first fastest row can be on the staircase, and it is when it is
    # faster than every earlier group of its class (the same rows, in the same order, as a running
    # minimum over the rows sorted by (class, GPUs, time), without sorting by time)
    order = np.argsort(key, kind="stable")
    ks, ts = key[order], t[order]
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    gid = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, ks.size]))
    gmin = np.minimum.reduceat(ts, starts)
    cand = np.flatnonzero(ts == gmin[gid])
    rep = cand[np.r_[True, gid[cand[1:]] != gid[cand[:-1]]]]  # first fastest row of each group
    c = cls[order[starts]]
    new_class = np.ones(starts.size, dtype=bool)
    new_class[1:] = c[1:] != c[:-1]
    span = float(ts.max() - ts.min()) + 1.0
    shifted = gmin - np.cumsum(new_class) * span * 2.0
    keep = np.ones(starts.size, dtype=bool)
    keep[1:] = shifted[1:] < np.minimum.accumulate(shifted)[:-1]
    sel = order[rep[keep]]
    if cross:
        sel = sel[_dominated_across_classes(n[sel], t[sel], ri[sel], xi[sel]) == 0]
    sel = sel[np.lexsort((t[sel], n[sel]))]
    return cs.take(idx[sel])


#: largest (resident levels x transient levels x GPU counts) grid for the cross-class prune
CROSS_CLASS_GRID = 1 << 17


def _levels(idx: np.ndarray, cap: int):
    """Ranks of the non-negative integers ``idx`` mapped to at most ``cap`` monotone buckets;
    ``(buckets, count, exact)``: exact when every level keeps a bucket of its own."""
    present = np.zeros(int(idx.max()) + 1, dtype=np.int64)
    present[idx] = 1
    ranks = np.cumsum(present) - 1  # non-negative integers: ranks by counting, no sort
    rank = ranks[idx]
    L = int(ranks[-1]) + 1
    if L <= cap:
        return rank, L, True
    return rank * cap // L, cap, False


def _dominated_across_classes(n, t, ri, xi) -> np.ndarray:
    """1 for rows dominated by another row with no more GPUs, time, resident and transient bytes
    (less in at least one): such a row can be swapped for that one in any plan (every mode's GPU,
    time and memory terms are monotone in the four), so dropping it keeps the search exact.

    Computed on a (resident, transient, GPUs) grid of running minima of time. A dimension with more
    levels than the grid allows is bucketed (monotone); a dominator is then only taken from a
    strictly lower bucket of it, which still guarantees ``≤`` there (sound, pruning a little less).
    The grid has at most :data:`CROSS_CLASS_GRID` cells."""
    out = np.zeros(n.size, dtype=np.int8)
    if n.size < 2:
        return out
    nb, ln, n_exact = _levels(n, 256)
    room = max(CROSS_CLASS_GRID // ln, 4)
    side = max(int(np.sqrt(room)), 2)
    rb, lr, r_exact = _levels(ri, side)
    xb, lx, x_exact = _levels(xi, max(room // lr, 2))
    f = np.full((ln, lr, lx), np.inf)
    np.minimum.at(f, (nb, rb, xb), t)
    np.minimum.accumulate(f, axis=0, out=f)
    np.minimum.accumulate(f, axis=1, out=f)
    k = 1
    while k < lx:  # running minimum along the last axis by doubling (accumulate is slow there)
        np.minimum(f[:, :, k:], f[:, :, :-k], out=f[:, :, k:])
        k *= 2
    best = np.full(n.size, np.inf)
    if r_exact and x_exact and n_exact:
        queries = [(rb - 1, xb, nb), (rb, xb - 1, nb), (rb, xb, nb - 1)]
    else:  # one strict (bucketed) dimension excludes the row itself
        queries = [(rb - (0 if r_exact else 1), xb - (0 if x_exact else 1), nb - (0 if n_exact else 1))]
    for qr, qx, qn in queries:
        ok = (qr >= 0) & (qx >= 0) & (qn >= 0)
        best = np.where(ok, np.minimum(best, f[np.maximum(qn, 0), np.maximum(qr, 0), np.maximum(qx, 0)]), best)
    out[t >= best] = 1
    return out


def latency_frontier(cs: CandidateSet) -> CandidateSet:
    """The 2-D latency-vs-GPUs frontier (for display): fastest candidate per GPU count, dropping
    those no faster than a candidate with fewer GPUs."""
    if len(cs) == 0:
        return cs
    order = np.lexsort((cs.t, cs.n))
    t = cs.t[order]
    prev = np.minimum.accumulate(t)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = t[1:] < prev[:-1]
    return cs.take(order[keep])
