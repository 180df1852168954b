"""ZeRO-3 parameter traffic per implementation (``FrameworkSpec.zero3_impl``).

``fsdp`` (the default) is :func:`nereus.cost.latency.dp_sync_time` with the prefetch overlap of
:func:`nereus.cost.overlap.overlap_dp`: PyTorch FSDP/FSDP2 flattens each wrapped block's parameters
into one buffer and all-gathers it with one collective (``all_gather_into_tensor``), so each
message is a whole block and NCCL spreads it over every channel and NIC; the next block's gather is
issued ahead of the current block's compute in forward (CPU run-ahead, ``forward_prefetch``) and in
backward (``backward_prefetch=BACKWARD_PRE``, the default), the reduce-scatter runs on its own
stream. ``deepspeed`` and ``deepspeed-2021`` are charged here.

**Flat gathers** (``deepspeed``, ``deepspeed-2021``). The default model (:func:`nereus.cost.latency.dp_sync_time`) charges a ZeRO-3 / FSDP group's
all-gathers and reduce-scatters hierarchically: inside a node over NVLink, and across nodes only each
rank's ``1/k`` share on its NIC (``k`` ranks per node), as NCCL's multi-channel rings over
rail-optimized NICs can. DeepSpeed ZeRO-3 at scale did not reach that: Narayanan et al. (SC'21,
arXiv:2104.04473, Table 2) measured GPT-175B under ZeRO-3 on DGX A100 nodes at 144, 88 and 44
TFLOP/s per GPU on 384, 768 and 1536 GPUs at a fixed batch, i.e. a constant iteration time once
communication dominates: the ``~4·(n-1)/n·W`` bytes of parameter gathers and gradient
reduce-scatters per GPU (W = 349 GB) in about 65 s is 21.5 GB/s per GPU, 86% of its 25 GB/s NIC:
every GPU's NIC carried the whole ring traffic, not a ``1/8`` share. The flat mode charges that:

* per micro-batch, one all-gather of each layer's weights in forward and one in backward, and one
  reduce-scatter of its gradients (ZeRO-3 gathers per layer, Rajbhandari et al. SC'20 §5.3), over all
  ``n`` ranks of the DP group;
* each collective's bytes at ``(n-1)/n·S`` per GPU over its NIC (op classes ``allgather@<nic>``,
  ``reducescatter@<nic>`` at their efficiencies) and its latency as a ring: ``(n-1)·α`` (NCCL runs
  all-gather and reduce-scatter only as rings; nccl-tests ``doc/PERFORMANCE.md``), ``α`` the NIC's
  ``scaleout_latency``, once per layer.

Groups inside one node keep the default model. DeepSpeed's ZeRO-3 gathers each sub-module's
parameters as it is about to run (per ``nn.Parameter`` partitions, Rajbhandari et al. SC'20 §5.3;
DeepSpeed ``stage3_prefetch_bucket_size``, default 5e7 elements, bounds what is fetched ahead), not
a block-sized flat buffer, which is what the flat charge stands for.

**Forward fetched on demand** (``deepspeed-2021``). DeepSpeed ZeRO-3 up to v0.4 (the one of the
SC'21 comparison, arXiv April 2021) skipped its forward prefetches (deepspeedai/DeepSpeed issue
#1069: the pre-module hook reset the step id after the first sub-module's hook incremented it, "the
rest of the step ids in the forward pass [were] off by 1, which was causing the prefetches to be
skipped"; fixed by PR #1170, June 2021) and each parameter all-gather synchronised the device
before the next one (PR #1188: "the async version is not async at all, because each all_gather
calls torch.cuda.synchronize()"). So each micro-batch's forward gather of the rank's weights adds
to the forward compute; the backward gathers and the reduce-scatters (``overlap_comm`` on its own
stream) overlap the backward only: window ``m · share · T_compute`` with ``share`` the backward's
part of a micro-batch's compute, 3/4 with full recompute (forward, recomputed forward, backward of
twice the forward) and 2/3 otherwise. Inference passes (forward only) of a ZeRO-3 engine
(:func:`zero3_infer_comm`): one gather per micro-batch, flat across nodes for both DeepSpeed kinds,
and with ``deepspeed-2021`` not overlapped.

Elementwise over NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.collectives import allgather_time
from nereus.cost.overlap import overlap_dp
from nereus.cost.shapes import max_layers_rank, params_rank

__all__ = ["flat_zero3_times", "zero3_train_comm", "zero3_infer_comm", "backward_share"]


def backward_share(recompute) -> np.ndarray:
    """The backward's share of a training micro-batch's compute: 3/4 with full recompute
    (``recompute`` code 2: forward 1, recomputed forward 1, backward 2), else 2/3."""
    return np.where(np.asarray(recompute) == 2, 0.75, 2.0 / 3.0)


def _where(mask, a: dict, b: dict) -> dict:
    """Per op class: ``a`` where ``mask``, else ``b`` (a missing class counts 0)."""
    return {k: np.where(mask, a.get(k, 0.0), b.get(k, 0.0)) for k in set(a) | set(b)}


def zero3_infer_comm(impl: str, comm: dict, last: dict, model, workload, cluster, eff, tp, pp, dp, zero,
                     micro_batches, overlap: bool) -> dict:
    """ZeRO-3 weight-gather op-class seconds per step of an inference model-stage, after overlap:
    ``comm`` is :func:`nereus.cost.sharded_infer.infer_gather_times`'s (before overlap). ``fsdp``:
    :func:`overlap_dp` when ``overlap``; ``deepspeed``: groups spanning nodes take the forward half
    of :func:`flat_zero3_times`'s all-gather (one gather per micro-batch) instead; ``deepspeed-2021``:
    the same, never overlapped (forward fetched on demand).

    Raises:
        ValueError: ``impl`` is not one of ``fsdp``, ``deepspeed``, ``deepspeed-2021``.
    """
    if impl not in ("fsdp", "deepspeed", "deepspeed-2021"):
        raise ValueError(f"zero3_impl must be one of ['fsdp', 'deepspeed', 'deepspeed-2021'], got {impl!r}")
    z3 = np.asarray(zero) >= 3
    if impl != "fsdp" and np.any(z3):
        flat, mask = flat_zero3_times(model, workload, cluster, eff, tp, pp, dp, micro_batches, workload.grad_bytes)
        flat = {k: 0.5 * v for k, v in flat.items() if k.startswith("allgather@")}
        comm = _where(mask & z3, flat, comm)
    if not overlap or impl == "deepspeed-2021":
        return comm
    return overlap_dp(comm, last, zero, micro_batches)


def zero3_train_comm(impl: str, comm: dict, last: dict, model, workload, cluster, eff, tp, pp, dp, zero,
                     micro_batches, reduce_bytes, recompute, overlap: bool) -> dict:
    """DP communication op-class seconds per optimizer step of training rows, after overlap, for
    ``impl`` (``FrameworkSpec.zero3_impl``): ``comm`` is :func:`nereus.cost.latency.dp_sync_time`'s
    (the default model, before overlap) and ``last`` the op-class seconds of one micro-batch on the
    last pipeline rank. Rows with ``zero < 3`` and ``impl="fsdp"`` get the default treatment
    (:func:`overlap_dp` when ``overlap``). ``deepspeed``: ZeRO-3 rows whose DP group spans nodes
    take :func:`flat_zero3_times` instead of ``comm``. ``deepspeed-2021``: also, on every ZeRO-3 row,
    half the all-gather seconds (the forward's) stay exposed and the rest overlaps a window of
    ``share · m · T_compute`` (:func:`backward_share`).

    Raises:
        ValueError: ``impl`` is not one of ``fsdp``, ``deepspeed``, ``deepspeed-2021``.
    """
    if impl not in ("fsdp", "deepspeed", "deepspeed-2021"):
        raise ValueError(f"zero3_impl must be one of ['fsdp', 'deepspeed', 'deepspeed-2021'], got {impl!r}")
    z3 = np.asarray(zero) >= 3
    default = overlap_dp(comm, last, zero, micro_batches) if overlap else comm
    if impl == "fsdp" or not np.any(z3):
        return default
    flat, mask = flat_zero3_times(model, workload, cluster, eff, tp, pp, dp, micro_batches, reduce_bytes)
    mine = _where(mask, flat, comm)
    if impl == "deepspeed":
        return _where(z3, overlap_dp(mine, last, zero, micro_batches) if overlap else mine, default)
    forward = {k: 0.5 * v for k, v in mine.items() if k.startswith("allgather@")}
    rest = {k: v - forward.get(k, 0.0) for k, v in mine.items()}
    if overlap:
        share = backward_share(recompute)
        rest = overlap_dp(rest, {k: v * share for k, v in last.items()}, zero, micro_batches)
    for k, v in forward.items():
        rest[k] = rest.get(k, 0.0) + v
    return _where(z3, rest, default)


def flat_zero3_times(model, workload, cluster, eff, tp, pp, dp, micro_batches, reduce_bytes) -> tuple:
    """``(times, mask)``: op-class seconds per optimizer step of the flat ZeRO-3 traffic of ``m``
    micro-batches (``micro_batches``) and the rows it applies to (DP groups spanning several nodes).

    ``times``: ``{"allgather@<nic>": 2·m·(T_bw(W) + L·(n-1)·α), "reducescatter@<nic>": m·(T_bw(G) +
    L·(n-1)·α)}`` with ``W = params_rank · param_bytes``, ``G = params_rank · reduce_bytes``, ``L`` the
    rank's layers and ``T_bw(S) = (n-1)/n · S / (B_nic · eff)``."""
    g = cluster.gpu
    tp, pp, dp = np.asarray(tp), np.asarray(pp), np.asarray(dp, dtype=float)
    m = np.asarray(micro_batches, dtype=float)
    mask = (tp * pp * dp > cluster.gpus_per_node) & (dp > 1)
    params = params_rank(model, tp, pp)
    layers = max_layers_rank(model, pp)
    lat = layers * np.maximum(dp - 1.0, 0.0) * g.scaleout_latency
    out = {}
    for kind, size, times in (("allgather", params * workload.param_bytes, 2.0),
                              ("reducescatter", params * reduce_bytes, 1.0)):
        bw = g.scaleout_bandwidth * eff.get(f"{kind}@{g.scaleout_link}", g)
        t = allgather_time(size, dp, bw, 0.0) + np.where(dp > 1, lat, 0.0)
        out[f"{kind}@{g.scaleout_link}"] = np.where(mask, times * m * t, 0.0)
    return out, mask
