"""A small controller API for external trainers (verl, OpenRLHF, your own loop).

A trainer that runs its own steps calls :meth:`NereusController.observe` at each safe boundary (after
a step, before the next) with what it measured, and gets back a decision as plain data (JSON-ready
dicts): keep the plan, move to a target plan (with the transition DAG of Split/Merge/Extend/Destroy
primitives and their schedule), or checkpoint and restart. Nereus's runtime is not needed: the
trainer applies the decision its own way (e.g. re-launch with the target's settings from
``nereus plan --export``).

Example::

    from nereus.controller.api import NereusController
    ctl = NereusController.for_job(job)                      # plans the job (or pass plan=...)
    d = ctl.observe(step=0, response_len=612.0, step_time=41.3, pool=range(16))
    if d["kind"] == "transition":
        target = d["plan"]                                   # {"candidates": [...], "l_step": ...}
        dag = d["transition"]["dag"]                         # {"nodes": [...], "edges": [...]}

``observe`` fields (one step's measurements, :class:`~nereus.controller.monitor.StepReport`):
``step``, ``response_len`` (mean tokens), ``step_time`` (s), ``pool`` (GPU ids usable next step),
optional ``op_seconds`` (model-stage -> op class -> s; ``{"total": s}`` for a model-stage timed only
as a whole, e.g. verl's ``timing_s/gen`` for ``actor.generate``), ``peak_memory`` (model-stage -> bytes per
GPU), ``oom``, ``alive`` (GPUs still running, including those under a preemption notice),
``elapsed_s``. :meth:`NereusController.observe_record` takes the same fields as one dict (a line of
a JSON-lines step log).
"""

from __future__ import annotations

import json
from pathlib import Path

from nereus.controller.controller import Controller, ControllerConfig
from nereus.controller.decisions import Transition, decision_to_dict
from nereus.controller.monitor import StepReport
from nereus.controller.planning import CostModelPlanner
from nereus.spec.job import JobSpec
from nereus.spec.plan import Plan

__all__ = ["NereusController", "read_step_log", "STEP_FIELDS"]

#: fields of one step record (``observe`` keyword arguments)
STEP_FIELDS = ("step", "response_len", "step_time", "pool", "op_seconds", "peak_memory", "oom", "alive", "elapsed_s")


class NereusController:
    """Nereus's controller behind a data-in, data-out interface.

    Args:
        job: the job (its response length is replaced by each step's measured one).
        plan: the plan the trainer runs now (placed candidates; ``nereus plan --json`` output).
        config: controller policy knobs (payback margin ``gamma``...).
        headroom: fraction of GPU memory kept free (None: the job's memory_fraction, else 10%).
    """

    def __init__(self, job: JobSpec, plan: Plan, config: ControllerConfig | None = None,
                 headroom: float | None = None):
        self.job = job
        self.planner = CostModelPlanner(headroom=headroom)
        self.controller = Controller(job, self.planner.estimate(job, plan), self.planner, config=config)

    @classmethod
    def for_job(cls, job: JobSpec, pool=None, **kw) -> NereusController:
        """Start from Nereus's best plan for ``job`` on ``pool`` (default: the whole cluster)."""
        from nereus.planner.search import plan_job

        return cls(job, plan_job(job, pool=frozenset(pool) if pool is not None else None), **kw)

    @property
    def plan(self) -> Plan:
        """The plan in effect (the target of the last transition or restart)."""
        return self.controller.plan

    def observe(self, step: int, response_len: float, step_time: float, pool, op_seconds: dict | None = None,
                peak_memory: dict | None = None, oom: bool = False, alive=None, elapsed_s: float | None = None) -> dict:
        """One step's measurements in, the decision out (module docstring).

        Returns:
            ``{"kind": "keep" | "transition" | "restart", "reason", "triggers", ...}``; a transition
            carries ``plan`` (the target), ``estimate`` (``L_tran``, bytes) and ``transition`` (the
            DAG: ``dag.nodes``/``dag.edges``, ``schedule``, ``durations_s``); a restart carries
            ``plan`` (or None when nothing fits) and ``checkpoint_first``.

        Raises:
            ValueError: a malformed measurement (named).
        """
        report = StepReport(step=int(step), response_len=float(response_len), pool=frozenset(int(g) for g in pool),
                            step_time=float(step_time), op_seconds=dict(op_seconds or {}),
                            peak_memory=dict(peak_memory or {}), oom=bool(oom),
                            alive=frozenset(int(g) for g in alive) if alive is not None else None,
                            elapsed_s=elapsed_s)
        before = self.controller.plan
        decision = self.controller.observe(report)
        out = decision_to_dict(decision)
        out["step"] = report.step
        if isinstance(decision, Transition):
            from nereus.transition.estimate import estimate_transition

            job = self.controller.job_at(report.response_len)
            alive_set = report.alive | report.pool if report.alive is not None else report.pool
            out["transition"] = estimate_transition(job, before, decision.plan, frozenset(alive_set)).to_dict()
        json.dumps(out)
        return out

    def observe_record(self, record: dict) -> dict:
        """:meth:`observe` with one step record (a dict of :data:`STEP_FIELDS`).

        Raises:
            ValueError: a missing or unknown field.
        """
        unknown = sorted(set(record) - set(STEP_FIELDS))
        if unknown:
            raise ValueError(f"step record has unknown field(s) {unknown}; valid: {list(STEP_FIELDS)}")
        for k in ("step", "response_len", "step_time", "pool"):
            if k not in record:
                raise ValueError(f"step record {record.get('step', '?')}: missing field {k!r} "
                                 f"(required: step, response_len, step_time, pool)")
        return self.observe(**record)


def read_step_log(path) -> list[dict]:
    """Step records of a JSON-lines log (one :data:`STEP_FIELDS` dict per line; ``#`` lines skipped).

    Raises:
        ValueError: a missing file or a line that is not a JSON object (named with its line number).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"step log {str(p)!r} does not exist")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"step log {str(p)!r} line {i}: not JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"step log {str(p)!r} line {i}: expected a JSON object of step fields")
        out.append(rec)
    return out
