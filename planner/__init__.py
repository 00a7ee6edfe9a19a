"""Public API of the activation-checkpoint planner: `plan(model, sample_input, budget_gb) -> Plan` (whole model) and
`enable(model, budget_gb)` (in place, per repeated block).

The package is cut by concern, each layer importing only those below it:

- `planner.tools`: fit, the curve, measurement, the baselines people write by hand, the command line;
- `planner.whole` (plan(), the Plan type and its JSON, checkpointing candidates) and `planner.inplace` (enable());
- `planner.core`: the planning problem of a trace, its solver graph and the one solving core both use;
- `planner.execution`: a schedule as fx code (step builder, runtime, RNG replay, inductor).

The names are imported on first use, so that `python -m planner solve` (benchmark graphs, no model) starts
without importing torch.
"""
from __future__ import annotations

import importlib

_NAMES = {
    "GB": "planner.core.units", "Plan": "planner.core.plan_type", "plan": "planner.whole.api",
    "smallest_budget": "planner.whole.api", "SmallestBudget": "planner.core.problem",
    "PlannedModule": "planner.execution.runtime",
    "PlanMismatchError": "graphs.errors", "ExecutorError": "graphs.errors",
    "InfeasibleBudgetError": "graphs.errors", "NoSolutionInTimeError": "graphs.errors",
    "max_batch": "planner.tools.fit", "overhead_curve": "planner.tools.curve",
    "enable": "planner.inplace.controller", "disable": "planner.inplace.controller",
    "inplace_plan": "planner.inplace.controller", "InPlaceController": "planner.inplace.controller",
    "compile": "planner.compiled.api",
}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
