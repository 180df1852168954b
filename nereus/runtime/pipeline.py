"""Pipeline-parallel execution over micro-batches inside one EMU (GPipe schedule).

Every TP rank of PP rank ``p`` receives its activations ``[b, T, h]`` from the same TP rank of
``p-1`` and sends its output to ``p+1`` (emu-group point-to-point). Training runs all forwards, then
all backwards in the same micro-batch order, gradients flowing back with the same point-to-point
pattern: the GPipe schedule (Huang et al. 2019), bubble ``(pp-1)/(m+pp-1)``. All ranks walk the
micro-batches in one order, so the blocking gloo sends and receives always pair up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nereus.runtime.model import LlamaShard

__all__ = ["forward_only", "forward_backward"]


def _recv_hidden(model: LlamaShard, shape: tuple[int, ...]) -> torch.Tensor:
    ctx = model.ctx
    buf = torch.empty(shape, dtype=model.dtype, device=model.device)
    return ctx.emu_group.recv(buf, ctx.emu_rank(ctx.p - 1, ctx.t))


def _send_next(model: LlamaShard, x: torch.Tensor) -> None:
    ctx = model.ctx
    ctx.emu_group.send(x.detach(), ctx.emu_rank(ctx.p + 1, ctx.t))


def forward_only(model: LlamaShard, micro_tokens: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Forward every micro-batch ``[b, T]`` of token ids through the pipeline, without gradients.

    Returns:
        the last PP rank's outputs (logits ``[b, T, V]`` or values ``[b, T]``) per micro-batch on the
        last PP rank's workers; None on the others.
    """
    ctx, h = model.ctx, model.spec.hidden_size
    outs = []
    with torch.no_grad():
        for ids in micro_tokens:
            inp = ids if ctx.is_first else _recv_hidden(model, (ids.shape[0], ids.shape[1], h))
            out = model.forward(inp)
            if ctx.is_last:
                outs.append(out)
            else:
                _send_next(model, out)
    return outs if ctx.is_last else None


def forward_backward(model: LlamaShard, micro_tokens: list[torch.Tensor],
                     loss_fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, dict]],
                     track: bool = True) -> list[dict] | None:
    """Forward and backward every micro-batch; gradients accumulate in ``model.params[..].grad``.

    Args:
        micro_tokens: token ids ``[b, T]`` per micro-batch (every rank of the EMU gets them).
        loss_fn: ``(last-rank output, micro-batch index) -> (scalar loss, metrics)``, already scaled
            so that summing over micro-batches and DP replicas gives the mini-batch loss.

    Returns:
        per-micro-batch metrics on the last PP rank, None elsewhere.
    """
    ctx, h = model.ctx, model.spec.hidden_size
    exclude = {id(w) for w in model.params.values()}
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    metrics: list[dict] = []
    cm = model.meter.track_activations(exclude) if track else _null()
    with cm:
        for m, ids in enumerate(micro_tokens):
            if ctx.is_first:
                inp = ids
            else:
                inp = _recv_hidden(model, (ids.shape[0], ids.shape[1], h)).requires_grad_(True)
            out = model.forward(inp)
            if ctx.is_last:
                loss, met = loss_fn(out, m)
                metrics.append(met)
                saved.append((None if ctx.is_first else inp, loss))
            else:
                _send_next(model, out)
                saved.append((None if ctx.is_first else inp, out))
    for m in range(len(micro_tokens)):
        inp, out = saved[m]
        if ctx.is_last:
            out.backward()
        else:
            g = torch.empty_like(out)
            ctx.emu_group.recv(g, ctx.emu_rank(ctx.p + 1, ctx.t))
            out.backward(g)
        if inp is not None:
            ctx.emu_group.send(inp.grad.contiguous(), ctx.emu_rank(ctx.p - 1, ctx.t))
        saved[m] = (None, None)
    return metrics if ctx.is_last else None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
