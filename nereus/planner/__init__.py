"""Plan search: candidates, frontier, dynamic programming, placement, critical path."""

from nereus.spec.plan import Candidate, Plan, StageEstimate, load_plan

__all__ = ["Candidate", "Plan", "StageEstimate", "load_plan"]
