"""Candidate enumeration and the latency-vs-GPUs frontier per model-stage (DESIGN.md §4.4 steps 1-2).

The plan space of one model-stage:

* TP: powers of two that divide the query heads and the MLP width and divide, or are a multiple of,
  the KV heads (KV heads are then replicated); at most ``max(gpus_per_node, 8)`` so TP stays inside
  a node when nodes are large enough (groups that cross nodes pay the NIC in the cost model);
* PP: powers of two dividing the layers;
* DP: training needs ``dp·b·a = mini_batch`` (b a power of two up to the workload's micro-batch);
  inference and generation take any DP, and among DP degrees that give the same per-replica load
  (``ceil(B/dp)``) only the smallest is kept, since the others add GPUs for no speed;
* generation picks a concurrency (KV-cache budget) per replica from powers of two;
* training picks recompute ``none`` or ``full`` when the workload says ``auto``.

Candidates are held as NumPy columns (:class:`CandidateSet`) and evaluated by one elementwise call
of the cost model per model-stage. The frontier keeps candidates that fit memory on their own and
lie on the (GPUs, time) staircase of their memory class (same resident and transient bytes); the
memory columns stay because co-resident model-stages make them matter to the plan, and the search's
memory filters settle dominance across classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_pp, valid_tp
from nereus.planner.plan import Candidate
from nereus.workflow import ModelStage

__all__ = ["CandidateSet", "enumerate_candidates", "frontier", "latency_frontier"]

RECOMPUTE_CODES = ("none", "selective", "full")


@dataclass
class CandidateSet:
    """Columns of candidates of one model-stage (all arrays of equal length)."""

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

    def __len__(self) -> int:
        return int(self.n.shape[0])

    def take(self, idx) -> CandidateSet:
        f = {k: getattr(self, k)[idx] for k in ("tp", "pp", "dp", "b", "rc", "c", "n", "t", "r", "x")}
        return CandidateSet(self.model_stage, **f)

    def candidate(self, i: int, mini_batch: int) -> Candidate:
        """Row ``i`` as a :class:`Candidate` (without GPUs)."""
        stage = ModelStage.parse(self.model_stage).stage
        dp, b = int(self.dp[i]), int(self.b[i])
        return Candidate(self.model_stage, int(self.tp[i]), int(self.pp[i]), dp,
                         micro_batch=b if stage != "generate" else 0,
                         grad_accum=mini_batch // (dp * b) if stage == "train" else 0,
                         recompute=RECOMPUTE_CODES[int(self.rc[i])],
                         concurrency=int(self.c[i]) if stage == "generate" else 0)


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _distinct_load_dps(total: int, max_dp: int) -> np.ndarray:
    """Smallest dp for every distinct value of ``ceil(total/dp)``, dp in 1..max_dp."""
    dps = np.arange(1, max(max_dp, 0) + 1)
    if dps.size == 0:
        return dps
    load = -(-total // dps)
    keep = np.ones_like(dps, dtype=bool)
    keep[1:] = load[1:] != load[:-1]
    return dps[keep]


def enumerate_candidates(cost: CostModel, ms: ModelStage, num_gpus: int, multi_node: bool,
                         recompute_modes: tuple[str, ...] | None = None,
                         min_micro_batch: int = 1, min_train_replicas: int = 1) -> CandidateSet:
    """All candidates of ``ms`` on at most ``num_gpus`` GPUs, with time and memory columns.

    ``recompute_modes`` overrides the workload's choice (the urgent path may force ``full``).
    """
    job = cost.job
    w = job.workload
    model = cost.model_of(ms)
    tp_cap = max(job.cluster.gpus_per_node, 8)
    tps = [t for t in _pow2_upto(min(tp_cap, num_gpus)) if valid_tp(model, t) is None]
    pps = [p for p in _pow2_upto(min(model.num_layers, num_gpus)) if valid_pp(model, p) is None]
    if recompute_modes is None:
        recompute_modes = ("none", "full") if w.recompute == "auto" else (w.recompute,)
    rc_codes = [RECOMPUTE_CODES.index(r) for r in recompute_modes]
    parts: dict = {k: [] for k in ("tp", "pp", "dp", "b", "rc", "c")}

    def add(tp, pp, dps, b, rc, c):
        k = dps.shape[0]
        parts["tp"].append(np.full(k, tp, dtype=np.int64))
        parts["pp"].append(np.full(k, pp, dtype=np.int64))
        parts["dp"].append(dps.astype(np.int64))
        for name, v in (("b", b), ("rc", rc), ("c", c)):
            parts[name].append(np.full(k, v, dtype=np.int64) if np.ndim(v) == 0 else np.asarray(v, dtype=np.int64))

    for tp in tps:
        for pp in pps:
            max_dp = num_gpus // (tp * pp)
            if max_dp < 1:
                continue
            if ms.stage == "train":
                pairs = [(b, d) for b in _pow2_upto(w.micro_batch_size)
                         if not (b < min_micro_batch and b < w.micro_batch_size) and w.mini_batch_size % b == 0
                         for d in range(min_train_replicas, min(max_dp, w.mini_batch_size // b) + 1)
                         if (w.mini_batch_size // b) % d == 0]
                if not pairs:
                    continue
                bs, dps = (np.array(v, dtype=np.int64) for v in zip(*pairs))
                for rc in rc_codes:
                    add(tp, pp, dps, bs, rc, 0)
            elif ms.stage == "infer":
                dps_all = _distinct_load_dps(w.global_batch, max_dp)
                seqs = -(-w.global_batch // dps_all)
                b2, d2 = np.meshgrid(np.array(_pow2_upto(w.infer_micro_batch_size)), dps_all, indexing="ij")
                ok = (b2 == 1) | (b2 <= seqs[None, :])
                if ok.any():
                    add(tp, pp, d2[ok], b2[ok], 0, 0)
            else:  # generate: every (dp, concurrency) pair
                dps = _distinct_load_dps(w.rollouts_per_step, max_dp)
                seqs = -(-w.rollouts_per_step // dps)
                d2, c2 = np.meshgrid(dps, np.array(_pow2_upto(2 * w.rollouts_per_step)), indexing="ij")
                s2 = np.broadcast_to(seqs[:, None], d2.shape)
                ok = (c2 <= s2) | ((c2 // 2) < s2)  # c == the least power of two >= seqs stays
                if ok.any():
                    add(tp, pp, d2[ok], 1, 0, np.minimum(c2[ok], s2[ok]))
    if not parts["dp"]:
        empty = np.zeros(0, dtype=np.int64)
        return CandidateSet(ms.name, *([empty] * 7), np.zeros(0), np.zeros(0), np.zeros(0))
    cols = {k: np.concatenate(v) for k, v in parts.items()}
    a = cost.candidate_arrays(ms, cols["tp"], cols["pp"], cols["dp"], micro_batch=cols["b"],
                              recompute=cols["rc"], concurrency=cols["c"], multi_node=multi_node)
    return CandidateSet(ms.name, n=cols["tp"] * cols["pp"] * cols["dp"], t=np.array(a["time"]),
                        r=np.array(a["resident"]), x=np.array(a["transient"]), **cols)


def frontier(cs: CandidateSet, usable: float) -> CandidateSet:
    """Candidates that fit ``usable`` bytes on their own and lie on the (GPUs, time) staircase of
    their memory class (same resident and transient bytes): within a class a candidate with no
    fewer GPUs and no less time is dominated. Across classes dominance is left to the search's
    memory filters. The result is sorted by GPUs, then time."""
    fits = (cs.r + cs.x) <= usable
    cs = cs.take(np.nonzero(fits)[0])
    if len(cs) <= 1:
        return cs
    # 2-D staircase per exact memory class (r, x), via a segmented running minimum over rows sorted
    # by class, then GPUs, then time. Rows come back sorted by (n, t), which the search relies on.
    order = np.lexsort((cs.t, cs.n, cs.x, cs.r))
    r, x, t = cs.r[order], cs.x[order], cs.t[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (r[1:] != r[:-1]) | (x[1:] != x[:-1])
    gid = np.cumsum(new_group)
    span = float(t.max() - t.min()) + 1.0
    shifted = t - gid * span * 2.0
    prev_min = np.minimum.accumulate(shifted)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = shifted[1:] < prev_min[:-1]
    cs = cs.take(order[keep])
    return cs.take(np.lexsort((cs.t, cs.n)))
    return cs


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
