"""One (TP rank, PP rank) shard of a Llama decoder: RMSNorm, RoPE, GQA, SwiGLU (DESIGN.md §4.7).

Megatron-style TP: the layer input goes through ``copy_to_tp`` (identity forward, gradient all-reduce)
before the column-parallel q/k/v and gate/up projections; the row-parallel o_proj and down_proj
outputs are summed with ``reduce_from_tp``. The vocab-parallel embedding masks out-of-shard ids and
all-reduces; the column-parallel ``lm_head`` all-gathers its logits over TP. A value head
(``spec.head == "value"``) is a replicated ``[1, h]`` projection giving one scalar per position.

Shapes: B batch, T new positions, h hidden, d head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nereus.runtime.comm import copy_to_tp, gather_last_dim, reduce_from_tp
from nereus.runtime.instrument import Meter
from nereus.runtime.layout import init_full_params, names_of_stage, param_shapes, shard
from nereus.runtime.parallel import ParallelContext
from nereus.spec.model import ModelSpec

__all__ = ["KVCache", "LlamaShard", "rms_norm", "rope"]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (HF ``LlamaRMSNorm``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, T, d]`` at ``positions`` ``[T]`` (HF rotate-half form)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _sdpa(q, k, v, mask, d):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))


class KVCache:
    """Per-layer key/value buffers ``[B, g_local, T_max, d]`` of one shard; ``length`` positions filled."""

    def __init__(self, layers, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.k = {i: torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros_like(self.k[i]) for i in layers}
        self.length = 0
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class LlamaShard:
    """The parameters and forward pass one worker holds for one model-stage.

    Args:
        spec: model shapes.
        ctx: the worker's parallel context (layout and groups).
        seed: initial logical parameters come from :func:`init_full_params` with this seed.
        meter: receives gemm/attention timings.
        dtype, device: fp32 on CPU; bf16 where the device supports it.
        recompute: activation recomputation in training: ``none``; ``selective`` (the attention
            core, as Megatron's selective recompute); ``full`` (each decoder layer).

    Attributes:
        params: logical name → this rank's shard (leaf tensor with ``requires_grad``).
        layers: global indices of the decoder layers this PP rank owns.
    """

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, seed: int, meter: Meter,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 full: dict[str, torch.Tensor] | None = None, recompute: str = "none",
                 shards: dict[str, torch.Tensor] | None = None) -> None:
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
        self.spec, self.ctx, self.meter, self.dtype, self.device = spec, ctx, meter, dtype, device
        self.recompute = recompute
        self.names = names_of_stage(spec, ctx.pp, ctx.p)
        if shards is not None:  # this rank's shards, moved here by a live transition
            missing = [n for n in self.names if n not in shards]
            if missing:
                raise ValueError(f"shards for {spec.name!r} rank (p={ctx.p}, t={ctx.t}) lack {missing[:3]}")
            self.params = {n: shards[n].detach().to(device, dtype).requires_grad_(True) for n in self.names}
        else:
            full = full if full is not None else init_full_params(spec, seed)
            shapes = param_shapes(spec)
            self.params = {n: shard(full[n], shapes[n][1], spec, ctx.tp, ctx.t).to(device, dtype)
                           .requires_grad_(True) for n in self.names}
        self.layers = sorted({int(n.split(".")[2]) for n in self.names if n.startswith("model.layers.")})
        tp, g = ctx.tp, spec.num_kv_heads
        self.q_heads = spec.num_attention_heads // tp
        self.kv_heads = g // tp if tp <= g else 1

    # ------------------------------------------------------------------ helpers
    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with self.meter.op("gemm"):
            return x @ w.t()

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.layers, batch, self.kv_heads, max_len, self.spec.head_dim, self.dtype, self.device)

    def _attention(self, i: int, x: torch.Tensor, start: int, cache: KVCache | None) -> torch.Tensor:
        s, P = self.spec, self.params
        pre = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        d = s.head_dim
        q = self._mm(x, P[pre + "q_proj.weight"]).view(B, T, self.q_heads, d).transpose(1, 2)
        k = self._mm(x, P[pre + "k_proj.weight"]).view(B, T, self.kv_heads, d).transpose(1, 2)
        v = self._mm(x, P[pre + "v_proj.weight"]).view(B, T, self.kv_heads, d).transpose(1, 2)
        with self.meter.op("attention"):
            if s.qk_norm:
                q = rms_norm(q, P[pre + "q_norm.weight"], s.rms_norm_eps)
                k = rms_norm(k, P[pre + "k_norm.weight"], s.rms_norm_eps)
            pos = torch.arange(start, start + T, device=x.device)
            q, k = rope(q, pos, s.rope_theta), rope(k, pos, s.rope_theta)
            if cache is not None:
                cache.k[i][:, :, start:start + T] = k.detach()
                cache.v[i][:, :, start:start + T] = v.detach()
                k, v = cache.k[i][:, :, :start + T], cache.v[i][:, :, :start + T]
            rep = self.q_heads // self.kv_heads
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            keys = torch.arange(start + T, device=x.device)
            mask = keys[None, :] <= pos[:, None]  # [T, start+T] causal over cached + new positions
            if self.recompute == "selective" and torch.is_grad_enabled():
                o = checkpoint(_sdpa, q, k, v, mask, d, use_reentrant=False)
            else:
                o = _sdpa(q, k, v, mask, d)
        o = o.transpose(1, 2).reshape(B, T, self.q_heads * d)
        return reduce_from_tp(self._mm(o, P[pre + "o_proj.weight"]), self.ctx.tp_group)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        P = self.params
        pre = f"model.layers.{i}.mlp."
        a = F.silu(self._mm(x, P[pre + "gate_proj.weight"])) * self._mm(x, P[pre + "up_proj.weight"])
        return reduce_from_tp(self._mm(a, P[pre + "down_proj.weight"]), self.ctx.tp_group)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.params["model.embed_tokens.weight"]
        rows = w.shape[0]
        lo = self.ctx.t * rows
        local = ids - lo
        ok = (local >= 0) & (local < rows)
        e = F.embedding(local.clamp(0, rows - 1), w) * ok.unsqueeze(-1).to(w.dtype)
        return reduce_from_tp(e, self.ctx.tp_group)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        s, P, tpg = self.spec, self.params, self.ctx.tp_group
        x = rms_norm(x, P["model.norm.weight"], s.rms_norm_eps)
        if s.head == "value":
            return (self._mm(x, P["score.weight"]) + P["score.bias"]).squeeze(-1).float()
        w = P["lm_head.weight"] if "lm_head.weight" in P else P["model.embed_tokens.weight"]
        logits = gather_last_dim(self._mm(copy_to_tp(x, tpg), w), tpg)
        return logits[..., :s.vocab_size].float()

    # ------------------------------------------------------------------ forward
    def forward(self, inp: torch.Tensor, start: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """Run this PP rank's part of the model.

        Args:
            inp: token ids ``[B, T]`` (int64) on the first PP rank, else hidden ``[B, T, h]``.
            start: position of the first new token (the cache length when decoding).
            cache: KV cache to read and extend (generation); None for full-sequence passes.

        Returns:
            hidden ``[B, T, h]`` on non-last ranks; on the last rank logits ``[B, T, V]`` (fp32, full
            vocab, identical on every TP rank) or values ``[B, T]`` for a value head.
        """
        x = self._embed(inp) if self.ctx.is_first else inp
        for i in self.layers:
            if self.recompute == "full" and torch.is_grad_enabled() and cache is None:
                # every TP rank recomputes the same layers in the same order, so the collectives
                # inside the recomputed forward pair up again
                x = checkpoint(self._layer, i, x, start, cache, use_reentrant=False)
            else:
                x = self._layer(i, x, start, cache)
        if cache is not None:
            cache.length = start + inp.shape[1]
        return self._head(x) if self.ctx.is_last else x

    def _layer(self, i: int, x: torch.Tensor, start: int, cache: KVCache | None) -> torch.Tensor:
        s, P, tpg = self.spec, self.params, self.ctx.tp_group
        pre = f"model.layers.{i}."
        hn = copy_to_tp(rms_norm(x, P[pre + "input_layernorm.weight"], s.rms_norm_eps), tpg)
        x = x + self._attention(i, hn, start, cache)
        hn = copy_to_tp(rms_norm(x, P[pre + "post_attention_layernorm.weight"], s.rms_norm_eps), tpg)
        return x + self._mlp(i, hn)

    # ------------------------------------------------------------------ gradients
    def zero_grad(self) -> None:
        for w in self.params.values():
            w.grad = None

    def reduce_partial_grads(self) -> None:
        """Complete the gradients that each TP rank holds only partially.

        * q/k RMSNorm weights (Qwen3) are replicated but each rank applies them to its own heads only:
          summed over the TP group.
        * k/v projections of a KV head replicated over ranks (tp > KV heads): each replica sees only
          its own query heads: summed over the ranks sharing that head.
        """
        for n, w in self.params.items():
            if w.grad is None:
                continue
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                self.ctx.tp_group.all_reduce(w.grad)
            elif self.ctx.kv_group is not None and n.endswith(("k_proj.weight", "v_proj.weight")):
                self.ctx.kv_group.all_reduce(w.grad)
