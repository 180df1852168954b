"""Nereus: adaptive parallelism for LLM RL post-training.

Pure decisions (spec → cost → planner → controller → transition) on one side, execution (runtime,
simulator) on the other; see DESIGN.md §3.
"""

__version__ = "0.1.0"
