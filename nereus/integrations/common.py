"""What the verl and OpenRLHF integrations share: an imported configuration, layout evaluation, the
comparison with Nereus's best plan, and the search for the closest plan a framework can express.

An import (:class:`Imported`) is a Nereus job plus the user's own layout as placed candidates (one
per model-stage, with the GPUs the framework puts it on) and the list of settings Nereus's plan
space cannot express yet (:class:`Unexpressible`: colocation of model-stages of one stage on the
same GPUs, FSDP / ZeRO sharding, offload, context parallelism...). A layout with no such setting is
evaluated by the cost model (:func:`evaluate_layout`); one with any is not evaluated: the report
names each setting instead of guessing.

Exports evaluate layouts in which model-stages of one stage share GPUs (verl runs every role on
one resource pool): such model-stages run one after another, so a stage takes, on its busiest GPU,
the sum of the times of the model-stages placed there (:func:`evaluate_layout` with
``allow_shared=True``). Per-GPU memory is the cost model's: workspace, the resident state of every
model-stage on the GPU, and the largest transient among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.cost.memory import stage_memory
from nereus.cost.model import CostModel
from nereus.planner.plan import Candidate, Plan
from nereus.spec.job import JobSpec
from nereus.workflow import ModelStage, workflow_for

__all__ = ["Unexpressible", "Imported", "LayoutEval", "evaluate_layout", "compare", "layout_key",
           "generation_concurrency", "memory_fraction_for", "GIB"]

GIB = 1024**3


@dataclass(frozen=True)
class Unexpressible:
    """A setting of the user's configuration that Nereus's plan space cannot express yet."""

    key: str
    value: object
    why: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}: {self.why}"

    def to_dict(self) -> dict:
        return {"key": self.key, "value": self.value if isinstance(self.value, (int, float, str, bool))
                or self.value is None else str(self.value), "why": self.why}


@dataclass
class Imported:
    """A framework configuration read as a Nereus job and the user's layout.

    Attributes:
        framework: ``verl`` or ``openrlhf``.
        job: the job (model, cluster, workload).
        layout: one placed candidate per model-stage of the job's workflow, as the framework runs it.
        unexpressible: settings outside Nereus's plan space (empty when the layout is evaluable).
        read: every configuration key Nereus read, with the value it used.
        notes: approximations made while reading (a maximum length used as the mean...).
    """

    framework: str
    job: JobSpec
    layout: tuple[Candidate, ...]
    unexpressible: list[Unexpressible] = field(default_factory=list)
    read: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def expressible(self) -> bool:
        return not self.unexpressible


def layout_key(cands) -> list[tuple]:
    """Comparable layout: per model-stage (name, tp, pp, dp, b, a, recompute, concurrency, GPUs)."""
    return sorted((c.model_stage, c.tp, c.pp, c.dp, c.micro_batch, c.grad_accum, c.recompute, c.concurrency,
                   tuple(sorted(c.gpus))) for c in cands)


def _gen_memory(job: JobSpec, tp: int, concurrency: int) -> tuple[float, float]:
    """(weights, KV bytes for ``concurrency`` sequences) per GPU of a generation replica with ``tp``."""
    m = stage_memory("generate", job.actor, job.workload, tp, 1, concurrency=concurrency)
    return float(m["weights"]), float(m["kv_cache"])


def generation_concurrency(job: JobSpec, tp: int, fraction: float, max_seqs: int | None = None) -> int:
    """Sequences one vLLM engine of TP ``tp`` holds at once when it may use ``fraction`` of each
    GPU's memory for weights and KV cache: ``floor((fraction · memory − weights/tp) / KV per sequence)``,
    capped by ``max_seqs`` and by the rollouts one engine gets; 0 when the weights alone do not fit."""
    w, kv1 = _gen_memory(job, tp, 1)
    room = fraction * job.cluster.gpu.memory_bytes - w
    c = int(room // kv1) if room > 0 else 0
    if max_seqs is not None:
        c = min(c, int(max_seqs))
    return c


def memory_fraction_for(job: JobSpec, tp: int, concurrency: int) -> float:
    """Smallest vLLM ``gpu_memory_utilization`` (rounded up to 0.01) holding the weights and the KV
    cache of ``concurrency`` sequences."""
    w, kv = _gen_memory(job, tp, concurrency)
    frac = (w + kv) / job.cluster.gpu.memory_bytes
    return min(0.99, int(frac * 100 + 0.999999) / 100 + 0.01)


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
    """

    plan: Plan
    l_step: float
    stage_times: dict
    fits: bool
    overflow: dict
    shared: list

    def to_dict(self) -> dict:
        p = self.plan
        return {"l_step": self.l_step, "fits": self.fits, "stage_times": self.stage_times,
                "capacity_gib": p.capacity / GIB, "shared_stages": self.shared,
                "model_stages": {c.model_stage: {
                    "tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
                    "recompute": c.recompute, "concurrency": c.concurrency, "gpus": list(c.gpus),
                    "time_s": p.estimates[c.model_stage].time, "peak_gib": p.peak_memory[c.model_stage] / GIB,
                    "memory_gib": {k: v / GIB for k, v in p.estimates[c.model_stage].memory.items() if v > 0},
                    "overflow": self.overflow.get(c.model_stage)} for c in p.candidates}}


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


def evaluate_layout(job: JobSpec, cands, headroom: float = 0.1, cost: CostModel | None = None) -> LayoutEval:
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
    overflow = {}
    for c in plan.candidates:
        worst = max(c.gpus, key=lambda g: plan.gpu_memory[g])
        over = plan.gpu_memory[worst] - plan.capacity
        if over <= 0:
            continue
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
                      shared=shared_stages(plan.candidates))


def compare(imp: Imported, headroom: float = 0.1, pool=None) -> dict:
    """The user's layout (evaluated, or the settings that are not expressible yet) next to Nereus's best
    plan for the same job and the predicted speedup. JSON-ready."""
    from nereus.planner.search import NoFeasiblePlan, plan_job

    out: dict = {"framework": imp.framework, "job": imp.job.to_dict(), "read": imp.read, "notes": imp.notes,
                 "user": {"expressible": imp.expressible,
                          "not_expressible": [u.to_dict() for u in imp.unexpressible],
                          "layout": [{"model_stage": c.model_stage, "tp": c.tp, "pp": c.pp, "dp": c.dp,
                                      "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
                                      "recompute": c.recompute, "concurrency": c.concurrency,
                                      "gpus": list(c.gpus)} for c in imp.layout]}}
    user = None
    if imp.expressible:
        user = evaluate_layout(imp.job, imp.layout, headroom)
        out["user"]["evaluation"] = user.to_dict()
    try:
        best = plan_job(imp.job, pool=pool, cost=CostModel(imp.job, headroom=headroom))
        out["nereus"] = {"feasible": True, "plan": best.to_dict(), "l_step": best.l_step}
        if user is not None and user.fits:
            out["speedup"] = user.l_step / best.l_step
    except NoFeasiblePlan as e:
        out["nereus"] = {"feasible": False, "reason": str(e)}
    return out


def check_workflow(job: JobSpec, cands, framework: str) -> None:
    """The layout covers exactly the job's workflow (an importer's own consistency check)."""
    want = sorted(m.name for m in workflow_for(job.workload).model_stages)
    have = sorted(c.model_stage for c in cands)
    if want != have:  # pragma: no cover - importers build the layout from the workflow
        raise ValueError(f"{framework} import: layout model-stages {have} do not match the workflow {want}")
