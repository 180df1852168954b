"""The EMU state on one worker: parameter shards, sharded Adam state, counters (DESIGN.md §2, §4.7).

Logical state ``Λ = (θ, ω, c, v, p)``: parameters, Adam moments (sharded exactly like θ since Adam is
elementwise; ``step`` replicated), the update counter ``c``, the model-stage and policy versions
``v``, the mini-batch position ``p`` of the last completed update. RNG and data order are derived from
the *global* sample index (``rl/task.py``, ``worker/rollout.py``), so they depend on (dp rank, p) only through
which samples a replica holds: changing dp neither repeats nor skips a sample.

:meth:`Engine.gather_logical_state` reassembles the full unsharded state on every worker of the EMU
(``logical_state.py``).

**Precision** (``precision``; Megatron-LM's ``--bf16`` with its ``Float16OptimizerWithFloat16Params``):

========  ======================================================  =========================
run       held per trained parameter                              bytes
========  ======================================================  =========================
``fp32``  fp32 weights (Adam's master weights), fp32 ``exp_avg``   4 + 8
          and ``exp_avg_sq``; gradients fp32
``bf16``  bf16 weights (forward, backward, TP/PP collectives in   2 + 4 + 8 (+ 4 transient
          bf16), fp32 ``master`` weights, fp32 moments; each      fp32 main gradient)
          micro-batch's bf16 gradient is added into an fp32
          *main gradient* as soon as autograd has accumulated it
          (a post-accumulate-grad hook, Megatron's ``main_grad``),
          so gradient accumulation, the KV-replica / tied-
          embedding reductions and the DP all-reduce run in fp32;
          Adam updates the master, which is then rounded (to
          nearest even) into the bf16 weights
========  ======================================================  =========================

Forward-only engines of a bf16 run hold bf16 weights only. The bf16 ``params`` are always the
master rounded to bf16, so a live transition moves all four kinds (``shards.train_kinds``) and
rebuilds an engine whose next update is bit-identical to the one it would have made in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.parallel import ParallelContext
from nereus.runtime.model.llama import LlamaShard, vocab_parallel_logprobs
from nereus.runtime.model.precision import PRECISIONS
from nereus.runtime.rl import algorithms as alg
from nereus.runtime.worker.logical_state import LogicalStateMixin
from nereus.runtime.worker.pipeline import forward_backward, forward_only
from nereus.spec.model import ModelSpec

__all__ = ["AdamConfig", "Engine", "split_micro"]


@dataclass(frozen=True)
class AdamConfig:
    """Adam hyper-parameters (``torch.optim.Adam`` semantics, no weight decay).

    Raises:
        ValueError: lr not positive, betas outside [0, 1), eps not positive.
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"adam field 'lr' must be > 0, got {self.lr}")
        for f in ("beta1", "beta2"):
            if not 0 <= getattr(self, f) < 1:
                raise ValueError(f"adam field {f!r} must be in [0, 1), got {getattr(self, f)}")
        if not self.eps > 0:
            raise ValueError(f"adam field 'eps' must be > 0, got {self.eps}")


def split_micro(n: int, b: int) -> list[slice]:
    """Slices of ``b`` rows covering ``n`` rows.

    Raises:
        ValueError: ``b`` does not divide ``n``.
    """
    if b < 1 or n % b:
        raise ValueError(f"micro_batch={b} must divide the replica's {n} sequences")
    return [slice(i, i + b) for i in range(0, n, b)]


class Engine(LogicalStateMixin):
    """One worker's part of one EMU of one model-stage.

    Args:
        spec: model shapes; ``spec.head`` picks logits or values.
        ctx: parallel context; ``ctx.d`` is this EMU's DP replica.
        seed: initial parameters (every layout of the same seed starts identical).
        trainable: hold Adam state and accept :meth:`train_step`.
        schedule: pipeline schedule of training, ``1f1b`` or ``gpipe``.
        recompute: activation recomputation, ``none``, ``selective`` or ``full`` (see ``model/llama.py``).
        state: ``{"tensors": {kind: {name: this rank's shard}}, "counters": {...}}`` to start from
            (a live transition's unit, ``transit/worker_side.py``) instead of the seed's initial weights.
        precision: ``fp32`` or ``bf16`` (module docstring); ``bf16`` makes the weights bf16 whatever
            ``dtype`` says and, when trainable, keeps fp32 ``master`` weights (from ``state``'s
            ``master`` when given, else the bf16 weights upcast, as Megatron creates them).

    Raises:
        ValueError: unknown schedule or precision.
    """

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, seed: int, meter: Meter, trainable: bool,
                 adam: AdamConfig | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 full: dict[str, torch.Tensor] | None = None, schedule: str = "1f1b",
                 recompute: str = "none", state: dict | None = None, precision: str = "fp32") -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pipeline schedule must be '1f1b' or 'gpipe', got {schedule!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.spec, self.ctx, self.meter, self.trainable = spec, ctx, meter, trainable
        self.schedule, self.precision = schedule, precision
        if precision == "bf16":
            dtype = torch.bfloat16
        tensors = state["tensors"] if state is not None else {}
        self.model = LlamaShard(spec, ctx, seed, meter, dtype, device, full=full, recompute=recompute,
                                shards=tensors.get("params"))
        self.adam = adam or AdamConfig()
        self.main_grad: dict[str, torch.Tensor] | None = None  # fp32 gradient accumulators (bf16)
        self._init_optimizer(tensors)
        self.step = 0            # Adam step (replicated)
        self.update_count = 0    # c
        self.version = 0         # model-stage version (bumped by every update or weight sync)
        self.policy_version = 0  # version of the policy whose weights these are
        self.position = 0        # global mini-batch position of the last completed update
        for k, v in (state or {}).get("counters", {}).items():
            setattr(self, k, int(v))
        self.meter.set_static(f"params:{id(self)}", self.state_bytes)

    def _init_optimizer(self, tensors: dict) -> None:
        """Adam moments (and, bf16, the fp32 master weights with their main-gradient hooks) from
        ``tensors`` when given, else zeros (and the weights upcast); sharded ZeRO engines
        (``worker/zero.py``) hold slices instead."""
        def moments(kind: str) -> dict:  # given moments as they are; zeros only when none are given
            given = tensors.get(kind)
            if given is not None:
                return dict(given)
            return {n: torch.zeros_like(w, dtype=torch.float32) for n, w in self.model.params.items()}

        self.exp_avg = moments("exp_avg") if self.trainable else {}
        self.exp_avg_sq = moments("exp_avg_sq") if self.trainable else {}
        # fp32 master weights of a bf16 trainable engine (fp32: the weights themselves are the master)
        self.master: dict[str, torch.Tensor] = {}
        if self.trainable and self.precision == "bf16":
            given = tensors.get("master")
            self.master = {n: (given[n] if given is not None else w.detach().float().clone())
                           for n, w in self.model.params.items()}
            for n, w in self.model.params.items():
                w.register_post_accumulate_grad_hook(self._accumulate_hook(n))

    @property
    def state_bytes(self) -> int:
        """Bytes of the resident state on this rank: weights, master weights and Adam moments."""
        return sum(t.numel() * t.element_size() for d in self.state_tensors().values() for t in d.values())

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """kind → name → this rank's shard, for every kind this engine holds (``shards.train_kinds``
        of its precision when trainable, ``params`` only otherwise); the tensors themselves, no copy."""
        out = {"params": {n: w.detach() for n, w in self.model.params.items()}}
        if self.trainable:
            if self.precision == "bf16":
                out["master"] = self.master
            out["exp_avg"], out["exp_avg_sq"] = self.exp_avg, self.exp_avg_sq
        return out

    def _accumulate_hook(self, name: str):
        """Autograd hook on a bf16 parameter: once its ``.grad`` holds a micro-batch's gradient, add it
        into the fp32 main gradient and drop it (Megatron's ``main_grad`` accumulation)."""
        def hook(w: torch.Tensor) -> None:
            if self.main_grad is not None:
                self.main_grad[name].add_(w.grad)
                w.grad = None
        return hook

    def _zero_grad(self, numel: int | None = None) -> None:
        """One flat fp32 gradient buffer of ``numel`` elements (default: the shard's ``N``; ZeRO-1 pads
        to ``dp·k``) whose views are the gradients autograd accumulates into (fp32: ``.grad``; bf16:
        the main gradients), as DDP's ``gradient_as_bucket_view`` and Megatron's contiguous gradient
        buffer hold them; accounted as ``grads:<engine>`` until the update frees it."""
        self.model.zero_grad()
        P = self.model.params
        n = sum(w.numel() for w in P.values())
        self._gbuf = torch.zeros(max(numel or n, n), dtype=torch.float32, device=next(iter(P.values())).device)
        self.meter.set_static(f"grads:{id(self)}", self._gbuf.numel() * 4)
        views, off = {}, 0
        for name, w in P.items():
            views[name] = self._gbuf[off:off + w.numel()].view(w.shape)
            off += w.numel()
        if self.master:
            self.main_grad = views
        else:
            for name, w in P.items():
                w.grad = views[name]
        self._gviews = views

    def _grad_buffer(self) -> torch.Tensor:
        """The flat gradient buffer holding the current gradients (copied back where a reduction
        replaced a gradient by a new tensor, e.g. the tied-embedding sum)."""
        grads = self.grads()
        for name, v in self._gviews.items():
            if grads[name] is not v:
                v.copy_(grads[name])
        return self._gbuf

    def _free_grads(self) -> None:
        """Drop the gradients and their buffer after the update (the cost model's transient term)."""
        self.model.zero_grad()
        self.main_grad = None
        self._gbuf, self._gviews = None, {}
        self.meter.drop_static(f"grads:{id(self)}")

    def grads(self) -> dict[str, torch.Tensor]:
        """name → the gradient the optimizer uses: the fp32 main gradient (bf16) or ``.grad`` (fp32);
        zeros for a parameter that received none."""
        if self.main_grad is not None:
            return self.main_grad
        return {n: (w.grad if w.grad is not None else torch.zeros_like(w)) for n, w in self.model.params.items()}

    def _reduce_grads(self) -> None:
        """KV-replica and tied-embedding sums, then the DP all-reduce (all in fp32 under bf16)."""
        if self.main_grad is not None:
            self.model.reduce_partial_grads(self.main_grad)
        else:
            self.model.reduce_partial_grads()
        self._dp_reduce_grads()

    # ------------------------------------------------------------------ inference
    def forward(self, tokens: torch.Tensor, micro_batch: int) -> torch.Tensor | None:
        """Last-rank outputs ``[n, T, V]`` logits or ``[n, T]`` values; None off the last PP rank."""
        micro = [tokens[s] for s in split_micro(tokens.shape[0], micro_batch)]
        outs = forward_only(self.model, micro)
        return None if outs is None else torch.cat(outs, 0)

    def logprobs(self, tokens: torch.Tensor, prompt_len: int, micro_batch: int,
                 temperature: float = 1.0) -> torch.Tensor | None:
        """Log-probabilities ``[n, R]`` of the response tokens ``tokens[:, prompt_len:]``, computed
        vocab-parallel per micro-batch (each TP rank keeps its ``[b, T, V/tp]`` logits shard only)."""
        slices = split_micro(tokens.shape[0], micro_batch)
        self.model.local_logits = True
        try:
            outs = forward_only(self.model, [tokens[s] for s in slices])
        finally:
            self.model.local_logits = False
        if outs is None:
            return None
        return torch.cat([self._response_logprobs(o, tokens[s], prompt_len, temperature)
                          for o, s in zip(outs, slices)])

    def _response_logprobs(self, local: torch.Tensor, tokens: torch.Tensor, prompt_len: int,
                           temperature: float) -> torch.Tensor:
        return vocab_parallel_logprobs(local[:, prompt_len - 1:-1], tokens[:, prompt_len:], self.ctx.tp_group,
                                       self.spec.vocab_size, temperature)

    def values(self, tokens: torch.Tensor, prompt_len: int, micro_batch: int) -> torch.Tensor | None:
        """Values ``[n, R]`` at the positions that predict each response token."""
        v = self.forward(tokens, micro_batch)
        return None if v is None else v[:, prompt_len - 1:-1]

    # ------------------------------------------------------------------ training
    def backward_lm(self, tokens: torch.Tensor, micro_batch: int, denom: float) -> float | None:
        """Gradients of a plain objective (for checks), left in ``params[..].grad``, no update.

        LM head: next-token cross-entropy summed over positions ``/ denom``; value head: the sum of
        values ``/ denom``. Gradients are reduced over replicated KV heads and DP like a real update.

        Returns:
            the summed loss on the last PP rank, None elsewhere.
        """
        slices = split_micro(tokens.shape[0], micro_batch)

        def loss_fn(out: torch.Tensor, m: int):
            ids = tokens[slices[m]]
            if self.spec.head == "value":
                lv = out.sum() / denom
            else:
                lv = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                                       ids[:, 1:].reshape(-1), reduction="sum") / denom
            return lv, {"loss": float(lv.detach())}

        self._zero_grad()
        mets = forward_backward(self.model, [tokens[s] for s in slices], loss_fn, self.schedule)
        self._reduce_grads()
        return None if mets is None else sum(m["loss"] for m in mets)

    def train_step(self, batch: dict[str, torch.Tensor], loss: dict, micro_batch: int, denom: float,
                   position: int) -> dict | None:
        """One optimizer update on this replica's share of a mini-batch.

        Args:
            batch: ``tokens [n, T]`` plus per-token fields ``[n, R]``: ``mask``; for the actor
                ``old_logp, adv`` (and ``ref_logp`` when ``loss["kl_coef"] > 0``); for the critic
                ``old_values, returns``.
            loss: ``{"kind": "actor"|"critic", "prompt_len", "clip", "kl_coef", "temperature"}``.
            micro_batch: ``b``; this replica runs ``n / b`` accumulation micro-batches.
            denom: response tokens in the whole mini-batch (all replicas).
            position: global mini-batch position this update completes.

        Returns:
            summed metrics (``loss``, ``clipped``) on the last PP rank, None elsewhere.

        Raises:
            RuntimeError: the engine is not trainable.
        """
        if not self.trainable:
            raise RuntimeError("train_step on a non-trainable engine")
        tokens = batch["tokens"]
        slices = split_micro(tokens.shape[0], micro_batch)
        P = int(loss["prompt_len"])

        def loss_fn(out: torch.Tensor, m: int):
            mb = {k: v[slices[m]] for k, v in batch.items()}
            if loss["kind"] == "critic":
                v = out[:, P - 1:-1]
                lv = alg.value_loss(v, mb["old_values"], mb["returns"], mb["mask"], loss["clip"], denom)
                return lv, {"loss": float(lv.detach())}
            lp = self._response_logprobs(out, mb["tokens"], P, loss.get("temperature", 1.0))
            lpol, clipped = alg.policy_loss(lp, mb["old_logp"], mb["adv"], mb["mask"], loss["clip"], denom)
            total = lpol
            kl = torch.zeros(())
            if loss.get("kl_coef", 0.0) > 0:
                kl = (alg.kl_k3(lp, mb["ref_logp"]) * mb["mask"]).sum() / denom
                total = total + loss["kl_coef"] * kl
            return total, {"loss": float(total.detach()), "pg_loss": float(lpol.detach()), "kl": float(kl.detach()),
                           "clipped": float(clipped)}

        self._zero_grad()
        self.model.local_logits = loss["kind"] != "critic"
        try:
            mets = forward_backward(self.model, [tokens[s] for s in slices], loss_fn, self.schedule)
        finally:
            self.model.local_logits = False
        self._reduce_grads()
        self._adam_step()
        self._free_grads()  # the fp32 gradients are transient (cost model: grad_bytes)
        self.update_count += 1
        self.version += 1
        self.position = position
        if mets is None:
            return None
        return {k: sum(m[k] for m in mets) for k in mets[0]}

    def _dp_reduce_grads(self) -> None:
        """All-reduce the flat gradient buffer in place (the gradients are its views)."""
        g = self.ctx.dp_group
        if g.size == 1:
            return
        g.all_reduce(self._grad_buffer())  # losses are pre-scaled by the mini-batch token count: SUM, not AVG
        for name, v in self._gviews.items():
            if self.main_grad is not None:
                self.main_grad[name] = v
            else:
                self.model.params[name].grad = v

    @torch.no_grad()
    def _adam_step(self) -> None:
        """Adam on the fp32 master (the weights themselves in fp32); bf16: the weights become the
        master rounded to bf16."""
        a = self.adam
        self.step += 1
        bc1, bc2 = 1 - a.beta1 ** self.step, 1 - a.beta2 ** self.step
        for n, w in self.model.params.items():
            if self.main_grad is not None:
                grad, target = self.main_grad[n], self.master[n]
            else:
                if w.grad is None:
                    continue
                grad, target = w.grad, w
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.mul_(a.beta1).add_(grad, alpha=1 - a.beta1)
            v.mul_(a.beta2).addcmul_(grad, grad, value=1 - a.beta2)
            target.addcdiv_(m / bc1, (v / bc2).sqrt_().add_(a.eps), value=-a.lr)
            if target is not w:
                w.copy_(target)


