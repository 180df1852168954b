"""Model specs built from Hugging Face ``config.json`` fields.

A :class:`ModelSpec` holds the shapes of a Llama-architecture decoder (RMSNorm, RoPE, grouped-query
attention, SwiGLU; Qwen3 adds per-head q/k RMSNorm). Everything the cost model and the runtime need
(parameter counts, KV-cache bytes per token, FLOPs per token) is derived from these shapes.

Formulas (standard transformer accounting; Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, §3; vLLM's KV-cache block size):

* parameters of one layer: ``2·h·(a·d) + 2·h·(g·d) + 3·h·F + 2·h`` (+ ``2·d`` for q/k norms),
  with h hidden size, a query heads, g KV heads, d head dim, F intermediate size;
* total: ``L·N_layer + V·h·(2 if untied else 1) + h``; Llama-3.1-8B gives 8,030,261,248;
* KV-cache bytes per token: ``2·L·g·d·dtype_bytes`` (vLLM ``CacheEngine.get_cache_block_size``);
  Llama-3.1-8B in bf16 gives 131,072.

Presets carry the shapes published in the models' ``config.json`` on Hugging Face
(meta-llama/Llama-3.1-8B, meta-llama/Llama-3.3-70B-Instruct, Qwen/Qwen3-14B, Qwen/Qwen3-32B).

A config file is validated field by field (``docs/files.md``): integers must be JSON integers,
booleans JSON booleans (``"false"`` is refused, not read as true), and every error names the field,
the value and what is valid.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelSpec", "value_head_variant"]


#: config.json fields read as positive integers, booleans and positive numbers
_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")

#: ``model_type`` values whose math the runtime implements (Llama, Qwen2 with q/k/v biases, Qwen3 with
#: per-head q/k RMSNorm)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: activations of the gated MLP (``transformers.activations.ACT2FN`` names)
SUPPORTED_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
#: ``rope_scaling`` / ``rope_parameters`` types (``transformers.modeling_rope_utils``)
SUPPORTED_ROPE = ("default", "linear", "llama3")
#: config fields of a mixture-of-experts model: refused (the runtime and cost model are dense)
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
               "num_experts_per_tok", "n_shared_experts", "moe_layer_freq", "decoder_sparse_step")


#: what a family users run has that Nereus does not model (named in the refusal; Gemma Team 2024, arXiv:2408.00118 §2)
_FAMILY_GAPS = {"gemma2": "Gemma 2 alternates sliding-window (4,096) and global attention layers, soft-caps attention "
                "and final logits and norms both before and after each block"}


def _refuse_unsupported(config: dict) -> None:
    """Raise ValueError naming the first config field whose math this model does not implement."""
    for k in _MOE_FIELDS:
        v = config.get(k)
        if v not in (None, 0, [], False):
            raise ValueError(f"model field {k!r}={v!r}: mixture-of-experts models are not supported (dense "
                             f"Llama, Qwen2 and Qwen3 decoders only)")
    mt = config.get("model_type", "llama")
    if mt not in SUPPORTED_MODEL_TYPES:
        why = _FAMILY_GAPS.get(mt, "its layers are not the Llama-style decoder Nereus models")
        raise ValueError(f"model field 'model_type'={mt!r} is not supported ({why}); valid: {list(SUPPORTED_MODEL_TYPES)}")
    if config.get("mlp_bias"):
        raise ValueError("model field 'mlp_bias'=true is not supported; valid: false (no MLP biases)")
    sw = config.get("sliding_window")
    if config.get("use_sliding_window") or (sw is not None and mt == "llama"):
        raise ValueError(f"model field {'use_sliding_window' if config.get('use_sliding_window') else 'sliding_window'}"
                         f"={config.get('use_sliding_window') or sw!r}: sliding-window attention is not "
                         "supported; valid: false / null (full attention)")
    lt = config.get("layer_types")
    if lt is not None and (not isinstance(lt, list) or any(t != "full_attention" for t in lt)):
        raise ValueError(f"model field 'layer_types'={lt!r} is not supported; valid: only 'full_attention' layers")
    act = config.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTS:
        raise ValueError(f"model field 'hidden_act'={act!r} is not supported; valid: {list(SUPPORTED_ACTS)}")
    for k in ("pretraining_tp",):
        if config.get(k, 1) not in (1, None):
            raise ValueError(f"model field {k!r}={config[k]!r} is not supported; valid: 1")


def _rope_fields(config: dict) -> tuple[float | None, tuple]:
    """``(rope_theta, scaling items)`` from ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5); items are sorted ``(key, value)`` pairs without ``rope_theta``; ``()`` for none.

    Raises:
        ValueError: an unsupported scaling type, or a llama3/linear scaling missing its fields.
    """
    theta = None
    rs = config.get("rope_scaling")
    rp = config.get("rope_parameters")
    src, d = ("rope_scaling", rs) if rs else ("rope_parameters", rp)
    if d is None:
        return None, ()
    if not isinstance(d, dict):
        raise ValueError(f"model field {src!r} must be a JSON object or null, got {d!r}")
    d = dict(d)
    theta = d.pop("rope_theta", None)
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"model field {src!r} has rope_type={kind!r}, which is not supported; valid: "
                         f"{list(SUPPORTED_ROPE)}")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind, ())
    for k in need:
        v = d.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"model field {src!r}: {kind} scaling needs {k!r} > 0, got {v!r}")
    if kind == "default":
        return theta, ()
    items = [("rope_type", kind)] + [(k, float(d[k])) for k in need]
    return theta, tuple(items)


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model field {name!r} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Llama-architecture decoder.

    Attributes:
        name: preset or file name, for display.
        hidden_size: h, the residual width.
        intermediate_size: F, the SwiGLU MLP width.
        num_layers: L, decoder layers (``num_hidden_layers``).
        num_attention_heads: a, query heads.
        num_kv_heads: g, key/value heads (GQA); ``a % g == 0``.
        head_dim: d; an explicit ``head_dim`` in config.json wins over ``h / a``.
        vocab_size: V.
        tie_word_embeddings: whether ``lm_head`` shares the embedding matrix.
        qk_norm: Qwen3-style RMSNorm on q and k per head (adds ``2·d`` parameters per layer).
        rope_theta, max_position_embeddings, rms_norm_eps: carried for the runtime.
        qkv_bias: biases on the q/k/v projections (Qwen2; Llama's ``attention_bias``), ``a·d + 2·g·d``
            parameters per layer.
        o_bias: a bias on ``o_proj`` (Llama's ``attention_bias``), ``h`` per layer.
        hidden_act: the gated MLP's activation (``silu`` for Llama/Qwen).
        rope_scaling: sorted ``(key, value)`` items of a ``linear`` or ``llama3`` RoPE scaling; ``()``
            for none (the Hugging Face ``rope_scaling`` / ``rope_parameters`` fields).
        model_type: ``llama``, ``qwen2`` or ``qwen3`` (for the config written back on save).
        checkpoint: a Hugging Face model directory holding the weights (``*.safetensors``) and the
            tokenizer, or None for randomly initialised weights; not part of equality.
        head: ``"lm"`` for a language-model head ``[V, h]``; ``"value"`` for a scalar value head
            ``[1, h]`` (critic and reward models).

    Raises:
        ValueError: at construction, naming the field, when a shape is not a positive integer or the
            heads do not divide as GQA requires.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    head: str = "lm"
    qkv_bias: bool = False
    o_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: tuple = ()
    model_type: str = field(default="", compare=False)
    checkpoint: str | None = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                  "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            _require_positive_int(f, getattr(self, f))
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model field 'num_key_value_heads'={self.num_kv_heads} must divide "
                f"'num_attention_heads'={self.num_attention_heads} (grouped-query attention)")
        if self.head not in ("lm", "value"):
            raise ValueError(f"model field 'head' must be 'lm' or 'value', got {self.head!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"model field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps!r}")
        if self.hidden_act not in SUPPORTED_ACTS:
            raise ValueError(f"model field 'hidden_act'={self.hidden_act!r} is not supported; valid: "
                             f"{list(SUPPORTED_ACTS)}")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, config: dict, name: str = "custom") -> ModelSpec:
        """Build from a Hugging Face ``config.json`` dict.

        Reads ``hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads`` (defaults to the query heads), ``head_dim`` (defaults to
        ``hidden_size // num_attention_heads``), ``vocab_size, tie_word_embeddings``, ``attention_bias``
        (Llama: q/k/v/o biases), ``hidden_act``, ``rope_scaling`` or ``rope_parameters``
        (``default``, ``linear``, ``llama3``); Qwen2 always has q/k/v biases, Qwen3 q/k norms.

        Raises:
            ValueError: naming the missing or malformed field, or a field whose math is not
                implemented (mixture of experts, sliding window, MLP biases, another
                ``model_type``, another activation or RoPE scaling).
        """
        if not isinstance(config, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}; "
                             f"a Llama-style config needs {list(required)}")
        for k in _INT_FIELDS:
            if config.get(k) is not None:
                _require_positive_int(k, config[k])
        for k in _BOOL_FIELDS:
            if k in config and not isinstance(config[k], bool):
                raise ValueError(f"model field {k!r} must be a JSON boolean (true or false), got "
                                 f"{config[k]!r}")
        for k in _FLOAT_FIELDS:
            v = config.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"model field {k!r} must be a number > 0, got {v!r}")
        if "model_type" in config and not isinstance(config["model_type"], str):
            raise ValueError(f"model field 'model_type' must be a string such as 'llama' or 'qwen3', "
                             f"got {config['model_type']!r}")
        _refuse_unsupported(config)
        theta_p, scaling = _rope_fields(config)
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % heads != 0:
                raise ValueError(f"config.json has no 'head_dim' and hidden_size={hidden} is not "
                                 f"divisible by num_attention_heads={heads}")
            head_dim = hidden // heads
        model_type = str(config.get("model_type", "llama"))
        attn_bias = bool(config.get("attention_bias", False))
        return cls(
            name=name,
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type.startswith("qwen3"),
            rope_theta=float(config.get("rope_theta") or theta_p or 10000.0),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-5),
            qkv_bias=model_type == "qwen2" or attn_bias,
            o_bias=attn_bias and model_type != "qwen2",
            hidden_act=str(config.get("hidden_act", "silu")),
            rope_scaling=scaling,
            model_type=model_type if "model_type" in config else "",
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelSpec:
        """Load a Hugging Face ``config.json`` file.

        Raises:
            ValueError: the file is missing, is not JSON, or lacks a required field.
        """
        p = Path(path)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ValueError(f"model directory {str(p)!r} holds no config.json")
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"model config file {str(p)!r} does not exist")
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model config file {str(p)!r} is not valid JSON: {e}") from e
        except OSError as e:
            raise ValueError(f"model config file {str(p)!r} cannot be read: {e.strerror or e}") from e
        spec = cls.from_hf_config(cfg, name=p.stem if p.stem != "config" else p.parent.resolve().name or "custom")
        if any(p.parent.glob("*.safetensors")):
            from dataclasses import replace

            spec = replace(spec, checkpoint=str(p.parent.resolve()))
        return spec

    def to_hf_config(self) -> dict:
        """The Hugging Face ``config.json`` fields of this spec (read back by :meth:`from_hf_config`)."""
        mt = self.model_type or ("qwen3" if self.qk_norm else "qwen2" if self.qkv_bias and not self.o_bias
                                 else "llama")
        out = {
            "model_type": mt,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
        }
        if mt == "llama" and (self.qkv_bias or self.o_bias):
            out["attention_bias"] = True
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        d.pop("checkpoint", None)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    # ---------------------------------------------------------------- derived shapes
    @property
    def q_dim(self) -> int:
        """a·d, the query projection width."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """g·d, the width of each of the k and v projections."""
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer: q,o ``2·h·a·d``; k,v ``2·h·g·d``; MLP ``3·h·F``; 2 norms."""
        h = self.hidden_size
        n = 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate_size + 2 * h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n + self.bias_params_per_layer

    @property
    def bias_params_per_layer(self) -> int:
        """Projection biases of one layer: q/k/v ``a·d + 2·g·d`` (Qwen2), o ``h`` (Llama attention_bias)."""
        return (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)

    @property
    def embedding_params(self) -> int:
        """Input embedding ``V·h``."""
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Output head: ``lm_head`` ``V·h`` (0 extra when tied) or value head ``h`` (+1 bias)."""
        if self.head == "value":
            return self.hidden_size + 1
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters ``L·N_layer + V·h + head + h`` (final norm)."""
        return (self.num_layers * self.params_per_layer + self.embedding_params
                + self.head_params + self.hidden_size)

    @property
    def gemm_params_per_layer(self) -> int:
        """Parameters of one layer that take part in GEMMs (everything but the norms)."""
        h = self.hidden_size
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate_size

    @property
    def head_out_dim(self) -> int:
        """Output width of the head: V for an LM head, 1 for a value head."""
        return 1 if self.head == "value" else self.vocab_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV-cache bytes one token occupies on one TP rank: ``2·L·max(g/tp, 1)·d·bytes``.

        KV heads are replicated when ``tp > g`` (vLLM), so the per-rank term never drops below one head.
        """
        kv_heads = max(self.num_kv_heads // tp, 1) if tp <= self.num_kv_heads else 1
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype_bytes

    def fwd_flops_per_token(self, context: float = 0.0, causal: bool = True) -> float:
        """Forward FLOPs per token: ``2·N_gemm`` plus attention ``4·L·a·d·context`` (halved if causal).

        ``N_gemm`` excludes the input embedding (a lookup) and includes the head (PaLM convention:
        Chowdhery et al. 2022, appendix B). ``context`` is the number of keys a query attends to (the sequence
        length for training; the current cache length for decode).
        """
        n_gemm = self.num_layers * self.gemm_params_per_layer + self.hidden_size * self.head_out_dim
        attn = 4.0 * self.num_layers * self.q_dim * context
        if causal:
            attn *= 0.5
        return 2.0 * n_gemm + attn

    def value_head(self) -> ModelSpec:
        """The same backbone with a scalar value head (critic, reward model)."""
        return value_head_variant(self)


def value_head_variant(m: ModelSpec) -> ModelSpec:
    """Critic/reward variant of ``m``: same backbone, ``lm_head`` replaced by a ``[1, h]`` value head."""
    from dataclasses import replace

    return replace(m, head="value", name=f"{m.name}+value-head")


