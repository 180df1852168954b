"""FP8 recipes: predicted vs measured speedups of torchao's float8 training recipes over bf16 (issue 27).

Source: pytorch/ao ``torchao/float8/README.md``, "Training benchmarks", NVIDIA H100: torchtitan,
single-node training on 8 H100, batch size 1 per GPU, sequence length 8192, ``torch.compile``, FSDP2,
per-op selective activation checkpointing; Llama3-8B median tokens/s: bf16 6150, ``tensorwise with
float8 all-gather`` 7689.5 (+25.0%), ``rowwise with bfloat16 all-gather`` 6768 (+10.1%).

Each row is a cost-model query of one training iteration (:func:`validate_cost_model._query`, FSDP
ZeRO-3 over 8 GPUs, selective recompute), FP8 rows with ``gemm_precision="fp8"`` and the row's
``fp8_recipe`` (:mod:`nereus.cost.fp8`); *without recipe* is the model before the cast terms (FP8
GEMMs at the FP8 peak, no casts). Only ratios are compared (the table's absolute throughput depends
on the compile and the GPU's 500 W power cap). The torchao rows were not used to derive any
constant: the cast bytes come from torchao's roofline model.

Run: ``python benchmarks/validate_fp8_recipes.py``; the last line reads ``fp8 recipes: ...``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from validate_cost_model import _query, capabilities  # noqa: E402
from validation_data import Row  # noqa: E402

from nereus.cost.efficiency import EfficiencyTable  # noqa: E402
from nereus.cost.model import CostModel  # noqa: E402

REF = "pytorch/ao torchao/float8/README.md, Training benchmarks, NVIDIA H100 (torchao 0.10, torchtitan 0.0.2)"
#: (label, precision, fp8_recipe, measured tokens/s)
MEASURED = (("bf16", "bf16", None, 6150.0), ("tensorwise", "fp8", "tensorwise", 7689.5),
            ("rowwise", "fp8", "rowwise", 6768.0))


def iteration_time(precision: str, recipe: str | None) -> float:
    """Predicted seconds of one Llama3-8B iteration of the table's setup."""
    r = Row(id="ao", source="torchao-float8", reference=REF, model="llama-3.1-8b", gpu="h100", num_gpus=8, tp=1, pp=1,
            cp=1, dp=8, micro_batch=1, grad_accum=1, global_batch=8, seq_len=8192, recompute="selective", zero=3, sp=0,
            vpp=1, overlap_grad_reduce=1, overlap_tp_comm=0, grad_reduce_bytes=4, precision=precision, kind="pretrain",
            measured_quantity="tokens_per_s", measured_value=1.0, iter_time_s=1.0, conversion="ratio only")
    cm, cand = _query(r, capabilities(), EfficiencyTable())
    if recipe is not None:
        job = replace(cm.job, workload=replace(cm.job.workload, fp8_recipe=recipe))
        cm = CostModel(job, efficiency=cm.eff, workflow=cm.workflow)
    return cm.estimate_candidate(cand).time


def speedups() -> list[tuple]:
    """``(label, measured speedup over bf16, predicted without recipe, predicted with it)``."""
    base = iteration_time("bf16", None)
    out = []
    for label, prec, recipe, tps in MEASURED[1:]:
        out.append((label, tps / MEASURED[0][3], base / iteration_time(prec, None), base / iteration_time(prec, recipe)))
    return out


def main() -> int:
    rows = speedups()
    print(f"Llama3-8B, 8 H100, FSDP2, batch 1 x 8192, per-op SAC ({REF})")
    print(f"{'recipe':12s} {'measured':>9s} {'no recipe':>10s} {'with recipe':>12s}")
    for label, m, p0, p1 in rows:
        print(f"{label:12s} {m:9.3f} {p0:10.3f} {p1:12.3f}")
    (_, mt, _, pt), (_, mr, _, pr) = rows
    print(f"fp8 recipes: tensorwise over rowwise measured {mt / mr:.3f}x, predicted {pt / pr:.3f}x "
          f"(without the recipe terms 1.000x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
