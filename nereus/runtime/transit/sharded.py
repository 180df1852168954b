"""What the live-transition executor needs to know about ZeRO groups and offloaded state (driver side).

Source: DESIGN.md §4.8; issue 24 item 4; ``transit/flat.py`` (how slices move).

* :func:`aligned_target`: the transition planner may order a target ZeRO group's DP ranks so that
  staying ranks keep most of their slices (``transition/group_ranks.py``); the DAG's target EMU
  records that order, and the engines must be built in it, so the plan the driver adopts takes each
  ZeRO group's GPU order from the DAG (the same GPUs and degrees: which rank owns which slice and
  which micro-batches is a convention at a step boundary).
* :func:`live_unsupported`: why the executor cannot run a DAG (None when it can): a primitive that
  meets ZeRO-1 slices (one range of each shard's flat vector) and ZeRO-2/3 slices (one range per layer
  unit, ``transit/flat.py``) of one kind, whose bytes the planner counts as if the layouts were one;
  or one that moves slices between TP/PP layouts otherwise than ``transit/regroup.py`` does (a whole
  target gathers from slices of any layout; a sliced target is cut only locally from whole units,
  the planner's free Merge). ``nereus run --adaptive`` sends such a change through the
  checkpoint restart, which holds the unsliced logical state (``durable/``).
"""

from __future__ import annotations

from dataclasses import replace

from nereus.runtime.transit.flat import sliced_kinds
from nereus.spec.plan import Plan

__all__ = ["aligned_target", "live_unsupported", "schedule_fault", "dropped_targets", "rebuild_dropped"]


def aligned_target(dag, target: Plan) -> Plan:
    """``target`` with each ZeRO group's GPUs in the order of the DAG's target EMU.

    Raises:
        ValueError: a target EMU's GPUs are not the candidate's (another plan than the DAG's).
    """
    out = []
    for c in target.candidates:
        emu = next((e for e in dag.target if e.model_stage == c.model_stage and e.z > 1), None)
        if emu is not None and tuple(emu.gpus) != tuple(c.gpus):
            if sorted(emu.gpus) != sorted(c.gpus):
                raise ValueError(f"{c.model_stage}: the DAG's target group is on {list(emu.gpus)}, the plan's "
                                 f"on {list(c.gpus)}")
            c = replace(c, gpus=tuple(emu.gpus))
        out.append(c)
    return replace(target, candidates=tuple(out))


def schedule_fault(est) -> str | None:
    """Why ``est``'s schedule fails the executor's own check (``transition.verify.verify_schedule``,
    run again by :class:`~nereus.runtime.transit.driver_side.TransitionExecutor` before anything
    moves), or None. The adaptive run asks before it starts a live transition, so a planner defect
    becomes a restart from the durable checkpoint instead of the run's end."""
    from nereus.transition.verify import ScheduleError, verify_schedule

    try:
        verify_schedule(est.dag, est.schedule)
    except ScheduleError as e:
        return f"the transition planner's schedule fails its check ({e})"
    return None


def live_unsupported(dag, *plans: Plan) -> str | None:
    """Why the executor cannot run ``dag`` live (module docstring), or None; ``plans`` (the current and
    target) are not needed and kept for callers."""
    del plans
    emus = list(dag.initial) + list(dag.target) + [e for p in dag.nodes for e in p.produces]
    for e in emus:
        if e.z > 1:
            try:
                sliced_kinds(e.zero)
            except ValueError as err:
                return f"{e.model_stage}: {err}"
    by_uid = {e.uid: e for e in emus}
    for p in dag.nodes:
        read = [by_uid[u] for u in p.reads + p.consumes if u in by_uid]
        # a Load moves the weights only: a ZeRO-1/2 group's weights are whole (per name)
        groups = [u for u in read + list(p.produces) if u.z > 1 and (p.kind != "load" or u.zero == 3)]
        stages = {u.zero for u in groups}
        if 1 in stages and stages & {2, 3}:
            return (f"{p.pid}: moves optimizer slices between ZeRO-1 (one range of each shard) and ZeRO-"
                    f"{max(stages)} (one range per layer unit), which the planner counts as one layout")
        why = _across_layouts(p, read, groups)
        if why:
            return why
    return None


def _across_layouts(p, read, groups) -> str | None:
    """Why primitive ``p`` cannot move ZeRO slices between its units' TP/PP layouts
    (``transit/regroup.py``), or None: a sliced target is cut only from whole units, locally (the
    planner's free Merge); a whole target gathers from slices of any layout."""
    for d in p.produces:
        others = [u for u in read if (u.tp, u.pp) != (d.tp, d.pp)]
        if not others:
            continue
        if d in groups:
            if any(u in groups for u in others):
                return f"{p.pid}: cuts ZeRO slices of {d.uid} from slices of another TP/PP layout"
            if p.bytes_moved > 0:
                return f"{p.pid}: cuts ZeRO slices of {d.uid} from units of another TP/PP layout, not locally"
    return None


def dropped_targets(driver, dag, changed: list[str]) -> list[str]:
    """The changed model-stages whose target drops its idle state (no EMU in ``dag.target``)."""
    have = {e.model_stage for e in dag.target}
    return [ms for ms in changed if driver.cands[ms].offload == "drop" and ms not in have]


def rebuild_dropped(driver, names: list[str]) -> None:
    """Build the engines of ``names`` (:func:`dropped_targets`), whose idle state is dropped in the target
    (``offload == "drop"``: ``phi`` gives them no EMU, so no unit reaches them) as at the run's start:
    frozen ones from their seeds (the stored weights, the planner's reload from storage); derived
    copies (``actor.generate``, ``actor.infer``, ``critic.infer``) then take their training
    model-stage's weights by the driver's weight sync (the planner's re-sync), which is not part of
    the transition's bytes. Runs after the other model-stages' engines are built."""
    for ms in names:
        wf_ms = next(x for x in driver.wf.model_stages if x.name == ms)
        lay, c = driver.layouts[ms], driver.cands[ms]
        driver._get([driver.workers[i].build.remote(ms, driver._spec_of(wf_ms.model), lay, driver.seed_of(wf_ms.model),
                                                    False, None, driver.tag, precision=driver.cfg.precision,
                                                    zero=c.zero, offload=c.offload) for i in lay.workers],
                    f"building {ms} (idle state dropped)")
    if any(ms.split(".")[0] in ("actor", "critic") for ms in names):
        driver._sync()
