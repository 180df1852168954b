"""Engines to units and back when the state is ZeRO-sliced or offloaded to the host pool (worker side).

Source: DESIGN.md §4.8; issue 24 item 4. Called by ``WorkerCore.transition_begin`` and
``transition_finish`` (``worker/core.py``).

**Into a unit** (:func:`adopt_engine`). The transition planner sees a model-stage whose idle state is
offloaded (``Candidate.offload == "host"``) as host EMUs (``transition/emu.py``: ``phi``), so its unit
must be in the host pool at the start: an engine that is still resident (it ran last) is offloaded
first (a real, measured copy, ``worker/memory_pool.py``), and the unit *is* its host copy (no device
bytes). A unit the planner sees on the device is restored first if offloaded. The pool forgets the
engine either way (its host copy is of the old layout). A ZeRO-1 engine's sliced kinds are
``{"flat": slice}`` (``worker/zero.py``), a ZeRO-2/3 engine's ``{unit: slice}`` (``worker/zero3.py``;
ZeRO-3's ``params`` are its slice leaves, detached here): the slots ``transit/flat.py`` names. An
engine with a single DP rank (``z = 1``, a replica to the planner) holds whole flat vectors, which
are cut per name here.

**Out of a unit** (:func:`build_engine`). The engine of the target layout is built from the unit (no
copy) after idle offloadable model-stages here made room (as before a turn); a ZeRO target takes
its slices as they came: the engine is built from the unit's whole kinds (a ZeRO-3 engine, whose
weights are sliced too, from the run's seed, as any build materializes its shard once) and its slices
are then set to the unit's (ZeRO-1: the ``"flat"`` entries of ``exp_avg`` / ``exp_avg_sq`` /
``master``; ZeRO-2/3: :func:`_set_slices`, the slice leaves and optimizer slices by unit, checked
against the engine's ``layout()``); a target host EMU is offloaded into the pool right away.
"""

from __future__ import annotations

import torch

from nereus.runtime.transit.flat import FLAT, is_sliced, sliced_kinds, unflatten
from nereus.runtime.transit.packing import COUNTERS
from nereus.runtime.transit.plans import UnitMeta
from nereus.runtime.transit.worker_side import Transit, Unit
from nereus.runtime.worker.memory_pool import MemoryPools
from nereus.runtime.worker.zero import make_engine

__all__ = ["adopt_engine", "unit_tensors", "build_engine", "snapshot_meta"]


def adopt_engine(transit: Transit, pools: MemoryPools, model_stage: str, engine, meta: UnitMeta, me: int) -> Unit:
    """``engine``'s state as the unit ``meta`` on worker ``me`` (module docstring); returns the unit."""
    counters = {k: int(getattr(engine, k)) for k in COUNTERS}
    if meta.host:
        if model_stage not in pools.offloaded:
            pools.offload(model_stage, engine)
        tensors = {k: dict(d) for k, d in pools.host[model_stage].items()}
    else:
        pools.restore(model_stage, engine)
        tensors = {k: dict(d) for k, d in engine.state_tensors().items()}
    pools.forget(model_stage)
    tensors = unit_tensors(engine, meta, me, tensors)
    unit = Unit(meta, tensors, counters)
    transit.units[meta.uid] = unit
    return unit


def unit_tensors(engine, meta: UnitMeta, me: int, tensors: dict) -> dict:
    """kind → key → tensor of ``engine``'s state ``tensors`` (its own or its host copies) as the unit
    ``meta`` holds them on worker ``me`` (``transit/flat.py``): detached (ZeRO-3's slice leaves), and
    per name for a replica (``z = 1``) whose engine holds whole flat vectors (a ZeRO engine of one DP
    rank). Views, no copy, except a ZeRO-1 flat vector, which ``unflatten`` cuts into fresh tensors."""
    tensors = {k: {key: t.detach() for key, t in d.items()} for k, d in tensors.items()}
    if meta.z == 1:
        for k, d in tensors.items():
            if FLAT in d:  # a ZeRO-1 engine of one DP rank: the whole flat vector
                tensors[k] = unflatten(engine.spec, meta, me, d[FLAT][:sum(w.numel() for w in engine.model.params.values())])
            elif getattr(engine, "zero", 0) >= 2 and k in sliced_kinds(engine.zero):  # {unit: [N_u]}
                tensors[k] = {n: x for u in d for n, x in engine._views(u, d[u]).items()}
    return tensors


def build_engine(pools: MemoryPools, engines: dict, model_stage: str, unit: Unit, zero: int, offload: str,
                 *args, **kwargs):
    """The engine of ``model_stage`` from ``unit`` (module docstring): ``make_engine(zero, *args,
    state=..., **kwargs)``, registered in ``engines`` and in the pool with residency ``offload``.

    Raises:
        DeviceMemoryError: the engine does not fit next to what stays resident.
        ValueError: an offload mode the runtime does not execute.
    """
    pools.set_mode(model_stage, offload)
    pools.make_room(engines, {model_stage})
    sliced = {k: d for k, d in unit.tensors.items() if is_sliced(unit.meta, k)}
    tensors = {k: d for k, d in unit.tensors.items() if k not in sliced}
    engine = make_engine(zero, *args, state={"tensors": tensors, "counters": unit.counters}, **kwargs)
    for k, d in sliced.items():  # the ZeRO slices as they came (same shapes as the ones built)
        if zero == 1:
            getattr(engine, k)["flat"] = d[FLAT]
        else:
            _set_slices(engine, k, d)
    engines[model_stage] = engine
    if unit.meta.host:
        pools.offload(model_stage, engine)
    return engine


@torch.no_grad()
def _set_slices(engine, kind: str, slots: dict) -> None:
    """A ``worker/zero3.py`` engine takes this rank's slices of ``kind`` as the transition delivered them
    (unit → ``[k_u]``, the engine's ``layout()``): ZeRO-3 ``params`` become its slice leaves (in the
    weights' dtype), the optimizer kinds replace its slices.

    Raises:
        ValueError: other units or lengths than the engine's, or a kind it does not hold as slices.
    """
    held = {"params": engine.pslice if engine.zero == 3 else None}.get(kind, getattr(engine, kind, None) or None)
    if held is None:
        raise ValueError(f"a ZeRO-{engine.zero} engine holds no slices of {kind!r}")
    got = {u: tuple(t.shape) for u, t in slots.items()}
    want = {u: (k,) for u, _names, _n, k, _lo in engine.layout()}
    if got != want:
        raise ValueError(f"{kind} slices {got} do not match the engine's layout {want}")
    if kind == "params":
        engine.pslice = {u: t.to(engine._wdtype).detach().requires_grad_(engine.trainable) for u, t in slots.items()}
    else:
        held.update(slots)


def snapshot_meta(model_stage: str, engine, built: dict) -> UnitMeta:
    """The EMU an engine's rollback snapshot is (``worker/fault_tolerant.py``), as the transition
    planner's ``phi`` names it: replica ``d`` is ``"<ms>#d"`` on its workers; a ZeRO group
    (``built["zero"] >= 1`` and DP > 1) is one EMU ``"<ms>#0"`` on all its workers with ``z = dp``;
    ``offload == "host"`` makes it a host copy."""
    lay, d = engine.ctx.layout, engine.ctx.d
    zero, host = int(built.get("zero", 0)), built.get("offload", "none") == "host"
    if zero and lay.dp > 1:
        return UnitMeta(f"{model_stage}#0", model_stage, lay.tp, lay.pp, tuple(lay.workers), host, lay.dp, zero)
    return UnitMeta(f"{model_stage}#{d}", model_stage, lay.tp, lay.pp, tuple(lay.replica(d)), host)
