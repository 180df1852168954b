"""Checks of a plan read from a file against its job, and of two jobs against each other.

A plan file (``docs/files.md``) is data a person may have edited, so before anything schedules it:

* its model-stages are exactly the workflow's (``nereus.workflow.workflow_for``), or a subset of
  them where a caller allows partial plans (``nereus transition`` does: it moves those alone);
* every layout is legal for the model: TP divides the query heads and the MLP width and divides, or
  is a multiple of, the KV heads; PP divides the layers (``nereus.cost.shapes``);
* batch rules: a training model-stage has ``dp·b·a = mini_batch_size`` with ``b, a >= 1``; an
  inference model-stage a micro-batch ``b >= 1``; generation a concurrency ``>= 1``; under a
  framework with ``even_dp`` an inference or generation dp divides its rows (``even_dp_rows``);
* GPU ids lie in its cluster (``0 .. nodes·gpus_per_node - 1``) and the set has ``tp·pp·dp`` ids.

Two plans are transitioned only between jobs of the same model (shapes), algorithm, batch sizes and
GPU type with the same GPUs per node; the clusters may differ in nodes (growing or shrinking) and the
prompt/response lengths may differ (they drift during a run).
"""

from __future__ import annotations

from nereus.cost.shapes import valid_pp, valid_tp
from nereus.planner.candidates import even_dp_rows
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan
from nereus.workflow import ModelStage, workflow_for

__all__ = ["check_plan", "check_same_job"]

#: workload fields two plans of one job must share (lengths may drift between them)
SAME_WORKLOAD = ("algorithm", "prompts_per_step", "samples_per_prompt", "mini_batch_size", "ppo_epochs",
                 "reward_model", "asynchronous", "param_bytes", "grad_bytes", "optimizer_bytes", "kv_bytes")


def check_plan(plan: Plan, job: JobSpec, label: str = "plan", complete: bool = True) -> None:
    """Raise ValueError naming ``label``, the model-stage, the field, the value and what is valid
    when ``plan`` is not a legal placed plan of ``job`` (module docstring).

    With ``complete=False`` the plan may list a subset of the workflow's model-stages (a transition
    of those alone); names outside the workflow are still refused.
    """
    wf = workflow_for(job.workload)
    want = [m.name for m in wf.model_stages]
    have = list(plan.model_stages)
    if (sorted(want) != sorted(have)) if complete else not set(have) <= set(want):
        missing = [m for m in want if m not in have]
        extra = [m for m in have if m not in want]
        what = "; ".join(x for x in (f"missing {missing}" if missing else "",
                                     f"not in the workflow {extra}" if extra else "") if x)
        raise ValueError(f"{label}: model-stages do not match the job's {job.workload.algorithm.upper()} "
                         f"workflow ({what}); expected {want}")
    n = job.cluster.num_gpus
    mb = job.workload.mini_batch_size
    for c in plan.candidates:
        ms = ModelStage.parse(c.model_stage)
        model = job.model(ms.model)
        where = f"{label}: {c.model_stage}"
        why = valid_tp(model, c.tp) or valid_pp(model, c.pp)
        if why:
            raise ValueError(f"{where}: {why} (model {model.name})")
        if ms.stage == "train":
            if c.micro_batch < 1 or c.grad_accum < 1:
                raise ValueError(f"{where}: a training model-stage needs micro_batch >= 1 and grad_accum >= 1, "
                                 f"got micro_batch={c.micro_batch}, grad_accum={c.grad_accum}")
            if c.dp * c.micro_batch * c.grad_accum != mb:
                raise ValueError(f"{where}: dp*micro_batch*grad_accum = {c.dp}*{c.micro_batch}*{c.grad_accum} = "
                                 f"{c.dp * c.micro_batch * c.grad_accum}, must equal the job's mini_batch_size "
                                 f"{mb}")
        elif job.framework.even_dp and even_dp_rows(job.workload, c.model_stage) % c.dp:
            raise ValueError(f"{where}: dp={c.dp} must divide {even_dp_rows(job.workload, c.model_stage)} "
                             f"(framework {job.framework.name!r} splits a batch's rows evenly over DP); "
                             f"valid: a dp dividing it")
        if ms.stage == "infer" and c.micro_batch < 1:
            raise ValueError(f"{where}: an inference model-stage needs micro_batch >= 1, got {c.micro_batch}")
        elif ms.stage == "generate" and c.concurrency < 1:
            raise ValueError(f"{where}: generation needs concurrency >= 1 (sequences per replica), "
                             f"got {c.concurrency}")
        if not c.gpus:
            raise ValueError(f"{where}: field 'gpus' is empty; a plan file needs placed candidates "
                             f"(tp*pp*dp = {c.num_gpus} GPU ids each)")
        bad = sorted(g for g in c.gpus if not 0 <= g < n)
        if bad:
            raise ValueError(f"{where}: GPU ids {bad[:5]} outside its cluster's 0..{n - 1} "
                             f"({job.cluster.num_nodes} node(s) x {job.cluster.gpus_per_node})")


def check_same_job(a: JobSpec, b: JobSpec, label_a: str = "current plan", label_b: str = "target plan") -> None:
    """Raise ValueError unless ``a`` and ``b`` describe the same training job on clusters of one GPU
    type and node size (module docstring); names the first difference."""
    if a.actor.to_hf_config() != b.actor.to_hf_config():
        diff = sorted(k for k, v in a.actor.to_hf_config().items() if b.actor.to_hf_config().get(k) != v)
        raise ValueError(f"{label_a} and {label_b} are plans of different models ({a.actor.name} vs "
                         f"{b.actor.name}; fields {diff} differ); a transition keeps the model")
    wa, wb = a.workload.to_dict(), b.workload.to_dict()
    for k in SAME_WORKLOAD:
        if wa[k] != wb[k]:
            raise ValueError(f"{label_a} and {label_b} are plans of different workloads: {k} = {wa[k]!r} vs "
                             f"{wb[k]!r}; a transition keeps the workload (only lengths may differ)")
    if a.cluster.gpu != b.cluster.gpu:
        raise ValueError(f"{label_a} and {label_b} are on different GPUs ({a.cluster.gpu.name} vs "
                         f"{b.cluster.gpu.name})")
    if a.cluster.gpus_per_node != b.cluster.gpus_per_node:
        raise ValueError(f"{label_a} and {label_b} have different GPUs per node ({a.cluster.gpus_per_node} vs "
                         f"{b.cluster.gpus_per_node}); GPU ids would name different nodes")
