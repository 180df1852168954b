"""Plan search: the fastest feasible plan for a job on a GPU pool (DESIGN.md §4.4, paper Eq. 1).

The search model (shared exactly with :mod:`nereus.planner.exhaustive`). Each stage is placed by a
*partition* of its model-stages into blocks: a block's model-stages share one GPU set and run one
after another, distinct blocks run concurrently on disjoint GPUs. The job's framework says which
partitions (``framework.colocate``: ``never`` → singletons only; ``always`` → one block; ``auto``
→ every partition, Bell(k) of them for k model-stages: 2, 5, 15 for k = 2, 3, 4):

* *disjoint* (all singletons): the stage's model-stages run concurrently on disjoint GPUs,
  ``Σ GPUs ≤ |P_gpu|``; stage time ``T_s = max_M t_M``, per-GPU resident bound ``R_s = max_M r_M``;
* *colocated* (one block): they run one after another on GPU sets taken from the same start of
  the pool (verl's hybrid engine), each ``GPUs_M ≤ |P_gpu|``; ``T_s = Σ_M t_M``, ``R_s = Σ_M r_M``
  (a GPU may host one replica of each). With the same rows, disjoint is never worse, so
  colocation only pays when the stage's model-stages do not fit the pool side by side;
* *mixed* (any other partition, e.g. PPO's ``{reference, reward}`` colocated beside
  ``{critic.infer}``): a block ``B`` takes ``g_B = max_{M in B} GPUs_M`` GPUs, time
  ``Σ_{M in B} t_M`` and resident ``Σ_{M in B} r_M``; ``Σ_B g_B ≤ |P_gpu|``, ``T_s = max_B``
  of the block times, ``R_s = max_B`` of the block residents;
* in every partition, ``X_s = max_M x_M``; an idle model-stage's offloaded or dropped state counts as
  resident 0 and as transient while it runs (its candidate rows say so, :mod:`nereus.cost`);
* stages share GPUs one after another; every stage places its model-stages from the same end of the
  pool ("aligned"), so the per-GPU bound is ``workspace + Σ_stage R_s + max_stage X_s ≤
  (1-headroom)·capacity``: an upper bound on every GPU's peak for any placement in which a GPU
  hosts at most one replica of each model-stage and distinct blocks of a stage do not share GPUs,
  so the placed plan always fits;
* ``L_step = Σ_stage T_s`` (synchronous) or ``max(T_gen, T_inf + T_train)`` (asynchronous,
  generation on GPUs of its own).

Algorithm (exact for this model):

1. per model-stage: candidates → frontier (the (GPUs, time) staircase of each memory class;
   :mod:`nereus.planner.candidates` says why the reduced concurrency and micro-batch sets are exact);
2. per stage, at a transient bound τ, its *staircase*: the least stage time for every resident
   bound, over its modes. Disjoint: at each resident level β (a resident value of the stage's
   rows) a min-max knapsack over the model-stages under the GPU budget, exactly the least ``T``
   among the staircase times with ``Σ_M N_M(T) ≤ budget`` (``N_M(T)``: fewest GPUs of M at time
   ≤ T under β, τ), solved for all levels at once; colocated: Pareto sums of the model-stages'
   (resident, time) staircases under τ (GPUs only need to fit the pool); mixed: the same
   knapsack with each block as one unit, its rows the block's (GPUs, resident, time) front
   (:func:`~nereus.planner.staircase._block_member`: members' rows combined one by one, dominated combinations dropped).
   A model-stage alone is its own staircase. Mixed partitions are searched in a second pass
   after the best plan without them, only those whose memory-free least stage time
   (:func:`memory_free_times`) plus the other stages' could beat it (:func:`promising_mixed`;
   that pass keeps only strictly better plans, so a plan without mixed placements is returned
   unchanged), and inside the staircase a partition is skipped when the earlier ones already
   match its GPU-unlimited bound at every resident level (:meth:`~nereus.planner.staircase._Group._no_better`). Blocks too
   large to combine (:data:`~nereus.planner.staircase.MIXED_MAX_COMBOS`, :data:`~nereus.planner.staircase.MIXED_MAX_ROWS`, checked once before the
   pass) leave that stage's mixed partitions unsearched: ``SearchResult.mixed_skipped`` names it,
   and the result is then exact over the other placements only;
3. over τ: the plan's largest transient ``X`` is one of the rows' transient values (levels
   ``x_1 < … < x_K``). For an interval of levels ``[x_a, x_b]`` the relaxation "transient ≤ x_b,
   Σ_s R_s ≤ usable - x_a" (a min-plus convolution of the stage staircases) bounds every plan whose
   ``X`` lies in the interval from below, and its minimizer, when it also satisfies
   ``Σ R + X ≤ usable``, is the best such plan. Best-first branch and bound over intervals: an
   infeasible minimizer (``X = x_k``, ``a < k``) splits the interval into ``[x_a, x_{k-1}]`` (its
   transient is too large there) and ``[x_k, x_b]`` (its resident is too large there), so every
   split cuts the minimizer off; the search stops when the smallest open bound reaches the best
   plan found. Every level lies in some interval, so no plan is lost. Staircases are cached per
   (each model-stage's count of its own transient levels ≤ τ, budget), shared by model-stages with
   one frontier (``actor.infer`` and ``reference.infer``). Asynchronous jobs run this per GPU budget
   left by each generation row of its (GPUs, time) staircase.

A second exact algorithm for all-disjoint jobs, a branch and bound over resident levels ``(β_s)``
with ``τ = usable - Σ β_s`` (the search before colocation), stays for cross-checks
(``_LEVEL_SEARCH``; :mod:`nereus.planner.level_search`). Messages when nothing fits come from
:mod:`nereus.planner.diagnose`. The partitions a stage's framework allows, and the memory-free bound
that decides which mixed ones get a knapsack, are in :mod:`nereus.planner.partitions`; the per-stage
staircases in :mod:`nereus.planner.staircase`.

Then :func:`nereus.planner.placement.place` assigns GPU ids, preferring the current plan's GPUs
(a mixed stage's blocks on GPUs of their own); the plan records nothing about modes: colocation
is visible as overlapping GPU sets in a stage (:func:`nereus.cost.model.stage_groups` finds the
blocks, and the cost model adds times inside a group and takes the max across groups).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from nereus.cost.model import FROZEN_MODELS, CostModel
from nereus.planner import partitions
from nereus.planner.candidates import COLUMNS, CandidateSet, enumerate_candidates, frontier
from nereus.planner.diagnose import diagnose_alone, diagnose_joint
from nereus.planner.level_search import _search_async, _search_sync, _Stage, generation_stair
from nereus.planner.partitions import (
    promising_mixed,
    stage_modes,
)
from nereus.planner.staircase import _convolve, _Group, _member, partition_mode
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["NoFeasiblePlan", "SearchResult", "plan_job", "search", "SearchOptions"]

GIB = 1024**3
#: candidate count above which a knapsack stage's frontier also drops rows dominated across memory
#: classes (below it the search's per-bound scans are cheaper than the prune)
CROSS_MIN_ROWS = 16384
#: use the resident-level branch and bound for all-disjoint jobs instead of the transient-bound
#: search (a second exact algorithm; tests compare the two)
_LEVEL_SEARCH = False


class NoFeasiblePlan(ValueError):
    """No plan fits the pool; ``diagnosis`` says how far the closest candidate is from fitting."""

    def __init__(self, message: str, diagnosis: dict | None = None):
        super().__init__(message)
        self.diagnosis = diagnosis or {}


@dataclass(frozen=True)
class SearchOptions:
    """Knobs of the search.

    Attributes:
        recompute_modes: override the workload's recompute choice (urgent path: ``("none","full")``).
        min_micro_batch: smallest training micro-batch to consider (1 lets the urgent path shrink).
        min_train_replicas: smallest DP degree of every ``*.train`` model-stage. With 2 or more,
            :func:`plan_job` also places those replicas on distinct nodes where the pool allows, so
            one node's loss leaves a live copy of the trainable state (``nereus.controller.risk``);
            the replicas are then unsharded (ZeRO stage 0): ZeRO shards the optimizer state over
            the DP ranks, so sharded replicas hold a single copy of it.

    Raises:
        ValueError: ``min_micro_batch`` or ``min_train_replicas`` below 1.
    """

    recompute_modes: tuple[str, ...] | None = None
    min_micro_batch: int = 1
    min_train_replicas: int = 1

    def __post_init__(self) -> None:
        for f in ("min_micro_batch", "min_train_replicas"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"search option {f!r} must be an integer >= 1, got {v!r}")


@dataclass
class SearchResult:
    """Chosen rows per model-stage and the search's bookkeeping."""

    choice: dict  # model-stage -> (CandidateSet, row)
    l_step: float
    frontiers: dict = field(default_factory=dict)
    candidates_enumerated: int = 0
    frontier_size: int = 0
    knapsacks: int = 0
    modes: dict = field(default_factory=dict)  # stage -> 'disjoint' | 'colocated' | 'mixed'
    blocks: dict = field(default_factory=dict)  # stage -> blocks: tuples of model-stage names sharing GPUs
    #: stages whose mixed placements could beat the plan found without them but were not searched
    #: (:data:`~nereus.planner.staircase.MIXED_MAX_COMBOS`); empty when the result is exact over every placement
    mixed_skipped: tuple = ()
    #: model-stage -> its enumerated candidates, with their op-class and memory terms
    #: (:meth:`~nereus.planner.candidates.CandidateSet.estimate_of`)
    enumerated: dict = field(default_factory=dict)


def search(cost: CostModel, pool_size: int, multi_node: bool,
           options: SearchOptions | None = None, full_frontiers: bool = False) -> SearchResult:
    """Exact search of the plan space on ``pool_size`` GPUs; see the module docstring.

    ``full_frontiers``: keep every model-stage's whole frontier in the result (for display,
    ``nereus plan --frontier``); by default a model-stage alone in its stage of a synchronous job
    is enumerated with the fewest-wave replica count per layout
    (:func:`~nereus.planner.candidates.enumerate_candidates`, ``gpus_free``), which loses no plan.

    Raises:
        NoFeasiblePlan: nothing fits; ``diagnosis`` names the closest miss.
    """
    options = options or SearchOptions()
    wf = cost.workflow
    usable = cost.usable
    asyn = wf.asynchronous and "generate" in wf.stages
    sets_all, fronts, memo = {}, {}, {}
    total = 0
    for ms in wf.model_stages:
        # Model-stages with the same shapes and stage cost the same (actor.infer and reference.infer);
        # the actor's train and generate stages differ by their side of the weight sync, and frozen
        # models (reference, reward) differ from the others when idle state may be dropped.
        key = (cost.model_of(ms), ms.stage, ms.model == "actor" and ms.stage != "infer",
               cost.memory_correction.get(ms.name, 1.0), _frozen(ms.model, cost), _offload_modes(cost, ms.name))
        if key not in memo:
            multi = len(wf.in_stage(ms.stage)) > 1
            # alone in its stage of a synchronous job, a model-stage's GPU count only has to fit the
            # pool: the enumeration keeps per layout the replica count with the fewest waves
            free = not multi and not asyn and not full_frontiers
            cs = enumerate_candidates(cost, ms, pool_size, multi_node, options.recompute_modes,
                                      options.min_micro_batch, options.min_train_replicas, gpus_free=free,
                                      drop_dominated=not full_frontiers)
            # the cross-class prune pays where a stage's knapsack scans many rows (2+ model-stages)
            memo[key] = (cs, frontier(cs, usable, cross=multi and len(cs) > CROSS_MIN_ROWS, alone=not multi))
        cs, fr = memo[key]
        total += len(cs)
        sets_all[ms.name] = CandidateSet(ms.name, **{f: getattr(cs, f) for f in COLUMNS}, detail=cs.detail)
        fronts[ms.name] = CandidateSet(ms.name, **{f: getattr(fr, f) for f in COLUMNS})
    empty = [m for m, f in fronts.items() if len(f) == 0]
    if empty:
        raise NoFeasiblePlan(diagnose_alone(cost, sets_all, empty, pool_size),
                             {"model_stages": empty, "kind": "alone"})
    modes = {s: stage_modes(cost, s) for s in wf.stages}
    shared: dict = {}
    skipped: list = []
    if _LEVEL_SEARCH and all(m == ("disjoint",) for s, m in modes.items()):
        stages = {s: _Stage(s, [fronts[m.name] for m in wf.in_stage(s)], pool_size) for s in wf.stages}
        if asyn:
            best = _search_async(stages, usable, pool_size)
        else:
            best = _search_sync(list(stages.values()), usable)
        knap = sum(s.calls for s in stages.values())
        if best is not None:
            best = (best[0], best[1], {s: tuple((m.name,) for m in wf.in_stage(s)) for s in wf.stages})
    else:
        parts = {s: partitions.stage_partitions(cost, s) for s in wf.stages}
        names = {s: [m.name for m in wf.in_stage(s)] for s in wf.stages}
        members = {s: [_member(shared, fronts[n]) for n in names[s]] for s in wf.stages}
        # first without mixed placements, then the mixed partitions that could beat that plan
        groups = {s: _Group(s, members[s], [p for p in parts[s] if partition_mode(p) != "mixed"], names[s])
                  for s in wf.stages}
        best = _tau_async(groups, usable, pool_size) if asyn else _tau_search(list(groups.values()), usable, pool_size)
        knap = sum(g.calls for g in groups.values())
        has_mixed = any(partition_mode(p) == "mixed" for ps in parts.values() for p in ps)
        kept = promising_mixed(parts, names, fronts, pool_size, best[0] if best else math.inf, asyn) \
            if has_mixed else {}
        groups2 = dict(groups)
        for st in list(kept):
            g2 = _Group(st, members[st], groups[st].parts + kept[st], names[st], usable)
            if g2.affordable(kept[st], pool_size):
                groups2[st] = g2
            else:
                del kept[st]
                skipped.append(st)
        if kept:
            if asyn:
                got = _tau_async(groups2, usable, pool_size)
            else:
                got = _tau_search(list(groups2.values()), usable, pool_size, best[0] if best else math.inf)
            if got is not None and (best is None or got[0] < best[0] * (1 - 1e-12)):
                best = got
            knap += sum(groups2[s].calls for s in kept)
    if best is None:
        raise NoFeasiblePlan(diagnose_joint(cost, fronts, pool_size), {"kind": "joint"})
    l_step, choice_rows, chosen_blocks = best
    choice = {}
    for st_name, rows in choice_rows.items():
        for m, row in zip(wf.in_stage(st_name), rows):
            choice[m.name] = (fronts[m.name], int(row))
    return SearchResult(choice=choice, l_step=l_step, frontiers=fronts, candidates_enumerated=total,
                        frontier_size=sum(len(f) for f in fronts.values()), knapsacks=knap,
                        modes={st: partition_mode(b) for st, b in chosen_blocks.items()},
                        blocks=dict(chosen_blocks), mixed_skipped=tuple(skipped), enumerated=sets_all)


def _offload_modes(cost: CostModel, name: str) -> tuple:
    return tuple(cost.job.framework.offload_modes(name))


def _frozen(model: str, cost: CostModel) -> bool:
    return model in FROZEN_MODELS and "drop" in cost.job.framework.offload


# ---------------------------------------------------------------------------------------------
# Search over the transient bound τ (any mix of disjoint and colocated stages)


def _tau_search(groups: list[_Group], usable: float, pool: int, bound: float = math.inf):
    """Exact best plan of the stages in ``groups`` run one after another on ``pool`` GPUs (see the
    module docstring): ``(l_step, {stage: rows}, {stage: mode})`` or None."""
    members = {id(m): m for g in groups for m in g.members}.values()
    xs, lo = [], 0.0
    for m in members:
        ok = m.fs.n <= pool
        if not ok.any():
            return None
        lo = max(lo, float(m.fs.x[ok].min()))
        xs.append(m.fs.x[ok])
    levels = np.unique(np.concatenate(xs))
    levels = levels[(levels >= lo) & (levels <= usable)]
    if levels.size == 0:
        return None
    best = None
    best_val = bound

    top = usable - float(levels[0])  # staircases are cached for the widest resident budget

    def evaluate(a: int, b: int):
        tau, cap = float(levels[b]), usable - float(levels[a])
        stairs = []
        for g in groups:
            st = g.stair(tau, pool, top)
            if st is None:
                return math.inf, None
            stairs.append(st)
        val, ent = _convolve(stairs, cap)
        return val, (None if ent is None else (stairs, ent))

    heap = []
    v, sol = evaluate(0, levels.size - 1)
    if sol is not None:
        heap.append((v, 0, levels.size - 1, sol))
    while heap:
        v, a, b, (stairs, ent) = heapq.heappop(heap)
        if v >= best_val * (1 - 1e-12):
            break
        R = sum(float(st[0][e]) for st, e in zip(stairs, ent))
        X = max(float(st[2][e]) for st, e in zip(stairs, ent))
        if R + X <= usable * (1 + 1e-12):
            best_val = v
            best = (v, {g.name: [int(r) for r in st[3][e]] for g, st, e in zip(groups, stairs, ent)},
                    {g.name: g.blocks_of(int(st[4][e])) for g, st, e in zip(groups, stairs, ent)})
            continue
        k = int(np.searchsorted(levels, X, side="left"))
        for ca, cb in ((a, k - 1), (k, b)):
            if ca > cb:
                continue
            cv, csol = evaluate(ca, cb)
            if csol is not None and cv < best_val * (1 - 1e-12):
                heapq.heappush(heap, (cv, ca, cb, csol))
    return best


def _tau_async(groups: dict, usable: float, pool_size: int):
    """Generation on its own GPUs; the other stages share the rest (τ search per budget)."""
    gen = groups["generate"]
    rest = [g for n, g in groups.items() if n != "generate"]
    g = gen.members[0].fs
    stair = generation_stair(g, usable)
    if stair.size == 0:
        return None
    best = None
    for row in stair:
        left = pool_size - int(g.n[row])
        if left < 1:
            break
        if best is not None and float(g.t[row]) >= best[0]:
            continue
        sub = _tau_search(rest, usable, left, best[0] if best else math.inf) if rest else (0.0, {}, {})
        if sub is None:
            continue
        val = max(float(g.t[row]), sub[0])
        if best is None or val < best[0]:
            rows = dict(sub[1])
            rows["generate"] = [int(row)]
            modes = dict(sub[2])
            modes["generate"] = gen.blocks_of(0)
            best = (val, rows, modes)
    return best


def plan_job(job: JobSpec, pool=None, current: Plan | None = None, cost: CostModel | None = None,
             options: SearchOptions | None = None, workflow=None) -> Plan:
    """The fastest feasible plan for ``job`` on ``pool`` (GPU ids; default: the whole cluster),
    placed on concrete GPUs and estimated.

    Args:
        current: the running plan; placement keeps its GPUs where the layout allows.
        cost: a (calibrated) cost model; a default one when None.
        options: urgent-path knobs (smaller micro-batches, forced recompute) and the redundancy
            of training state (``min_train_replicas``; replicas then go on distinct nodes).

    Raises:
        ValueError: bad pool.
        NoFeasiblePlan: nothing fits (a ValueError with ``diagnosis``).
    """
    from nereus.planner.placement import place

    cost = cost or CostModel(job, workflow=workflow)
    pool = job.cluster.check_pool(pool if pool is not None else job.cluster.all_gpus())
    multi = job.cluster.spans_nodes(pool)
    res = search(cost, len(pool), multi, options)
    mb = job.workload.mini_batch_size
    cands = [fs.candidate(row, mb) for fs, row in (res.choice[m.name] for m in cost.workflow.model_stages)]
    spread = frozenset(m.name for m in cost.workflow.model_stages
                       if m.stage == "train") if options is not None and options.min_train_replicas > 1 else frozenset()
    colocated = frozenset(s for s, m in res.modes.items() if m == "colocated")
    mixed = {s: res.blocks[s] for s, m in res.modes.items() if m == "mixed"}
    placed = place(cands, pool, job.cluster, cost.workflow, current, spread=spread, colocated=colocated,
                   blocks=mixed)
    # the chosen rows' estimates from the enumeration's arrays (the values estimate_candidate gives)
    known = {}
    for m in cost.workflow.model_stages:
        fs, row = res.choice[m.name]
        e = res.enumerated[m.name].estimate_of(fs, row) if m.name in res.enumerated else None
        if e is not None:
            known[m.name] = e
    return cost.estimate(Plan(candidates=tuple(placed)), pool, known=known)
