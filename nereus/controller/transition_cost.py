"""``L_tran`` for admission: the transition planner's DAG estimate when available, else bytes over bandwidth.

The DAG-based estimate is ``nereus.transition.estimate_transition(job, current, target, pool)``
(critical path of the global transition DAG, DESIGN.md §4.6). Until that module is importable, the
fallback estimates the same quantity coarsely:

* per model-stage whose candidate changed: receivers are the target GPUs that do not already hold
  the same shard (all target GPUs when the (tp, pp) layout changes — resharding; only the new GPUs
  when just DP grows — Extend); each receives its resident bytes per GPU (weights and optimizer
  state, ``StageEstimate.resident``);
* receivers load in parallel, so a model-stage takes ``resident / bandwidth`` where the bandwidth is
  the scale-up link inside one node and the scale-out link otherwise;
* model-stages share links, so their times add up; plus ``SETUP_S`` for communicator creation and
  engine re-initialisation (NCCL communicator init takes seconds at scale; vLLM re-allocates its
  KV cache and re-captures CUDA graphs; measured `C_switch` components, cost-model.md §4).

Infeasible when the target uses a GPU outside the pool.

Both estimates add the rollout-engine start when a generation model-stage changes layout or gains
GPUs: state movement does not cover starting the engine on its new layout (vLLM spawns workers,
profiles memory, allocates the KV cache and captures CUDA graphs). Given the job, it is
``nereus.controller.engine_start.generation_restart_s`` (by model size and TP: 25 s for 8B TP 1,
3.5 min for 70B TP 8; sources there) plus ``group_init_s`` (creating the process groups of a
re-laid-out training model-stage at scale); without a job, or with ``engine_reinit_s`` given, the
flat :data:`ENGINE_REINIT_S`. ``engine_reinit_s=0`` leaves the DAG's pure state-movement cost.
"""

from __future__ import annotations

from nereus.controller.decisions import TransitionCost
from nereus.controller.engine_start import generation_restart_s, group_init_s
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["estimate_transition_cost", "bandwidth_estimate", "engine_reinit", "SETUP_S", "ENGINE_REINIT_S",
           "dag_estimator"]

#: seconds of fixed setup per transition in the fallback (communicators); an assumption, see above.
SETUP_S = 5.0
#: seconds to start a rollout engine on a new layout or new GPUs when the job is not known (the
#: flat assumption before ``engine_start``); see above.
ENGINE_REINIT_S = 20.0


def engine_reinit(current: Plan, target: Plan, engine_reinit_s: float | None = None,
                  job: JobSpec | None = None) -> float:
    """Seconds of engine (re)starts and process-group creation of ``current → target``.

    With ``job`` and no ``engine_reinit_s``: ``generation_restart_s`` (the slowest new engine, by model
    size and TP) plus ``group_init_s`` (``nereus.controller.engine_start``). Otherwise ``engine_reinit_s``
    (default :data:`ENGINE_REINIT_S`) if a ``*.generate`` model-stage changes layout or gains GPUs, else 0.
    """
    if job is not None and engine_reinit_s is None:
        return generation_restart_s(job.model, current, target) + group_init_s(current, target)
    if engine_reinit_s is None:
        engine_reinit_s = ENGINE_REINIT_S
    for t in target.candidates:
        if not t.model_stage.endswith(".generate"):
            continue
        c = current[t.model_stage] if t.model_stage in current else None
        if c is None or c.layout != t.layout or not set(t.gpus) <= set(c.gpus):
            return engine_reinit_s
    return 0.0


def dag_estimator():
    """``nereus.transition.estimate_transition`` if the module provides it, else None."""
    try:
        from nereus.transition.estimate import estimate_transition  # noqa: PLC0415
    except ImportError:
        return None
    return estimate_transition


def bandwidth_estimate(job: JobSpec, current: Plan, target: Plan, pool=None) -> TransitionCost:
    """Fallback ``L_tran``: bytes to move over link bandwidth plus :data:`SETUP_S` (module docstring)."""
    pool = frozenset(pool) if pool is not None else None
    if pool is not None:
        outside = sorted(target.gpus_used() - pool)
        if outside:
            return TransitionCost(0.0, feasible=False, reason=f"target uses GPUs {outside[:4]} outside the pool")
    total_s, total_b, changed = 0.0, 0.0, 0
    for t in target.candidates:
        c = current[t.model_stage] if t.model_stage in current else None
        if c is not None and c.key() == t.key() and c.gpus == t.gpus:
            continue
        changed += 1
        est = target.estimates.get(t.model_stage)
        resident = est.resident if est is not None else 0.0
        alive = set(c.gpus) & pool if (c is not None and pool is not None) else set(c.gpus if c else ())
        if c is not None and c.layout == t.layout:
            receivers = [g for g in t.gpus if g not in alive]
        else:
            receivers = list(t.gpus)
        if not receivers:
            continue
        span = set(receivers) | alive
        bw = job.cluster.link_of(span)[0]
        total_s += resident / bw
        total_b += resident * len(receivers)
    if changed == 0:
        return TransitionCost(0.0, bytes_moved=0.0, reason="same plan")
    return TransitionCost(total_s + SETUP_S, bytes_moved=total_b, source="bytes/bandwidth",
                          reason=f"{changed} model-stage(s) change; {total_b / 1e9:.1f} GB over links")


def estimate_transition_cost(job: JobSpec, current: Plan, target: Plan, pool=None,
                             engine_reinit_s: float | None = None) -> TransitionCost:
    """``L_tran`` of ``current → target``: the DAG estimate when ``nereus.transition`` provides one,
    else :func:`bandwidth_estimate`; plus :func:`engine_reinit`."""
    fn = dag_estimator()
    if fn is None:
        est = bandwidth_estimate(job, current, target, pool)
    else:
        e = fn(job, current, target, pool=pool)
        est = TransitionCost(float(e.l_tran), feasible=bool(e.feasible), bytes_moved=float(e.bytes_moved),
                             source="dag", reason=str(getattr(e, "reason", "") or ""))
    if not est.feasible:
        return est
    extra = engine_reinit(current, target, engine_reinit_s, job)
    return TransitionCost(est.l_tran + extra, True, est.bytes_moved, est.source,
                          est.reason + (f"; +{extra:.1f}s engine start and group creation" if extra else ""))
