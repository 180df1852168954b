"""Pipeline-parallel execution over micro-batches inside one EMU (1F1B or GPipe schedule).

Every TP rank of PP rank ``p`` receives its activations ``[b, T, h]`` from the same TP rank of
``p-1`` and sends its output to ``p+1`` (emu-group point-to-point); gradients flow back the same way.
Sends are asynchronous and only receives block, so neighbours that send to each other at the same
moment (as 1F1B's steady state does) never wait on each other. Messages between two ranks keep their
order per direction, so micro-batch ``m``'s activation always meets micro-batch ``m``'s receive.

Every rank receives the micro-batch's token ids, so each derives the same left padding from them
(``model.left_pad``) without it travelling with the activations.

Schedules: GPipe (Huang et al. 2019) and 1F1B (PipeDream-flush, Narayanan et al. 2021; Megatron's
default); both have bubble ``(pp-1)/(m+pp-1)``; 1F1B keeps at most ``pp-p`` micro-batches of
activations alive on PP rank ``p`` instead of ``m``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nereus.runtime.model.llama import LlamaShard, left_pad

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
            out = model.forward(inp, lpad=left_pad(ids, model.pad_id))
            if ctx.is_last:
                outs.append(out)
            else:
                _send_next(model, out)
    return outs if ctx.is_last else None


def forward_backward(model: LlamaShard, micro_tokens: list[torch.Tensor],
                     loss_fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, dict]],
                     schedule: str = "1f1b", track: bool = True) -> list[dict] | None:
    """Forward and backward every micro-batch; gradients accumulate in ``model.params[..].grad``.

    Args:
        micro_tokens: token ids ``[b, T]`` per micro-batch (every rank of the EMU gets them).
        loss_fn: ``(last-rank output, micro-batch index) -> (scalar loss, metrics)``, already scaled
            so that summing over micro-batches and DP replicas gives the mini-batch loss.
        schedule: ``1f1b`` (PipeDream-flush / Megatron: ``pp-p-1`` warm-up forwards, then one forward
            one backward, then the remaining backwards; at most ``pp-p`` micro-batches of activations
            alive) or ``gpipe`` (all forwards, then all backwards). Same bubble ``(pp-1)/(m+pp-1)``.

    Returns:
        per-micro-batch metrics on the last PP rank, None elsewhere.

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"pipeline schedule must be '1f1b' or 'gpipe', got {schedule!r}")
    ctx, h = model.ctx, model.spec.hidden_size
    M = len(micro_tokens)
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    metrics: list[dict] = []
    sends: list[tuple] = []  # async sends: both neighbours may send at once, only receives block
    exclude = {id(w) for w in model.params.values()}

    def fwd(m: int) -> None:
        ids = micro_tokens[m]
        with model.meter.track_activations(exclude, model.params.values()) if track else _null():
            inp = ids if ctx.is_first else _recv_hidden(model, (ids.shape[0], ids.shape[1], h)).requires_grad_(True)
            out = model.forward(inp, lpad=left_pad(ids, model.pad_id))
            if ctx.is_last:
                out, met = loss_fn(out, m)
                metrics.append(met)
            else:
                sends.append(ctx.emu_group.isend(out, ctx.emu_rank(ctx.p + 1, ctx.t)))
        saved[m] = (None if ctx.is_first else inp, out)

    def bwd(m: int) -> None:
        inp, out = saved.pop(m)
        if ctx.is_last:
            out.backward()
        else:
            g = torch.empty_like(out)
            ctx.emu_group.recv(g, ctx.emu_rank(ctx.p + 1, ctx.t))
            out.backward(g)
        if inp is not None:
            sends.append(ctx.emu_group.isend(inp.grad, ctx.emu_rank(ctx.p - 1, ctx.t)))

    warmup = M if schedule == "gpipe" else min(ctx.pp - ctx.p - 1, M)
    for m in range(warmup):
        fwd(m)
    for i in range(M - warmup):
        fwd(warmup + i)
        bwd(i)
    for m in range(M - warmup, M):
        bwd(m)
    for s in sends:
        ctx.emu_group.wait(s)
    return metrics if ctx.is_last else None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
