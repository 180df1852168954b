"""How ``bench_faults.py`` compares a run with its replay and its fault-free reference: the gathered
state of every model-stage (parameters, fp32 master, Adam's moments, and a trained model-stage's
counters; fp32 tolerance ``fault_run.ATOL``/``RTOL``) and the layouts each step ran on."""

from __future__ import annotations

from dataclasses import replace

import torch
from fault_run import ATOL, RTOL

from nereus.spec.plan import Plan


def _renumbered(plan: Plan) -> Plan:
    """``plan`` with its worker ids renumbered ``0..n-1`` in order (every candidate's rank order kept)."""
    rank = {g: i for i, g in enumerate(sorted(plan.gpus_used()))}
    return Plan(candidates=tuple(replace(c, gpus=tuple(rank[g] for g in c.gpus)) for c in plan.candidates))


def same_layouts(a: dict[int, Plan], b: dict[int, Plan]) -> bool:
    """Every step ran on the same layouts (tp, pp, dp, micro-batch, accumulation) in ``a`` and ``b``,
    whichever workers held them: the same sums in the same order."""
    def shape(p: Plan):
        return sorted((c.model_stage, c.tp, c.pp, c.dp, c.micro_batch, c.grad_accum, c.concurrency, c.recompute)
                      for c in p.candidates)
    return a.keys() == b.keys() and all(shape(a[k]) == shape(b[k]) for k in a)


#: the tensor kinds of a gathered logical state (``Engine.gather_logical_state``) and its counters
KINDS = ("params", "master", "exp_avg", "exp_avg_sq")
COUNTERS = ("step", "update_count", "position")


def compare(a: dict | None, b: dict | None) -> tuple[bool, float]:
    """Same state of every model-stage, trained and frozen (issue 30): the same kinds, every tensor of
    every kind (parameters, fp32 master, Adam's two moments) within fp32 tolerance, and for a
    trained model-stage its Adam step, update counter and data position; ``(equal, max |difference|)``."""
    if not a or not b or a.keys() != b.keys():
        return False, float("inf")
    ok, worst = True, 0.0
    for ms in a:
        if "exp_avg" in a[ms] and any(a[ms].get(c) != b[ms].get(c) for c in COUNTERS):
            ok = False  # a trained model-stage's counters (a frozen copy's are not state)
        kinds = [k for k in KINDS if k in a[ms] or k in b[ms]]
        for kind in kinds:
            if kind not in a[ms] or kind not in b[ms] or a[ms][kind].keys() != b[ms][kind].keys():
                return False, float("inf")
            for n, x in a[ms][kind].items():
                y = b[ms][kind][n]
                worst = max(worst, float((x - y).abs().max()))
                ok &= bool(torch.allclose(x, y, atol=ATOL, rtol=RTOL))
    return ok, worst
