"""Validity of a candidate for its model-stage, with errors that name the field, the value and
what would be valid (used by :meth:`nereus.cost.model.CostModel.estimate_candidate` and the
array API's training rows)."""

from __future__ import annotations

import numpy as np

from nereus.cost.shapes import valid_pp, valid_tp
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.workflow import ModelStage

__all__ = ["check_candidate", "check_train_batch"]


def check_candidate(job: JobSpec, ms: ModelStage, cand: Candidate) -> None:
    """Raise ValueError naming the field when ``cand`` cannot run ``ms`` of ``job``.

    Checked: tp/pp shard the model (pp may leave a remainder when the framework allows uneven
    stages), ``grad_accum`` matches the mini-batch, ZeRO for training (any stage) and inference (3:
    a ZeRO-3/FSDP engine) only, ``drop`` never for
    training state, interleaving only for training with ``pp > 1``, ``pp·vpp`` dividing the layers and
    the micro-batches per replica a multiple of ``pp`` (Megatron's interleaved-schedule rule).
    Whether the framework supports a feature is not checked here (the what-if reports it).
    """
    model = job.model(ms.model)
    where = f"candidate {cand.model_stage} ({cand.short()})"
    why = valid_tp(model, cand.tp) or valid_pp(model, cand.pp, uneven=job.framework.uneven_pp)
    if why:
        raise ValueError(f"{where}: {why}")
    mini = job.workload.mini_batch_size
    b = max(cand.micro_batch, 1)
    if ms.stage == "train" and cand.grad_accum and cand.dp * b * cand.grad_accum != mini:
        raise ValueError(f"{where}: grad_accum={cand.grad_accum} gives "
                         f"dp*micro_batch*grad_accum = {cand.dp}*{b}*{cand.grad_accum} = "
                         f"{cand.dp * b * cand.grad_accum}; valid: grad_accum = mini_batch_size/(dp*micro_batch)"
                         f" = {mini}/{cand.dp * b}" + ("" if mini % (cand.dp * b) else f" = {mini // (cand.dp * b)}"))
    if cand.zero and ms.stage == "generate":
        raise ValueError(f"{where}: zero={cand.zero}: generation engines do not shard weights over DP; valid: zero=0")
    if cand.zero in (1, 2) and ms.stage == "infer":
        raise ValueError(f"{where}: zero={cand.zero} shards optimizer state or gradients, which an inference "
                         f"model-stage has none of; valid: zero=0, or 3 (weights sharded over DP, a ZeRO-3/FSDP engine)")
    if cand.offload == "drop" and ms.stage == "train":
        raise ValueError(f"{where}: offload='drop' would lose training state; valid: 'none', 'host' or "
                         f"'cpu_adam'")
    if cand.vpp > 1:
        if ms.stage != "train" or cand.pp == 1:
            raise ValueError(f"{where}: vpp={cand.vpp} (interleaved pipeline) needs a training model-stage "
                             f"with pp > 1; valid: vpp=1")
        if model.num_layers % (cand.pp * cand.vpp):
            raise ValueError(f"{where}: pp*vpp = {cand.pp * cand.vpp} does not divide num_hidden_layers="
                             f"{model.num_layers}; valid: vpp dividing {model.num_layers}/pp")
        m = mini // (cand.dp * b) if mini % (cand.dp * b) == 0 else 0
        if m % cand.pp:
            raise ValueError(f"{where}: the interleaved schedule needs the {m} micro-batch(es) per replica to be a "
                             f"multiple of pp={cand.pp} (Megatron); valid: vpp=1 or a micro-batch count "
                             f"divisible by pp")


def check_train_batch(ms: ModelStage, mini: int, tp, pp, dp, b) -> None:
    """Raise ValueError naming the first row whose ``dp·b`` does not divide the mini-batch (zero
    micro-batches when it exceeds it; sequences dropped when it leaves a remainder)."""
    per = dp * b
    bad = (per > mini) | (mini % per != 0)
    if not np.any(bad):
        return
    i = int(np.flatnonzero(np.broadcast_to(bad, np.broadcast_shapes(np.shape(bad), np.shape(dp))))[0])
    row = [int(np.broadcast_to(np.asarray(v), np.shape(dp)).reshape(-1)[i]) for v in (tp, pp, dp, b)]
    t, p, d, mb = row
    where = f"candidate {ms.name} (tp{t} pp{p} dp{d} b{mb})"
    if d * mb > mini:
        raise ValueError(f"{where}: dp*micro_batch = {d}*{mb} = {d * mb} exceeds the job's mini_batch_size {mini} "
                         f"(zero micro-batches per replica); valid: dp*micro_batch dividing {mini}")
    if mini % d:
        raise ValueError(f"{where}: dp={d} does not divide the job's mini_batch_size {mini} (replicas would get "
                         f"unequal shares or drop {mini % d} sequence(s)); valid: a dp dividing {mini}")
    raise ValueError(f"{where}: micro_batch={mb} does not divide the {mini // d} sequences per replica "
                     f"(mini_batch_size {mini} / dp {d}); valid: a micro_batch dividing {mini // d}")
