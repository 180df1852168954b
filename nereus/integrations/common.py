"""What the verl and OpenRLHF integrations share: an imported configuration, layout evaluation, the
comparison with Nereus's best plan, and the search for the closest plan a framework can express.

An import (:class:`Imported`) is a Nereus job (with the framework's features as its
:class:`~nereus.spec.framework.FrameworkSpec`) plus the user's own layout as placed candidates (one
per model-stage, with the GPUs the framework puts it on, ZeRO stage, idle-state offload and
interleaving) and the list of settings the cost model cannot express (:class:`Unexpressible`:
context / Ulysses parallelism, token-budget micro-batches, MoE, asynchronous trainer modes...). A
layout with no such setting is evaluated by the cost model (:func:`evaluate_layout`, which lives in
:mod:`nereus.planner.whatif` and also serves ``nereus plan --layout``); one with any is not
evaluated: the report names each setting instead of guessing.

Model-stages of one stage whose GPU sets intersect (verl's hybrid engine, OpenRLHF's colocation
flags) run one after another: a stage takes, on its busiest GPU, the sum of the times of the
model-stages placed there. Per-GPU memory is the cost model's: workspace, the resident state of every
model-stage on the GPU, and the largest transient among them (offloaded or dropped state is
transient). :func:`best_colocated` picks, for exports, one option per group of model-stages that all
share the same GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nereus.cost.memory import WORKSPACE_BYTES, stage_memory
from nereus.cost.model import CostModel
from nereus.planner.whatif import evaluate_layout
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.workflow import workflow_for

__all__ = ["Unexpressible", "Imported", "compare", "layout_key", "generation_concurrency",
           "memory_fraction_for", "without_fraction", "best_colocated", "pareto", "GIB", "launch_text", "launch_error",
           "model_override_notes"]

GIB = 1024**3


@dataclass(frozen=True)
class Unexpressible:
    """A setting of the user's configuration that the cost model cannot express."""

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
    #: what the user gave, for exports that keep their settings: verl ``{"config", "overrides"}``,
    #: OpenRLHF ``{"args": tokens}``; None when the import came from a dict
    source: dict | None = None

    @property
    def expressible(self) -> bool:
        return not self.unexpressible


def layout_key(cands) -> list[tuple]:
    """Comparable layout: per model-stage (name, tp, pp, dp, b, a, recompute, concurrency, zero, offload,
    vpp, GPUs)."""
    return sorted(c.key() + (tuple(sorted(c.gpus)),) for c in cands)


def candidate_dict(c: Candidate) -> dict:
    return {"model_stage": c.model_stage, "tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum, "recompute": c.recompute, "concurrency": c.concurrency, "zero": c.zero,
            "offload": c.offload, "vpp": c.vpp, "gpus": list(c.gpus)} | ({"cp": c.cp} if c.cp > 1 else {})


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
    """Smallest vLLM ``gpu_memory_utilization`` (rounded up to 0.01, plus 0.01) whose pre-allocation
    (:mod:`nereus.cost.vllm_memory`) holds the per-GPU workspace, the weights, the profiled
    activations and logits, and the KV cache of ``concurrency`` sequences at the memory length, so the
    engine imported back with it decodes ``concurrency`` sequences at once."""
    m = stage_memory("generate", job.actor, job.workload, tp, 1, concurrency=concurrency)
    need = WORKSPACE_BYTES + m["weights"] + m["kv_cache"] + m["activations"] + m["logits"]
    frac = need / job.cluster.gpu.memory_bytes
    # whole hundredths: ``int(..) / 100 + 0.01`` alone prints as 0.41000000000000003 in an export
    return round(min(0.99, int(frac * 100 + 0.999999) / 100 + 0.01), 2)


def without_fraction(job: JobSpec) -> JobSpec:
    """``job`` with vLLM's fraction left to the planner (``rollout_memory_fraction`` unset): Nereus's
    own plans and exports size the engine and write the fraction they need. Generation by the
    training engine (``framework.train_engine_generation``, OpenRLHF's non-Ray ``train_ppo``) is
    turned off too: Nereus's plans and the OpenRLHF export (``train_ppo_ray``) generate with vLLM."""
    from dataclasses import replace

    if job.framework.train_engine_generation:
        job = replace(job, framework=replace(job.framework, train_engine_generation=False))
    if job.workload.rollout_memory_fraction is None:
        return job
    return job.with_workload(replace(job.workload, rollout_memory_fraction=None))


def compare(imp: Imported, headroom: float | None = None, pool=None) -> dict:
    """The user's layout (evaluated, or the settings that are not expressible yet) next to Nereus's best
    plan for the same job and the predicted speedup. JSON-ready."""
    from nereus.planner.search import NoFeasiblePlan, plan_job

    out: dict = {"framework": imp.framework, "job": imp.job.to_dict(), "read": imp.read, "notes": imp.notes,
                 "user": {"expressible": imp.expressible,
                          "not_expressible": [u.to_dict() for u in imp.unexpressible],
                          "layout": [candidate_dict(c) for c in imp.layout]}}
    user = None
    if imp.expressible:
        user = evaluate_layout(imp.job, imp.layout, headroom)
        out["user"]["evaluation"] = user.to_dict()
    try:
        njob = without_fraction(imp.job)
        best = plan_job(njob, pool=pool, cost=CostModel(njob, headroom=headroom))
        out["nereus"] = {"feasible": True, "plan": best.to_dict(), "l_step": best.l_step}
        if user is not None and user.fits:
            out["speedup"] = user.l_step / best.l_step
    except NoFeasiblePlan as e:
        out["nereus"] = {"feasible": False, "reason": str(e)}
    return out


def pareto(items):
    """Keep the ``(time, resident, transient, payload)`` items no other beats on all three."""
    items = sorted(items, key=lambda x: (x[0], x[1], x[2]))
    kept: list = []
    for it in items:
        if not any(k[0] <= it[0] and k[1] <= it[1] and k[2] <= it[2] for k in kept):
            kept.append(it)
    return kept


def _front(t, r, choice):
    """Rows of (time, resident) no other row beats on both (ties: the first)."""
    order = np.lexsort((t, r))
    t, r, choice = t[order], r[order], choice[order]
    before = np.concatenate([[np.inf], np.minimum.accumulate(t)[:-1]])
    keep = t < before
    return t[keep], r[keep], choice[keep]


def best_colocated(groups, usable: float):
    """One option per group, all on the same GPUs, with the least total time that fits.

    ``groups``: lists of ``(time, resident, transient, payload)`` options (a group's model-stages run
    one after another on every GPU of the pool). A choice fits when ``Σ resident + max transient <=
    usable`` (the cost model's per-GPU peak less the workspace). Exact: for each transient bound ``X``
    among the options', every group keeps its options with transient ``<= X``, the groups' (time,
    resident) Pareto fronts are merged pairwise and the fastest with ``Σ resident <= usable - X`` is
    kept; the best over all ``X`` is the optimum (at the optimum's own largest transient the bound is
    exact, at any other it is conservative).

    Returns:
        ``(total time, [payload per group])`` or None when nothing fits.
    """
    if not groups or any(not g for g in groups):
        return None
    arrs = [(np.array([o[0] for o in g], dtype=float), np.array([o[1] for o in g], dtype=float),
             np.array([o[2] for o in g], dtype=float)) for g in groups]
    bounds = np.unique(np.concatenate([a[2] for a in arrs]))
    best = None
    for x in bounds[bounds <= usable]:
        budget = usable - x
        t = r = choice = None
        for gt, gr, gx in arrs:
            ok = np.nonzero((gx <= x) & (gr <= budget))[0]
            if not ok.size:
                t = None
                break
            if t is None:
                t, r, choice = _front(gt[ok], gr[ok], ok[:, None])
                continue
            tt = (t[:, None] + gt[ok][None, :]).reshape(-1)
            rr = (r[:, None] + gr[ok][None, :]).reshape(-1)
            cc = np.concatenate([np.repeat(choice, len(ok), axis=0), np.tile(ok, len(t))[:, None]], axis=1)
            fit = rr <= budget
            if not fit.any():
                t = None
                break
            t, r, choice = _front(tt[fit], rr[fit], cc[fit])
        if t is None:
            continue
        i = int(np.argmin(t))
        if best is None or t[i] < best[0]:
            best = (float(t[i]), [groups[g][int(k)][3] for g, k in enumerate(choice[i])])
    return best


def check_workflow(job: JobSpec, cands, framework: str) -> None:
    """The layout covers exactly the job's workflow (an importer's own consistency check)."""
    want = sorted(m.name for m in workflow_for(job.workload).model_stages)
    have = sorted(c.model_stage for c in cands)
    if want != have:  # pragma: no cover - importers build the layout from the workflow
        raise ValueError(f"{framework} import: layout model-stages {have} do not match the workflow {want}")


def launch_text(value: str, flag: str) -> str:
    """``value``, or the text of the launch script it names (one word that is an existing file), so
    ``--from-openrlhf run.sh`` reads the script like ``--from-verl run.sh``.

    Raises:
        ValueError: the file cannot be read (``flag`` and the path named).
    """
    from pathlib import Path

    v = str(value).strip()
    if not v or any(c.isspace() for c in v):
        return value
    p = Path(v).expanduser()
    if not p.is_file():
        return value
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {v!r}: cannot read the launch script: {e}") from None


#: shlex's own messages (``shlex.shlex.read_token``) for a line it cannot split, with what causes each
_SHLEX = {"No closing quotation": "an unmatched ' or \" quote",
          "No escaped character": "a backslash with nothing after it (the last line of a "
                                  "continued command ends in \\)"}


def launch_error(err: ValueError, flag: str, text) -> ValueError:
    """``err`` with context when it is shlex's bare message for a launch line it could not split: the
    flag, the start of the input and the usual cause; else ``err`` itself."""
    why = _SHLEX.get(str(err))
    if why is None:
        return err
    head = " ".join(str(text if isinstance(text, str) else " ".join(map(str, text))).split())
    head = head[:80] + ("..." if len(head) > 80 else "")
    return ValueError(f"{flag} {head!r}: cannot split the launch line into words ({err}): look for {why}")


def model_override_notes(notes: list[str], model, keys=("actor_rollout_ref.model.path=", "--actor.model_name_or_path ")):
    """``notes`` with the "not a key Nereus reads; ignored" note of the framework's model path (one of
    ``keys``) replaced by what happened: ``--model`` overrode it, and where the shapes came from."""
    if model is None:
        return notes
    src = model if isinstance(model, str) else getattr(model, "name", str(model))
    out = []
    for n in notes:
        if n.startswith(keys) and n.endswith(("not a key Nereus reads; ignored", "not an option Nereus reads; ignored")):
            n = n.rsplit(": not a", 1)[0] + f": overridden by --model (shapes read from {src})"
        out.append(n)
    return out
