"""Validate the cost model against published training-iteration measurements (issue 13 item 7).

Reads ``benchmarks/data/published_measurements.csv`` (sources and conversions in
``benchmarks/data/README.md``), predicts each row's iteration time (and peak memory per GPU) with
:class:`nereus.cost.model.CostModel`, and reports per source and overall:

* median and mean absolute percentage error (APE) of predicted vs measured iteration time (and memory
  where a row publishes it), with the default efficiencies (**before** calibration);
* **after** calibration fitted on one source and tested on the others (leave-one-source-out): the
  efficiencies are fitted on the measured totals of one source (one scale per op-class group, prior
  towards the defaults, bounds inside the caps; :func:`nereus.cost.fit.fit_scales` on the predicted
  breakdowns, then polished with :func:`nereus.cost.fit.fit_table` on the real model), then every
  row of the other sources is predicted with the fitted table; also pooled over all the fits, and
  the *floor*: one fit over all bf16 rows (and per GPU type) judged in-sample;
* the Spearman rank correlation of predicted vs measured times across the rows (layouts, batch
  and sequence settings) of one model, and of the time per token (which removes the size of the
  workload and leaves the layout and shape effects);
* a log-log PNG of predicted vs measured times, one colour per source (``--out``).

How a row becomes a cost-model query (a pretraining or full fine-tuning iteration is one
optimizer step over the global batch, i.e. the ``train`` model-stage time of one mini-batch):

* job: the row's model (preset, or an HF-style config below), ``ceil(GPUs/8)`` nodes of 8 GPUs of
  the row's preset, a workload with ``prompts_per_step = mini_batch_size = global batch``, one
  sample per prompt, ``prompt_len + response_len = seq_len`` and one update per step;
* workflow: the single model-stage ``reference.train``. Any role but ``actor`` keeps the RL
  weight sync (actor.train → actor.generate) out of the time; the reference role uses the actor's
  shapes with its LM head, so this is the plain training iteration;
* candidate ``Candidate("reference.train", tp, pp, dp, micro_batch, grad_accum, recompute)`` with
  ``zero``/``vpp`` when the installed :class:`Candidate` has those fields, and the job's
  :class:`~nereus.spec.framework.FrameworkSpec` (sequence parallelism, DP/TP overlap, reduce bytes)
  when :class:`JobSpec` has a ``framework`` field. Context parallelism has no counterpart: a row with
  ``cp > 1`` is evaluated as ``dp·cp`` data-parallel replicas of full sequences (same tokens and
  FLOPs per GPU; the KV all-gather of CP is not charged). A row with ``precision=fp8`` runs its
  GEMMs in FP8 (``WorkloadSpec.gemm_precision="fp8"``: the GPU's FP8 peak and the op class
  ``gemm_fp8``; attention and the rest stay bf16) when the installed workload has that field.
* Calibration is carried across GPU types as relative corrections: a fitted table holds, per op
  class, the GPU-independent default times the fitted scale, and each row is predicted with its own
  GPU's defaults times the same scales (:func:`on_gpu`). On one GPU type this is the planner's own
  calibration (a calibrated value replaces the default); across types it keeps each GPU's
  per-generation defaults (``GPUSpec.default_efficiency``) and moves them together.
* Every feature a row uses is checked: passed to the model, and the estimate compared with the
  neutral value. A feature the installed model does not accept, or accepts with no effect on time
  and memory, is listed as not modelled for that row. A row the model refuses with its features
  (e.g. after an API change) is evaluated without them and says why.

Run: ``python benchmarks/validate_cost_model.py [--csv PATH] [--out PNG] [--json PATH] [--markdown]``;
takes 10-30 s on a CPU.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nereus.cost.efficiency import EfficiencyTable, default_efficiency  # noqa: E402
from nereus.cost.fit import fit_scales, fit_table  # noqa: E402
from nereus.cost.model import CostModel  # noqa: E402
from nereus.spec import ClusterSpec, JobSpec, WorkloadSpec, get_gpu, get_model  # noqa: E402
from nereus.spec.model import ModelSpec  # noqa: E402
from nereus.spec.plan import Candidate  # noqa: E402
from nereus.workflow import ModelStage, Workflow  # noqa: E402

try:  # optional: the framework flags arrived with issue 13 item 3
    from nereus.spec.framework import FrameworkSpec  # noqa: E402
except ImportError:  # pragma: no cover - older cost model
    FrameworkSpec = None

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
           "grad_reduce_bytes": 4}


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


def capabilities() -> dict:
    """Which row features the installed cost model can be handed (by field presence)."""
    cand = {f.name for f in dataclasses.fields(Candidate)}
    job = {f.name for f in dataclasses.fields(JobSpec)}
    fw = {f.name for f in dataclasses.fields(FrameworkSpec)} if FrameworkSpec is not None else set()
    has_fw = "framework" in job and FrameworkSpec is not None
    wl = {f.name for f in dataclasses.fields(WorkloadSpec)}
    return {"zero": "zero" in cand, "vpp": "vpp" in cand, "cp": "cp" in cand, "fp8": "gemm_precision" in wl,
            "sp": has_fw and "sequence_parallel" in fw,
            "overlap_grad_reduce": has_fw and "overlap_grad_reduce" in fw,
            "overlap_tp_comm": has_fw and "overlap_tp_comm" in fw,
            "grad_reduce_bytes": has_fw and "grad_reduce_bytes" in fw}


def _query(r: Row, caps: dict, eff: EfficiencyTable, drop: frozenset = frozenset()):
    """(CostModel, Candidate) for row ``r``; features in ``drop`` take their neutral value."""
    def val(f):
        return NEUTRAL[f] if f in drop else getattr(r, f)

    cp = val("cp")
    dp = r.dp if caps["cp"] else r.dp * cp
    ga = r.global_batch // (dp * r.micro_batch)
    rc = r.recompute
    wkw = {"gemm_precision": "fp8"} if caps.get("fp8") and r.precision == "fp8" else {}
    wl = WorkloadSpec(algorithm="ppo", prompts_per_step=r.global_batch, samples_per_prompt=1,
                      prompt_len=r.seq_len // 2, response_len=r.seq_len - r.seq_len // 2,
                      mini_batch_size=r.global_batch, micro_batch_size=r.micro_batch, ppo_epochs=1,
                      recompute=rc, reward_model=False, **wkw)
    nodes = -(-r.num_gpus // 8)
    cluster = ClusterSpec(get_gpu(r.gpu), nodes, min(8, r.num_gpus))
    jkw = {}
    if caps["sp"] or caps["overlap_grad_reduce"] or caps["overlap_tp_comm"] or caps["grad_reduce_bytes"]:
        fkw = {"name": "validation"}
        if caps["sp"]:
            fkw["sequence_parallel"] = bool(val("sp"))
        if caps["overlap_grad_reduce"]:
            fkw["overlap_grad_reduce"] = bool(val("overlap_grad_reduce"))
        if caps["overlap_tp_comm"]:
            fkw["overlap_tp_comm"] = bool(val("overlap_tp_comm"))
        if caps["grad_reduce_bytes"]:
            # neutral: None = the workload's grad_bytes (4, fp32 main gradients reduced as stored)
            fkw["grad_reduce_bytes"] = None if "grad_reduce_bytes" in drop else r.grad_reduce_bytes
        fields = {f.name for f in dataclasses.fields(FrameworkSpec)}
        if "zero_stages" in fields:
            fkw["zero_stages"] = tuple(sorted({0, int(val("zero"))}))
        if "max_virtual_stages" in fields:
            fkw["max_virtual_stages"] = max(1, int(val("vpp")))
        jkw["framework"] = FrameworkSpec(**fkw)
    job = JobSpec(model_spec(r.model), cluster, wl, **jkw)
    wf = Workflow(algorithm="ppo", model_stages=(ModelStage.parse(STAGE),))
    ckw = {}
    if caps["zero"]:
        ckw["zero"] = int(val("zero"))
    if caps["vpp"]:
        ckw["vpp"] = int(val("vpp"))
    if caps["cp"]:
        ckw["cp"] = int(cp)
    cand = Candidate(STAGE, r.tp, r.pp, dp, micro_batch=r.micro_batch, grad_accum=ga, recompute=rc, **ckw)
    return CostModel(job, efficiency=on_gpu(eff, cluster.gpu), workflow=wf), cand


def on_gpu(eff: EfficiencyTable, gpu) -> EfficiencyTable:
    """``eff`` (calibrated values relative to the GPU-independent defaults) carried onto ``gpu``:
    each calibrated class becomes ``gpu``'s default times the fitted scale ``value / GPU-independent
    default`` (the same table when ``gpu`` has no defaults of its own for those classes)."""
    if not eff.values:
        return eff
    out = eff.copy()
    for c, v in eff.values.items():
        out.values[c] = min(max(default_efficiency(c, gpu) * v / default_efficiency(c), 1e-3), 1.5)
    return out


@dataclasses.dataclass
class Prediction:
    """Predicted seconds per iteration, its op-class breakdown, and bytes per GPU."""

    time: float
    breakdown: dict
    memory: float
    memory_terms: dict


def predict(r: Row, eff: EfficiencyTable | None = None, caps: dict | None = None,
            drop: frozenset = frozenset()) -> Prediction:
    """The cost model's iteration time and per-GPU peak memory (workspace + resident + transient)."""
    caps = capabilities() if caps is None else caps
    cm, cand = _query(r, caps, eff if eff is not None else EfficiencyTable(), drop)
    e = cm.estimate_candidate(cand)
    return Prediction(e.time, dict(e.breakdown), cm.workspace + e.resident + e.transient, dict(e.memory))


#: what a refused row drops (CP stays folded into DP so the row keeps its GPU count)
ALL_FEATURES = frozenset(NEUTRAL) - {"cp"}


def usable_drop(r: Row, caps: dict) -> tuple[frozenset, str | None]:
    """Features to leave out so that the installed cost model accepts row ``r``: none, or (when it
    refuses the row with its features, e.g. an API change) all of them, with the refusal's message."""
    try:
        predict(r, caps=caps)
        return frozenset(), None
    except (ValueError, TypeError) as e:
        predict(r, caps=caps, drop=ALL_FEATURES)  # still failing: let it raise, the row is unusable
        return ALL_FEATURES, f"{type(e).__name__}: {e}"


def unmodelled(r: Row, caps: dict | None = None, base: Prediction | None = None) -> list[str]:
    """Features row ``r`` uses that the installed cost model does not represent: not accepted, or
    accepted with no effect on its time and memory (compared with the neutral value)."""
    caps = capabilities() if caps is None else caps
    out = []
    if r.precision != "bf16" and not (r.precision == "fp8" and caps.get("fp8")):
        out.append(r.precision)
    used = [f for f, n in NEUTRAL.items() if getattr(r, f) != n]
    if r.tp == 1:  # SP and TP overlap need TP > 1
        used = [f for f in used if f not in ("sp", "overlap_tp_comm")]
    if r.dp * (1 if caps.get("cp") else r.cp) == 1:  # nothing to shard or reduce across DP
        used = [f for f in used if f not in ("zero", "overlap_grad_reduce", "grad_reduce_bytes")]
    for f in used:
        if not caps.get(f, False):
            out.append(f if f != "cp" else "cp (as dp*cp replicas)")
            continue
        base = base if base is not None else predict(r, caps=caps)
        alt = predict(r, caps=caps, drop=frozenset({f}))
        if math.isclose(alt.time, base.time, rel_tol=1e-9) and math.isclose(alt.memory, base.memory, rel_tol=1e-9):
            out.append(f"{f} (no effect in this row)")
    return out


# ---------------------------------------------------------------------------- statistics
def ape(pred, meas) -> np.ndarray:
    """Absolute percentage errors ``100·|pred - meas| / meas``."""
    p, m = np.asarray(pred, dtype=float), np.asarray(meas, dtype=float)
    return 100.0 * np.abs(p - m) / m


def spearman(a, b) -> float:
    """Spearman rank correlation (scipy.stats.spearmanr when installed; else Pearson of average ranks)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size < 3:
        return float("nan")
    try:
        from scipy.stats import spearmanr

        return float(spearmanr(a, b).statistic)
    except ImportError:  # pragma: no cover - scipy is a dependency
        def ranks(x):
            order = np.argsort(x, kind="mergesort")
            r = np.empty(len(x))
            r[order] = np.arange(1, len(x) + 1)
            for v in np.unique(x):
                idx = x == v
                r[idx] = r[idx].mean()
            return r

        ra, rb = ranks(a), ranks(b)
        return float(np.corrcoef(ra, rb)[0, 1])


def _stats(errs) -> dict:
    e = np.asarray(errs, dtype=float)
    if e.size == 0:
        return {"n": 0, "median": float("nan"), "mean": float("nan")}
    return {"n": int(e.size), "median": float(np.median(e)), "mean": float(np.mean(e))}


# ---------------------------------------------------------------------------- evaluation
def evaluate(rows: list[Row], *, prior_sigma: float = 0.5, fit_min_rows: int = 1, method: str = "table") -> dict:
    """Predictions, errors before and after leave-one-source-out calibration, rank correlations.

    Returns a JSON-serialisable dict: ``rows`` (per row: measured, predicted, APE, not modelled),
    ``before`` (per source and overall APE statistics), ``loso`` (per fitted source: the fitted group
    scales and the held-out errors per source and pooled), ``spearman`` (per model) and
    ``capabilities``.
    """
    caps = capabilities()
    default = EfficiencyTable()
    drops, refused = {}, {}
    for r in rows:
        drops[r.id], why = usable_drop(r, caps)
        if why:
            refused[r.id] = why
    preds = [predict(r, default, caps, drops[r.id]) for r in rows]
    meas = np.array([r.iter_time_s for r in rows])
    t_pred = np.array([p.time for p in preds])
    errs = ape(t_pred, meas)
    sources = list(OrderedDict.fromkeys(r.source for r in rows))
    per_row = []
    for r, p, e in zip(rows, preds, errs):
        mem_err = None
        if r.memory_gib is not None:
            mem_err = float(ape([p.memory / GIB], [r.memory_gib])[0])
        per_row.append({"id": r.id, "source": r.source, "model": r.model, "gpu": r.gpu, "precision": r.precision,
                        "layout": f"tp{r.tp} pp{r.pp} cp{r.cp} dp{r.dp} b{r.micro_batch} ga{r.grad_accum} "
                                  f"s{r.seq_len} z{r.zero} v{r.vpp} rc={r.recompute}",
                        "measured_s": float(r.iter_time_s), "predicted_s": float(p.time), "ape": float(e),
                        "breakdown": {k: float(v) for k, v in p.breakdown.items()},
                        "predicted_memory_gib": p.memory / GIB, "measured_memory_gib": r.memory_gib,
                        "memory_ape": mem_err,
                        "not_modelled": (["all features (refused: " + refused[r.id] + ")"] if r.id in refused
                                         else unmodelled(r, caps, p))})

    def by_source(e, mask=None):
        out = {}
        for s in sources:
            idx = [i for i, r in enumerate(rows) if r.source == s and (mask is None or mask[i])]
            out[s] = _stats(np.asarray(e)[idx])
        return out

    bf16 = np.array([r.precision == "bf16" for r in rows])
    mem_rows = [x for x in per_row if x["memory_ape"] is not None]
    before = {"by_source": by_source(errs), "overall": _stats(errs), "overall_bf16": _stats(errs[bf16]),
              "memory": _stats([x["memory_ape"] for x in mem_rows])}

    classes = sorted({c for p in preds for c in p.breakdown if c != "bubble"})

    def calibrate(fit_idx):
        """fit_scales on the predicted breakdowns, then (method "table") polished on the real model,
        whose overlaps make the breakdown non-additive."""
        fit_rows = [rows[i] for i in fit_idx]
        meas_fit = [r.iter_time_s for r in fit_rows]
        res = fit_scales([preds[i].breakdown for i in fit_idx], meas_fit, base=default, prior_sigma=prior_sigma)
        if method == "table":
            def pred_fit(table):
                return [predict(r, table, caps, drops[r.id]).time for r in fit_rows]

            res = fit_table(pred_fit, classes, meas_fit, base=default, prior_sigma=prior_sigma,
                            start=res.scales, max_nfev=12 * (len(res.scales) + 1))
        return res

    # the floor: one calibration on all bf16 rows (and per GPU type), judged in-sample; what remains is
    # structure the op-class efficiencies cannot absorb
    floor = {}
    for label, sel in (("all bf16", lambda r: r.precision == "bf16"),
                       *((f"bf16 {g}", (lambda r, g=g: r.precision == "bf16" and r.gpu == g))
                         for g in sorted({r.gpu for r in rows}))):
        idx = [i for i, r in enumerate(rows) if sel(r)]
        if not idx:
            continue
        res = calibrate(idx)
        e_fit = ape([predict(rows[i], res.table, caps, drops[rows[i].id]).time for i in idx], meas[idx])
        floor[label] = {"in_sample": _stats(e_fit), "before": _stats(errs[idx]), "scales": res.scales}

    # leave-one-source-out: fit on one source, test on every other
    loso = {}
    held_preds: dict = {}
    pooled: list = []
    pooled_bf16: list = []
    for s in sources:
        fit_idx = [i for i, r in enumerate(rows) if r.source == s]
        if len(fit_idx) < fit_min_rows:
            continue
        fit_rows = [rows[i] for i in fit_idx]
        res = calibrate(fit_idx)
        t_after = np.array([predict(r, res.table, caps, drops[r.id]).time for r in rows])
        e_after = ape(t_after, meas)
        other = np.array([r.source != s for r in rows])
        fit_gpus = {r.gpu for r in fit_rows}
        same_gpu = np.array([r.gpu in fit_gpus for r in rows])
        held_preds[s] = t_after
        pooled += list(e_after[other])
        pooled_bf16 += list(e_after[other & bf16])
        loso[s] = {"fit_rows": len(fit_idx), "scales": res.scales, "converged": res.success,
                   "efficiencies": res.efficiencies, "at_bound": list(res.at_bound),
                   "in_sample": _stats(e_after[~other]),
                   "held_out_by_source": {k: v for k, v in by_source(e_after, other).items() if v["n"]},
                   "held_out": _stats(e_after[other]), "held_out_bf16": _stats(e_after[other & bf16]),
                   "held_out_same_gpu": _stats(e_after[other & same_gpu]),
                   "gpus": sorted(fit_gpus)}

    # rank correlation per model across its rows (layouts and workloads), time and time per token
    spear = {}
    tokens = np.array([r.global_batch * r.seq_len for r in rows], dtype=float)
    for mname in sorted({r.model for r in rows}):
        idx = [i for i, r in enumerate(rows) if r.model == mname]
        if len(idx) < 3:
            continue
        spear[mname] = {"n": len(idx), "time": spearman(t_pred[idx], meas[idx]),
                        "time_per_token": spearman(t_pred[idx] / tokens[idx], meas[idx] / tokens[idx])}
    loso_pooled = {"all": _stats(pooled), "bf16": _stats(pooled_bf16)}
    return {"capabilities": caps, "rows": per_row, "before": before, "loso": loso, "loso_pooled": loso_pooled,
            "floor": floor,
            "spearman": spear,
            "sources": sources, "held_predictions": {k: v.tolist() for k, v in held_preds.items()}}


# ---------------------------------------------------------------------------- output
def _fmt(st: dict) -> str:
    if not st["n"]:
        return "    -           -      0"
    return f"{st['median']:6.1f}%   {st['mean']:6.1f}%  {st['n']:4d}"


def report(res: dict) -> str:
    """The printed tables."""
    out = []
    caps = res["capabilities"]
    out.append("cost-model features handed over: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in caps.items()))
    nm: dict = {}
    for x in res["rows"]:
        for f in x["not_modelled"]:
            nm[f] = nm.get(f, 0) + 1
    out.append("not modelled (rows): " + (", ".join(f"{k} ({v})" for k, v in sorted(nm.items())) or "none"))
    out.append("")
    out.append("BEFORE calibration (default efficiencies): iteration time APE")
    out.append(f"{'source':28s} {'median':>7s}   {'mean':>7s}  {'rows':>4s}")
    for s, st in res["before"]["by_source"].items():
        out.append(f"{s:28s} {_fmt(st)}")
    out.append(f"{'overall':28s} {_fmt(res['before']['overall'])}")
    out.append(f"{'overall, bf16 rows':28s} {_fmt(res['before']['overall_bf16'])}")
    mem = res["before"]["memory"]
    out.append(f"memory: {'no row publishes a memory figure' if not mem['n'] else _fmt(mem)}")
    out.append("")
    out.append("AFTER calibration, leave-one-source-out (fit on one source, error on the others)")
    for s, d in res["loso"].items():
        sc = ", ".join(f"{g} x{v:.2f}" for g, v in sorted(d["scales"].items()))
        out.append(f"fit on {s} ({d['fit_rows']} rows): {sc}" + (f"; at bound: {d['at_bound']}" if d["at_bound"] else "")
                   + ("" if d.get("converged", True) else " (solver stopped at its evaluation cap)"))
        out.append(f"   {'in-sample':25s} {_fmt(d['in_sample'])}")
        for k, st in d["held_out_by_source"].items():
            out.append(f"   held out {k:16s} {_fmt(st)}")
        out.append(f"   {'held out, all':25s} {_fmt(d['held_out'])}")
        out.append(f"   {'held out, bf16 rows':25s} {_fmt(d['held_out_bf16'])}")
        out.append(f"   {'held out, same GPU (' + '/'.join(d['gpus']) + ')':25s} {_fmt(d['held_out_same_gpu'])}")
    lp = res["loso_pooled"]
    out.append(f"{'pooled over the fits (each row under every fit but its own source)':70s}")
    out.append(f"   {'held out, all':25s} {_fmt(lp['all'])}")
    out.append(f"   {'held out, bf16 rows':25s} {_fmt(lp['bf16'])}")
    out.append("")
    out.append("Floor: one calibration on all rows of a group, error in-sample (what calibration cannot absorb)")
    for k, d in res["floor"].items():
        sc = ", ".join(f"{g} x{v:.2f}" for g, v in sorted(d["scales"].items()))
        out.append(f"   {k:25s} {_fmt(d['in_sample'])}   (before {d['before']['median']:.1f}%; {sc})")
    out.append("")
    out.append("Spearman rank correlation, predicted vs measured, across the rows of one model")
    out.append(f"{'model':16s} {'rows':>4s} {'time':>6s} {'time/token':>10s}")
    for m, d in res["spearman"].items():
        out.append(f"{m:16s} {d['n']:4d} {d['time']:6.3f} {d['time_per_token']:10.3f}")
    return "\n".join(out)


def markdown(res: dict) -> str:
    """The figures as the Markdown tables of docs/planner.md ("Validation against published
    measurements")."""
    def cell(st):
        return "-" if not st["n"] else f"{st['median']:.1f}% / {st['mean']:.1f}% ({st['n']})"

    b = res["before"]
    out = ["| source | rows | before: median / mean APE |", "|---|---:|---|"]
    for s, st in b["by_source"].items():
        out.append(f"| `{s}` | {st['n']} | {cell(st)} |")
    out.append(f"| all | {b['overall']['n']} | {cell(b['overall'])} |")
    out.append(f"| all bf16 | {b['overall_bf16']['n']} | {cell(b['overall_bf16'])} |")
    groups = ("gemm", "gemm_fp8", "attention", "memory", "comm@nvlink", "comm@ib")
    out += ["", "| fitted on | fitted scales (GEMM, FP8 GEMM, attention, HBM, NVLink, NIC) | in-sample | "
                "held out: all | held out: bf16 | held out: same GPU type |", "|---|---|---|---|---|---|"]
    for s, d in res["loso"].items():
        sc = d["scales"]
        scs = ", ".join(f"{sc.get(g, 1.0):.2f}" for g in groups)
        flag = " (NIC at bound)" if any(c.endswith("@ib") for c in d["at_bound"]) else ""
        out.append(f"| `{s}` ({d['fit_rows']}) | {scs}{flag} | {cell(d['in_sample'])} | {cell(d['held_out'])} | "
                   f"{cell(d['held_out_bf16'])} | {cell(d['held_out_same_gpu'])} |")
    lp = res["loso_pooled"]
    out.append(f"| pooled over the fits | | | {cell(lp['all'])} | {cell(lp['bf16'])} | |")
    out += ["", "| calibrated on all rows of | rows | before | after, in-sample | fitted scales (as above) |",
            "|---|---:|---|---|---|"]
    for k, d in res["floor"].items():
        scs = ", ".join(f"{d['scales'].get(g, 1.0):.2f}" for g in groups)
        out.append(f"| {k} | {d['in_sample']['n']} | {cell(d['before'])} | {cell(d['in_sample'])} | {scs} |")
    out += ["", "| model | rows | Spearman, time | Spearman, time per token |", "|---|---:|---:|---:|"]
    for m, d in res["spearman"].items():
        out.append(f"| {m} | {d['n']} | {d['time']:.2f} | {d['time_per_token']:.2f} |")
    return "\n".join(out)


def plot(res: dict, path: str | Path) -> None:
    """Log-log predicted vs measured (left: default efficiencies; right: each row predicted with the
    fit on the largest other source), one colour per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    sources = res["sources"]
    gpus_of = {s: set(res["loso"][s]["gpus"]) for s in res["loso"]}
    sizes = {s: sum(1 for x in rows if x["source"] == s) for s in sources}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    meas = np.array([x["measured_s"] for x in rows])
    for ax, title in zip(axes, ("default efficiencies",
                                "fitted on another source (same GPU type where one exists)")):
        for k, s in enumerate(sources):
            idx = [i for i, x in enumerate(rows) if x["source"] == s]
            if title.startswith("default"):
                p = np.array([rows[i]["predicted_s"] for i in idx])
            else:
                mine = {x["gpu"] for x in rows if x["source"] == s}
                others = [o for o in sorted(sources, key=lambda o: (not (gpus_of.get(o, set()) & mine), -sizes[o]))
                          if o != s and o in res["held_predictions"]]
                if not others:
                    continue
                p = np.array(res["held_predictions"][others[0]])[idx]
            ax.scatter(meas[idx], p, s=18, color=colours[k % len(colours)], label=f"{s} ({len(idx)})", alpha=0.8)
        lo = min(meas.min(), min(x["predicted_s"] for x in rows)) / 1.5
        hi = max(meas.max(), max(x["predicted_s"] for x in rows)) * 1.5
        xs = np.array([lo, hi])
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, xs * 1.1, "k:", lw=0.6)
        ax.plot(xs, xs / 1.1, "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured iteration time (s)")
        ax.set_title(title)
    axes[0].set_ylabel("predicted iteration time (s)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Nereus cost model vs published training iterations (dotted: ±10%)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="measurements CSV (default: %(default)s)")
    ap.add_argument("--out", default=str(DEFAULT_PNG), help="PNG path (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the full result as JSON here")
    ap.add_argument("--markdown", action="store_true", help="also print the tables of docs/planner.md")
    ap.add_argument("--prior-sigma", type=float, default=0.5, help="prior width of the calibration (log units)")
    ap.add_argument("--fit", choices=("breakdowns", "table"), default="table",
                    help="calibration: 'breakdowns' = fit_scales on the predicted op-class breakdowns only "
                         "(additive approximation); 'table' (default) = then polish with fit_table, which "
                         "re-evaluates the cost model for each trial table (exact with overlaps)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = load_rows(a.csv)
    res = evaluate(rows, prior_sigma=a.prior_sigma, method=a.fit)
    print(f"{len(rows)} rows from {len(res['sources'])} sources ({a.csv})")
    print(report(res))
    if a.markdown:
        print("\n" + markdown(res))
    plot(res, a.out)
    print(f"\nPNG: {a.out}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=float))
        print(f"JSON: {a.json}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
