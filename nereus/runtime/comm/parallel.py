"""The parallel context of one worker inside one model-stage: its (d, p, t) position and its groups.

Passed explicitly to the model and the engine, never a global (DESIGN.md §3). Worker order follows
the plan convention (``nereus/spec/plan.py``): ``workers[(d*pp + p)*tp + t]`` is DP replica ``d``,
PP rank ``p``, TP rank ``t``.

Groups built (only those this worker belongs to):

* ``tp``: the ``tp`` workers of (d, p); Megatron all-reduces.
* ``emu``: the ``tp·pp`` workers of replica d, group rank ``p·tp + t``; PP point-to-point and
  token broadcasts during generation.
* ``dp``: the ``dp`` workers at (p, t); gradient all-reduce.
* ``kv``: when ``tp`` exceeds the KV heads, the TP ranks holding the same replicated KV head;
  their partial k/v gradients are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from nereus.runtime.comm.groups import DEFAULT_TIMEOUT_S, Group, new_group
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.model.sharding import validate_layout
from nereus.spec.model import ModelSpec

__all__ = ["Layout", "ParallelContext", "build_context"]


@dataclass(frozen=True)
class Layout:
    """Degrees and worker ids of one model-stage.

    Raises:
        ValueError: degrees not positive or ``len(workers) != tp*pp*dp`` or repeated workers.
    """

    tp: int
    pp: int
    dp: int
    workers: tuple[int, ...]

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layout field {f!r} must be a positive integer, got {v!r}")
        if len(self.workers) != self.tp * self.pp * self.dp:
            raise ValueError(f"layout (tp={self.tp}, pp={self.pp}, dp={self.dp}) needs "
                             f"{self.tp * self.pp * self.dp} workers, got {len(self.workers)}: {self.workers}")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"layout workers repeat: {self.workers}")

    def worker(self, d: int, p: int, t: int) -> int:
        return self.workers[(d * self.pp + p) * self.tp + t]

    def position(self, worker: int) -> tuple[int, int, int]:
        """(d, p, t) of ``worker``."""
        i = self.workers.index(worker)
        return i // (self.tp * self.pp), (i // self.tp) % self.pp, i % self.tp

    def replica(self, d: int) -> tuple[int, ...]:
        k = self.tp * self.pp
        return self.workers[d * k:(d + 1) * k]


@dataclass
class ParallelContext:
    """One worker's place in a model-stage's layout and its communicators."""

    layout: Layout
    me: int
    d: int
    p: int
    t: int
    tp_group: Group
    emu_group: Group
    dp_group: Group
    kv_group: Group | None

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def is_first(self) -> bool:
        return self.p == 0

    @property
    def is_last(self) -> bool:
        return self.p == self.layout.pp - 1

    def emu_rank(self, p: int, t: int) -> int:
        return p * self.layout.tp + t


def build_context(spec: ModelSpec, layout: Layout, me: int, store: dist.Store, name: str, meter: Meter,
                  timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None) -> ParallelContext:
    """Build this worker's groups for ``layout``; every worker of the layout must call it.

    Args:
        name: unique prefix of this model-stage's groups (e.g. ``"e0/actor.train"``).
        device: the worker's device; a CUDA device gives NCCL groups (``comm.backend_for``).

    Raises:
        ValueError: invalid layout for ``spec`` or ``me`` not in the layout.
    """
    validate_layout(spec, layout.tp, layout.pp)
    if me not in layout.workers:
        raise ValueError(f"worker {me} is not in layout workers {layout.workers} of {name!r}")
    d, p, t = layout.position(me)
    L = layout
    # Build in one fixed order on every worker (tp, emu, dp, kv) so rendezvous never cross-wait.
    tp_g = new_group(store, f"{name}/tp/d{d}p{p}", tuple(L.worker(d, p, i) for i in range(L.tp)), me,
                     meter, timeout_s, device)
    emu_g = new_group(store, f"{name}/emu/d{d}", L.replica(d), me, meter, timeout_s, device)
    dp_g = new_group(store, f"{name}/dp/p{p}t{t}", tuple(L.worker(i, p, t) for i in range(L.dp)), me,
                     meter, timeout_s, device)
    kv_g = None
    g = spec.num_kv_heads
    if L.tp > g:
        r = L.tp // g
        j = t // r
        kv_g = new_group(store, f"{name}/kv/d{d}p{p}j{j}", tuple(L.worker(d, p, j * r + i) for i in range(r)),
                         me, meter, timeout_s, device)
    return ParallelContext(layout=L, me=me, d=d, p=p, t=t, tp_group=tp_g, emu_group=emu_g, dp_group=dp_g,
                           kv_group=kv_g)
