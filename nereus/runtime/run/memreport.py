"""Measured vs predicted peak memory per model-stage of a run (bytes).

*Measured*: the largest ``peak_bytes_by_stage[ms]`` over the workers of model-stage ``ms`` (the
worker's :class:`~nereus.runtime.comm.instrument.Meter`: on CPU the tracked tensor bytes while ``ms`` ran:
the parameters and Adam moments of every engine on that worker, the KV cache during generation and
the activations saved for backward in training; on GPU the CUDA allocator's peak).

*Predicted*: the cost model's peak of the same worker while ``ms`` runs: the resident bytes of every
model-stage placed on it plus the transient bytes of ``ms`` (``nereus.cost.memory.stage_memory``:
gradients, activations, logits, KV cache), in the byte widths the runtime holds
(``device_model.runtime_job``: fp32 weights and KV cache, 8 B of Adam moments per trained parameter),
without the per-GPU workspace constant (CUDA context, NCCL buffers), which a CPU worker does not have.
"""

from __future__ import annotations

__all__ = ["memory_rows", "format_rows"]


def memory_rows(cost, plan, measurements: dict) -> list[dict]:
    """``[{"model_stage", "measured", "predicted", "ratio", "worker"}]`` (see the module docstring).

    Args:
        cost: a ``nereus.cost.model.CostModel`` of the run's job.
        plan: the run's plan.
        measurements: ``RLDriver.measurements()``.
    """
    est = cost.estimate(plan)
    on: dict[int, list[str]] = {}
    for c in plan.candidates:
        for g in c.gpus:
            on.setdefault(g, []).append(c.model_stage)
    per = {m.get("worker"): m for m in measurements.get("per_worker", [])}
    rows = []
    for c in plan.candidates:
        ms = c.model_stage
        pred, meas, where = 0.0, 0, None
        for g in c.gpus:
            p = sum(float(est.estimates[o].resident) for o in on[g]) + \
                float(est.estimates[ms].transient)
            pred = max(pred, p)
            m = int(per.get(g, {}).get("peak_bytes_by_stage", {}).get(ms, 0))
            if m > meas:
                meas, where = m, g
        rows.append({"model_stage": ms, "measured": meas, "predicted": pred,
                     "ratio": meas / pred if pred else None, "worker": where})
    return rows


def format_rows(rows: list[dict]) -> str:
    """One line per model-stage: measured and predicted MB and their ratio."""
    out = ["peak memory per model-stage (MB; measured = tracked tensor bytes on its busiest worker, "
           "predicted = cost model, no workspace):"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"  {r['model_stage']:<16} measured {r['measured'] / 1e6:9.1f}  predicted "
                   f"{r['predicted'] / 1e6:9.1f}  measured/predicted {ratio}")
    return "\n".join(out)
