"""Plans as data (re-exported): the types live in :mod:`nereus.spec.plan`, below both the cost
model and the planner, so that :mod:`nereus.cost` does not import the planner. Existing imports of
``nereus.planner.plan`` keep working.
"""

from nereus.spec.plan import Candidate, Plan, StageEstimate, load_plan, read_plan_document

__all__ = ["Candidate", "StageEstimate", "Plan", "load_plan", "read_plan_document"]
