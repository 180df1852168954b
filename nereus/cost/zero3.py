"""ZeRO-3 parameter traffic as flat per-layer rings across nodes (``EngineCosts.zero3_gather="flat"``).

The default model (:func:`nereus.cost.latency.dp_sync_time`) charges a ZeRO-3 / FSDP group's
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

Groups inside one node keep the default model. Elementwise over NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.collectives import allgather_time
from nereus.cost.shapes import max_layers_rank, params_rank

__all__ = ["flat_zero3_times"]


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
