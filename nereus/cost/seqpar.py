"""Sequence splitting across GPUs of a replica: Ulysses sequence parallelism and context parallelism.

A model-stage run with a sequence-split degree ``u`` (:attr:`nereus.spec.plan.Candidate.cp`) cuts
every sequence of a micro-batch into ``u`` pieces on ``u`` GPUs of its replica group:

* **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509 §3; verl
  ``ulysses_sequence_parallel_size``): each GPU holds ``s/u`` tokens outside attention; before
  attention an all-to-all trades the sequence split for a head split (q, k, v: each GPU then holds
  all ``s`` tokens of ``a/u`` heads) and after it a second all-to-all trades back (the output). Per
  layer and pass, each GPU sends ``(u-1)/u`` of a buffer of ``X = tokens · (2q + 2kv) · 2`` bytes
  (``tokens`` = ``s·b/u`` on the GPU; q, k, v and the output, bf16, ``/t`` under TP), which costs an
  all-gather of ``X`` over ``u`` ranks (``(u-1)/u·X/B``; :mod:`nereus.cost.collectives`).
* **context parallelism** (Megatron-Core ``context_parallel_size``, ring attention with causal load
  balancing; Liu et al. 2023 arXiv:2310.01889): each GPU keeps ``s/u`` queries and the K, V of the
  other ranks pass around the ring: per layer and pass each GPU receives ``(u-1)`` chunks of
  ``tokens · 2kv · 2`` bytes, an all-gather of the ``u`` chunks (``kind="ring"``).

Everything else follows from ``tokens = s·b/u`` per GPU: GEMM and memory-bound work, stored
activations and logits ``/u``; attention does ``a/u`` heads x ``s`` queries (Ulysses) or ``s/u``
queries x ``s`` keys (ring): ``1/u`` of the score FLOPs either way, i.e. the attention of ``s·b/u``
query tokens against a context of ``s``. Gradients, optimizer state and ZeRO shard over all
``dp·u`` GPUs (verl's FSDP shards over the whole pool; Megatron's distributed optimizer over DP x CP).
Training passes communicate in forward and backward (2x, 3x with full recompute), inference once.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.shapes import max_layers_rank

__all__ = ["SEQ_SPLIT_KINDS", "seq_split_comm", "with_seq_split"]

#: ``ulysses`` (all-to-all of q/k/v/output) or ``ring`` (K/V around a ring, Megatron CP)
SEQ_SPLIT_KINDS = ("ulysses", "ring")


def seq_split_comm(links, model, tokens, tp, layers, cp: int, passes, kind: str = "ulysses") -> dict:
    """Seconds by op class of one micro-batch's sequence-split communication on one GPU.

    Args:
        links: a :class:`nereus.cost.latency.LinkModel`.
        tokens: tokens of the micro-batch on one GPU (``s·b/cp``), arrays allowed.
        tp: tensor-parallel degree (heads split further).
        layers: layers on the pipeline rank.
        cp: the sequence-split degree ``u``; 1 costs nothing.
        passes: communicating passes per micro-batch (train 2, or 3 with full recompute; infer 1).
        kind: ``ulysses`` or ``ring``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in SEQ_SPLIT_KINDS:
        raise ValueError(f"sequence-split kind must be one of {SEQ_SPLIT_KINDS}, got {kind!r}")
    if cp <= 1:
        return {}
    tokens, tp = np.asarray(tokens, dtype=float), np.asarray(tp, dtype=float)
    if kind == "ulysses":
        size = tokens * (2.0 * model.q_dim + 2.0 * model.kv_dim) * 2.0 / tp
    else:
        size = tokens * cp * 2.0 * model.kv_dim * 2.0 / tp
    per = links.time("allgather", size, cp)
    k = np.asarray(passes, dtype=float) * layers
    return {c: t * k for c, t in per.items()}


def with_seq_split(job, eff, model, mid: dict, last: dict, tp, pp, micro_batch, recompute, cp: int,
                   stage: str) -> tuple[dict, dict]:
    """``(mid, last)`` per-micro-batch op-class times with the sequence-split communication of
    ``cp`` added to both (unchanged at ``cp = 1``): Ulysses under an FSDP framework (verl's
    ``ulysses_sequence_parallel_size``), ring attention otherwise (Megatron's context parallelism,
    OpenRLHF's ``--ds.ring_attn_size``). ``recompute``:
    codes (2 = full: three communicating passes); ``stage``: ``train`` or ``infer``."""
    if cp <= 1:
        return mid, last
    from nereus.cost.latency import LinkModel

    passes = 1 if stage == "infer" else np.where(np.asarray(recompute) == 2, 3, 2)
    kind = "ulysses" if "fsdp" in job.framework.name else "ring"
    tokens = job.workload.seq_len * np.asarray(micro_batch) / cp
    comm = seq_split_comm(LinkModel(job.cluster, eff), model, tokens, tp, max_layers_rank(model, pp), cp, passes, kind)

    def add(d):
        out = dict(d)
        for c, v in comm.items():
            out[c] = out.get(c, 0.0) + v
        return out

    return add(mid), add(last)
