"""Time of an inference pass run by a ZeRO-3 / FSDP engine (weights sharded over its DP group).

OpenRLHF runs its reference and reward models as DeepSpeed ZeRO-3 engines and computes the actor's
log-probs and the critic's values with the training engines; verl computes log-probs with its FSDP
actor and reference. Such an engine holds ``1/dp`` of the weights per GPU
(:func:`nereus.cost.memory.stage_memory`) and gathers each layer before running it: every forward
of a micro-batch all-gathers the rank's weights once (``W = params_rank · param_bytes``, the bytes
produced on every rank), ``m`` times per step for ``m`` micro-batches per replica (Rajbhandari et
al. SC'20 §5: stage 3 adds one all-gather of the parameters per forward; FSDP's ``forward_prefetch``
overlaps the next layer's gather with this layer's compute, which
:func:`nereus.cost.model.CostModel.candidate_arrays` applies when the framework overlaps).
"""

from __future__ import annotations

import numpy as np

from nereus.cost.latency import LinkModel
from nereus.cost.rows import expand, rows_of, unique_rows
from nereus.cost.shapes import params_rank

__all__ = ["infer_gather_times"]


def infer_gather_times(model, workload, cluster, eff, tp, pp, dp, zero, micro_batches) -> dict:
    """Seconds per step of the ZeRO-3 weight all-gathers of an inference model-stage, by op class
    (``allgather@<link>``), before overlap: ``m · t_allgather(W, dp)`` where ``zero >= 3``, 0
    elsewhere. Elementwise over arrays ``tp``, ``pp``, ``dp``, ``zero``, ``micro_batches`` (``m``).
    The group spans ``tp·pp·dp`` GPUs (:class:`~nereus.cost.latency.LinkModel` picks the link)."""
    dp = np.atleast_1d(np.asarray(dp))
    shape = dp.shape
    tp, pp = np.broadcast_to(np.asarray(tp), shape), np.broadcast_to(np.asarray(pp), shape)
    zero, m = np.asarray(zero), np.asarray(micro_batches)
    first, inv = unique_rows(shape, tp, pp, dp)  # one all-gather per distinct (tp, pp, dp)
    ut, up, ud = rows_of(first, tp, pp, dp)
    w = params_rank(model, ut, up) * workload.param_bytes
    ag = expand(LinkModel(cluster, eff).time("allgather", w, ud, span=ut * up * ud), inv)
    return {k: np.where(zero >= 3, v * m, 0.0) for k, v in ag.items()}
