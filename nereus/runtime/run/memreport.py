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

from nereus.cost.shapes import params_rank

__all__ = ["memory_rows", "format_rows", "move_rows", "zero_bytes", "format_moves", "worker_rows", "format_workers",
           "generation_line"]


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


def generation_line(cost, plan, measurements: dict, steps: int, rollout: str) -> str:
    """The generation stage's seconds per step, the cost model's prediction (``estimate_candidate`` of
    ``actor.generate``: decode with vLLM-style fused attention, plus its side of the weight sync) against
    the measured ``stage_seconds`` (the slowest worker, averaged over ``steps``), for the engine used."""
    c = plan["actor.generate"]
    pred = cost.estimate_candidate(c).time
    meas = measurements.get("stage_seconds", {}).get("actor.generate", 0.0) / max(steps, 1)
    return (f"actor.generate ({rollout} engine): predicted {pred:.3f}s per step, measured {meas:.3f}s "
            f"(ratio {meas / pred if pred > 0 else float('nan'):.2f})")


def move_rows(cost, plan, measurements: dict, steps: int, updates_per_step: int, first: dict | None = None) -> dict:
    """Offload and ZeRO bytes per RL step, measured next to the cost model's figure.

    *Offload* (``cost/latency.py`` ``offload_times``): per step a ``host`` model-stage copies its
    state ``S`` (weights and optimizer state per GPU, the cost model's ``weights + optimizer``) out and
    back (``2·S``), a dropped frozen one reloads it (``S``), a dropped derived copy is re-synced (0
    offload bytes: where its shards sit on its source's workers the runtime defers the sync to its
    turn and fills it from the source's host copy, ``MemoryPools.defer``; those bytes are reported as
    ``resync``, the weight sync's, not offload), each times its GPUs. A ZeRO-3 trainer's dropped derived
    copies cannot be deferred (the sync's gathers are collective over the trainer's DP group, which the
    copy's own turn does not include: ``worker/core.py`` ``_sync_from_slices``): each is written at
    the sync and offloaded after it, ``2·S``. Measured: the workers' offload
    plus restore bytes per step, from ``first`` (the measurements after the first step: the steady
    state) when given, else over the run (the build's first copies included).

    *ZeRO collectives* (``comm/groups.py`` payload model; ``cost/latency.py`` ``dp_sync_time``, the
    same counts; ``worker/zero.py``, ``worker/zero3.py``): per optimizer update of ``m`` micro-batches
    per replica every rank of a ZeRO-``z`` model-stage sends ``(dp-1)·4·k`` bytes of reduce-scatter
    (``m`` times for ``z >= 2``) and ``(dp-1)·k·w`` of all-gather (``2m`` times for ``z = 3``), ``k =
    ceil(P/dp)`` with ``P`` the parameters per rank (the cost model's weights term) and ``w`` the weight
    width; a ZeRO-3 ``infer`` pass all-gathers once per micro-batch, and a ZeRO-3 trainer once more
    per weight sync it sources. Measured: ``op_bytes["reducescatter@gloo"]`` and
    ``op_bytes["allgather@gloo"]`` per step (every all-gather of the run: with TP = 1 only ZeRO's).

    Returns:
        ``{"offload", "reduce_scatter", "all_gather": (measured, predicted)}`` bytes per step and
        ``offload_s`` (measured seconds per step).
    """
    est = cost.estimate(plan)
    pred_off = pred_rs = pred_ag = 0.0
    names = {x.model_stage: x for x in plan.candidates}
    for c in plan.candidates:
        mem = est.estimates[c.model_stage].memory
        state = float(mem.get("weights", 0.0)) + float(mem.get("optimizer", 0.0))
        model = c.model_stage.split(".")[0]
        frozen = model in ("reference", "reward")
        src = names.get(f"{model}.train")
        zero3_src = not frozen and src is not None and src.zero == 3 and src.dp > 1
        # a dropped derived copy of a ZeRO-3 trainer is written at the sync and offloaded (2·S)
        ways = {"host": 2.0, "drop": 1.0 if frozen else (2.0 if zero3_src else 0.0)}.get(c.offload, 0.0)
        pred_off += ways * state * c.num_gpus
        if c.zero and c.dp > 1:
            rs, ag = zero_bytes(cost, plan, c)
            pred_rs += c.num_gpus * (updates_per_step * rs if c.model_stage.endswith(".train") else rs)
            pred_ag += c.num_gpus * (updates_per_step * ag if c.model_stage.endswith(".train") else ag)
    def since(key: str, sub: str) -> float:
        now = float(measurements.get(key, {}).get(sub, 0.0))
        return now - (float(first.get(key, {}).get(sub, 0.0)) if first else 0.0)

    n = max(steps - 1, 1) if first else max(steps, 1)
    meas_off = (since("memory", "offload_bytes") + since("memory", "restore_bytes")) / n
    meas_rs = since("op_bytes", "reducescatter@gloo") / n
    meas_ag = since("op_bytes", "allgather@gloo") / n
    return {"offload": (meas_off, pred_off), "reduce_scatter": (meas_rs, pred_rs), "all_gather": (meas_ag, pred_ag),
            "resync_bytes": since("memory", "resync_bytes") / n,
            "offload_s": (since("memory", "offload_s") + since("memory", "restore_s")) / n}


def zero_bytes(cost, plan, c) -> tuple[float, float]:
    """``(reduce-scatter, all-gather)`` bytes one rank of candidate ``c`` sends per optimizer update
    (``train``) or per pass (``infer``), by the formulas of :func:`move_rows` (0 without ZeRO or DP)."""
    w = cost.job.workload
    if not c.zero or c.dp < 2:
        return 0.0, 0.0
    p = float(params_rank(cost.job.model(c.model_stage.split(".")[0]), c.tp, c.pp))  # parameters per rank
    k = -(-int(round(p)) // c.dp)
    unit = (c.dp - 1) * k
    if not c.model_stage.endswith(".train"):
        m = -(-w.global_batch // (c.dp * max(c.micro_batch, 1)))
        return 0.0, m * unit * w.param_bytes
    m = max(w.mini_batch_size // (c.dp * max(c.micro_batch, 1)), 1)
    rs = unit * 4.0 * (m if c.zero >= 2 else 1)
    ag = unit * w.param_bytes * (2 * m if c.zero == 3 else 1)
    if c.zero == 3:  # the weight syncs it sources all-gather its shard once each (per step, not per update)
        syncs = {"actor.train": ("actor.generate", "actor.infer"), "critic.train": ("critic.infer",)}
        names = {x.model_stage for x in plan.candidates}
        ag += unit * w.param_bytes * sum(d in names for d in syncs.get(c.model_stage, ())) / max(w.updates_per_step, 1)
    return rs, ag


def format_moves(rows: dict) -> str:
    """Three lines: offload, ZeRO reduce-scatter and ZeRO all-gather MB per step, measured and predicted."""
    (mo, po), (mr, pr) = rows["offload"], rows["reduce_scatter"]
    ma, pa = rows.get("all_gather", (0.0, 0.0))
    return (f"offload per step (MB): measured {mo / 1e6:.2f} in {rows['offload_s']:.3f} s, predicted {po / 1e6:.2f}"
            f" (deferred weight syncs from host: {rows.get('resync_bytes', 0.0) / 1e6:.2f})\n"
            f"ZeRO reduce-scatter per step (MB): measured {mr / 1e6:.2f}, predicted {pr / 1e6:.2f}\n"
            f"ZeRO all-gather per step (MB): measured {ma / 1e6:.2f}, predicted {pa / 1e6:.2f}")


def worker_rows(cost, plan, measurements: dict) -> list[dict]:
    """``[{"worker", "measured", "predicted", "ratio"}]``: each worker's peak tracked device bytes over
    the run (``peak_bytes``, every model-stage's turn and the weight syncs included) next to the cost
    model's peak of that GPU (``Plan.gpu_memory``: resident state of every model-stage whose idle
    state stays plus the largest running model-stage's own state and transient bytes) less the
    workspace constant (the CPU worker has none)."""
    est = cost.estimate(plan)
    rows = []
    for m in measurements.get("per_worker", []):
        g = m.get("worker")
        if g not in est.gpu_memory:
            continue
        pred = float(est.gpu_memory[g]) - float(cost.workspace)
        meas = int(m.get("peak_bytes", 0))
        rows.append({"worker": g, "measured": meas, "predicted": pred, "ratio": meas / pred if pred > 0 else None})
    return sorted(rows, key=lambda r: r["worker"])


def format_workers(rows: list[dict]) -> str:
    out = ["peak device memory per worker (MB; measured = tracked tensor bytes, predicted = cost model, no workspace):"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"  worker {r['worker']:<3} measured {r['measured'] / 1e6:9.1f}  predicted {r['predicted'] / 1e6:9.1f}"
                   f"  measured/predicted {ratio}")
    return "\n".join(out)
