"""The logical state ``Λ = (θ, ω, c, v, p)`` of an EMU, gathered whole and loaded back (DESIGN.md §2, §4.7).

:class:`LogicalStateMixin` is the part of :class:`~nereus.runtime.worker.engine.Engine` that turns its
shards into full unsharded tensors and back: :meth:`~LogicalStateMixin.gather_logical_state` reassembles
the state on every worker of the EMU (a TP all-gather of one flat buffer within each PP rank, then a
broadcast per PP rank over the EMU group, :func:`broadcast_stages`); :meth:`~LogicalStateMixin.load_logical_state`
and :meth:`~LogicalStateMixin.load_full` take this rank's shards of such a state (sharding full tensors and
gathering them back is exact, so the state round-trips bit for bit). Used by weight sync, the
centralized re-layout (``run/relayout.py``) and the checks of every transition test.
"""

from __future__ import annotations

import torch

from nereus.runtime.comm.groups import Group
from nereus.runtime.model.sharding import names_of_stage, param_shapes, shard, unshard
from nereus.spec.model import ModelSpec

__all__ = ["LogicalStateMixin", "broadcast_stages", "full_stage_numel"]


class LogicalStateMixin:
    """Gathers and loads the full logical state of an :class:`~nereus.runtime.worker.engine.Engine` (it supplies
    ``spec``, ``ctx``, ``model``, ``master``, ``exp_avg``, ``exp_avg_sq``, ``trainable``, ``grads()`` and the counters)."""

    # ------------------------------------------------------------------ logical state
    def _full_stage(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Flat full tensors of this PP rank (TP all-gather of one flat buffer), in name order."""
        names = self.model.names
        flat = torch.cat([tensors[n].detach().reshape(-1).float() for n in names])
        parts = self.ctx.tp_group.all_gather(flat)
        shapes = param_shapes(self.spec)
        out, off = [], 0
        for n in names:
            k = tensors[n].numel()
            sh = tuple(tensors[n].shape)
            full = unshard([p[off:off + k].view(sh) for p in parts], shapes[n][1], self.spec)
            out.append(full.reshape(-1))
            off += k
        return torch.cat(out)

    def gather_full(self, kind: str = "params", group: Group | None = None,
                    roots: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Full unsharded ``kind`` (``params``, ``master``, ``grads``, ``exp_avg``, ``exp_avg_sq``) on
        every member, as fp32 (bf16 weights upcast exactly).

        Default group is the EMU group with root ``(q, 0)`` for PP rank ``q``.
        """
        src = {"params": self.model.params, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
               "master": self.master or self.model.params, "grads": self.grads()}[kind]
        mine = self._full_stage(src)
        group = group or self.ctx.emu_group
        roots = roots or [self.ctx.emu_rank(q, 0) for q in range(self.ctx.pp)]
        return broadcast_stages(self.spec, self.ctx.pp, mine, self.ctx.p, group, roots)

    def gather_logical_state(self) -> dict:
        """``{"params", "exp_avg", "exp_avg_sq": {name: full fp32 tensor}, "step", "update_count",
        "version", "policy_version", "position"}`` on every worker of the EMU (collective); a bf16
        trainable engine adds ``"master"`` (``params`` are then the bf16 weights, upcast)."""
        out = {"params": self.gather_full("params")}
        if self.master:
            out["master"] = self.gather_full("master")
        if self.trainable:
            out["exp_avg"] = self.gather_full("exp_avg")
            out["exp_avg_sq"] = self.gather_full("exp_avg_sq")
        out.update(step=self.step, update_count=self.update_count, version=self.version,
                   policy_version=self.policy_version, position=self.position)
        return out

    @torch.no_grad()
    def load_logical_state(self, state: dict) -> None:
        """Take this rank's shards of a gathered logical state (the inverse of
        :meth:`gather_logical_state`): parameters, Adam moments when trainable, Adam step, update
        counter, versions and mini-batch position. Used by ``run/relayout.py`` to rebuild an EMU in a new
        layout; sharding full tensors and gathering them back is exact, so the state round-trips bit
        for bit.

        Raises:
            ValueError: a parameter or moment is missing or has another shape.
        """
        self.load_full(state["params"])
        if self.master:  # bf16: the master from the state (an fp32 state's weights are its master)
            src = state.get("master", state["params"])
            shapes = param_shapes(self.spec)
            for n, t in self.master.items():
                t.copy_(shard(src[n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t).to(t.dtype))
        if self.trainable and "exp_avg" in state:
            shapes = param_shapes(self.spec)
            for key, dst in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                for n, t in dst.items():
                    if n not in state[key] or tuple(state[key][n].shape) != tuple(shapes[n][0]):
                        raise ValueError(f"model {self.spec.name!r}: {key} of {n!r} is missing or misshapen")
                    t.copy_(shard(state[key][n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t).to(t.dtype))
        for k in ("step", "update_count", "version", "policy_version", "position"):
            setattr(self, k, int(state[k]))

    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Replace this rank's parameter shards with shards of the full tensors ``full`` (and, in a
        bf16 trainable engine, its fp32 master: the weights become the master rounded to bf16).

        Raises:
            ValueError: a parameter is missing from ``full`` or has another shape (mismatched config).
        """
        shapes = param_shapes(self.spec)
        for n in self.model.params:
            if n not in full or tuple(full[n].shape) != tuple(shapes[n][0]):
                got = tuple(full[n].shape) if n in full else "missing"
                raise ValueError(f"model {self.spec.name!r}: parameter {n!r} should be {tuple(shapes[n][0])}, "
                                 f"got {got}: the source and destination configs differ")
        for n, w in self.model.params.items():
            x = shard(full[n], shapes[n][1], self.spec, self.ctx.tp, self.ctx.t)
            if n in self.master:  # bf16 trainable: the master takes the full values, the weights their rounding
                self.master[n].copy_(x.float())
                w.copy_(self.master[n])
            else:
                w.copy_(x.to(w.dtype))


def full_stage_numel(spec: ModelSpec, pp: int, q: int) -> int:
    shapes = param_shapes(spec)
    return sum(int(torch.Size(shapes[n][0]).numel()) for n in names_of_stage(spec, pp, q))


def broadcast_stages(spec: ModelSpec, pp: int, mine: torch.Tensor | None, my_p: int | None, group: Group,
                     roots: list[int]) -> dict[str, torch.Tensor]:
    """Broadcast the flat full tensors of each PP rank ``q`` from group rank ``roots[q]``.

    ``mine`` is this worker's flat full stage (used when it is a root). Returns name → full tensor.
    """
    shapes = param_shapes(spec)
    out = {}
    for q in range(pp):
        if group.rank == roots[q]:
            buf = mine.contiguous()
            assert my_p == q
        else:
            buf = torch.empty(full_stage_numel(spec, pp, q), device=group.device)  # NCCL: on the device
        group.broadcast(buf, roots[q])
        off = 0
        for n in names_of_stage(spec, pp, q):
            shp = shapes[n][0]
            k = int(torch.Size(shp).numel())
            out[n] = buf[off:off + k].view(shp).cpu().clone()
            off += k
    return out
