"""ZeRO-1 for training EMUs: Adam state sharded over the DP group, composed with TP/PP (DESIGN.md §4.7).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20),
stage 1 ``P_os``; Megatron-LM's distributed optimizer is the same partitioning. Every DP rank at
(p, t) holds the same TP/PP parameter shards; ZeRO-1 flattens them, in the engine's name order, into
one vector of ``N`` elements, pads it to ``dp·k`` (``k = ceil(N / dp)``), and gives DP rank ``r``
the slice ``[r·k, (r+1)·k)``. Per optimizer step:

1. the fp32 gradients (bf16 runs: the fp32 main gradients) are **reduce-scattered** over the DP group
   (one collective, ``(dp-1)/dp·4N`` bytes sent per rank) instead of all-reduced: rank ``r`` receives
   the summed gradient of its slice only, and the full gradients are freed;
2. Adam updates rank ``r``'s slice of the master weights (fp32 runs: of the weights themselves) with
   its slice of ``exp_avg`` / ``exp_avg_sq``; Adam is elementwise, so the slice sees exactly the
   arithmetic the unsharded update does;
3. the updated slices, rounded to the weights' dtype, are **all-gathered** over the DP group
   (``(dp-1)·k·bytes`` sent per rank) and written into the weights.

Resident bytes per rank: weights ``+ (master + 2 moments) / dp`` (:attr:`Engine.state_bytes` counts
the slices; the cost model's ZeRO-1 optimizer term, cost-model.md §2.3). The step equals plain DP's up
to the order of the fp32 gradient sum (reduce-scatter vs all-reduce; bit-equal at dp = 2).

The logical state is unchanged: :meth:`ZeroEngine.gather_full` all-gathers the slices over the DP
group first, so ``gather_logical_state`` must run on *every* replica of the EMU (the driver does so
for ZeRO model-stages); :meth:`ZeroEngine.load_logical_state` takes this rank's slice of a full state.

**Why not torch FSDP2** (``torch.distributed.fsdp.fully_shard``): it shards over a ``DeviceMesh``, and
the runtime's communicators are subset groups built without a world group
(``ProcessGroupGloo(PrefixStore(...))``, ``comm/groups.py``). ``DeviceMesh.from_group`` refuses a bare
``ProcessGroupGloo`` (``TypeError: 'ProcessGroupGloo' object is not iterable``) and, when it is
wrapped in a ``c10d.ProcessGroup``, looks its ranks up in ``_world.pg_group_ranks``, which only
``init_process_group``/``new_group`` fill (``KeyError``; checked on torch 2.13). It would also need
the engine's parameters as ``nn.Module`` parameters (DTensors) while TP here is the engine's own
sharding (``model/sharding.py``). So ZeRO is built on the engine's own shards and groups.

DCP checkpoints (``durable/worker_side.py``) hold the unsliced state, as of a plain engine: the
writing replica all-gathers the slices over DP (the other replicas join,
:meth:`ZeroEngine.join_checkpoint`), and a loading ZeRO engine keeps its own slice, so a checkpoint
restores into any DP degree, with or without ZeRO.

**Live transitions** (``transit/flat.py``, ``transit/residency.py``; issue 24, kept for the executor):
they rely on this layout as it is: the flat order is ``model.params``' order, which is
``transit.index.stage_names``' order; ``N`` counts the shards' elements (vocab padding included);
``k = ceil(N/dp)``; rank ``r`` = ``ctx.dp_group.rank`` holds ``[r·k, (r+1)·k)`` zero-padded; the sliced
kinds are ``{"flat": [k]}`` entries of ``exp_avg``, ``exp_avg_sq`` and (bf16) ``master``, which
``state_tensors()`` returns. ``transit/residency.build_engine`` builds a ``ZeroEngine`` from the
weights alone and then sets those three ``"flat"`` entries to the slices the transition delivered
(same shape). A change of this layout must keep ``transit/flat.py`` in step.

ZeRO-2 and ZeRO-3 (gradients, and parameters, sharded per layer) are in ``worker/zero3.py``; the
live executor moves their slices too, one range per layer unit (``transit/flat.py``), but not between
a ZeRO-1 group and a ZeRO-2/3 group in one primitive (their slices of one kind differ:
``transit/sharded.py``): ``nereus run --adaptive`` makes that change through the durable checkpoint.
"""

from __future__ import annotations

import torch

from nereus.runtime.model.sharding import param_shapes, shard
from nereus.runtime.worker.engine import Engine
from nereus.runtime.worker.logical_state import broadcast_stages
from nereus.runtime.worker.zero3 import ShardedEngine

__all__ = ["ZeroEngine", "make_engine", "RUNTIME_ZERO_STAGES"]

#: ZeRO stages the runtime executes for training model-stages
RUNTIME_ZERO_STAGES = (0, 1, 2, 3)

_SLICED = ("master", "exp_avg", "exp_avg_sq")


class ZeroEngine(Engine):
    """An :class:`Engine` whose Adam state (and bf16 master weights) are ZeRO-1 slices over its DP group.

    Same arguments as :class:`Engine`; ``trainable`` must be true. ``exp_avg``, ``exp_avg_sq`` and (bf16)
    ``master`` are ``{"flat": [k] fp32}``: this DP rank's slice of the flattened TP/PP shard.

    Raises:
        ValueError: not trainable.
    """

    def __init__(self, *args, **kwargs) -> None:
        trainable = kwargs.get("trainable", args[4] if len(args) > 4 else False)
        if not trainable:
            raise ValueError("ZeRO-1 shards optimizer state: only a trainable engine can use it (zero=1)")
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ the flat layout
    def _layout(self) -> tuple[list[str], int, int, int]:
        names = list(self.model.params)
        N = sum(self.model.params[n].numel() for n in names)
        dp, r = self.ctx.dp_group.size, self.ctx.dp_group.rank
        k = -(-N // dp)
        return names, N, k, r * k

    def _flat(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Names in order, flattened into fp32 and zero-padded to ``dp·k``."""
        names, N, k, _ = self._layout()
        flat = torch.cat([tensors[n].detach().reshape(-1).float() for n in names])
        return torch.cat([flat, flat.new_zeros(k * self.ctx.dp_group.size - N)])

    def _my_slice(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        _, _, k, lo = self._layout()
        return self._flat(tensors)[lo:lo + k].clone()

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for n, w in self.model.params.items():
            out[n] = flat[off:off + w.numel()].view(w.shape)
            off += w.numel()
        return out

    def _init_optimizer(self, tensors: dict) -> None:
        full = {n: torch.zeros_like(w, dtype=torch.float32) for n, w in self.model.params.items()}
        self.exp_avg = {"flat": self._my_slice(tensors.get("exp_avg", full))}
        self.exp_avg_sq = {"flat": self._my_slice(tensors.get("exp_avg_sq", full))}
        self.master = {}
        if self.precision == "bf16":
            self.master = {"flat": self._my_slice(tensors.get("master", self.model.params))}
            for n, w in self.model.params.items():
                w.register_post_accumulate_grad_hook(self._accumulate_hook(n))

    def _zero_grad(self) -> None:
        """The flat fp32 gradient buffer padded to ``dp·k`` (:meth:`Engine._zero_grad`)."""
        self._grad_slice = None
        _, _, k, _ = self._layout()
        super()._zero_grad(k * self.ctx.dp_group.size)

    # ------------------------------------------------------------------ the step
    def _dp_reduce_grads(self) -> None:
        """Reduce-scatter the flat fp32 gradient buffer over DP; keep this rank's summed slice, free the
        buffer (accounted: buffer and slice while both exist, then the slice)."""
        buf = self._grad_buffer()
        self._grad_slice = self.ctx.dp_group.reduce_scatter(buf)
        key = f"grads:{id(self)}"
        self.meter.set_static(key, buf.numel() * 4 + self._grad_slice.numel() * 4)
        self.model.zero_grad()
        self.main_grad, self._gbuf, self._gviews = None, None, {}
        self.meter.set_static(key, self._grad_slice.numel() * 4)

    def grads(self) -> dict[str, torch.Tensor]:
        g = getattr(self, "_grad_slice", None)
        if g is not None:  # after the reduce-scatter only this rank's slice exists
            raise RuntimeError("a ZeRO-1 engine holds only its slice of the reduced gradients")
        return super().grads()

    @torch.no_grad()
    def _adam_step(self) -> None:
        a = self.adam
        self.step += 1
        bc1, bc2 = 1 - a.beta1 ** self.step, 1 - a.beta2 ** self.step
        grad, self._grad_slice = self._grad_slice, None
        target = self.master["flat"] if self.master else self._my_slice(self.model.params)
        m, v = self.exp_avg["flat"], self.exp_avg_sq["flat"]
        m.mul_(a.beta1).add_(grad, alpha=1 - a.beta1)
        v.mul_(a.beta2).addcmul_(grad, grad, value=1 - a.beta2)
        target.addcdiv_(m / bc1, (v / bc2).sqrt_().add_(a.eps), value=-a.lr)
        dtype = next(iter(self.model.params.values())).dtype
        parts = self.ctx.dp_group.all_gather(target.to(dtype))
        for n, x in self._unflatten(torch.cat(parts)).items():
            self.model.params[n].copy_(x)

    # ------------------------------------------------------------------ logical state
    def _unsliced(self, kind: str) -> dict[str, torch.Tensor]:
        """name → this (p, t) shard of ``kind`` (all-gathered over DP; collective over the DP group)."""
        src = getattr(self, kind)["flat"]
        return {n: x.clone() for n, x in self._unflatten(torch.cat(self.ctx.dp_group.all_gather(src))).items()}

    def gather_full(self, kind: str = "params", group=None, roots=None) -> dict[str, torch.Tensor]:
        """As :meth:`Engine.gather_full`; the sliced kinds are all-gathered over DP first (every DP
        replica must call it)."""
        if kind not in _SLICED or (kind == "master" and not self.master):
            return super().gather_full(kind, group, roots)
        mine = self._full_stage(self._unsliced(kind))
        group = group or self.ctx.emu_group
        roots = roots or [self.ctx.emu_rank(q, 0) for q in range(self.ctx.pp)]
        return broadcast_stages(self.spec, self.ctx.pp, mine, self.ctx.p, group, roots)

    @torch.no_grad()
    def load_logical_state(self, state: dict) -> None:
        """This rank's shards, and slices, of a gathered logical state (the inverse of
        :meth:`gather_full` over every kind)."""
        shapes = param_shapes(self.spec)

        def local(full: dict) -> dict:
            return {n: shard(full[n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t) for n in self.model.params}

        master, self.master = self.master, {}
        self.load_full(state["params"])  # weights only (the master is set below)
        self.master = master
        if self.master:
            self.master["flat"] = self._my_slice(local(state.get("master", state["params"])))
        if "exp_avg" in state:
            self.exp_avg["flat"] = self._my_slice(local(state["exp_avg"]))
            self.exp_avg_sq["flat"] = self._my_slice(local(state["exp_avg_sq"]))
        for k in ("step", "update_count", "version", "policy_version", "position"):
            setattr(self, k, int(state[k]))


    # ------------------------------------------------------------------ DCP checkpoints (durable/worker_side.py)
    def checkpoint_tensors(self, gather: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """kind → name → this (p, t) shard, as an unsharded engine holds it: ``params`` themselves, the
        sliced kinds all-gathered over DP (``gather``: collective over the DP group) or zero buffers
        to load into (then :meth:`load_checkpoint_tensors`)."""
        out = {"params": {n: w.detach() for n, w in self.model.params.items()}}
        for kind in [k for k in _SLICED if k != "master" or self.master]:
            out[kind] = self._unsliced(kind) if gather else \
                {n: torch.zeros(w.shape, dtype=torch.float32) for n, w in self.model.params.items()}
        return out

    def join_checkpoint(self) -> None:
        """A replica that does not write takes part in the writing replica's DP all-gathers."""
        self.checkpoint_tensors()

    def load_checkpoint_tensors(self, tensors: dict) -> None:
        """Keep this rank's slices of loaded unsliced kinds."""
        for kind in [k for k in _SLICED if k != "master" or self.master]:
            getattr(self, kind)["flat"] = self._my_slice(tensors[kind])


def make_engine(zero: int, *args, **kwargs) -> Engine:
    """An :class:`Engine` (``zero=0``), a :class:`ZeroEngine` (``zero=1``, trainable only) or a
    :class:`~nereus.runtime.worker.zero3.ShardedEngine` (``zero=2``, trainable only; ``zero=3``).

    Raises:
        ValueError: a ZeRO stage outside :data:`RUNTIME_ZERO_STAGES`.
    """
    if zero not in RUNTIME_ZERO_STAGES:
        raise ValueError(f"zero={zero!r}: the runtime executes ZeRO stages {list(RUNTIME_ZERO_STAGES)}")
    if zero >= 2:
        return ShardedEngine(zero, *args, **kwargs)
    return ZeroEngine(*args, **kwargs) if zero else Engine(*args, **kwargs)
