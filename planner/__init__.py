"""Public API of the activation-checkpoint planner: `plan(model, sample_input, budget_gb) -> Plan`."""
from planner.api import GB, Plan, plan
from planner.executor import ExecutorError, PlanMismatchError, PlannedModule

__all__ = ["GB", "Plan", "plan", "PlannedModule", "PlanMismatchError", "ExecutorError"]
