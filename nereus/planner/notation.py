"""One plan notation for every printed plan: ``tp2 pp1 dp4 on workers 0-7``.

A candidate prints as its degrees then its GPU set in compact ranges (``0-3,8-11``); batch choices
follow in brackets when asked for (``b2 a64``: micro-batch and gradient-accumulation steps of a
training model-stage, ``c256``: generation concurrency per replica, ``rc:full``: activation
recomputation). Framework choices always follow the degrees when set: ``z1`` (ZeRO stage),
``v2`` (virtual pipeline stages), ``off:host`` / ``off:drop`` (idle state offloaded to host memory or
dropped and reloaded). ``unit`` names what the ids count: ``GPUs`` in plans of GPU clusters, ``workers``
for the CPU worker processes of ``nereus run``. A plan prints one model-stage per line.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["format_gpus", "format_candidate", "format_plan", "format_batch"]


def format_gpus(gpus: Iterable[int]) -> str:
    """Sorted ids as compact ranges: ``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``; ``"-"`` when empty."""
    gs = sorted(set(int(g) for g in gpus))
    if not gs:
        return "-"
    out, start, prev = [], gs[0], gs[0]
    for g in gs[1:] + [None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return ",".join(out)


def format_batch(c) -> str:
    """Batch choices of a candidate: ``b2 a64 rc:full`` (training), ``b8`` (inference), ``c256``."""
    parts = []
    if getattr(c, "micro_batch", 0):
        parts.append(f"b{c.micro_batch}")
    if getattr(c, "grad_accum", 0):
        parts.append(f"a{c.grad_accum}")
    if getattr(c, "concurrency", 0):
        parts.append(f"c{c.concurrency}")
    if getattr(c, "recompute", "none") not in ("none", ""):
        parts.append(f"rc:{c.recompute}")
    return " ".join(parts)


def format_candidate(c, unit: str = "workers", batch: bool = False) -> str:
    """``"tp2 pp1 dp4 on workers 0-7"``; with ``batch``, ``"tp2 pp1 dp4 (b2 a64) on workers 0-7"``.

    ``c`` is a :class:`~nereus.spec.plan.Candidate` (anything with ``tp, pp, dp, gpus``); an
    unplaced candidate (no GPUs) prints without the ``on ...`` part.
    """
    s = f"tp{c.tp} pp{c.pp} dp{c.dp}"
    if getattr(c, "zero", 0):
        s += f" z{c.zero}"
    if getattr(c, "vpp", 1) > 1:
        s += f" v{c.vpp}"
    if getattr(c, "offload", "none") != "none":
        s += f" off:{c.offload}"
    if batch:
        b = format_batch(c)
        if b:
            s += f" ({b})"
    gpus = tuple(getattr(c, "gpus", ()) or ())
    if gpus:
        s += f" on {unit} {format_gpus(gpus)}"
    return s


def format_plan(plan, unit: str = "workers", batch: bool = False, indent: str = "") -> str:
    """One line per model-stage: ``actor.train      tp2 pp1 dp2 on workers 0-3``."""
    cands = list(plan.candidates)
    width = max((len(c.model_stage) for c in cands), default=0)
    return "\n".join(f"{indent}{c.model_stage:<{width}}  {format_candidate(c, unit, batch)}" for c in cands)
