"""Model presets by name: the published shapes of the models users train (each from its Hugging Face
``config.json``) and two small Llamas for CPU runs, and :func:`get_model`, which takes a preset name or a
path to a ``config.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereus.spec.model import ModelSpec

__all__ = ["MODEL_PRESETS", "get_model"]


def _preset(name: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, **kw)


#: Published shapes (the models' Hugging Face config.json), plus a tiny model for CPU runs.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": _preset("llama-3.1-8b", hidden_size=4096, intermediate_size=14336, num_layers=32,
                            num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
                            rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "llama-3.3-70b": _preset("llama-3.3-70b", hidden_size=8192, intermediate_size=28672, num_layers=80,
                             num_attention_heads=64, num_kv_heads=8, head_dim=128, vocab_size=128256,
                             rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "qwen3-14b": _preset("qwen3-14b", hidden_size=5120, intermediate_size=17408, num_layers=40,
                         num_attention_heads=40, num_kv_heads=8, head_dim=128, vocab_size=151936,
                         qk_norm=True, rope_theta=1000000.0, max_position_embeddings=40960,
                         rms_norm_eps=1e-6),
    "qwen3-32b": _preset("qwen3-32b", hidden_size=5120, intermediate_size=25600, num_layers=64,
                         num_attention_heads=64, num_kv_heads=8, head_dim=128, vocab_size=151936,
                         qk_norm=True, rope_theta=1000000.0, max_position_embeddings=40960,
                         rms_norm_eps=1e-6),
    # Qwen2.5-0.5B(-Instruct) config.json: q/k/v biases, tied embeddings, 14 query / 2 KV heads.
    "qwen2.5-0.5b": _preset("qwen2.5-0.5b", hidden_size=896, intermediate_size=4864, num_layers=24,
                            num_attention_heads=14, num_kv_heads=2, head_dim=64, vocab_size=151936,
                            qkv_bias=True, tie_word_embeddings=True, rope_theta=1000000.0,
                            max_position_embeddings=32768, rms_norm_eps=1e-6),
    # A tiny Llama for CPU runs: 4 layers so PP up to 4, 4 query / 2 KV heads so TP up to 4
    # (KV heads replicated at TP=4), vocabulary sized for the built-in task's tokenizer.
    "tiny": _preset("tiny", hidden_size=64, intermediate_size=128, num_layers=4, num_attention_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=64, rope_theta=10000.0,
                    max_position_embeddings=256, rms_norm_eps=1e-5),
    # The tiny model with vLLM's head size (vLLM's CPU attention refuses head_dim 16): --rollout vllm on CPU
    "tiny-d64": _preset("tiny-d64", hidden_size=256, intermediate_size=512, num_layers=4, num_attention_heads=4,
                        num_kv_heads=2, head_dim=64, vocab_size=64, rope_theta=10000.0,
                        max_position_embeddings=256, rms_norm_eps=1e-5),
    # A small Llama for CPU runs where compute should dominate communicator setup (the adaptive
    # scenario): 8 layers, 8 query / 4 KV heads, about 4.7M parameters.
    "small": _preset("small", hidden_size=256, intermediate_size=512, num_layers=8, num_attention_heads=8,
                     num_kv_heads=4, head_dim=32, vocab_size=64, rope_theta=10000.0,
                     max_position_embeddings=512, rms_norm_eps=1e-5),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive), a ``config.json`` path, or a directory holding one.

    Raises:
        ValueError: unknown preset and no such file; lists the valid presets.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"model must be a preset name ({', '.join(sorted(MODEL_PRESETS))}) or a path to a "
                         f"Hugging Face config.json (or its directory), got {name_or_path!r}")
    key = name_or_path.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return ModelSpec.from_json_file(p)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODEL_PRESETS)} "
                     f"or a path to a Hugging Face config.json")
