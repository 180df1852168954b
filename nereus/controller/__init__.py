"""nereus.controller: monitor, triggers and ``H_x``, admission, and the controller (DESIGN.md §4.5).

Imports only spec, cost, planner, transition and workflow; never ``nereus.sim`` or ``nereus.runtime``.
"""

from nereus.controller.admission import Option, admit, payback_ok, payback_steps
from nereus.controller.controller import Controller, ControllerConfig, state_survives
from nereus.controller.decisions import Keep, Restart, Transition, TransitionCost, decision_to_dict
from nereus.controller.horizon import Horizon
from nereus.controller.monitor import Monitor, StepReport, Trigger
from nereus.controller.planning import CostModelPlanner, PlannerBackend

__all__ = ["Controller", "ControllerConfig", "state_survives", "Keep", "Transition", "Restart",
           "TransitionCost", "decision_to_dict", "Horizon", "Monitor", "StepReport", "Trigger",
           "Option", "admit", "payback_ok", "payback_steps", "CostModelPlanner", "PlannerBackend"]
