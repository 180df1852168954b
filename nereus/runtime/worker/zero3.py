"""ZeRO-2 and ZeRO-3 (FSDP) engines: gradients, and with ZeRO-3 parameters, sharded over the DP group.

Rajbhandari et al., "ZeRO" (SC'20), stages ``P_os+g`` (2) and ``P_os+g+p`` (3); PyTorch FSDP (Zhao et
al., VLDB'23) is stage 3 with per-module units. Built on the engine's own TP/PP shards and groups, for
the reason :mod:`nereus.runtime.worker.zero` gives (FSDP2's ``DeviceMesh.from_group`` refuses the
runtime's world-less subset gloo groups; re-checked on torch 2.13: unchanged).

**Slice layout** (what a live transition moves). The (p, t) shard's parameters are grouped into
*units*, in this order: ``embed`` (``model.embed_tokens.weight``, on the first PP rank and, with tied
embeddings under PP > 1, the last rank's copy), ``layer<i>`` for each decoder layer ``i`` of this PP rank
(its names in ``LlamaShard.names`` order), ``head`` (``model.norm.weight``, ``lm_head.weight`` or
``score.*``, last PP rank). Unit ``u`` is its names' tensors flattened in that order, ``N_u`` elements,
zero-padded to ``dp·k_u`` with ``k_u = ceil(N_u / dp)``; DP rank ``r`` holds ``[r·k_u, (r+1)·k_u)``.
Every sliced kind (``exp_avg``, ``exp_avg_sq``, bf16 ``master``; ZeRO-3 also ``params``, in the weights'
dtype) is ``{unit: [k_u] tensor}`` (:meth:`ShardedEngine.state_tensors`; :meth:`ShardedEngine.layout`
gives ``(unit, names, N_u, k_u, lo)`` per unit).

**ZeRO-2** (stage 2): full TP/PP parameters stay; each parameter's gradient is taken by a
post-accumulate-grad hook as autograd produces it, and once a unit's gradients of one micro-batch are
all there they are flattened in fp32 and **reduce-scattered** over DP (``(dp-1)·4·k_u`` bytes sent per
rank per micro-batch), added into the fp32 gradient slice and freed: no full gradient outlives its
unit's backward. Adam updates the slices; the updated slices are **all-gathered** per unit
(``(dp-1)·k_u·w`` bytes, ``w`` the weight width) into the weights.

**ZeRO-3** (stage 3): only the parameter slices stay. The forward pass (``LlamaShard.forward`` replaced
on this engine's shard) all-gathers a unit just before the part that uses it (embedding, each layer,
final norm and head; the tied ``lm_head`` of a single PP rank gathers ``embed`` again) and frees it
after; in training each part runs under activation checkpointing (``torch.utils.checkpoint``,
non-reentrant), so backward all-gathers the unit again to recompute it, and the gather's backward
reduce-scatters the unit's fp32 gradient into the slice (FSDP's reshard-after-forward with
backward prefetch off). Per micro-batch and use of a unit: 2 all-gathers of ``(dp-1)·k_u·w`` and one
reduce-scatter of ``(dp-1)·4·k_u`` bytes sent per rank. Forward-only ZeRO-3 engines (log-probs,
values, reference, reward, generation) gather per part the same way, without checkpointing.

The KV-replica, q/k-norm and tied-embedding gradient sums (``LlamaShard.reduce_partial_grads``) are
linear, so they run on the gradient slices after the backward (every TP rank has the same layout).
Mixed precision as :mod:`nereus.runtime.worker.engine`: bf16 weights and collectives of weights, fp32
gradient reduction, master and moments. The update equals plain DP's up to the order of the fp32
gradient sums (bit-equal at dp 2 with one micro-batch per replica and no tied embedding).

**Accounting** (the worker's :class:`~nereus.runtime.comm.instrument.Meter`): ``state_bytes`` counts the
resident slices (ZeRO-2: plus the full weights); the fp32 gradient slices are accounted during a step
(``grads:<engine>``; ZeRO-2's reductions in flight ``bucket:<engine>``, ``grad_buckets.py``), ZeRO-3's
gathered units as ``gathered:<engine>``: ``2·dp·k_u·w`` while the
all-gather's receive buffers and the flat unit both exist, ``dp·k_u·w`` while the unit is in use (in
backward until its gradient is reduce-scattered). The build itself materializes the (p, t) shard once
before slicing it (FSDP's meta-device init would avoid that; not accounted).

Checkpoints and logical state hold unsliced (p, t) shards, as ZeRO-1's do (``worker/zero.py``): every
DP replica takes part in the all-gathers (``gather_full``, ``checkpoint_tensors``,
:meth:`ShardedEngine.shard_params` for a weight sync from a ZeRO-3 source).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from nereus.runtime.model.sharding import param_shapes, shard, tied_copy
from nereus.runtime.worker.engine import Engine
from nereus.runtime.worker.grad_buckets import account_bucket
from nereus.runtime.worker.logical_state import broadcast_stages

__all__ = ["ShardedEngine", "unit_names", "colocated_sync"]

_KV = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


def unit_names(names: list[str]) -> list[tuple[str, list[str]]]:
    """``[(unit, names)]`` of a (p, t) shard's ordered parameter names (module docstring)."""
    embed = [n for n in names if n == "model.embed_tokens.weight"]
    layers: dict[int, list[str]] = {}
    for n in names:
        if n.startswith("model.layers."):
            layers.setdefault(int(n.split(".")[2]), []).append(n)
    head = [n for n in names if not n.startswith("model.layers.") and n != "model.embed_tokens.weight"]
    out = [("embed", embed)] if embed else []
    out += [(f"layer{i}", layers[i]) for i in sorted(layers)]
    return out + ([("head", head)] if head else [])


def colocated_sync(src, dst) -> bool:
    """Whether every worker of layout ``dst`` holds, in layout ``src``, the shard of the same (p, t)
    (same TP and PP degrees): a ZeRO-3 source then fills its destinations unit by unit in place
    (:meth:`ShardedEngine.sync_units`), with no exchange between workers."""
    if (src.tp, src.pp) != (dst.tp, dst.pp):
        return False
    return all(w in src.workers and src.position(w)[1:] == dst.position(w)[1:] for w in dst.workers)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Gather(torch.autograd.Function):
    """Forward: a unit's flat parameters all-gathered from its slice; backward: the unit's gradient
    reduce-scattered (fp32) into the engine's gradient slice (nothing flows back to the slice leaf)."""

    @staticmethod
    def forward(ctx, piece, engine, unit):
        ctx.engine, ctx.unit = engine, unit
        return engine._all_gather(unit, piece.detach())

    @staticmethod
    def backward(ctx, g):
        ctx.engine._reduce_unit(ctx.unit, g)
        ctx.engine._release(ctx.unit)
        return None, None, None


class ShardedEngine(Engine):
    """An :class:`Engine` at ZeRO stage 2 or 3 (module docstring); ``zero`` first, then
    :class:`Engine`'s arguments. Stage 2 needs a trainable engine; stage 3 also runs forward-only.

    Raises:
        ValueError: ``zero`` not 2 or 3; stage 2 and not trainable.
    """

    def __init__(self, zero: int, *args, **kwargs) -> None:
        trainable = kwargs.get("trainable", args[4] if len(args) > 4 else False)
        if zero not in (2, 3):
            raise ValueError(f"ShardedEngine runs ZeRO stages 2 and 3, got zero={zero!r}")
        if zero == 2 and not trainable:
            raise ValueError("ZeRO-2 shards gradients: only a trainable engine can use it (zero=2)")
        self.zero = zero
        self._held: dict[str, int] = {}
        self._gslice: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, dict[str, torch.Tensor]] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ the slice layout
    def layout(self) -> list[tuple[str, list[str], int, int, int]]:
        """``[(unit, names, N_u, k_u, lo)]``: this DP rank holds ``[lo, lo + k_u)`` of each unit."""
        dp, r = self.ctx.dp_group.size, self.ctx.dp_group.rank
        out = []
        for u, names in self.units:
            N = sum(self._numel[n] for n in names)
            k = -(-N // dp)
            out.append((u, names, N, k, r * k))
        return out

    def _slices(self, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
        """unit → this rank's slice of name → (p, t) shard ``tensors`` (a new tensor of ``dtype``)."""
        dp = self.ctx.dp_group.size
        out = {}
        for u, names, N, k, lo in self.layout():
            flat = torch.cat([tensors[n].detach().reshape(-1).to(dtype) for n in names])
            flat = torch.cat([flat, flat.new_zeros(dp * k - N)])
            out[u] = flat[lo:lo + k].clone()
        return out

    def _views(self, unit: str, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for n in dict(self.units)[unit]:
            out[n] = flat[off:off + self._numel[n]].view(self._shape[n])
            off += self._numel[n]
        return out

    def _init_optimizer(self, tensors: dict) -> None:
        P = self.model.params
        self.units = unit_names(list(P))
        self._shape = {n: tuple(w.shape) for n, w in P.items()}
        self._numel = {n: w.numel() for n, w in P.items()}
        self._wdtype = next(iter(P.values())).dtype
        self._k = {u: k for u, _, _, k, _ in self.layout()}
        self.exp_avg, self.exp_avg_sq, self.master = {}, {}, {}
        if self.trainable:
            zeros = {n: torch.zeros(self._shape[n]) for n in P}
            self.exp_avg = self._slices(tensors.get("exp_avg", zeros))
            self.exp_avg_sq = self._slices(tensors.get("exp_avg_sq", zeros))
            if self.precision == "bf16":
                self.master = self._slices(tensors.get("master", P))
        if self.zero == 3:
            self.pslice = {u: s.to(self._wdtype).requires_grad_(self.trainable)
                           for u, s in self._slices(P, self._wdtype).items()}
            self._empty = {n: torch.empty(0, dtype=self._wdtype, device=w.device) for n, w in P.items()}
            P.update(self._empty)  # the full shards are freed: only the slices stay
            self.model.forward = self._forward
        else:
            for n, w in P.items():
                w.register_post_accumulate_grad_hook(self._grad_hook(n))
        self._unit_of = {n: u for u, names in self.units for n in names}

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """kind → key → tensor held: ZeRO-3 ``params`` are ``{unit: slice leaf}``, ZeRO-2's are the
        weights by name; the optimizer kinds ``{unit: slice}`` (module docstring)."""
        out = {"params": dict(self.pslice) if self.zero == 3 else
               {n: w.detach() for n, w in self.model.params.items()}}
        if self.trainable:
            if self.master:
                out["master"] = self.master
            out["exp_avg"], out["exp_avg_sq"] = self.exp_avg, self.exp_avg_sq
        return out

    # ------------------------------------------------------------------ gathers (ZeRO-3)
    def _hold(self, unit: str, nbytes: int) -> None:
        self._held[unit] = nbytes
        self.meter.set_static(f"gathered:{id(self)}", sum(self._held.values()))

    def _release(self, unit: str) -> None:
        if self._held.pop(unit, None) is not None:
            self.meter.set_static(f"gathered:{id(self)}", sum(self._held.values()))

    def _all_gather(self, unit: str, piece: torch.Tensor) -> torch.Tensor:
        """The flat unit ``[dp·k_u]`` from every rank's slice; accounts receive buffers and the unit."""
        g = self.ctx.dp_group
        nbytes = g.size * piece.numel() * piece.element_size()
        self._hold(unit, 2 * nbytes if g.size > 1 else nbytes)
        flat = torch.cat(g.all_gather(piece)) if g.size > 1 else piece.clone()
        self._hold(unit, nbytes)
        return flat

    def _gathered(self, units: list[str], fn, *args):
        """Run ``fn(*args)`` with ``units`` gathered into the shard's parameters, then free them."""
        P, views = self.model.params, {}
        grad = torch.is_grad_enabled() and self.trainable
        for u in units:
            flat = _Gather.apply(self.pslice[u], self, u) if grad else self._all_gather(u, self.pslice[u].detach())
            views.update(self._views(u, flat))
        P.update(views)
        try:
            return fn(*args)
        finally:
            P.update({n: self._empty[n] for n in views})
            if not (grad and _in_backward()):  # in backward the unit stays until its reduce-scatter
                for u in units:
                    self._release(u)

    def _use(self, units: list[str], fn, *args):
        if torch.is_grad_enabled() and self.trainable:
            return checkpoint(self._gathered, units, fn, *args, use_reentrant=False)
        return self._gathered(units, fn, *args)

    def _forward(self, inp: torch.Tensor, start: int = 0, cache=None, lpad=None) -> torch.Tensor:
        """``LlamaShard.forward`` with each part's unit gathered just before it (same returns)."""
        m = self.model
        x = self._use(["embed"], m._embed, inp) if m.ctx.is_first else inp
        for i in m.layers:
            x = self._use([f"layer{i}"], m._layer, i, x, start, cache, lpad)
        if cache is not None:
            cache.length = start + inp.shape[1]
        if not m.ctx.is_last:
            return x
        tied = m.spec.head == "lm" and "lm_head.weight" not in self._numel  # the head reads the embedding
        return self._use(["head"] + (["embed"] if tied else []), m._head, x)

    # ------------------------------------------------------------------ gradients
    def _grad_hook(self, name: str):
        """ZeRO-2: take a parameter's micro-batch gradient; reduce-scatter its unit once complete."""
        def hook(w: torch.Tensor) -> None:
            if self._pending is None:
                return
            u = self._unit_of[name]
            self._pending.setdefault(u, {})[name] = w.grad.float() if w.grad.dtype != torch.float32 else w.grad
            w.grad = None
            account_bucket(self)
            if len(self._pending[u]) == len(dict(self.units)[u]):
                self._flush(u)
        return hook

    def _flush(self, unit: str) -> None:
        got = self._pending.pop(unit, {})
        dp = self.ctx.dp_group.size
        parts = [got.get(n, torch.zeros(self._shape[n])).reshape(-1).float() for n in dict(self.units)[unit]]
        flat = torch.cat(parts)
        account_bucket(self, 4 * (2 * flat.numel() + (dp + 1) * self._k[unit]))  # grads, flat, padded, output
        self._reduce_unit(unit, torch.cat([flat, flat.new_zeros(dp * self._k[unit] - flat.numel())]))
        account_bucket(self)

    def _reduce_unit(self, unit: str, g: torch.Tensor) -> None:
        """Reduce-scatter a unit's flat ``[dp·k_u]`` gradient (fp32) over DP into its slice."""
        self._gslice[unit].add_(self.ctx.dp_group.reduce_scatter(g.float().contiguous()))

    def _zero_grad(self) -> None:
        self.model.zero_grad()
        self._gslice = {u: torch.zeros(k) for u, k in self._k.items()}
        self.meter.set_static(f"grads:{id(self)}", 4 * sum(self._k.values()))
        self._pending = {} if self.zero == 2 else None
        self.main_grad = None

    def grads(self) -> dict[str, torch.Tensor]:
        raise RuntimeError(f"a ZeRO-{self.zero} engine holds only its slices of the reduced gradients")

    def _reduce_grads(self) -> None:
        """Flush ZeRO-2's incomplete units, then the q/k-norm, KV-replica and tied-embedding sums on
        the gradient slices (``LlamaShard.reduce_partial_grads``' reductions)."""
        if self._pending is not None:
            for u, _ in self.units:
                if u in self._pending:
                    self._flush(u)
            self._pending = None
        ctx = self.ctx
        for u, names, _, k, lo in self.layout():
            off = 0
            for n in names:
                a, b = max(off, lo), min(off + self._numel[n], lo + k)
                off += self._numel[n]
                grp = ctx.tp_group if n.endswith(("q_norm.weight", "k_norm.weight")) else \
                    ctx.kv_group if ctx.kv_group is not None and n.endswith(_KV) else None
                if grp is not None and a < b:
                    piece = self._gslice[u][a - lo:b - lo].clone()
                    grp.all_reduce(piece)
                    self._gslice[u][a - lo:b - lo] = piece
        if tied_copy(self.spec, ctx.pp) and "embed" in self._gslice and (ctx.is_first or ctx.is_last):
            g = self._gslice["embed"]
            other = torch.empty_like(g)
            ctx.emu_group.sendrecv(g, other, ctx.emu_rank(ctx.pp - 1 if ctx.is_first else 0, ctx.t))
            self._gslice["embed"] = g + other

    @torch.no_grad()
    def _adam_step(self) -> None:
        """Adam on the slices; ZeRO-2 all-gathers the updated slices into the weights, ZeRO-3 keeps
        them (rounded to the weights' dtype under bf16)."""
        a = self.adam
        self.step += 1
        bc1, bc2 = 1 - a.beta1 ** self.step, 1 - a.beta2 ** self.step
        grads, self._gslice = self._gslice, None
        self.meter.drop_static(f"grads:{id(self)}")
        if self.master:
            targets = self.master
        elif self.zero == 3:
            targets = {u: s.data for u, s in self.pslice.items()}
        else:
            targets = self._slices(self.model.params)
        for u, _, _, _, _ in self.layout():
            m, v, t = self.exp_avg[u], self.exp_avg_sq[u], targets[u]
            m.mul_(a.beta1).add_(grads[u], alpha=1 - a.beta1)
            v.mul_(a.beta2).addcmul_(grads[u], grads[u], value=1 - a.beta2)
            t.addcdiv_(m / bc1, (v / bc2).sqrt_().add_(a.eps), value=-a.lr)
            if self.zero == 3:
                if self.master:
                    self.pslice[u].data.copy_(t)
            else:
                for n, x in self._views(u, torch.cat(self.ctx.dp_group.all_gather(t.to(self._wdtype)))).items():
                    self.model.params[n].copy_(x)

    # ------------------------------------------------------------------ unsliced state
    def _unsliced(self, slices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """name → (p, t) shard of a sliced kind (all-gathered over DP: every replica calls it)."""
        out = {}
        for u, _ in self.units:
            out.update({n: x.clone() for n, x in self._views(u, torch.cat(self.ctx.dp_group.all_gather(
                slices[u].detach()))).items()})
        return out

    def shard_params(self) -> dict[str, torch.Tensor]:
        """name → this rank's (p, t) parameter shard (ZeRO-3: all-gathered over DP, collective)."""
        if self.zero == 3:
            return self._unsliced(self.pslice)
        return {n: w.detach() for n, w in self.model.params.items()}

    @torch.no_grad()
    def sync_units(self, dst: Engine | None, slices: dict[str, torch.Tensor] | None = None) -> int:
        """A weight sync into ``dst``, a forward-only engine of the same (p, t) shard on this worker
        (or None: this rank only joins the gathers): each unit all-gathered over DP and written into
        ``dst`` at once, so one unit is gathered at a time (verl's layered FSDP → rollout sync).
        ``slices``: this rank's parameter slices by unit when not the resident ones (an offloaded
        engine's host copies). Collective over the DP group; returns the bytes this rank sent."""
        sent = 0
        slices = slices if slices is not None else self.pslice
        for u, _, N, _, _ in self.layout():
            piece = slices[u].detach()
            flat = self._all_gather(u, piece)
            sent += (self.ctx.dp_group.size - 1) * piece.numel() * piece.element_size()
            if isinstance(dst, ShardedEngine) and dst.zero == 3:
                _, _, _, k2, lo2 = next(x for x in dst.layout() if x[0] == u)
                full = torch.cat([flat[:N], flat.new_zeros(max(lo2 + k2 - N, 0))])
                dst.pslice[u].data.copy_(full[lo2:lo2 + k2])
            elif dst is not None:
                for n, x in self._views(u, flat).items():
                    dst.model.params[n].copy_(x)
            self._release(u)
        return sent

    def _kind(self, kind: str) -> dict[str, torch.Tensor]:
        if kind == "params":
            return self.shard_params()
        if kind == "master" and not self.master:
            return self.shard_params()
        if kind == "grads":
            return self.grads()
        return self._unsliced(getattr(self, kind))

    def gather_full(self, kind: str = "params", group=None, roots=None) -> dict[str, torch.Tensor]:
        """As :meth:`Engine.gather_full`; sliced kinds are all-gathered over DP first (every DP replica
        calls it)."""
        mine = self._full_stage(self._kind(kind))
        group = group or self.ctx.emu_group
        roots = roots or [self.ctx.emu_rank(q, 0) for q in range(self.ctx.pp)]
        return broadcast_stages(self.spec, self.ctx.pp, mine, self.ctx.p, group, roots)

    @torch.no_grad()
    def load_shards(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take kind → name → (p, t) shard: weights (``params``; ``master`` when held, else the
        weights upcast) and whichever optimizer kinds are given; keeps this rank's slices."""
        params = tensors["params"]
        if self.zero == 3:
            for u, s in self._slices(params, self._wdtype).items():
                self.pslice[u].data.copy_(s)
        else:
            for n, w in self.model.params.items():
                w.copy_(params[n].to(w.dtype))
        if self.master:
            self.master.update(self._slices(tensors.get("master", params)))
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind in tensors and self.trainable:
                getattr(self, kind).update(self._slices(tensors[kind]))

    def load_shard_params(self, params: dict[str, torch.Tensor]) -> None:
        """A weight sync's new (p, t) parameter shards (a forward-only destination)."""
        self.load_shards({"params": params})

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        shapes = param_shapes(self.spec)
        local = {n: shard(full[n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t) for n in self._numel}
        self.load_shards({"params": local, "master": local})

    @torch.no_grad()
    def load_logical_state(self, state: dict) -> None:
        """This rank's shards, then slices, of a gathered logical state (inverse of
        ``gather_logical_state``)."""
        shapes = param_shapes(self.spec)
        for n in self._numel:
            if n not in state["params"] or tuple(state["params"][n].shape) != tuple(shapes[n][0]):
                raise ValueError(f"model {self.spec.name!r}: parameter {n!r} is missing or misshapen")
        local = {kind: {n: shard(state[kind][n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t)
                        for n in self._numel} for kind in ("params", "master", "exp_avg", "exp_avg_sq")
                 if kind in state}
        self.load_shards(local)
        for k in ("step", "update_count", "version", "policy_version", "position"):
            setattr(self, k, int(state[k]))

    # ------------------------------------------------------------------ DCP checkpoints
    def checkpoint_tensors(self, gather: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """kind → name → (p, t) shard as a plain engine holds it (``gather``: all-gathered over DP,
        collective) or zero buffers to load into (then :meth:`load_checkpoint_tensors`)."""
        kinds = ["params"] + [k for k in ("master", "exp_avg", "exp_avg_sq") if getattr(self, k)]
        if not gather:
            return {k: {n: torch.zeros(s, dtype=self._wdtype if k == "params" else torch.float32)
                        for n, s in self._shape.items()} for k in kinds}
        return {k: self._kind(k) for k in kinds}

    def join_checkpoint(self) -> None:
        """A replica that does not write takes part in the writing replica's DP all-gathers."""
        self.checkpoint_tensors()

    def load_checkpoint_tensors(self, tensors: dict) -> None:
        self.load_shards(tensors)
