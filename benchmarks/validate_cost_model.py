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
  ``gemm_fp8``; attention and the rest stay bf16) when the installed workload has that field. The
  row's ``attention_kernel`` (flash, flash_triton, unfused_dropout) goes to
  ``WorkloadSpec.attention_kernel`` likewise.
* Calibration is carried across GPU types as relative corrections: a fitted table holds, per op
  class, the GPU-independent default times the fitted scale, and each row is predicted with its own
  GPU's defaults times the same scales (:func:`on_gpu`). On one GPU type this is the planner's own
  calibration (a calibrated value replaces the default); across types it keeps each GPU's
  per-generation defaults (``GPUSpec.default_efficiency``) and moves them together.
* Every feature a row uses is checked: passed to the model, and the estimate compared with the
  neutral value. A feature the installed model does not accept, or accepts with no effect on time
  and memory, is listed as not modelled for that row. A row the model refuses with its features
  (e.g. after an API change) is evaluated without them and says why.

The rows and their loader are in ``benchmarks/validation_data.py``, the tables and the plot in
``benchmarks/validation_report.py``.

Run: ``python benchmarks/validate_cost_model.py [--csv PATH] [--out PNG] [--json PATH] [--markdown]``;
takes 10-30 s on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from nereus.cost.efficiency import EfficiencyTable, default_efficiency  # noqa: E402
from nereus.cost.fit import fit_scales, fit_table  # noqa: E402
from nereus.cost.model import CostModel  # noqa: E402
from nereus.spec.hardware import ClusterSpec, get_gpu  # noqa: E402
from nereus.spec.job import JobSpec  # noqa: E402
from nereus.spec.plan import Candidate  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.workflow import ModelStage, Workflow  # noqa: E402

try:  # optional: the framework flags arrived with issue 13 item 3
    from nereus.spec.framework import FrameworkSpec  # noqa: E402
except ImportError:  # pragma: no cover - older cost model
    FrameworkSpec = None
from validation_data import (  # noqa: E402
    DEFAULT_CSV,
    DEFAULT_PNG,
    GIB,
    NEUTRAL,
    STAGE,
    Row,
    load_rows,
    model_spec,
)
from validation_report import markdown, plot, report  # noqa: E402

#: ``FrameworkSpec.zero3_impl`` of every row (None: the default, ``fsdp``: every ZeRO-3 row of the CSV
#: is a PyTorch FSDP/FSDP2 run); ``--zero3-impl`` sets it to see another implementation's model on them
ZERO3_IMPL: str | None = None


def capabilities() -> dict:
    """Which row features the installed cost model can be handed (by field presence)."""
    cand = {f.name for f in dataclasses.fields(Candidate)}
    job = {f.name for f in dataclasses.fields(JobSpec)}
    fw = {f.name for f in dataclasses.fields(FrameworkSpec)} if FrameworkSpec is not None else set()
    has_fw = "framework" in job and FrameworkSpec is not None
    wl = {f.name for f in dataclasses.fields(WorkloadSpec)}
    return {"zero": "zero" in cand, "vpp": "vpp" in cand, "cp": "cp" in cand, "fp8": "gemm_precision" in wl,
            "attention_kernel": "attention_kernel" in wl,
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
    if caps.get("attention_kernel"):
        wkw["attention_kernel"] = val("attention_kernel")
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
        if "zero3_impl" in fields and ZERO3_IMPL is not None:
            fkw["zero3_impl"] = ZERO3_IMPL
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
    ap.add_argument("--zero3-impl", default=None, choices=("fsdp", "deepspeed", "deepspeed-2021"),
                    help="charge every ZeRO-3 row as this implementation (default: the framework default, fsdp)")
    a = ap.parse_args(argv)
    global ZERO3_IMPL
    ZERO3_IMPL = a.zero3_impl
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
