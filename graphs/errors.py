"""The project's exception hierarchy: every layer raises one of these.

`RematError` is the base; catching it catches everything the project raises on purpose.
"""
from __future__ import annotations


class RematError(Exception):
    """Base class of every error this project raises."""


class ArgumentError(RematError, ValueError, TypeError):
    """An argument of the API or the command line is not one the planner can take: the message names the argument,
    what it got and what would work. A ValueError and a TypeError both, as Python's own checks raise one or the
    other."""


class GraphError(RematError, ValueError):
    """A graph is malformed: a cycle, a wrong order, an unknown id, a negative cost or size."""


class ScheduleError(RematError, ValueError):
    """A schedule is invalid for its graph (the simulator names the op at fault)."""

    def __init__(self, message: str, op_index: int | None = None):
        super().__init__(message)
        self.op_index = op_index


class ScheduleFormatError(RematError, ValueError):
    """A `remat-schedule` JSON file is malformed or inconsistent (names the field or the op)."""


class InfeasibleBudgetError(RematError):
    """It is proven that no schedule the solver can produce fits in the budget; `reason` names the proof and the
    schedules it covers (every schedule: the single-operation bound, the subgraph relaxation, non-recomputable
    values that must stay resident; or the solver's own family: an exact solver's proof, a baseline's one schedule).
    A search that merely found nothing in time raises NoSolutionInTimeError instead.

    `min_budget_bytes` is the smallest budget the solver (or the proof at hand) knows to work;
    `reason` also says how that figure is known.
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int | None, solver: str, reason: str = ""):
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.solver = solver
        self.reason = reason
        if self.min_budget_bytes is None:
            need = "no schedule is known to fit any budget"
        else:
            need = f"the smallest budget it can meet is {self.min_budget_bytes} bytes"
        msg = f"budget {self.budget_bytes} bytes is infeasible for solver '{solver}': {need}"
        if reason:
            msg += f" ({reason})"
        super().__init__(msg)


class TraceError(RematError):
    """A model cannot be traced into one joint graph; the message names the cause."""


class SpecialisationError(TraceError):
    """An input differs from the one a traced graph was specialised to (shape, dtype or a value read)."""


class SolverError(RematError):
    """A solver failed for a reason other than an infeasible budget (a backend failure, an invalid proposal)."""


class NoSolutionInTimeError(SolverError):
    """The time limit ran out before any schedule within the budget was found. This proves nothing about the budget.

    `min_budget_bytes` is the smallest budget known to work (a schedule met it), None when none is known;
    `seconds` the time limit that ran out, where the raiser knows it.
    """

    def __init__(self, message: str, *, budget_bytes: int | None = None, min_budget_bytes: int | None = None,
                 solver: str | None = None, seconds: float | None = None):
        super().__init__(message)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.solver = solver
        self.seconds = seconds


class UnknownSolverError(RematError, KeyError):
    """The requested solver name is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown solver"


class ExecutorError(RematError):
    """A schedule cannot run as a training step (the message says which value is at fault)."""


class PlanMismatchError(RematError, ValueError):
    """A plan is applied to a model or an input it was not made for."""
