"""Transition planning: EMUs, the four primitives, local and global DAGs, cost and scheduling.

Source: paper §5-§6, DESIGN.md §4.6. The controller calls :func:`estimate_transition`.
"""

from nereus.transition.cost import CostParams
from nereus.transition.emu import EMU, phi, state_bytes_per_param, t_sub
from nereus.transition.estimate import TransitionEstimate, estimate_transition, plan_dag
from nereus.transition.global_dag import GlobalDAG
from nereus.transition.local_dag import Infeasible, LocalDAG
from nereus.transition.primitives import Primitive
from nereus.transition.schedule import Schedule

__all__ = ["estimate_transition", "TransitionEstimate", "plan_dag", "CostParams", "EMU", "phi",
           "state_bytes_per_param", "t_sub", "GlobalDAG", "LocalDAG", "Infeasible", "Primitive",
           "Schedule"]
