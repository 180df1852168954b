"""Plan order: does the cost model rank layouts of one model as they measured? (issue 27 item 2)

Public tables that compare layouts of one model on one cluster, as rows of
:class:`validation_data.Row` predicted with :func:`validate_cost_model.predict` (the same query as the
pretraining validation). For every pair of rows of one model whose measured per-GPU throughputs
differ by more than 5%, the pair is *right* when the predicted per-GPU throughputs (tokens per
second per GPU, proportional to TFLOP/s per GPU for one model) order them the same way.

Table (:data:`ROWS`): Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473), §5.2 and Table 2, "Comparison of PTD
Parallelism to ZeRO-3 (without model parallelism)": achieved teraFLOP/s per GPU on DGX A100 80GB
nodes (8 x 200 Gb/s HDR InfiniBand each), sequence 2048, vocabulary 51,200 (the ungated 4h GELU MLP
expressed as a gated MLP of the same GEMM parameters, width rounded to a multiple of 128):

* GPT 174.6B (96 layers, hidden 12288, 96 heads): ZeRO-3 at batch 1536 on 384 / 768 / 1536 GPUs,
  micro-batch 4 / 2 / 1: 144 / 88 / 44; PTD-P model-parallel size 96 (TP 8 x PP 12), micro-batch 1,
  same batch and GPUs: 153 / 149 / 141;
* GPT 529.6B (105 layers, hidden 20480, 128 heads): ZeRO-3 on 640 GPUs at batch 2560, micro-batch 4:
  138; on 1120 / 2240 GPUs at batch 2240, micro-batch 2 / 1: 98 / 48; PTD-P model-parallel size 280
  (TP 8 x PP 35), micro-batch 1, batch 2240, on 560 / 1120 / 2240 GPUs: 171 / 167 / 159.

Settings not printed in the table, as the paper describes its runs (§5): activation recomputation
in every run, attention without fused kernels of the flash kind (2021), Megatron's data-parallel
all-reduce in fp16/bf16 not overlapped with backward, no sequence parallelism, no interleaving
(the paper's PTD-P rows of Table 2 are its Table 1 configurations); ZeRO-3 (DeepSpeed) with its
prefetch overlapping gathers with compute and bf16 reduction.

Async-TP credit (:func:`async_tp_credit`): torchtitan's async TP against vanilla TP, pytorch/torchtitan
``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025, H100 96GB, 400 Gb/s per GPU,
sequence 8192 as torchtitan's Llama 3 configs): Llama3 70B on 256 GPUs, FSDP 32 x TP 8, full
activation checkpointing, local batch 16: 597.3 -> 652.4 tokens/s (1.09x); Llama3 8B on 64 GPUs,
FSDP 8 x TP 8, per-op selective checkpointing, local batch 12: 4378 -> 4809.4 (1.10x). Predicted
with TP overlap at full credit (the default) and at
:data:`nereus.spec.engine.ASYNC_TP_SHARE` (derived from the 70B row; the 8B row is held out).

Run: ``python benchmarks/validate_plan_order.py``; the last line reads ``plan order: X of N pairs
right (P%)``.
"""

from __future__ import annotations

import sys
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dataclasses import replace  # noqa: E402

from validate_cost_model import _query, capabilities  # noqa: E402
from validation_data import MODEL_CONFIGS, Row  # noqa: E402

from nereus.cost.efficiency import EfficiencyTable  # noqa: E402
from nereus.cost.model import CostModel  # noqa: E402
from nereus.spec.engine import EngineCosts  # noqa: E402

SOURCE = "narayanan-2021-table2"
REF = "Narayanan et al. SC'21 (arXiv:2104.04473) Table 2"
for _k, (_h, _a, _layers) in {"174.6b": (12288, 96, 96), "529.6b": (20480, 128, 105)}.items():
    MODEL_CONFIGS[f"ptdp-gpt-{_k}"] = dict(model_type="llama", hidden_size=_h, intermediate_size=128 * round(8 * _h / 3 / 128),
                                           num_hidden_layers=_layers, num_attention_heads=_a, num_key_value_heads=_a,
                                           vocab_size=51200, max_position_embeddings=2048, tie_word_embeddings=True,
                                           hidden_act="gelu")


def _row(rid, model, gpus, tp, pp, mb, batch, tflops, zero):
    dp = gpus // (tp * pp)
    return Row(id=rid, source=SOURCE, reference=REF, model=model, gpu="a100", num_gpus=gpus, tp=tp, pp=pp, cp=1,
               dp=dp, micro_batch=mb, grad_accum=batch // (dp * mb), global_batch=batch, seq_len=2048,
               recompute="full", zero=zero, sp=0, vpp=1, overlap_grad_reduce=1 if zero else 0, overlap_tp_comm=0,
               grad_reduce_bytes=2, precision="bf16", kind="pretrain", measured_quantity="tflops_per_gpu",
               measured_value=float(tflops), iter_time_s=1.0, conversion="order only",
               attention_kernel="unfused")


M1, M2 = "ptdp-gpt-174.6b", "ptdp-gpt-529.6b"
ROWS = [
    _row("Z1", M1, 384, 1, 1, 4, 1536, 144, 3), _row("Z2", M1, 768, 1, 1, 2, 1536, 88, 3),
    _row("Z3", M1, 1536, 1, 1, 1, 1536, 44, 3),
    _row("P1", M1, 384, 8, 12, 1, 1536, 153, 0), _row("P2", M1, 768, 8, 12, 1, 1536, 149, 0),
    _row("P3", M1, 1536, 8, 12, 1, 1536, 141, 0),
    _row("Z4", M2, 640, 1, 1, 4, 2560, 138, 3), _row("Z5", M2, 1120, 1, 1, 2, 2240, 98, 3),
    _row("Z6", M2, 2240, 1, 1, 1, 2240, 48, 3),
    _row("P4", M2, 560, 8, 35, 1, 2240, 171, 0), _row("P5", M2, 1120, 8, 35, 1, 2240, 167, 0),
    _row("P6", M2, 2240, 8, 35, 1, 2240, 159, 0),
]


#: the ZeRO-3 implementation of the table's runs: DeepSpeed ZeRO-3 of early 2021
#: (``FrameworkSpec.zero3_impl``, :mod:`nereus.cost.zero3`)
IMPL = "deepspeed-2021"


def estimate(r: Row, zero3_impl: str = IMPL, eff: EfficiencyTable | None = None):
    """The cost model's estimate of row ``r``; ZeRO-3 rows with ``FrameworkSpec(zero3_impl=...)``
    (``fsdp`` is the default model, ``deepspeed`` DeepSpeed's flat per-layer rings, ``deepspeed-2021``
    also its forward gathers fetched on demand; :mod:`nereus.cost.zero3`)."""
    cm, cand = _query(r, capabilities(), eff if eff is not None else EfficiencyTable())
    if r.zero >= 3:
        fw = replace(cm.job.framework, zero3_impl=zero3_impl)
        cm = CostModel(cm.job.with_framework(fw), efficiency=cm.eff, workflow=cm.workflow)
    return cm.estimate_candidate(cand)


def throughput(r: Row, zero3_impl: str = IMPL) -> float:
    """Predicted tokens per second per GPU."""
    return r.global_batch * r.seq_len / (estimate(r, zero3_impl).time * r.num_gpus)


def measured_time(r: Row) -> float:
    """Iteration seconds from the published TFLOP/s per GPU with the paper's FLOP count (its Eq. 3,
    activation recomputation included): ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` per iteration."""
    c = MODEL_CONFIGS[r.model]
    h, layers, v, s = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], r.seq_len
    flops = 96.0 * r.global_batch * s * layers * h * h * (1 + s / (6.0 * h) + v / (16.0 * layers * h))
    return flops / (r.num_gpus * r.measured_value * 1e12)


def calibration_within_job(rows=ROWS, zero3_impl: str = IMPL) -> dict:
    """Calibrate on one row of a model (one scale per op-class group the row exercises,
    :func:`nereus.cost.fit.fit_scales` at its defaults, A100 defaults as base, on the measured time
    moved onto the model's 10% band, :func:`nereus.cost.fit.deadband_targets`) and predict the
    model's other rows; for every choice of calibration row. Returns per model: the median APE of
    the other rows uncalibrated, and per calibration row the median APE after."""
    from nereus.cost.fit import deadband_targets, fit_scales
    from nereus.spec.hardware import get_gpu

    gpu = get_gpu("a100")
    out: dict = {}
    for model in sorted({r.model for r in rows}):
        rs = [r for r in rows if r.model == model]
        base = {r.id: estimate(r, zero3_impl) for r in rs}
        meas = {r.id: measured_time(r) for r in rs}
        ape0 = {r.id: abs(base[r.id].time / meas[r.id] - 1) * 100 for r in rs}
        res = {}
        for c in rs:
            target = deadband_targets([base[c.id].time], [meas[c.id]])
            fit = fit_scales([base[c.id].breakdown], target, base=EfficiencyTable(), gpu=gpu)
            others = [r for r in rs if r is not c]
            after = [abs(estimate(r, zero3_impl, fit.table.copy()).time / meas[r.id] - 1) * 100 for r in others]
            before = [ape0[r.id] for r in others]
            res[c.id] = (_median(before), _median(after))
        out[model] = res
    return out


def async_tp_credit() -> list[tuple]:
    """``(model, measured speedup, predicted at full credit, predicted at ASYNC_TP_SHARE)``."""
    from nereus.spec.engine import ASYNC_TP_SHARE

    out = []
    for model, gpus, mb, rc, vanilla, asyn in (("llama-3.3-70b", 256, 16, "full", 597.3, 652.4),
                                                ("llama-3.1-8b", 64, 12, "selective", 4378.0, 4809.4)):
        dp = gpus // 8
        t = {}
        for ov, share in ((0, 1.0), (1, 1.0), (1, ASYNC_TP_SHARE)):
            r = Row(id="tt", source="torchtitan-async-tp", reference="", model=model, gpu="h100", num_gpus=gpus, tp=8,
                    pp=1, cp=1, dp=dp, micro_batch=mb, grad_accum=1, global_batch=dp * mb, seq_len=8192, recompute=rc,
                    zero=3, sp=1, vpp=1, overlap_grad_reduce=1, overlap_tp_comm=ov, grad_reduce_bytes=4,
                    precision="bf16", kind="pretrain", measured_quantity="tokens_per_s_per_gpu",
                    measured_value=vanilla, iter_time_s=1.0, conversion="ratio only")
            cm, cand = _query(r, capabilities(), EfficiencyTable())
            if share != 1.0:
                fw = replace(cm.job.framework, engine=EngineCosts(tp_overlap_share=share))
                cm = CostModel(cm.job.with_framework(fw), efficiency=cm.eff, workflow=cm.workflow)
            t[(ov, share)] = cm.estimate_candidate(cand).time
        out.append((model, asyn / vanilla, t[(0, 1.0)] / t[(1, 1.0)], t[(0, 1.0)] / t[(1, ASYNC_TP_SHARE)]))
    return out


def _median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def pairs(rows=ROWS, margin: float = 0.05, zero3_impl: str = IMPL) -> list[tuple]:
    """``(a, b, measured ratio, predicted ratio, right)`` for pairs of one model whose measured
    throughputs differ by more than ``margin``."""
    pred = {r.id: throughput(r, zero3_impl) for r in rows}
    out = []
    for a, b in combinations(rows, 2):
        if a.model != b.model:
            continue
        m = a.measured_value / b.measured_value
        if abs(m - 1) <= margin:
            continue
        p = pred[a.id] / pred[b.id]
        out.append((a.id, b.id, m, p, (m > 1) == (p > 1)))
    return out


def main() -> int:
    impls = ("fsdp", "deepspeed", IMPL)
    pred = {i: {r.id: throughput(r, i) for r in ROWS} for i in impls}
    print(f"{'row':4s} {'model':16s} {'GPUs':>5s} {'layout':14s} {'meas TF/GPU':>11s}  predicted tok/s/GPU with "
          f"zero3_impl = {', '.join(impls)}")
    for r in ROWS:
        lay = f"ZeRO-3 mb{r.micro_batch}" if r.zero else f"TP{r.tp} PP{r.pp} mb{r.micro_batch}"
        print(f"{r.id:4s} {r.model:16s} {r.num_gpus:5d} {lay:14s} {r.measured_value:11.0f}  "
              + " ".join(f"{pred[i][r.id]:8.1f}" for i in impls))
    for i in impls[:-1]:
        ph = pairs(zero3_impl=i)
        print(f"zero3_impl={i}: {sum(1 for *_, ok in ph if ok)} of {len(ph)} pairs right")
    ps = pairs()
    wrong = [f"{a}/{b} (measured {m:.2f}x, predicted {p:.2f}x)" for a, b, m, p, ok in ps if not ok]
    print("wrong pairs:", "; ".join(wrong) if wrong else "none")
    print(f"within-job calibration (zero3_impl={IMPL}): calibrate on one layout, median APE of the "
          "model's other layouts before -> after")
    worse = []
    for model, res in calibration_within_job().items():
        cells = ", ".join(f"{cid} {b:.0f}->{a:.0f}%" for cid, (b, a) in res.items())
        print(f"  {model}: {cells}")
        worse += [f"{model}:{cid}" for cid, (b, a) in res.items() if a > b]
    print(f"calibration rows that make the other layouts worse: {', '.join(worse) or 'none'}")
    for model, m, full, share in async_tp_credit():
        print(f"async TP over vanilla TP, {model}: measured {m:.3f}x, predicted {full:.3f}x at full credit, "
              f"{share:.3f}x at the async-TP share")
    right = sum(1 for *_, ok in ps if ok)
    print(f"plan order: {right} of {len(ps)} pairs right ({100.0 * right / len(ps):.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
