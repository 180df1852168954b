"""What-if of a user's own layout: evaluate fixed (tp, pp, dp) per model-stage next to the best plan.

``nereus plan --layout actor.train=2,2,2 actor.generate=4,1,4,c=128 ...`` and the verl / OpenRLHF
imports (:mod:`nereus.integrations`) share this code:

* :func:`parse_layout` reads ``MODEL_STAGE=TP,PP,DP[,b=B][,rc=...][,c=C][,z=Z][,off=O][,v=V]`` specs
  (``z`` ZeRO stage, ``off`` idle-state offload, ``v`` virtual pipeline stages) into candidates; what a spec leaves out is filled the way the frameworks do it: a training micro-batch
  is the largest ``b <= micro_batch_size`` dividing the per-replica mini-batch (``a = mini/(dp·b)``),
  recompute is the workload's (``auto``: none when it fits on its own, else full), an inference
  micro-batch is ``min(infer_micro_batch_size, ceil(B/dp))``, a generation concurrency the most
  sequences per replica whose KV cache fits on its GPUs next to the workspace and the resident state
  placed there (vLLM fills what its memory fraction leaves). Model-stages the specs
  do not name take the degrees and batch choices of Nereus's best plan.
* :func:`evaluate_layout` estimates placed candidates: step time (model-stages sharing GPUs within a
  stage run one after another), per-GPU peak memory (workspace + resident state of every
  model-stage on the GPU + the largest transient), and, for each model-stage whose fullest GPU is
  over the allowed bytes, by how much and its largest terms.
* :func:`whatif` places a parsed layout (model-stages of a stage on disjoint GPUs; with a framework
  that colocates, ``always`` or, under ``auto``, when they do not fit side by side, on one shared
  GPU set from the start of the pool, run one after another) and puts its evaluation next to the
  best plan with the predicted speedup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from nereus.cost.checks import check_candidate
from nereus.cost.memory import OFFLOAD_CODES
from nereus.cost.model import CostModel
from nereus.cost.shapes import valid_pp, valid_tp
from nereus.cost.step import engine_owned
from nereus.cost.vllm_startup import gpu_excess
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate, Plan
from nereus.workflow import ModelStage

__all__ = ["LayoutEval", "evaluate_layout", "shared_stages", "parse_layout", "whatif", "LAYOUT_SYNTAX"]

GIB = 1024**3
LAYOUT_SYNTAX = ("MODEL_STAGE=TP,PP,DP[,b=B][,rc=none|selective|full][,c=C][,z=ZERO][,off=none|host|drop|cpu_adam][,v=V], "
                 "e.g. actor.train=2,2,2,b=2,z=1")
_RECOMPUTE = ("none", "selective", "full")
_OFFLOAD = OFFLOAD_CODES
_OPTIONS = {"b": "micro-batch", "rc": "recompute", "c": "generation concurrency", "z": "ZeRO stage 0-3",
            "off": "offload none|host|drop|cpu_adam", "v": "virtual pipeline stages"}


@dataclass
class LayoutEval:
    """Predicted cost of a layout.

    Attributes:
        plan: the estimated plan (per-model-stage estimates, per-GPU memory).
        l_step: predicted seconds per RL step (model-stages sharing GPUs in a stage run one after
            another).
        stage_times: stage -> seconds.
        fits: every GPU within ``capacity`` (device memory less headroom).
        overflow: model-stage -> text naming the GPU, the bytes over and the largest terms.
        shared: stages whose model-stages share GPUs.
        over_bytes: model-stage -> bytes over ``capacity`` on its fullest GPU (only those over).
    """

    plan: Plan
    l_step: float
    stage_times: dict
    fits: bool
    overflow: dict
    shared: list
    over_bytes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        p = self.plan
        return {"l_step": self.l_step, "fits": self.fits, "stage_times": self.stage_times,
                "capacity_gib": p.capacity / GIB, "shared_stages": self.shared,
                "model_stages": {c.model_stage: {
                    "tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
                    "recompute": c.recompute, "concurrency": c.concurrency, "zero": c.zero, "offload": c.offload,
                    "vpp": c.vpp, "gpus": list(c.gpus),
                    "time_s": p.estimates[c.model_stage].time, "peak_gib": p.peak_memory[c.model_stage] / GIB,
                    "memory_gib": {k: v / GIB for k, v in p.estimates[c.model_stage].memory.items() if v > 0},
                    "overflow": self.overflow.get(c.model_stage),
                    "over_gib": self.over_bytes.get(c.model_stage, 0.0) / GIB} for c in p.candidates}}


def shared_stages(cands) -> list[str]:
    """Stages in which two model-stages use a common GPU."""
    out = []
    by_stage: dict = {}
    for c in cands:
        by_stage.setdefault(ModelStage.parse(c.model_stage).stage, []).append(c)
    for st, cs in by_stage.items():
        seen: set = set()
        for c in cs:
            if seen & set(c.gpus):
                out.append(st)
                break
            seen |= set(c.gpus)
    return out


def evaluate_layout(job: JobSpec, cands, headroom: float | None = None,
                    cost: CostModel | None = None) -> LayoutEval:
    """Step time and per-GPU memory of placed candidates (module docstring).

    Raises:
        ValueError: a candidate the model cannot shard (named by the cost model).
    """
    cost = cost or CostModel(job, headroom=headroom)
    plan = cost.estimate(Plan(candidates=tuple(cands)))
    per_stage: dict = {}
    for c in plan.candidates:
        st = ModelStage.parse(c.model_stage).stage
        per_gpu = per_stage.setdefault(st, {})
        for g in c.gpus:
            per_gpu[g] = per_gpu.get(g, 0.0) + plan.estimates[c.model_stage].time
    stage_times = {st: max(v.values()) if v else 0.0 for st, v in per_stage.items()}
    if job.workload.asynchronous:
        l_step = max(stage_times.get("generate", 0.0), stage_times.get("infer", 0.0) + stage_times.get("train", 0.0))
    else:
        l_step = sum(stage_times.values())
    overflow, over_bytes = {}, {}
    # vLLM's pre-allocated engine is exact; the headroom applies to the other bytes (cost/vllm_startup.py)
    excess = gpu_excess(job, plan, cost.headroom, cost.workspace, engine_owned(plan, job.framework))
    for c in plan.candidates:
        worst = max(c.gpus, key=lambda g: excess[g])
        over = excess[worst]
        if over <= 0:
            continue
        over_bytes[c.model_stage] = over
        own = plan.estimates[c.model_stage].memory
        terms = sorted(((k, v) for k, v in own.items() if v > 0), key=lambda kv: -kv[1])
        others = [o for o in plan.candidates if o is not c and worst in o.gpus]
        co = sum(plan.estimates[o.model_stage].resident for o in others)
        overflow[c.model_stage] = (
            f"GPU {worst} needs {plan.gpu_memory[worst] / GIB:.1f} GiB, {over / GIB:.1f} GiB over the "
            f"{plan.capacity / GIB:.1f} GiB allowed; largest own terms "
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in terms[:3])
            + (f"; co-resident {', '.join(o.model_stage for o in others)} {co / GIB:.1f} GiB" if others else "")
            + f"; workspace {cost.workspace / GIB:.1f} GiB")
    plan = Plan(candidates=plan.candidates, estimates=plan.estimates, l_step=l_step, peak_memory=plan.peak_memory,
                gpu_memory=plan.gpu_memory, capacity=plan.capacity,
                throughput=job.workload.global_batch * job.workload.response_len / l_step if l_step > 0 else 0.0)
    return LayoutEval(plan=plan, l_step=l_step, stage_times=stage_times, fits=not overflow, overflow=overflow,
                      shared=shared_stages(plan.candidates), over_bytes=over_bytes)


def _int(spec: str, name: str, what: str, v: str) -> int:
    if not v.strip().isdigit() or int(v) < 1:
        raise ValueError(f"--layout {spec!r}: {what} {name} = {v!r} must be an integer >= 1 ({LAYOUT_SYNTAX})")
    return int(v)


def _split(spec: str, names: list[str]) -> tuple[str, tuple[int, int, int], dict]:
    if "=" not in spec:
        raise ValueError(f"--layout {spec!r}: expected {LAYOUT_SYNTAX}")
    name, rest = spec.split("=", 1)
    name = name.strip()
    if name not in names:
        raise ValueError(f"--layout {spec!r}: model-stage {name!r} is not in the job's workflow; valid: {names}")
    parts = [x.strip() for x in rest.split(",")]
    degrees = [x for x in parts if "=" not in x]
    if len(degrees) != 3 or parts[:3] != degrees:
        raise ValueError(f"--layout {spec!r}: give the three degrees tp,pp,dp first ({LAYOUT_SYNTAX})")
    tp, pp, dp = (_int(spec, k, "degree", v) for k, v in zip(("tp", "pp", "dp"), degrees))
    opts: dict = {}
    for x in parts[3:]:
        k, v = (y.strip() for y in x.split("=", 1))
        if k not in _OPTIONS or k in opts:
            raise ValueError(f"--layout {spec!r}: option {k!r} is unknown or repeated; valid: "
                             + ", ".join(f"{o} ({d})" for o, d in _OPTIONS.items()))
        if k == "rc":
            if v not in _RECOMPUTE:
                raise ValueError(f"--layout {spec!r}: rc = {v!r} must be one of {list(_RECOMPUTE)}")
            opts[k] = v
        elif k == "off":
            if v not in _OFFLOAD:
                raise ValueError(f"--layout {spec!r}: off = {v!r} must be one of {list(_OFFLOAD)}")
            opts[k] = v
        elif k == "z":
            if v not in ("0", "1", "2", "3"):
                raise ValueError(f"--layout {spec!r}: z = {v!r} must be a ZeRO stage 0, 1, 2 or 3")
            opts[k] = int(v)
        else:
            opts[k] = _int(spec, k, "option", v)
    return name, (tp, pp, dp), opts


def _fits_alone(cost: CostModel, cand: Candidate) -> bool:
    return cost.estimate_candidate(cand).peak_own <= cost.usable


def _fill(cost: CostModel, spec: str, ms: ModelStage, degrees, opts) -> Candidate:
    """A candidate of ``ms`` with the given degrees; batch choices from ``opts`` or the defaults."""
    tp, pp, dp = degrees
    model = cost.model_of(ms)
    why = valid_tp(model, tp) or valid_pp(model, pp, uneven=cost.job.framework.uneven_pp)
    if why:
        raise ValueError(f"--layout {spec!r}: {why}")
    valid = {"train": ("b", "rc", "z", "off", "v"), "infer": ("b", "off"), "generate": ("c", "off")}[ms.stage]
    bad = [k for k in opts if k not in valid]
    if bad:
        raise ValueError(f"--layout {spec!r}: option(s) {bad} do not apply to a {ms.stage} model-stage; "
                         f"valid: {list(valid)}")
    extra = {"offload": opts.get("off", "none")}
    if ms.stage == "train":
        extra |= {"zero": opts.get("z", 0), "vpp": opts.get("v", 1)}
    return _checked(cost, spec, ms, _fill_batches(cost, spec, ms, degrees, opts, extra))


def _checked(cost: CostModel, spec: str, ms: ModelStage, cand: Candidate) -> Candidate:
    """``cand`` when the cost model accepts it; else ValueError naming the spec."""
    try:
        check_candidate(cost.job, ms, cand)
    except ValueError as e:
        raise ValueError(f"--layout {spec!r}: {e}") from e
    return cand


def _fill_batches(cost: CostModel, spec: str, ms: ModelStage, degrees, opts, extra) -> Candidate:
    w = cost.job.workload
    tp, pp, dp = degrees
    name = ms.name
    if ms.stage == "train":
        mini = w.mini_batch_size
        if mini % dp:
            raise ValueError(f"--layout {spec!r}: dp={dp} does not divide the job's mini_batch_size {mini}; valid: "
                             f"a dp dividing {mini}")
        per = mini // dp
        b = opts.get("b") or next(x for x in range(min(w.micro_batch_size, per), 0, -1) if per % x == 0)
        if per % b:
            raise ValueError(f"--layout {spec!r}: b={b} does not divide the {per} sequences per replica "
                             f"(mini_batch_size {mini} / dp {dp}); valid: a micro-batch dividing {per}")
        base = Candidate(name, tp, pp, dp, micro_batch=b, grad_accum=per // b, **extra)
        if "rc" in opts or w.recompute != "auto":
            return replace(base, recompute=opts.get("rc", w.recompute))
        _checked(cost, spec, ms, base)
        return base if _fits_alone(cost, base) else replace(base, recompute="full")
    if ms.stage == "infer":
        b = opts.get("b") or min(w.infer_micro_batch_size, -(-w.global_batch // dp))
        return Candidate(name, tp, pp, dp, micro_batch=b, **extra)
    # no c: 0 marks "as many as fit once placed" (whatif sizes it next to the co-resident state)
    return Candidate(name, tp, pp, dp, concurrency=opts.get("c", 0), **extra)


def _size_concurrency(cost: CostModel, placed: list[Candidate]) -> list[Candidate]:
    """Generation candidates placed with concurrency 0 get the most sequences per replica whose KV
    cache and working set fit on every one of their GPUs next to the workspace and the resident state
    of every model-stage there (vLLM fills what its memory fraction leaves); at least 1."""
    est = {c.model_stage: cost.estimate_candidate(c if c.concurrency or ModelStage.parse(c.model_stage).stage
                                                  != "generate" else replace(c, concurrency=1))
           for c in placed}
    resident: dict = {}
    for c in placed:
        for g in c.gpus:
            resident[g] = resident.get(g, 0.0) + est[c.model_stage].resident
    out = []
    for c in placed:
        ms = cost.workflow.get(c.model_stage)
        if ms.stage != "generate" or c.concurrency:
            out.append(c)
            continue
        room = min(cost.capacity - cost.workspace - resident[g] for g in c.gpus)
        seqs = -(-cost.job.workload.rollouts_per_step // c.dp)
        cs = np.arange(1, seqs + 1)
        a = cost.candidate_arrays(ms, c.tp, c.pp, np.full(cs.shape, c.dp), concurrency=cs,
                                  offload=_OFFLOAD.index(c.offload))
        ok = np.nonzero(np.asarray(a["transient"]) <= room)[0]
        out.append(replace(c, concurrency=int(cs[ok[-1]]) if ok.size else 1))
    return out


def parse_layout(cost: CostModel, specs, best: Plan | None = None) -> tuple[tuple[Candidate, ...], list[str]]:
    """Candidates (unplaced, in workflow order) for ``specs`` (module docstring) and the names of the
    model-stages taken from ``best``.

    Raises:
        ValueError: a malformed spec, an unknown or repeated model-stage, degrees the model cannot take,
            a batch that does not split, or model-stages left out with no best plan to take them from
            (each one line naming the spec, the field, the value and what is valid).
    """
    wf = cost.workflow
    names = [m.name for m in wf.model_stages]
    given: dict = {}
    for spec in specs:
        name, degrees, opts = _split(spec, names)
        if name in given:
            raise ValueError(f"--layout {spec!r}: model-stage {name!r} is given twice")
        given[name] = _fill(cost, spec, wf.get(name), degrees, opts)
    missing = [n for n in names if n not in given]
    if missing and best is None:
        raise ValueError(f"--layout: Nereus found no plan to fill the model-stages left out, so name every one; "
                         f"missing {missing}")
    cands = tuple(given[n] if n in given else best[n].with_gpus(()) for n in names)
    return cands, missing


def whatif(job: JobSpec, specs, cost: CostModel | None = None, pool=None,
           best: Plan | None = None) -> tuple[dict, LayoutEval]:
    """The user's layout (``specs``) placed, evaluated and set next to ``best`` (Nereus's plan; found
    here when None and one exists). Returns the evaluation and a JSON-ready report: ``layout`` (the evaluation, see
    :meth:`LayoutEval.to_dict`, plus ``from_nereus``), ``nereus`` (feasible, plan or reason) and
    ``speedup`` (user L_step / best L_step) when the layout fits.

    Raises:
        ValueError: a bad spec (:func:`parse_layout`) or a stage that needs more GPUs than the pool.
    """
    from nereus.planner.placement import PlacementError, place
    from nereus.planner.search import NoFeasiblePlan, plan_job

    cost = cost or CostModel(job)
    pool = job.cluster.check_pool(pool if pool is not None else job.cluster.all_gpus())
    out: dict = {}
    if best is None:
        try:
            best = plan_job(job, pool=pool, cost=cost)
        except NoFeasiblePlan as e:
            out["nereus"] = {"feasible": False, "reason": str(e)}
    if best is not None:
        out["nereus"] = {"feasible": True, "plan": best.to_dict(), "l_step": best.l_step}
    cands, from_best = parse_layout(cost, specs, best)
    colocate = job.framework.colocate
    shared: set = set()
    for st in cost.workflow.stages:
        members = [c for c in cands if ModelStage.parse(c.model_stage).stage == st]
        need = sum(c.num_gpus for c in members)
        big = max((c.num_gpus for c in members), default=0)
        if len(members) > 1 and (colocate == "always" or (colocate == "auto" and need > len(pool))):
            shared.add(st)
            need = big
        if need > len(pool):
            names = [f"{c.model_stage} ({c.num_gpus})" for c in members]
            how = ("colocated model-stages share GPUs, so the largest counts" if st in shared else
                   "model-stages of a stage run on disjoint GPUs" + ("" if colocate != "never" else
                                                                     "; the job's framework does not colocate"))
            raise ValueError(f"--layout: stage {st!r} needs {need} GPUs ({', '.join(names)}; {how}), "
                             f"the pool has {len(pool)}")
    try:
        placed = place([c for c in cands if ModelStage.parse(c.model_stage).stage not in shared], pool,
                       job.cluster, cost.workflow)
    except PlacementError as e:
        raise ValueError(f"--layout: {e}") from e
    order = sorted(pool)
    placed += [c.with_gpus(order[:c.num_gpus]) for c in cands if ModelStage.parse(c.model_stage).stage in shared]
    placed.sort(key=lambda c: [m.name for m in cost.workflow.model_stages].index(c.model_stage))
    ev = evaluate_layout(job, _size_concurrency(cost, placed), cost=cost)
    out["layout"] = ev.to_dict() | {"from_nereus": from_best}
    if best is not None and ev.fits and math.isfinite(ev.l_step) and best.l_step > 0:
        out["speedup"] = ev.l_step / best.l_step
    return out, ev
