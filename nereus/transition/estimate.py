"""``estimate_transition``: from two plans to a DAG, a schedule, ``L_tran`` and bytes moved.

Source: paper §4.3 (feasibility and profitability use ``L_tran``), §6; DESIGN.md §4.5-§4.6.
This is the function the controller calls at every replan; it is pure and takes a few
milliseconds for 16-64 GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan
from nereus.transition.buffers import with_buffers
from nereus.transition.copy_cost import with_strided
from nereus.transition.cost import CostParams, duration, min_bytes, ports
from nereus.transition.emu import check_zero, model_of, phi, stage_of, state_parts
from nereus.transition.global_dag import GlobalDAG, critical_path_length, plan_global
from nereus.transition.group_ranks import align_group
from nereus.transition.growth import fuse_growth
from nereus.transition.local_dag import Infeasible, build_local_dag
from nereus.transition.primitives import STORAGE
from nereus.transition.relayout import fuse_relayout
from nereus.transition.schedule import Schedule
from nereus.transition.sharing import shared_schedule
from nereus.transition.teardown import state_kinds, with_freed_tensors
from nereus.workflow import workflow_for

__all__ = ["TransitionEstimate", "estimate_transition", "plan_dag", "capacities", "reload_source", "HEADROOM"]

#: Fraction of device memory kept free (DESIGN.md §4.2: 10% headroom).
HEADROOM = 0.10


@dataclass(frozen=True)
class TransitionEstimate:
    """What the controller needs to admit or reject a transition.

    Attributes:
        feasible: whether a safe DAG exists (memory, ownership, one full copy kept).
        reason: why not, or ``"ok"``.
        l_tran: predicted seconds of the transition (makespan of the schedule; ``inf`` if infeasible).
        bytes_moved: bytes received over links by all primitives.
        min_bytes: bytes any transition between the two plans must move (a lower bound).
        dag: the :class:`GlobalDAG` (None when infeasible).
        schedule: start/end per primitive (None when infeasible).
        critical_path_s: longest DAG path in seconds ignoring link contention (<= ``l_tran``).
        durations: pid → predicted seconds of each primitive (``cost.duration``).
        reloads: model-stage → Load source (``"storage"``, a train EMU uid, or a train model-stage
            synced after its transition) for every frozen or derived model-stage re-created by a
            Load: it lost all its replicas, or its copies were dropped to make room (``plan_dag``).
    """

    feasible: bool
    reason: str
    l_tran: float
    bytes_moved: float
    min_bytes: float
    dag: GlobalDAG | None = None
    schedule: Schedule | None = None
    critical_path_s: float = 0.0
    durations: dict | None = None
    reloads: dict | None = None

    @property
    def num_primitives(self) -> int:
        return len(self.dag.nodes) if self.dag else 0

    def to_dict(self) -> dict:
        return {"feasible": self.feasible, "reason": self.reason,
                "l_tran_s": self.l_tran if math.isfinite(self.l_tran) else None,
                "critical_path_s": self.critical_path_s, "bytes_moved": self.bytes_moved,
                "min_bytes": self.min_bytes, "num_primitives": self.num_primitives,
                "durations_s": self.durations or {}, "reloads": self.reloads or {},
                "dag": self.dag.to_dict() if self.dag else None,
                "schedule": self.schedule.to_dict() if self.schedule else None}


def capacities(job: JobSpec, gpus, reserved_bytes: dict[int, float] | None = None,
               headroom: float = HEADROOM) -> dict[int, int]:
    """GPU → usable bytes: ``memory_bytes·(1 - headroom) - reserved[g]``.

    Raises:
        ValueError: a reserved GPU id outside the cluster or a negative reserved amount.
    """
    reserved = dict(reserved_bytes or {})
    n = job.cluster.num_gpus
    for g, b in reserved.items():
        if not (isinstance(g, int) and 0 <= g < n):
            raise ValueError(f"reserved_bytes has GPU id {g!r}; valid ids are 0..{n - 1}")
        if not b >= 0:
            raise ValueError(f"reserved_bytes[{g}] must be >= 0 bytes, got {b!r}")
    cap = math.floor(job.cluster.gpu.memory_bytes * (1.0 - headroom))
    return {g: cap - math.ceil(reserved.get(g, 0)) for g in gpus}


def _check_plans(job: JobSpec, current: Plan, target: Plan) -> None:
    a, b = set(current.model_stages), set(target.model_stages)
    if a != b:
        raise ValueError(f"plans must have the same model-stages: current has {sorted(a)}, target "
                         f"{sorted(b)}")
    n = job.cluster.num_gpus
    for name, plan in (("current", current), ("target", target)):
        owner: dict[tuple[str, int], str] = {}
        for c in plan.candidates:
            if not c.gpus:
                raise ValueError(f"{name} plan: {c.model_stage} has no GPU set (plan not placed)")
            bad = [g for g in c.gpus if not 0 <= g < n]
            if bad:
                raise ValueError(f"{name} plan: {c.model_stage} uses GPU ids {bad[:4]}; valid 0..{n - 1}")
            try:
                check_zero(c.model_stage, c.zero)
            except ValueError as e:
                raise ValueError(f"{name} plan: {e}") from None
            if c.offload == "drop" and stage_of(c.model_stage) == "train":
                raise ValueError(f"{name} plan: {c.model_stage} has offload='drop', which would lose its "
                                 "training state; valid: 'none', 'host' or 'cpu_adam'")
            if c.idle_off_gpu or job.framework.colocate != "never":
                continue  # colocated, or idle state off the GPUs: it owns no GPU at a step boundary
            for g in c.gpus:
                k = (stage_of(c.model_stage), g)
                if k in owner:
                    raise ValueError(f"{name} plan: concurrent model-stages {owner[k]} and "
                                     f"{c.model_stage} both use GPU {g}")
                owner[k] = c.model_stage


def reload_source(job: JobSpec, model_stage: str, model_stages) -> str | None:
    """Where a model-stage that lost every replica can get its state back, or None (DESIGN.md §4.9).

    * ``<model>.train``: None: it holds the unique logical state (θ, ω, counters); restore from a
      checkpoint.
    * a model that is trained (it has a ``train`` model-stage in the job's workflow or in
      ``model_stages``): its weights derive from ``<model>.train`` by the per-step weight sync, so
      the source is that model-stage (None when it is not in ``model_stages``).
    * a frozen model (reference, reward): ``"storage"``, the model files the job started from.
    """
    model, _, stage = model_stage.partition(".")
    if stage == "train":
        return None
    trained = {m.model for m in workflow_for(job.workload).model_stages if m.stage == "train"}
    trained |= {ms.partition(".")[0] for ms in model_stages if ms.endswith(".train")}
    if model in trained:
        return f"{model}.train" if f"{model}.train" in model_stages else None
    return STORAGE


def _pick_train_emu(train: list, target0, cluster):
    """The live train EMU a Load syncs from: most GPUs on the first target EMU's nodes, then uid."""
    nodes = cluster.nodes_of(target0.gpus)
    return min(train, key=lambda e: (-sum(cluster.node_of(g) in nodes for g in e.gpus), e.uid))


def _sync_sources(src: str, initial: list, final: list) -> list:
    """The EMUs of the train model-stage ``src`` a Load may sync from, best first: its live GPU
    copies, else its target GPU copies (synced after its transition), else its live copies in host
    memory (idle state offloaded, ``offload="host"``: host → device, ``primitives.load``), else its
    target host copies; empty when it keeps none (it lost every replica)."""
    for pool, host in ((initial, False), (final, False), (initial, True), (final, True)):
        out = [e for e in pool if e.model_stage == src and e.host == host]
        if out:
            return out
    return []


def _held_bytes(initial: list, model_stage: str) -> int:
    """Bytes the current EMUs of ``model_stage`` hold on GPUs."""
    return sum(x.bytes_on(g) for x in initial if x.model_stage == model_stage for g in x.gpus)


def _droppable(job: JobSpec, e: Infeasible, node: dict, initial: list, lost: list, names: set,
               idle: set = frozenset()) -> list[str]:
    """Frozen/derived model-stages whose current EMUs block the DAG, cheapest to reload first.

    On a circular wait: the model-stages on the cycle. On a memory block: for each blocked primitive,
    the other model-stages with a current EMU on a GPU it needs room on (in a swap, dropping one side
    frees the GPU the other side waits for). Only model-stages a Load can re-create qualify
    (:func:`reload_source`; never ``*.train``). Order: a weight sync from a train model-stage before
    a read from storage, then fewer current bytes.
    """
    if e.cycle:
        cands = {node[p].model_stage for p in e.blocked if p in node}
    else:
        cands = set()
        for p in e.blocked:
            if p not in node:
                continue
            need = {g for g, h in node[p].mem_hi.items() if h > 0}
            cands |= {x.model_stage for x in initial
                      if not x.host and need & set(x.gpus) and x.model_stage != node[p].model_stage}
    out = []
    for ms in cands - set(lost) - set(idle):
        src = reload_source(job, ms, names)
        if src is not None and src not in lost:
            out.append((src == STORAGE, _held_bytes(initial, ms), ms))
    return [ms for *_, ms in sorted(out)]


def _stageable(e: Infeasible, node: dict, initial: list, skip: set) -> str | None:
    """The model-stage to stage through host memory when a block has nothing to drop: on a circular
    wait one on the cycle, on a memory block one of the blocked primitives' own (its Offload frees
    its GPUs for the others first); the one holding the fewest bytes, None when all are ``skip``."""
    cands = {node[p].model_stage for p in e.blocked if p in node} - skip
    have = {x.model_stage for x in initial}
    held = {ms: _held_bytes(initial, ms) for ms in cands & have}
    return min(held, key=lambda ms: (held[ms], ms)) if held else None


def plan_dag(job: JobSpec, current: Plan, target: Plan, pool: frozenset[int] | None = None,
             reserved_bytes: dict[int, float] | None = None, params: CostParams | None = None,
             order: str = "critical") -> tuple[GlobalDAG, Schedule, dict[str, float]]:
    """The global DAG between two placed plans, its greedy schedule and the durations (s) per pid.

    EMUs of the current plan on GPUs outside ``pool`` are lost (a reclaimed GPU takes its shards).

    Raises:
        ValueError: plans with different model-stages, unplaced candidates, GPU ids outside the
            cluster, concurrent model-stages sharing a GPU (allowed when the job's framework
            colocates model-stages, ``FrameworkSpec.colocate`` not ``never``, or when all but one
            of them keep their idle state off the GPUs, ``offload`` ``host``/``drop``), ``zero`` on a
            model-stage that does not train, or ``offload="drop"`` on one that does.
        Infeasible: the target uses GPUs outside the pool, a model-stage with unique state lost
            every replica (``*.train``, or a derived copy whose train model-stage is not in the
            plans), the current state already exceeds a GPU's usable memory, or no safe order
            exists. A frozen or derived model-stage that lost every replica is re-created by a Load
            (:func:`reload_source`). Fallbacks, in order, while the DAG is blocked: a Split that
            does not fit in place is done on a copy on free GPUs (relocate); one that still does
            not fit moves its model-stage through host memory (Offload then Restore, training
            state included); then, for memory on a GPU or a circular wait, the frozen/derived
            model-stages in the way are dropped (Destroy of every current EMU) and reloaded (Load
            + Extends; a derived copy syncs from its train model-stage after that one's
            transition), one per round; when nothing can be dropped, one model-stage in the way
            is staged through host memory (:func:`_stageable`), one per round. Before those, a
            circular wait of ownership (model-stages of one stage swapping GPUs with no free GPU,
            e.g. two ``*.train``) is cleared by letting the model-stages on it share GPUs while the transition runs
            (``GlobalDAG.shared``, ours): each acquires its target GPUs before the other leaves
            them, both states counted on the shared GPU by the memory-aware schedule. The paper
            (§2, §6) keeps concurrent model-stages on disjoint GPUs; a transition runs at a step
            boundary, where no model-stage computes, so during it the only shared resource is
            memory (a swap then moves each state once, the minimum, instead of a drop and reload or a
            host round trip). When memory rules that out, the fallbacks above follow.
    """
    _check_plans(job, current, target)
    pool = job.cluster.all_gpus() if pool is None else job.cluster.check_pool(pool)
    outside = sorted(target.gpus_used() - pool)
    if outside:
        raise Infeasible(f"target plan uses GPUs {outside[:6]} outside the pool of {len(pool)} GPUs")
    initial, final = [], []
    lost = []
    idle: set[str] = set()  # model-stages whose idle state is off the GPUs in either plan
    for c in current.candidates:
        ms = c.model_stage
        t = target[ms]
        if c.idle_off_gpu or t.idle_off_gpu:
            idle.add(ms)
        cur = tuple(e for e in phi(job, c) if set(e.gpus) <= pool)
        if not cur and c.offload != "drop":
            lost.append(ms)
        tgt = phi(job, t, prefix="*")
        if not cur and all(e.host for e in tgt) and not ms.endswith(".train"):
            tgt = ()  # no state to move: the model-stage's next run re-creates it and offloads it
        initial += cur
        final += align_group(cur, tgt)
    names = set(current.model_stages)
    reload_from: dict = {}
    have = {e.model_stage for e in initial}
    # a lost training model-stage needs its state whatever the target keeps it in (it is unique)
    need = {e.model_stage for e in final if not e.host} | {ms for ms in lost if ms.endswith(".train")}
    reload = lost + sorted(ms for ms in names - have - set(lost) if ms in need)  # dropped idle state
    for ms in sorted(reload, key=lambda m: (not m.endswith(".train"), m)):  # unique state first
        if ms not in need:
            continue
        src = reload_source(job, ms, names)
        if src is None or src in lost:
            why = ("its training state is unique" if ms.endswith(".train") else
                   f"its weights derive from {ms.partition('.')[0]}.train, "
                   + ("which lost every replica too" if src in lost else "which is not in the plan"))
            where = "every replica lost GPUs outside the pool" if ms in lost else "its idle state was dropped"
            raise Infeasible(f"{ms}: {where} and {why}; restore from a checkpoint")
        tgt0 = next(e for e in final if e.model_stage == ms)
        train = [] if src == STORAGE else _sync_sources(src, initial, final)
        if src != STORAGE and not train:
            raise Infeasible(f"{ms}: its weights derive from {src}, which holds no copy before or "
                             "after the transition to sync from")
        reload_from[ms] = src if src == STORAGE else _pick_train_emu(train, tgt0, job.cluster)
    gpus = {g for e in initial + final for g in e.gpus}
    cap = capacities(job, gpus, reserved_bytes)
    used: dict[int, int] = {}
    for e in initial:
        for g in e.gpus:
            used[g] = used.get(g, 0) + e.bytes_on(g)
    over = sorted(g for g, b in used.items() if b > cap[g])
    if over:
        g = over[0]
        raise Infeasible(f"GPU {g} already holds {used[g] / 2**30:.2f} GiB of state, more than the "
                         f"{cap[g] / 2**30:.2f} GiB left after headroom and reserved bytes "
                         f"({len(over)} GPU(s) over): no room for a live transition")
    params = params or CostParams()
    relocate: set[str] = set()
    dropped: set[str] = set()
    staged: set[str] = set()
    shared: set[str] = set()  # model-stages let share GPUs during the transition (a circular wait)
    unfused: set[str] = set()  # model-stages whose same-GPU re-layout is not fused (relayout.py)
    first: Infeasible | None = None

    def give_up(e: Infeasible) -> Infeasible:
        """The first block is what the user can act on; name the fallbacks that did not clear it."""
        e0 = first or e
        tried = ([f"relocated Split of {', '.join(sorted(relocate))}"] if relocate else []) + (
            [f"staged {', '.join(sorted(staged))} through host memory"] if staged else []) + (
            [f"dropped {', '.join(sorted(dropped))}"] if dropped else [])
        tried += [f"let {', '.join(sorted(shared))} share GPUs during the transition"] if shared else []
        msg = str(e0) + (f" (also tried: {'; '.join(tried)})" if tried else "")
        return Infeasible(msg, e0.blocked, e0.cycle)

    while True:
        locals_, fused = [], set()
        for c in current.candidates:
            ms = c.model_stage
            cur = tuple(e for e in initial if e.model_stage == ms)
            ld = fuse_growth(build_local_dag(  # growth at the minimum bytes (growth.py)
                ms, cur, tuple(e for e in final if e.model_stage == ms),
                model_of(job, ms), state_parts(job, ms), job.cluster, relocate=ms in relocate,
                reload_from=reload_from.get(ms), staged=ms in staged))
            if ms not in unfused:  # same-GPU re-layout at the minimum bytes (relayout.py)
                ld, pids = fuse_relayout(ld, cur, model_of(job, ms), state_parts(job, ms))
                fused |= pids
            if params.transit_buffers:  # the executor's buffers and new shards (buffers.py), and
                # which of its copies are column slices (copy_cost.py)
                ld = replace(ld, nodes=with_strided(tuple(with_buffers(n) for n in ld.nodes), cur, model_of(job, ms)))
            # the tensors each Destroy frees (teardown.py)
            ld = replace(ld, nodes=with_freed_tensors(ld.nodes, cur, model_of(job, ms), state_kinds(job, ms)))
            locals_.append(ld)
        dur = {n.pid: duration(n, job.cluster, params) for ld in locals_ for n in ld.nodes}
        prt = {n.pid: ports(n, job.cluster, params) for ld in locals_ for n in ld.nodes}
        try:
            dag, sched = plan_global(locals_, tuple(initial), tuple(final), cap, dur, prt, order,
                                     exclusive=job.framework.colocate == "never", shared=frozenset(shared))
            models = {c.model_stage: (model_of(job, c.model_stage), state_parts(job, c.model_stage))
                      for c in current.candidates}
            # workers that share CPU cores: the same order, replayed under processor sharing (sharing.py)
            sched = shared_schedule(sched, {n.pid: n for n in dag.nodes}, dag.preds(), prt, dur,
                                    params.worker_cores, params.dispatch_s)
            return replace(dag, models=models), sched, dur
        except Infeasible as e:
            first = first or e
            # an in-place Split did not fit: copy that replica to free target GPUs and split there
            node = {n.pid: n for ld in locals_ for n in ld.nodes}
            # a circular wait of ownership (model-stages of one stage swapping GPUs): let the
            # model-stages on it share GPUs while the transition runs; the memory-aware schedule
            # still orders them (GlobalDAG.shared); a memory block after that takes the fallbacks below
            cyc = {node[p].model_stage for p in e.blocked if p in node} if e.cycle else set()
            if cyc - shared:
                shared |= cyc
                continue
            # a fused same-GPU re-layout does not fit: the Split → Merge it replaced
            unfuse = set() if e.cycle else {node[p].model_stage for p in e.blocked if p in fused} - unfused
            if unfuse:
                unfused |= unfuse
                continue
            splits = set() if e.cycle else {node[p].model_stage for p in e.blocked
                                            if p.startswith("split:") and node[p].model_stage not in idle}
            more = splits - relocate
            if more:
                relocate |= more
                continue
            # a relocated Split still does not fit: move that model-stage through host memory
            more = splits - staged
            if more:
                staged |= more
                continue
            # still blocked: drop the frozen/derived copies in the way and reload them at the end
            drop = [ms for ms in _droppable(job, e, node, initial, lost, names, idle) if ms not in dropped][:1]
            if not drop:
                # nothing to drop (e.g. two training model-stages swapping GPUs): stage one of the
                # model-stages in the way through host memory, the smallest first
                stage_ms = _stageable(e, node, initial, staged | set(reload_from) | idle)
                if not stage_ms:
                    raise give_up(e) from None
                staged.add(stage_ms)
                continue
            dropped |= set(drop)
            for ms in drop:
                src = reload_source(job, ms, names)
                tgt0 = next(x for x in final if x.model_stage == ms)
                reload_from[ms] = src if src == STORAGE else _pick_train_emu(
                    [x for x in final if x.model_stage == src], tgt0, job.cluster)


def estimate_transition(job: JobSpec, current: Plan, target: Plan, pool: frozenset[int] | None = None,
                        reserved_bytes: dict[int, float] | None = None,
                        params: CostParams | None = None, order: str = "critical") -> TransitionEstimate:
    """Plan the transition ``current → target`` and predict its cost (paper §4.3, §6).

    Args:
        job: models, cluster and workload (state bytes per parameter come from the workload).
        current, target: placed plans with the same model-stages.
        pool: GPUs available (``P_gpu``); all cluster GPUs when None.
        reserved_bytes: GPU → bytes kept for workspace/activations during the transition (default 0).
        params: communicator setup and teardown constants (:class:`CostParams` defaults when None).
        order: greedy order of the global DAG, ``"critical"`` or ``"stage"`` (see ``global_dag``).

    Returns:
        A :class:`TransitionEstimate`; ``feasible=False`` with a reason when no safe DAG exists.

    Raises:
        ValueError: malformed input (see :func:`plan_dag`).
    """
    models = {c.model_stage: (model_of(job, c.model_stage), state_parts(job, c.model_stage))
              for c in current.candidates}
    try:
        dag, sched, dur = plan_dag(job, current, target, pool, reserved_bytes, params, order)
    except Infeasible as e:
        return TransitionEstimate(False, str(e), math.inf, 0.0, 0.0)
    reloads = {n.model_stage: n.source for n in dag.nodes if n.kind == "load"}
    alive = {e.model_stage for e in dag.initial}
    reason = "ok"
    to_host = {c.model_stage for c in target.candidates if c.offload == "host"}
    staged = sorted(n.model_stage for n in dag.nodes if n.kind == "offload" and n.model_stage not in to_host)
    if staged:
        reason += "; staged through host memory (no GPU-resident path fits): " + ", ".join(staged)
    if dag.shared:
        reason += "; shared GPUs while swapping (circular wait of ownership): " + ", ".join(sorted(dag.shared))
    idle = sorted(ms for ms in to_host if any(n.model_stage == ms for n in dag.nodes))
    if idle:
        reason += "; idle state moved to or re-cut in host memory (offload='host'): " + ", ".join(idle)
    was_dropped = {c.model_stage for c in current.candidates if c.offload == "drop"}
    for what, group in (("every replica lost", [m for m in sorted(reloads) if m not in alive | was_dropped]),
                        ("idle state dropped", [m for m in sorted(reloads) if m in was_dropped]),
                        ("dropped to make room", [m for m in sorted(reloads) if m in alive])):
        if group:
            reason += f"; {what}, reloaded by Load: " + ", ".join(
                f"{ms} ({'from storage' if reloads[ms] == STORAGE else 'weight sync from ' + reloads[ms]})"
                for ms in group)
    return TransitionEstimate(True, reason, sched.makespan, float(dag.bytes_moved),
                              float(min_bytes(dag.initial, dag.target, models)), dag, sched,
                              critical_path_length(dag, dur), dur, reloads)
