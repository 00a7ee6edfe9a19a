"""Public API of the activation-checkpoint planner: `plan(model, sample_input, budget_gb) -> Plan`.

The names are imported on first use, so that `python -m planner solve` (benchmark graphs, no model) starts
without importing torch.
"""
from __future__ import annotations

import importlib

_NAMES = {
    "GB": "planner.plan_type", "Plan": "planner.plan_type", "plan": "planner.api", "smallest_budget": "planner.api",
    "SmallestBudget": "planner.problem", "PlannedModule": "planner.runtime",
    "PlanMismatchError": "graphs.errors", "ExecutorError": "graphs.errors",
    "InfeasibleBudgetError": "graphs.errors", "NoSolutionInTimeError": "graphs.errors",
    "max_batch": "planner.fit", "overhead_curve": "planner.curve",
    "enable": "planner.inplace", "disable": "planner.inplace", "inplace_plan": "planner.inplace",
    "InPlacePlan": "planner.inplace",
}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
