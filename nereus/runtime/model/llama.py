"""One (TP rank, PP rank) shard of a Llama decoder: RMSNorm, RoPE, GQA, SwiGLU (DESIGN.md §4.7).

Matches Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v biases) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm) in fp32 (tests/test_runtime_hf.py): RoPE with
``linear`` or ``llama3`` scaling (``transformers.modeling_rope_utils``), the config's ``hidden_act``,
tied embeddings (under PP > 1 the last rank holds its own copy; ``model/sharding.py``).

Left padding: when ``pad_id`` is set and a sequence starts with pad tokens, those ``lpad[b]`` positions
are masked out as keys and the real tokens get positions ``0, 1, ...`` (as ``transformers`` does with an
attention mask and ``position_ids = cumsum(mask) - 1``).

Megatron-style TP: the layer input goes through ``copy_to_tp`` (identity forward, gradient all-reduce)
before the column-parallel q/k/v and gate/up projections; the row-parallel o_proj and down_proj
outputs are summed with ``reduce_from_tp``. The vocab-parallel embedding masks out-of-shard ids and
all-reduces; the column-parallel ``lm_head`` all-gathers its logits over TP, unless ``local_logits`` is
set: then the last rank returns its own vocab shard ``[B, T, V/tp]`` and log-probabilities are computed
vocab-parallel (:func:`vocab_parallel_logprobs`, Megatron's cross-entropy: no full-vocab all-gather);
generation samples vocab-parallel too (``worker/rollout.py``). Random initial weights are drawn per shard
(``layout.init_shard_params``): no worker builds the full model. A value head
(``spec.head == "value"``) is a replicated ``[1, h]`` projection giving one scalar per position.

Shapes: B batch, T new positions, h hidden, d head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nereus.runtime.comm.groups import Group, copy_to_tp, gather_last_dim, reduce_from_tp
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.parallel import ParallelContext
from nereus.runtime.model.sharding import (
    init_shard_params,
    names_of_stage,
    padded_vocab,
    param_shapes,
    shard,
    tied_copy,
)
from nereus.spec.model import ModelSpec

__all__ = ["KVCache", "LlamaShard", "rms_norm", "rope", "inv_freq", "vocab_parallel_logprobs", "left_pad"]

_ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (HF ``LlamaRMSNorm``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def inv_freq(d: int, theta: float, scaling: tuple = ()) -> torch.Tensor:
    """RoPE inverse frequencies ``[d/2]`` (fp32), with ``linear`` or ``llama3`` scaling as in
    ``transformers.modeling_rope_utils`` (``_compute_linear_scaling_rope_parameters``,
    ``_compute_llama3_parameters``)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = dict(scaling)
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor, lo, hi, old = (sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                               sc["original_max_position_embeddings"])
        low_wl, high_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < high_wl) * ~(wl > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, scaling: tuple = ()) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, T, d]`` at ``positions`` ``[T]`` or ``[B, T]`` (HF rotate-half
    form)."""
    d = x.shape[-1]
    inv = inv_freq(d, theta, scaling).to(x.device)
    ang = positions.float()[..., :, None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def left_pad(ids: torch.Tensor, pad_id: int | None) -> torch.Tensor | None:
    """Leading ``pad_id`` tokens per row of ``ids`` ``[B, T]`` (``[B]`` int64), or None when no row has any."""
    if pad_id is None or ids.dim() != 2 or ids.shape[1] == 0 or not bool((ids[:, 0] == pad_id).any()):
        return None
    return torch.cumprod((ids == pad_id).long(), 1).sum(1)


def vocab_parallel_logprobs(local: torch.Tensor, targets: torch.Tensor, group: Group, vocab: int,
                            temperature: float = 1.0, entropy: bool = False):
    """Log-probabilities ``[B, T]`` of ``targets`` ``[B, T]`` from this TP rank's vocab shard of the
    logits ``local`` ``[B, T, Vp/tp]`` (rows past ``vocab`` are padding), without gathering the full
    vocabulary (Megatron's ``vocab_parallel_cross_entropy``): the max is exchanged as ``[B, T]``, the
    partition sum and the target logit are summed over TP (gradient flows to each rank's own shard).

    Returns:
        log-probs ``[B, T]`` (fp32), identical on every TP rank; with ``entropy`` also the entropy
        ``[B, T]`` of the tempered distribution.
    """
    lg = local.float() / temperature
    c = lg.shape[-1]
    lo = group.rank * c
    cols = torch.arange(lo, lo + c, device=lg.device)
    if lo + c > vocab:
        lg = lg.masked_fill(cols >= vocab, float("-inf"))
    with torch.no_grad():
        m = lg.max(-1).values.contiguous()
        if group.size > 1:
            m = torch.stack(group.all_gather(m)).max(0).values
    z = lg - m.unsqueeze(-1)
    e = z.exp()
    Z = reduce_from_tp(e.sum(-1), group)
    loc = targets - lo
    ok = (loc >= 0) & (loc < c)
    tz = z.gather(-1, loc.clamp(0, c - 1).unsqueeze(-1)).squeeze(-1) * ok.to(z.dtype)
    tz = reduce_from_tp(tz, group)
    lp = tz - torch.log(Z)
    if not entropy:
        return lp
    pz = (e * z.masked_fill(torch.isinf(z), 0.0)).sum(-1)
    ent = torch.log(Z) - reduce_from_tp(pz, group) / Z
    return lp, ent


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
        seed: initial logical parameters: ``layout.init_shard_params`` draws this rank's shards (the
            slices of ``layout.init_full_params(spec, seed)``), unless ``full``, ``shards`` or
            ``spec.checkpoint`` (then only ``score.*`` of a value head missing from it) provide them.
        full: logical name → full tensor to shard instead (tests).
        shards: this rank's shards (a live transition).
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
        elif full is None and spec.checkpoint:
            from nereus.runtime.model.hf import read_shards

            self.params = {n: w.requires_grad_(True) for n, w in
                           read_shards(spec, ctx.pp, ctx.p, ctx.tp, ctx.t, dtype, device, seed).items()}
        elif full is not None:
            shapes = param_shapes(spec)
            self.params = {n: shard(full[n], shapes[n][1], spec, ctx.tp, ctx.t).to(device, dtype)
                           .requires_grad_(True) for n in self.names}
        else:  # random init: only this rank's shards are drawn (never the full model)
            self.params = {n: w.requires_grad_(True) for n, w in
                           init_shard_params(spec, seed, ctx.pp, ctx.p, ctx.tp, ctx.t, dtype, device,
                                             self.names).items()}
        self.layers = sorted({int(n.split(".")[2]) for n in self.names if n.startswith("model.layers.")})
        tp, g = ctx.tp, spec.num_kv_heads
        self.q_heads = spec.num_attention_heads // tp
        self.kv_heads = g // tp if tp <= g else 1
        self.act = _ACTS[spec.hidden_act]
        self.pad_id: int | None = spec.extra.get("pad_id") if isinstance(spec.extra, dict) else None
        self.local_logits = False  # the last rank returns its vocab shard (vocab_parallel_logprobs)

    # ------------------------------------------------------------------ helpers
    def _mm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        with self.meter.op("gemm"):
            return x @ w.t() if b is None else torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(
                *x.shape[:-1], w.shape[0])

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.layers, batch, self.kv_heads, max_len, self.spec.head_dim, self.dtype, self.device)

    def _attention(self, i: int, x: torch.Tensor, start: int, cache: KVCache | None,
                   lpad: torch.Tensor | None = None) -> torch.Tensor:
        s, P = self.spec, self.params
        pre = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        d = s.head_dim
        q = self._mm(x, P[pre + "q_proj.weight"], P.get(pre + "q_proj.bias")).view(B, T, self.q_heads, d).transpose(1, 2)
        k = self._mm(x, P[pre + "k_proj.weight"], P.get(pre + "k_proj.bias")).view(B, T, self.kv_heads, d).transpose(1, 2)
        v = self._mm(x, P[pre + "v_proj.weight"], P.get(pre + "v_proj.bias")).view(B, T, self.kv_heads, d).transpose(1, 2)
        with self.meter.op("attention"):
            if s.qk_norm:
                q = rms_norm(q, P[pre + "q_norm.weight"], s.rms_norm_eps)
                k = rms_norm(k, P[pre + "k_norm.weight"], s.rms_norm_eps)
            pos = torch.arange(start, start + T, device=x.device)
            rpos = pos if lpad is None else (pos[None, :] - lpad[:, None]).clamp_(min=0)
            q, k = rope(q, rpos, s.rope_theta, s.rope_scaling), rope(k, rpos, s.rope_theta, s.rope_scaling)
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
            if lpad is not None:  # [B, 1, T, start+T]: no pad key; a pad query sees itself only
                mask = (mask & (keys[None, :] >= lpad[:, None])[:, None, :]) | (keys[None, :] == pos[:, None])
                mask = mask[:, None]
            if self.recompute == "selective" and torch.is_grad_enabled():
                o = checkpoint(_sdpa, q, k, v, mask, d, use_reentrant=False)
            else:
                o = _sdpa(q, k, v, mask, d)
        o = o.transpose(1, 2).reshape(B, T, self.q_heads * d)
        o = reduce_from_tp(self._mm(o, P[pre + "o_proj.weight"]), self.ctx.tp_group)
        return o if pre + "o_proj.bias" not in P else o + P[pre + "o_proj.bias"]

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        P = self.params
        pre = f"model.layers.{i}.mlp."
        a = self.act(self._mm(x, P[pre + "gate_proj.weight"])) * self._mm(x, P[pre + "up_proj.weight"])
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
        local = self._mm(copy_to_tp(x, tpg), w)
        if self.local_logits:
            return local.float()
        logits = gather_last_dim(local, tpg)
        return logits[..., :s.vocab_size].float()

    @property
    def local_vocab(self) -> tuple[int, int]:
        """``(first id, count)`` of this TP rank's vocab shard (padded vocabulary)."""
        c = padded_vocab(self.spec, self.ctx.tp) // self.ctx.tp
        return self.ctx.t * c, c

    # ------------------------------------------------------------------ forward
    def forward(self, inp: torch.Tensor, start: int = 0, cache: KVCache | None = None,
                lpad: torch.Tensor | None = None) -> torch.Tensor:
        """Run this PP rank's part of the model.

        Args:
            inp: token ids ``[B, T]`` (int64) on the first PP rank, else hidden ``[B, T, h]``.
            start: position of the first new token (the cache length when decoding).
            cache: KV cache to read and extend (generation); None for full-sequence passes.
            lpad: leading pad tokens per sequence ``[B]`` (:func:`left_pad`), or None for none.

        Returns:
            hidden ``[B, T, h]`` on non-last ranks; on the last rank logits ``[B, T, V]`` (fp32, full
            vocab, identical on every TP rank; ``[B, T, Vp/tp]``, this rank's shard, when
            ``local_logits``) or values ``[B, T]`` for a value head.
        """
        x = self._embed(inp) if self.ctx.is_first else inp
        for i in self.layers:
            if self.recompute == "full" and torch.is_grad_enabled() and cache is None:
                # every TP rank recomputes the same layers in the same order, so the collectives
                # inside the recomputed forward pair up again
                x = checkpoint(self._layer, i, x, start, cache, lpad, use_reentrant=False)
            else:
                x = self._layer(i, x, start, cache, lpad)
        if cache is not None:
            cache.length = start + inp.shape[1]
        return self._head(x) if self.ctx.is_last else x

    def _layer(self, i: int, x: torch.Tensor, start: int, cache: KVCache | None,
               lpad: torch.Tensor | None = None) -> torch.Tensor:
        s, P, tpg = self.spec, self.params, self.ctx.tp_group
        pre = f"model.layers.{i}."
        hn = copy_to_tp(rms_norm(x, P[pre + "input_layernorm.weight"], s.rms_norm_eps), tpg)
        x = x + self._attention(i, hn, start, cache, lpad)
        hn = copy_to_tp(rms_norm(x, P[pre + "post_attention_layernorm.weight"], s.rms_norm_eps), tpg)
        return x + self._mlp(i, hn)

    # ------------------------------------------------------------------ gradients
    def zero_grad(self) -> None:
        for w in self.params.values():
            w.grad = None

    def reduce_partial_grads(self, grads: dict[str, torch.Tensor] | None = None) -> None:
        """Complete the gradients that each TP rank holds only partially.

        * q/k RMSNorm weights (Qwen3) are replicated but each rank applies them to its own heads only:
          summed over the TP group.
        * k/v projections of a KV head replicated over ranks (tp > KV heads): each replica sees only
          its own query heads: summed over the ranks sharing that head.

        Args:
            grads: name → gradient (same shape as the shard) reduced in place, e.g. the fp32 main
                gradients of a bf16 engine; None: the parameters' ``.grad``.
        """
        own = grads is None
        if own:
            grads = {n: w.grad for n, w in self.params.items() if w.grad is not None}
        for n, g in grads.items():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                self.ctx.tp_group.all_reduce(g)
            elif self.ctx.kv_group is not None and n.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias",
                                                               "v_proj.bias")):
                self.ctx.kv_group.all_reduce(g)
        self.reduce_tied_grads(grads)
        if own:
            for n, g in grads.items():
                self.params[n].grad = g

    def reduce_tied_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Tied embeddings under PP > 1: the first rank's embedding and the last rank's output-layer copy
        exchange their gradients (same TP rank, emu-group point-to-point) and both take the sum, so
        the copies stay equal after every update (Megatron's embedding group all-reduce). ``grads``:
        name → gradient; the embedding's entry is replaced by the sum."""
        ctx, n = self.ctx, "model.embed_tokens.weight"
        if not tied_copy(self.spec, ctx.pp) or n not in self.params or not (ctx.is_first or ctx.is_last):
            return
        w = self.params[n]
        g = grads[n].contiguous() if grads.get(n) is not None else torch.zeros_like(w)
        peer = ctx.emu_rank(ctx.pp - 1 if ctx.is_first else 0, ctx.t)
        other = torch.empty_like(g)
        ctx.emu_group.sendrecv(g, other, peer)  # gloo: isend, recv, wait; NCCL: ordered by rank
        # a + b on the first rank, b + a on the last: IEEE addition commutes, so both copies are equal
        grads[n] = g + other
