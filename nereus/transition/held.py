"""Bytes of a target shard a GPU already holds: what a transition does not have to move.

:func:`resident_bytes` compares two (tp, pp) shard positions of one model (layer ranges times
tensor-slice overlap, replicated parts counted whole); :func:`held_bytes` does it for two EMUs on
one GPU, ZeRO slices included. Used by the transition cost (:mod:`nereus.transition.cost`) and the
DAG verifier (:mod:`nereus.transition.verify`)."""

from __future__ import annotations

import math

from nereus.cost.shapes import _layer_params_per_tp_rank, layers_of_rank, params_on_rank, replicated_per_layer
from nereus.spec.model import ModelSpec
from nereus.transition.emu import EMU, parts_of

__all__ = ["resident_bytes", "held_bytes"]

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


def _sharded(e: EMU, part: str) -> bool:
    """Whether ``part`` (``"w"`` weights, ``"o"`` optimizer state) is split over ``e``'s group."""
    return e.z > 1 and (e.zero >= 3 if part == "w" else e.zero >= 1)


def held_bytes(model: ModelSpec, bytes_per_param, src: EMU, src_gpu: int, dst: EMU, dst_gpu: int,
               optimistic: bool = False) -> int:
    """Bytes of ``dst``'s shard on ``dst_gpu`` already present in ``src``'s shard on ``src_gpu``.

    Two replicas (``z = 1``): :func:`resident_bytes` (unchanged). With a ZeRO group on either side
    the weights and the optimizer state (``bytes_per_param = (weights, optimizer)``,
    :func:`state_parts`) count apart; the fraction of a ``dst`` part present is

    * ``src`` holds the part whole: the TP/PP overlap ``f`` of the two shards (:func:`resident_bytes`
      per parameter, 1 at the same position), ``dst`` needing all of it or its slice;
    * ``src`` holds a slice, ``dst`` the whole part: the slice, ``params_src / (z_src·params_dst)``
      of it, when ``src``'s ``(p, t)`` shard lies inside ``dst``'s (its layers and TP slice, the
      embedding and head ranks; the same position or a larger ``dst`` shard, i.e. unsharding), else 0;
    * both hold slices: the overlap of ``[r/z, (r+1)/z)`` and ``[r*/z*, (r*+1)/z*)`` relative to
      the ``dst`` slice at the same ``(tp, pp, p, t)``;
    * a slice at another TP/PP layout: 0 (the flat buffers differ; errs towards moving more), or
      with ``optimistic`` (for the lower bound ``cost.min_bytes``) as much as could lie in ``dst``'s
      part, ``min(slice, TP/PP overlap)``.

    When ``src``'s shard lies inside ``dst``'s and ``dst`` shards nothing, everything ``src`` holds
    there is needed: ``min(dst bytes, src bytes)`` exactly. Otherwise rounded to the nearest byte,
    and ``dst``'s full bytes when the fraction is 1.
    """
    ps, ts = src.position(src_gpu)
    pd, td = dst.position(dst_gpu)
    total, pb, ob = parts_of(bytes_per_param)
    if src.z == 1 and dst.z == 1:
        return resident_bytes(model, total, (src.tp, src.pp, ps, ts), (dst.tp, dst.pp, pd, td))
    need = dst.shard_on(dst_gpu)
    same = (src.tp, src.pp, ps, ts) == (dst.tp, dst.pp, pd, td)
    if same:
        f, inside = 1.0, 1.0
    else:
        params = params_on_rank(model, dst.tp, dst.pp, pd)
        f = min(1.0, resident_bytes(model, 1, (src.tp, src.pp, ps, ts), (dst.tp, dst.pp, pd, td)) / max(params, 1))
        # src's whole (p, t) shard lies inside dst's (then so does any slice of it): its share of dst
        ls, ld = layers_of_rank(model.num_layers, src.pp, ps), layers_of_rank(model.num_layers, dst.pp, pd)
        nested = (ld.start <= ls.start and ls.stop <= ld.stop and _tp_overlap((td, dst.tp), (ts, src.tp)) >= 1 - 1e-12
                  and (ps != 0 or pd == 0) and (ps != src.pp - 1 or pd == dst.pp - 1))
        inside = min(1.0, params_on_rank(model, src.tp, src.pp, ps) / max(params, 1)) if nested else 0.0
    if inside and not (_sharded(dst, "w") or _sharded(dst, "o")):  # unsharding: all src holds is needed
        return min(need, src.shard_on(src_gpu))
    rs, rd = src.rank(src_gpu), dst.rank(dst_gpu)
    num = den = 0.0
    for part, bpp in (("w", pb), ("o", ob)):
        if bpp == 0:
            continue
        sd, ss = _sharded(dst, part), _sharded(src, part)
        weight = bpp / (dst.z if sd else 1)
        if not ss:
            cov = max(f, inside)  # a nested src shard counts whole (replicated KV heads included)
        elif not sd and inside:
            cov = inside / src.z
        elif not same:
            cov = 0.0
            if optimistic:  # the slice could be all inside dst's part, up to their TP/PP overlap
                pd_ = params_on_rank(model, dst.tp, dst.pp, pd)
                ps_ = params_on_rank(model, src.tp, src.pp, ps)
                cov = min(1.0, min(ps_ / src.z, f * pd_) / max(pd_ / (dst.z if sd else 1), 1e-300))
        else:
            lo = max(rs / src.z, rd / dst.z)
            hi = min((rs + 1) / src.z, (rd + 1) / dst.z)
            cov = max(0.0, hi - lo) * dst.z
        num += weight * cov
        den += weight
    frac = num / den if den else 1.0
    return need if frac >= 1.0 - 1e-12 else min(need, round(frac * need))
