"""Rollout generation with a KV cache inside an EMU's TP/PP layout.

Prefill runs the prompts ``[B, P]`` through the pipeline once; each decode step feeds one token per
sequence through every PP rank, extending each rank's KV cache ``[B, g_local, P+R, d]``. The last PP
rank picks the next token and broadcasts it over the EMU group so the first rank can embed it.

Vocab-parallel sampling: the logits are never gathered. Each TP rank of the last PP rank keeps its
vocab shard ``[b, V/tp]`` (ids ``lo .. lo+V/tp``), takes ``logits/temperature + gumbel`` over it (the
Gumbel-max form of temperature sampling; ``greedy=True``: the logits alone, ReMax's baseline) and its
local maximum, and the TP group all-gathers only ``(value, id)`` pairs ``[b, 2]``; the largest value wins,
the lowest id on ties (:func:`vocab_parallel_argmax`), so greedy decoding equals ``argmax`` over the
full vocabulary token for token.

Sampling is layout-independent: the noise of sequence ``i`` at decode step ``s`` for vocab id ``v`` is a
counter-based hash of ``(seeds[i], s, v)`` (:func:`gumbel_noise`; ``seeds[i]`` derives from the
*global* sample index), so any rank draws exactly the columns of its own shard, and the tokens do not
depend on dp, tp, pp or the batch a sequence ran in. Nothing ``[B, R, V]`` or ``[B, V]`` is allocated:
the noise is ``[b_active, V/tp]`` per rank and step.
Once a sequence emits ``eos_id`` the rest of it is ``pad_id`` and masked out, and it leaves the decode
batch: its rows of the KV cache are dropped (every rank knows which, from the broadcast tokens), so
finished sequences cost no further decode work. Left-padded prompts (``model.pad_id``) keep their
padding masked out and their positions counted from the first real token.
"""

from __future__ import annotations

import hashlib

import torch

from nereus.runtime.model.llama import LlamaShard, left_pad

__all__ = ["generate", "check_sampling", "response_mask", "gumbel_noise", "vocab_parallel_argmax"]

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of ``[0, 2**32)``), elementwise on int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seeds: list[int], step: int, lo: int, hi: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise ``[len(seeds), hi - lo]`` (fp32) of vocab ids ``lo .. hi-1`` at decode step
    ``step``: element ``[i, j]`` is a function of ``(seeds[i], step, lo + j)`` alone, so any column range is
    drawn without the others (counter-based, as Philox is on GPUs).

    Each ``(seed, step)`` gets two 32-bit keys ``k0, k1`` (BLAKE2b); id ``v`` gets
    ``x = fmix32(fmix32((v·0x9E3779B1 + k0) mod 2**32) xor k1)``, its top 24 bits give
    ``u = (x>>8 + 0.5) / 2**24`` in ``(0, 1)`` and the noise is ``-log(-log u)``.

    Raises:
        ValueError: ``lo > hi`` or ``lo < 0``.
    """
    if not 0 <= lo <= hi:
        raise ValueError(f"gumbel_noise: vocab range {lo}:{hi} is invalid")
    keys = []
    for sd in seeds:
        h = hashlib.blake2b(f"{int(sd)}/{int(step)}".encode(), digest_size=8).digest()
        keys.append((int.from_bytes(h[:4], "little"), int.from_bytes(h[4:], "little")))
    k = torch.tensor(keys, dtype=torch.int64, device=device).view(-1, 2)
    v = torch.arange(lo, hi, dtype=torch.int64, device=device)
    x = _fmix32((v[None, :] * 0x9E3779B1 + k[:, :1]) & _M32)
    x = _fmix32(x ^ k[:, 1:])
    u = ((x >> 8).float() + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(u))


def vocab_parallel_argmax(local: torch.Tensor, lo: int, vocab: int, group) -> torch.Tensor:
    """Global argmax ``[b]`` (int64 vocab ids) of scores split over a TP group by vocab.

    Args:
        local: this rank's scores ``[b, c]`` of ids ``lo .. lo+c-1`` (ids ``>= vocab`` are padding and
            never chosen).
        group: the TP group (``comm.Group``: ``size`` and ``all_gather``); ranks hold consecutive ranges.

    Returns:
        the id of the largest score, the lowest such id on ties (as ``torch.argmax`` over the full row),
        identical on every rank. Only ``[b, 2]`` ``(value, id)`` pairs cross the group.
    """
    c = local.shape[-1]
    if lo + c > vocab:
        local = local.clone()
        local[:, max(vocab - lo, 0):] = float("-inf")
    val, idx = local.max(-1)
    nxt = idx + lo
    if group is None or group.size == 1:
        return nxt
    pair = torch.stack([val.double(), nxt.double()], 1)  # fp32 values and ids are exact in fp64
    allp = torch.stack(group.all_gather(pair))  # [tp, b, 2], ranks in vocab order
    r = allp[:, :, 0].argmax(0)  # first rank with the maximum: the lowest id on ties
    return allp[r, torch.arange(allp.shape[1], device=allp.device), 1].long()


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, R]`` float mask: 1 up to and including the first EOS (all ones if none)."""
    is_eos = (responses == eos_id).int()
    before = torch.cumsum(is_eos, 1) - is_eos  # EOS tokens strictly before this position
    return (before == 0).float()


@torch.no_grad()
def check_sampling(batch: int, seeds: list[int], max_new_tokens: int, temperature: float, greedy: bool) -> None:
    """The sampling arguments every rollout engine takes (this one and ``vllm_engine.py``).

    Raises:
        ValueError: ``seeds`` length differs from ``batch``, ``max_new_tokens`` < 1, or a
            non-positive ``temperature`` when sampling.
    """
    if len(seeds) != batch:
        raise ValueError(f"generate: {len(seeds)} seeds for {batch} prompts")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature}")


def generate(model: LlamaShard, prompts: torch.Tensor, max_new_tokens: int, seeds: list[int],
             temperature: float = 1.0, greedy: bool = False, eos_id: int = 2, pad_id: int = 0) -> torch.Tensor:
    """Generate responses ``[B, R]`` (int64, R = max_new_tokens) for prompts ``[B, P]``.

    Collective over the EMU: every worker of the replica must call it with the same arguments.

    Raises:
        ValueError: ``seeds`` length differs from ``B``, non-positive ``max_new_tokens`` or
            ``temperature``, or ``P + R`` above the model's ``max_position_embeddings``.
    """
    B, P = prompts.shape
    R = int(max_new_tokens)
    check_sampling(B, seeds, R, temperature, greedy)
    if P + R > model.spec.max_position_embeddings:
        raise ValueError(f"generate: prompt {P} + response {R} exceeds max_position_embeddings "
                         f"{model.spec.max_position_embeddings}")
    ctx, V, h = model.ctx, model.spec.vocab_size, model.spec.hidden_size
    cache = model.new_cache(B, P + R)
    model.meter.set_static("kv_cache", cache.nbytes)
    out = torch.full((B, R), pad_id, dtype=torch.long, device=model.device)
    active = torch.arange(B, device=model.device)  # rows of ``out`` still decoding, in cache order
    last_root = ctx.emu_rank(ctx.pp - 1, 0)
    tok = prompts.to(model.device)
    lpad = left_pad(tok, model.pad_id)
    lo, c = model.local_vocab
    was_local, model.local_logits = model.local_logits, True  # the last rank keeps its vocab shard
    try:
        for s in range(R):
            start = 0 if s == 0 else P + s - 1
            b, T = tok.shape
            if ctx.is_first:
                inp = tok
            else:
                inp = torch.empty(b, T, h, dtype=model.dtype, device=model.device)
                ctx.emu_group.recv(inp, ctx.emu_rank(ctx.p - 1, ctx.t))
            y = model.forward(inp, start, cache, lpad)
            nxt = torch.empty(b, dtype=torch.long, device=model.device)
            if ctx.is_last:
                score = y[:, -1].float()  # [b, Vp/tp]
                if not greedy:
                    noise = gumbel_noise([seeds[i] for i in active.tolist()], s, lo, lo + c, model.device)
                    score = score / temperature + noise
                nxt = vocab_parallel_argmax(score, lo, V, ctx.tp_group)
            else:
                ctx.emu_group.send(y, ctx.emu_rank(ctx.p + 1, ctx.t))
            if ctx.pp > 1:
                ctx.emu_group.broadcast(nxt, last_root)
            out[active, s] = nxt
            keep = nxt != eos_id
            if not bool(keep.any()):
                break
            if not bool(keep.all()):  # finished sequences leave the batch and the cache
                for i in cache.k:
                    cache.k[i], cache.v[i] = cache.k[i][keep], cache.v[i][keep]
                active, nxt = active[keep], nxt[keep]
                lpad = None if lpad is None else lpad[keep]
            tok = nxt[:, None]
    finally:
        model.local_logits = was_local
        model.meter.drop_static("kv_cache")
    return out.cpu()
