"""State-preserving re-layout between RL steps: a centralized re-shard through the driver.

Applies a new :class:`~nereus.spec.plan.Plan` at a safe boundary (between two synchronous steps):

1. gather the logical state ``Λ = (θ, ω, c, v, p)`` of every ``*.train`` model-stage from one intact
   replica (``Engine.gather_logical_state``: parameters, Adam moments and step, update counter,
   versions, mini-batch position), or take it from an in-memory :func:`checkpoint` when no replica
   is intact (checkpoint/restart);
2. tear every engine down (local, no collective);
3. build every model-stage's engines in the new layout on its new workers, under a fresh group tag;
   frozen model-stages (``reference``, ``reward``) are re-created from their initial weights (the
   same deterministic seeds), exactly as at start-up;
4. load the full state into each ``*.train`` EMU (``Engine.load_logical_state``: every rank keeps
   its own shards) and re-sync the generation/inference copies with the ordinary weight sync.

The driver's step index and update counter are not touched (or are restored from the checkpoint), so
the global batch ``dp·b·a`` and the sample order (prompts, seeds and data derive from global indices)
continue as if nothing happened. Sharding then gathering is exact: the gathered state after a
re-layout equals the state before, bit for bit.

This is NOT the transition executor of DESIGN.md §4.8: every byte goes through the driver, every
engine is rebuilt, and nothing overlaps. ``nereus run --adaptive`` no longer uses it (live changes go
through ``transit/driver_side.py``, restarts through ``durable/``); it stays as the simplest reference
re-layout for tests (and :func:`intact_replica`, :func:`train_stages` are shared helpers).
"""

from __future__ import annotations

import time

from nereus.runtime.worker.failures import WorkerFailure
from nereus.spec.plan import Plan

__all__ = ["checkpoint", "intact_replica", "relayout", "train_stages"]


def train_stages(driver) -> list[str]:
    return [ms.name for ms in driver.wf.model_stages if ms.trainable]


def intact_replica(driver, model_stage: str) -> int | None:
    """The first DP replica of ``model_stage`` whose workers are all still in the pool, else None (a
    ZeRO group, whose DP ranks hold one optimizer slice each, is intact only whole: replica 0)."""
    lay = driver.layouts[model_stage]
    if driver.cands[model_stage].zero and lay.dp > 1:
        return 0 if all(i < len(driver.workers) and driver.workers[i] is not None for i in lay.workers) else None
    for d in range(lay.dp):
        if all(i < len(driver.workers) and driver.workers[i] is not None for i in lay.replica(d)):
            return d
    return None


def _gather(driver) -> dict:
    states = {}
    for name in train_stages(driver):
        d = intact_replica(driver, name)
        if d is None:
            raise WorkerFailure(f"relayout: every replica of {name} lost a worker; restore from a checkpoint")
        states[name] = driver.gather_logical_state(name, d)
    return states


def checkpoint(driver) -> dict:
    """An in-memory checkpoint on the driver at a safe boundary: the gathered logical state of every
    ``*.train`` model-stage plus the driver's step index and update counter."""
    return {"step_index": driver.step_index, "updates": driver.updates, "states": _gather(driver)}


def relayout(driver, plan: Plan, ckpt: dict | None = None) -> dict:
    """Rebuild ``driver``'s engines in ``plan``'s layouts keeping the logical state (module docstring).

    Args:
        driver: a started :class:`~nereus.runtime.run.driver.RLDriver`.
        plan: the target plan; its workers must be in the pool (``driver.workers[i]`` not None).
        ckpt: restore from this :func:`checkpoint` (a restart) instead of the live state.

    Returns:
        ``{"seconds", "source": "live" | "checkpoint", "steps_lost"}``.

    Raises:
        ValueError: the plan is invalid for this job or uses workers that left (nothing torn down).
        WorkerFailure: live state requested but a ``*.train`` model-stage has no intact replica.
    """
    import ray

    t0 = time.perf_counter()
    driver.num_workers = len(driver.workers)
    gone = sorted(g for c in plan.candidates for g in c.gpus if driver.workers[g] is None)
    if gone:
        raise ValueError(f"relayout: plan uses workers {gone} that left the pool")
    states = ckpt["states"] if ckpt is not None else _gather(driver)
    driver.set_plan(plan)  # validates first: on ValueError nothing has changed
    live = [w for w in driver.workers if w is not None]
    driver._get([w.destroy.remote(ms.name) for ms in driver.wf.model_stages for w in live], "relayout teardown")
    driver.build_engines()
    futs = []
    for name, st in states.items():
        ref = ray.put(st)  # one copy in the object store, read by every worker of the new layout
        futs += [driver.workers[i].load_logical_state.remote(name, ref) for i in driver.layouts[name].workers]
    driver._get(futs, "relayout load")
    lost = 0
    if ckpt is not None:
        lost = driver.step_index - ckpt["step_index"]
        driver.step_index, driver.updates = ckpt["step_index"], ckpt["updates"]
    driver._sync()
    return {"seconds": time.perf_counter() - t0, "source": "live" if ckpt is None else "checkpoint",
            "steps_lost": lost}
