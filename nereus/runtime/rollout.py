"""Rollout generation with a KV cache inside an EMU's TP/PP layout.

Prefill runs the prompts ``[B, P]`` through the pipeline once; each decode step feeds one token per
sequence through every PP rank, extending each rank's KV cache ``[B, g_local, P+R, d]``. The last PP
rank picks the next token (identical on its TP ranks, whose logits are all-gathered) and broadcasts
it over the EMU group so the first rank can embed it.

Sampling is layout-independent: sequence ``i`` draws its Gumbel noise ``[V]`` at each step from its
own generator seeded by ``seeds[i]`` (derived from its *global* sample index), so the token choice
``argmax(logits/temperature + gumbel)`` (the Gumbel-max form of temperature sampling) does not depend
on dp, tp, pp or the batch it ran in; the noise is drawn step by step (``[B_active, V]``), never as a
``[B, R, V]`` tensor. ``greedy=True`` takes ``argmax(logits)`` (ReMax's baseline).
Once a sequence emits ``eos_id`` the rest of it is ``pad_id`` and masked out, and it leaves the decode
batch: its rows of the KV cache are dropped (every rank knows which, from the broadcast tokens), so
finished sequences cost no further decode work. Left-padded prompts (``model.pad_id``) keep their
padding masked out and their positions counted from the first real token.
"""

from __future__ import annotations

import torch

from nereus.runtime.model import LlamaShard, left_pad

__all__ = ["generate", "response_mask"]


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, R]`` float mask: 1 up to and including the first EOS (all ones if none)."""
    is_eos = (responses == eos_id).int()
    before = torch.cumsum(is_eos, 1) - is_eos  # EOS tokens strictly before this position
    return (before == 0).float()


@torch.no_grad()
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
    if len(seeds) != B:
        raise ValueError(f"generate: {len(seeds)} seeds for {B} prompts")
    if R < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {R}")
    if not greedy and not temperature > 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature}")
    if P + R > model.spec.max_position_embeddings:
        raise ValueError(f"generate: prompt {P} + response {R} exceeds max_position_embeddings "
                         f"{model.spec.max_position_embeddings}")
    ctx, V, h = model.ctx, model.spec.vocab_size, model.spec.hidden_size
    cache = model.new_cache(B, P + R)
    model.meter.set_static("kv_cache", cache.nbytes)
    gens = [torch.Generator().manual_seed(int(sd)) for sd in seeds] if ctx.is_last and not greedy else None
    out = torch.full((B, R), pad_id, dtype=torch.long, device=model.device)
    active = torch.arange(B, device=model.device)  # rows of ``out`` still decoding, in cache order
    last_root = ctx.emu_rank(ctx.pp - 1, 0)
    tok = prompts.to(model.device)
    lpad = left_pad(tok, model.pad_id)
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
            logits = y[:, -1].float()
            if greedy:
                nxt = logits.argmax(-1)
            else:
                g = torch.stack([-torch.log(-torch.log(torch.rand(V, generator=gens[int(i)]).clamp_(1e-20, 1 - 1e-7)))
                                 for i in active.tolist()]).to(model.device)
                nxt = (logits / temperature + g).argmax(-1)
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
    model.meter.drop_static("kv_cache")
    return out.cpu()
