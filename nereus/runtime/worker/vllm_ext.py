"""Code that runs inside vLLM's own worker processes (one per vLLM TP rank): the weight-load half of
the runtime's weight sync into a vLLM engine.

vLLM calls a *worker extension class* (``LLM(worker_extension_cls=...)``; the route verl and OpenRLHF
use for their weight updates) and mixes it into its worker, so :meth:`NereusWorkerExtension.nereus_load_shards`
runs with ``self`` the vLLM worker. It is called through ``LLM.collective_rpc`` by method name: no
function is pickled (vLLM refuses that without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

What crosses: the runtime's Llama TP rules equal vLLM's (``runtime/model/sharding.py``: q/gate/up
column chunks, o/down row chunks, KV heads split or replicated as vLLM replicates them), so vLLM TP
rank ``t`` needs exactly the parameter shards that TP rank ``t`` of the runtime's ``actor.generate``
EMU holds. Each runtime rank writes its shards into one safetensors file ``rank-<t>.safetensors`` of a
hand-off directory (``/dev/shm`` on Linux: memory, no disk); vLLM rank ``t`` opens only its own file and
copies every tensor into its parameter in place: ``q, k, v`` into the fused ``qkv_proj`` rows,
``gate, up`` into ``gate_up_proj``. Only the vocabulary rows differ: vLLM pads the vocabulary to a
multiple of 64 before splitting it over TP (``vocab_parallel_embedding.pad_vocab_size``), the runtime
to a multiple of TP, so rank ``t`` reads the rows of its vLLM range from whichever runtime files hold
them (``safe_open(...).get_slice``: only those rows are read). No process holds the full model.
"""

from __future__ import annotations

import os

import torch

__all__ = ["NereusWorkerExtension", "vllm_name", "FUSED"]

#: runtime (Hugging Face) projection → (vLLM fused parameter, position among its parts)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_name(name: str) -> tuple[str, int | None]:
    """The vLLM Llama parameter a runtime parameter lives in, and its part of a fused one
    (``model.layers.0.self_attn.k_proj.weight`` → ``(model.layers.0.self_attn.qkv_proj.weight, 1)``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in FUSED:
            fused, k = FUSED[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), k
    return name, None


class NereusWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; ``self`` is the vLLM worker."""

    def nereus_rank(self) -> int:
        """This worker's TP rank in the engine."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def nereus_kv_blocks(self) -> dict:
        """What the engine allocated for its KV cache: blocks, block size, bytes (this rank)."""
        cc = self.vllm_config.cache_config
        nbytes = 0
        caches = getattr(self.model_runner, "kv_caches", None) or []
        for c in caches:
            for x in (c if isinstance(c, (list, tuple)) else [c]):
                if isinstance(x, torch.Tensor):
                    nbytes += x.numel() * x.element_size()
        return {"num_blocks": int(cc.num_gpu_blocks or 0), "block_size": int(cc.block_size), "kv_bytes": int(nbytes)}

    @torch.no_grad()
    def nereus_load_shards(self, directory: str, vocab: int, runtime_tp: int) -> dict:
        """Copy this rank's shards from ``<directory>/rank-<t>.safetensors`` into the model's parameters.

        On CPU, vLLM repacks linear weights for oneDNN / its small-GEMM kernel after loading and drops
        the plain weight (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so each updated layer
        gets its weight back as a parameter and is repacked (its ``process_weights_after_loading``); on
        GPUs the parameters are updated in place.

        Args:
            directory: the hand-off directory the runtime's ranks wrote.
            vocab: the model's vocabulary size (rows of ``embed_tokens``/``lm_head`` before padding).
            runtime_tp: TP degree of the runtime EMU that wrote the files (equal to the engine's).

        Returns:
            ``{"rank", "bytes" read, "tensors", "seconds"}``.

        Raises:
            KeyError: a runtime tensor with no vLLM parameter (another architecture).
        """
        import time

        from safetensors import safe_open

        t0 = time.perf_counter()
        rank = self.nereus_rank()
        model = self.model_runner.model
        params = dict(model.named_parameters())
        read, count = 0, 0
        new: dict[str, torch.Tensor] = {}
        fused_parts: dict[str, dict[int, torch.Tensor]] = {}
        with safe_open(os.path.join(directory, f"rank-{rank}.safetensors"), framework="pt") as f:
            for n in f.keys():
                if n.endswith(("embed_tokens.weight", "lm_head.weight")):
                    continue
                x = f.get_tensor(n)
                read += x.numel() * x.element_size()
                count += 1
                target, part = vllm_name(n)
                if part is None:
                    new[target] = x
                else:
                    fused_parts.setdefault(target, {})[part] = x
        for target, parts in fused_parts.items():
            new[target] = torch.cat([parts[k] for k in sorted(parts)], 0)
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            if n in params:  # absent when tied: lm_head shares embed_tokens
                x = params[n].detach().clone()
                read += self._load_vocab(directory, n, x, vocab, runtime_tp, rank)
                new[n] = x
                count += 1
        self._apply(model, new)
        return {"rank": rank, "bytes": read, "tensors": count, "seconds": time.perf_counter() - t0}

    def _apply(self, model, new: dict[str, torch.Tensor]) -> None:
        """Set every parameter of ``new`` (vLLM names, this rank's local shapes), repacking CPU layers."""
        from vllm.platforms import current_platform

        modules = dict(model.named_modules())
        touched = {}
        for name, x in new.items():
            mod_name, attr = name.rsplit(".", 1)
            mod = modules[mod_name]
            cur = getattr(mod, attr)
            if cur.numel() == 0:  # dropped after CPU repacking: give the layer its weight back
                setattr(mod, attr, torch.nn.Parameter(x.to(cur.dtype).contiguous(), requires_grad=False))
            else:
                if tuple(cur.shape) != tuple(x.shape):
                    raise ValueError(f"vLLM parameter {name} has shape {tuple(cur.shape)}, the runtime's shard "
                                     f"{tuple(x.shape)}")
                cur.data.copy_(x)
            touched[mod_name] = mod
        if current_platform.is_cpu():
            for mod in touched.values():
                qm = getattr(mod, "quant_method", None)
                if qm is not None and hasattr(mod, "cpu_linear"):
                    qm.process_weights_after_loading(mod)

    def _load_vocab(self, directory: str, name: str, param: torch.Tensor, vocab: int, tp: int, rank: int) -> int:
        """Rows of vLLM rank ``rank``'s vocabulary range, into ``param`` ``[rows per rank, h]``, from the
        runtime ranks' files holding them (only those rows are read)."""
        from safetensors import safe_open

        per_v = param.shape[0]
        lo, hi = min(rank * per_v, vocab), min((rank + 1) * per_v, vocab)
        c = -(-vocab // tp)  # the runtime's rows per rank
        read = 0
        for r in range(tp):
            a, b = max(lo, r * c), min(hi, (r + 1) * c)
            if a >= b:
                continue
            with safe_open(os.path.join(directory, f"rank-{r}.safetensors"), framework="pt") as f:
                key = name if name in f.keys() else "model.embed_tokens.weight"
                x = f.get_slice(key)[a - r * c:b - r * c]
            param[a - lo:b - lo].copy_(x)
            read += x.numel() * x.element_size()
        return read
