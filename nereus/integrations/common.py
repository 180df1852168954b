"""What the verl and OpenRLHF integrations share: an imported configuration, layout evaluation, the
comparison with Nereus's best plan, and the search for the closest plan a framework can express.

An import (:class:`Imported`) is a Nereus job plus the user's own layout as placed candidates (one
per model-stage, with the GPUs the framework puts it on) and the list of settings Nereus's plan
space cannot express yet (:class:`Unexpressible`: colocation of model-stages of one stage on the
same GPUs, FSDP / ZeRO sharding, offload, context parallelism...). A layout with no such setting is
evaluated by the cost model (:func:`evaluate_layout`, which lives in :mod:`nereus.planner.whatif`
and also serves ``nereus plan --layout``); one with any is not evaluated: the report names each
setting instead of guessing.

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
from nereus.planner.plan import Candidate
from nereus.planner.whatif import LayoutEval, evaluate_layout, shared_stages
from nereus.spec.job import JobSpec
from nereus.workflow import workflow_for

__all__ = ["Unexpressible", "Imported", "LayoutEval", "evaluate_layout", "shared_stages", "compare", "layout_key",
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


def compare(imp: Imported, headroom: float | None = None, pool=None) -> dict:
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
