"""Public API of the activation-checkpoint planner: `plan(model, sample_input, budget_gb) -> Plan`.

The names are imported on first use, so that `python -m planner solve` (benchmark graphs, no model) starts
without importing torch.
"""
from __future__ import annotations

import importlib

_NAMES = {"GB": "planner.api", "Plan": "planner.api", "plan": "planner.api",
          "PlannedModule": "planner.executor", "PlanMismatchError": "planner.executor",
          "ExecutorError": "planner.executor"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
