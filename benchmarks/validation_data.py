"""Rows of the cost-model validation benchmark: the measurements CSV (``benchmarks/data/
published_measurements.csv``, columns in ``benchmarks/data/README.md``), its loader and the model
shapes it names. Used by ``benchmarks/validate_cost_model.py``."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from nereus.spec.hardware import get_gpu
from nereus.spec.model import ModelSpec
from nereus.spec.presets import get_model

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CSV = ROOT / "benchmarks" / "data" / "published_measurements.csv"
DEFAULT_PNG = ROOT / "benchmarks" / "out" / "validate_cost_model.png"
GIB = 1024**3
STAGE = "reference.train"

#: Model shapes not among the presets, as Hugging Face config.json fields (read with
#: ModelSpec.from_hf_config). Llama-2: the meta-llama/Llama-2-{7b,13b,70b}-hf config.json files.
#: MPT (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads, n_layers,
#: expansion_ratio 4, vocab 50368, tied embeddings): MPT's MLP is ungated (2 matrices of h x 4h);
#: the cost model's MLP is gated (3 matrices of h x F), so F = round(8h/3) gives the same GEMM
#: parameters and FLOPs (within 0.01%). Not represented: MPT's fused QKV (7 GEMM calls per layer
#: are assumed for the GEMM size curve instead of 4) and its learned position embedding (a lookup).
_MPT = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
        "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MODEL_CONFIGS: dict = {
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    "llama-2-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                        max_position_embeddings=4096, tie_word_embeddings=False),
    "llama-2-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                        max_position_embeddings=4096, tie_word_embeddings=False),
}
#: GPT-3 5B/175B as NeMo-Megatron-Launcher configures them (launcher_scripts/conf/training/gpt3/{5b,175b}.yaml:
#: hidden 4096/12288, 24/96 layers, 32/96 heads, FFN 4h, GPT-2 BPE vocabulary 50257 padded to 50304
#: (make_vocab_size_divisible_by 128), shared input/output embedding); MLP mapped as for MPT.
for _k, (_h, _a, _layers) in {"5b": (4096, 32, 24), "175b": (12288, 96, 96)}.items():
    MODEL_CONFIGS[f"gpt3-{_k}"] = dict(model_type="llama", hidden_size=_h, intermediate_size=round(8 * _h / 3),
                                       num_hidden_layers=_layers, num_attention_heads=_a, num_key_value_heads=_a,
                                       vocab_size=50304, max_position_embeddings=2048, tie_word_embeddings=True,
                                       hidden_act="gelu")
for _k, (_h, _a, _layers) in _MPT.items():
    MODEL_CONFIGS[f"mpt-{_k}"] = dict(model_type="llama", hidden_size=_h, intermediate_size=round(8 * _h / 3),
                                      num_hidden_layers=_layers, num_attention_heads=_a, num_key_value_heads=_a,
                                      vocab_size=50368, max_position_embeddings=65536, tie_word_embeddings=True,
                                      hidden_act="gelu")

INT_COLS = ("num_gpus", "tp", "pp", "cp", "dp", "micro_batch", "grad_accum", "global_batch", "seq_len",
            "zero", "sp", "vpp", "overlap_grad_reduce", "overlap_tp_comm", "grad_reduce_bytes")
REQUIRED = ("id", "source", "reference", "model", "gpu", *INT_COLS, "recompute", "precision", "kind",
            "measured_quantity", "measured_value", "iter_time_s", "conversion")
#: feature → value that means "not used"
NEUTRAL = {"zero": 0, "sp": 0, "vpp": 1, "overlap_grad_reduce": 0, "overlap_tp_comm": 0, "cp": 1,
           "grad_reduce_bytes": 4, "attention_kernel": "flash"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One published measurement (columns documented in benchmarks/data/README.md)."""

    id: str
    source: str
    reference: str
    model: str
    gpu: str
    num_gpus: int
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    recompute: str
    zero: int
    sp: int
    vpp: int
    overlap_grad_reduce: int
    overlap_tp_comm: int
    grad_reduce_bytes: int
    precision: str
    kind: str
    measured_quantity: str
    measured_value: float
    iter_time_s: float
    conversion: str
    memory_gib: float | None = None
    attention_kernel: str = "flash"


def measured_iter_time(r: Row) -> float:
    """Iteration seconds from the published quantity (the conversions of benchmarks/data/README.md).

    Raises:
        ValueError: an unknown measured quantity.
    """
    tokens = r.global_batch * r.seq_len
    q, v = r.measured_quantity, r.measured_value
    if q == "tokens_per_s":
        return tokens / v
    if q == "tokens_per_s_per_gpu":
        return tokens / (v * r.num_gpus)
    if q == "step_time_s":
        return v
    if q == "mfu":  # fraction of the bf16 peak, 6N+attention FLOPs per token (llm-foundry/PaLM convention)
        m = model_spec(r.model)
        flops = 3 * m.fwd_flops_per_token(context=r.seq_len, causal=False) * tokens
        return flops / (v * r.num_gpus * get_gpu(r.gpu).peak_flops)
    raise ValueError(f"row {r.id}: unknown measured_quantity {q!r}; valid: tokens_per_s, "
                     f"tokens_per_s_per_gpu, step_time_s, mfu")


def load_rows(path: str | Path = DEFAULT_CSV) -> list[Row]:
    """Parse the measurements CSV.

    Raises:
        ValueError: a missing column or an unparsable value (naming the row id, column and value), a
            layout whose degrees do not multiply to the GPU count or the global batch, or an
            ``iter_time_s`` that disagrees with the conversion of the published quantity by more
            than 0.1%.
    """
    rows: list[Row] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}")
        for raw in reader:
            rid = raw.get("id") or "?"
            kw: dict = {}
            for c in REQUIRED:
                v = (raw.get(c) or "").strip()
                if v == "":
                    raise ValueError(f"row {rid}: column {c!r} is empty")
                if c in INT_COLS:
                    try:
                        kw[c] = int(v)
                    except ValueError as e:
                        raise ValueError(f"row {rid}: column {c!r}={v!r} must be an integer") from e
                elif c in ("measured_value", "iter_time_s"):
                    try:
                        kw[c] = float(v)
                    except ValueError as e:
                        raise ValueError(f"row {rid}: column {c!r}={v!r} must be a number") from e
                    if not kw[c] > 0:
                        raise ValueError(f"row {rid}: column {c!r}={v!r} must be > 0")
                else:
                    kw[c] = v
            mem = (raw.get("memory_gib") or "").strip()
            kw["memory_gib"] = float(mem) if mem else None
            kw["attention_kernel"] = (raw.get("attention_kernel") or "").strip() or "flash"
            r = Row(**kw)
            if r.tp * r.pp * r.cp * r.dp != r.num_gpus:
                raise ValueError(f"row {rid}: tp*pp*cp*dp = {r.tp}*{r.pp}*{r.cp}*{r.dp} != num_gpus {r.num_gpus}")
            if r.dp * r.micro_batch * r.grad_accum != r.global_batch:
                raise ValueError(f"row {rid}: dp*micro_batch*grad_accum = {r.dp}*{r.micro_batch}*{r.grad_accum}"
                                 f" != global_batch {r.global_batch}")
            conv = measured_iter_time(r)
            if abs(conv / r.iter_time_s - 1) > 1e-3:
                raise ValueError(f"row {rid}: iter_time_s={r.iter_time_s} but {r.conversion} gives {conv:.4f}")
            rows.append(r)
    return rows


_MODEL_CACHE: dict = {}


def model_spec(name: str) -> ModelSpec:
    """A preset (``llama-3.1-8b``...) or one of :data:`MODEL_CONFIGS`."""
    if name not in _MODEL_CACHE:
        if name in MODEL_CONFIGS:
            _MODEL_CACHE[name] = ModelSpec.from_hf_config(MODEL_CONFIGS[name], name=name)
        else:
            _MODEL_CACHE[name] = get_model(name)
    return _MODEL_CACHE[name]
