"""The one solving core: a planning problem and a budget in, the schedule the executor runs and its built step out.

`solve_problem(problem, budget_bytes, ...)` is what plan() (planner.whole.api) and the in-place block profiler
(planner.inplace.block_region) both call: keep everything where the executor's exact view holds it, else solve the
solver graph with the portfolio's candidates beside it (the checkpointing the user would otherwise write, checked
on the exact view: never a costlier plan, nor none, where one of them fits), solve again on the pinned graph where
the executor cannot hold the first schedule, name the smallest budget known to work where nothing fits, finalise
(each value freed at its last use, the executor's order, its exact peak) and build the step's fx halves once.
One solver graph per problem (and the pinned one where it is needed), however often the problem is solved.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.result import SolveResult
from planner.core.problem import GraphKind, PlanningProblem
from planner.core.solver_graph import split_position, traced_sequence
from planner.core.units import GB
from planner.execution.step_builder import StepHalves, build_step
from solvers.base import FLOOR_REASON, solve

FIRST_SOLVE_SHARE = 0.75  # of the time limit, for the first solve of a problem with secondary outputs


@dataclass(frozen=True)
class Solved:
    """A problem solved at a budget: the view it was solved on, the result as the executor runs it (each value freed
    at its last use), the computations in the executor's order (solver indices), its exact peak, the built halves."""

    kind: GraphKind
    graph: Graph
    result: SolveResult
    executor_computes: list[int]
    exact_peak_bytes: int
    halves: StepHalves


def _quiet(_message: str) -> None:
    pass


def solve_problem(problem: PlanningProblem, budget_bytes: int, *, solver: str = "auto", time_limit_s: float = 60.0,
                  candidates: list[tuple[str, dict]] = (), say: Callable[[str], None] = _quiet,
                  search_progress: Callable | None = None) -> Solved:
    """Solve `problem` within `budget_bytes` (see the module docstring). `candidates`: (label, block_checkpoint
    options) schedules for auto's portfolio; `say`: progress lines; `search_progress`: the solvers' own reports.
    Raises InfeasibleBudgetError (naming the smallest budget known to work, where one is found) and
    NoSolutionInTimeError; ExecutorError where the executor cannot run the schedule; SolverError where the schedule
    found would hold more than the budget as the executor runs it (a plan never exceeds its own budget)."""
    t0 = time.perf_counter()
    if problem.check_floor_bytes > budget_bytes:  # the check before the step holds more than the budget
        raise _naming_the_smallest(problem, budget_bytes, solver, time_limit_s, t0, say, InfeasibleBudgetError(
            budget_bytes, None, solver, f"checking the input against the forward's value reads holds "
                                        f"{problem.check_floor_bytes} bytes with the model and its inputs"))
    result = problem.keep_all(budget_bytes) if solver == "auto" else None
    if result is not None:
        kind = GraphKind.EXACT
    else:
        candidates = list(candidates) if solver == "auto" else []
        fallback = problem.best_candidate(budget_bytes, candidates) if candidates else None
        try:
            kind, result = _solve(problem, budget_bytes, solver, time_limit_s, t0, say, search_progress, candidates,
                                  have_fallback=fallback is not None)
        except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
            if fallback is None:
                raise
            say(f"auto found nothing cheaper ({type(e).__name__}); taking {fallback.solver}")
            kind, result = GraphKind.EXACT, fallback
        else:
            if fallback is not None and fallback.total_cost < result.total_cost * (1 - 1e-12):
                say(f"{fallback.solver} costs less than auto's schedule: taking it")
                kind, result = GraphKind.EXACT, fallback
    graph = problem.graph(kind)
    done = problem.finalise(graph, result)
    if done.exact_peak_bytes > budget_bytes:  # what the executor holds: never a plan over its own budget
        raise SolverError(
            f"{result.solver}: the schedule found holds {done.exact_peak_bytes} bytes as the executor runs it, over "
            f"the budget of {budget_bytes} bytes; plan again with more time or at a budget of "
            f"{done.exact_peak_bytes} bytes")
    seq = done.executor_computes
    say("building the step")
    # the step's halves, built once: solving fails here if the executor cannot run the schedule
    traced_n = problem.traced.graph.n
    halves = build_step(problem.traced, traced_sequence(graph, seq, traced_n), split_position(graph, seq, traced_n))
    # the step's peak: the schedule's, or the check's before it where that is more
    return Solved(kind, graph, done.result, seq, max(done.exact_peak_bytes, problem.check_floor_bytes), halves)


def _solve(problem: PlanningProblem, budget_bytes: int, solver: str, time_limit_s: float, t0: float,
           say: Callable[[str], None], search_progress, candidates: list[tuple[str, dict]],
           have_fallback: bool = False) -> tuple[GraphKind, SolveResult]:
    """(the graph kind, the result) of solving the problem's solver graph, and, where what the executor holds for
    that schedule does not fit, its pinned graph in the time left. Raises InfeasibleBudgetError naming the smallest
    budget known to work, NoSolutionInTimeError where no time is left for the fallback."""
    # a schedule that recomputes a secondary output may have to be solved again with it pinned: keep time for that
    first_limit = time_limit_s * FIRST_SOLVE_SHARE if problem.secondaries else time_limit_s
    graph = problem.solver_graph
    options: dict = {"progress": search_progress} if solver == "auto" and search_progress is not None else {}
    if candidates:
        options["candidates"] = candidates
    try:
        try:
            result = solve(graph, budget_bytes, solver, time_limit_s=first_limit, **options)
        except NoSolutionInTimeError:
            left = time_limit_s - (time.perf_counter() - t0)
            if have_fallback or left < 1.0:
                raise
            # the share kept for a second solve is not needed when the first found nothing: search on with it
            say(f"nothing found yet: searching on for the {left:.0f} s left")
            result = solve(graph, budget_bytes, solver, time_limit_s=left, **options)
    except InfeasibleBudgetError as e:
        if have_fallback:
            raise
        raise _naming_the_smallest(problem, budget_bytes, solver, time_limit_s, t0, say, e) from e
    executable = problem.executable(graph, result)
    if executable is not None:
        return GraphKind.SOLVER, executable
    left = time_limit_s - (time.perf_counter() - t0)
    if left <= 0:
        raise NoSolutionInTimeError(
            f"{solver}: the schedule found recomputes a secondary output whose op's result the executor would "
            "keep alive, and no time is left to solve again without it", budget_bytes=budget_bytes,
            seconds=time.perf_counter() - t0)
    say("the executor cannot hold that schedule within the budget: solving again with secondary outputs pinned")
    return GraphKind.PINNED, solve(problem.pinned_graph, budget_bytes, solver, time_limit_s=left, **options)


def _naming_the_smallest(problem: PlanningProblem, budget_bytes: int, solver: str, time_limit_s: float, t0: float,
                         say: Callable[[str], None], e: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """The error to raise for a budget proven infeasible: it names the smallest budget known to work."""
    # naming the minimum need not cost the whole time limit again
    left = max(5.0, min(time_limit_s / 2, time_limit_s - (time.perf_counter() - t0)))
    say(f"infeasible; finding the smallest feasible budget ({left:.0f} s at most)")
    found = problem.smallest_budget(left)
    smallest, how, by = found.budget_bytes, found.proof, found.solver
    if smallest is None and e.min_budget_bytes is not None and not e.reason.startswith(FLOOR_REASON):
        smallest, how, by = e.min_budget_bytes, e.reason, solver
    if smallest is None:  # the proof stands; the search for a budget that works found none in its time
        return InfeasibleBudgetError(
            budget_bytes, None, solver,
            f"budget {budget_bytes / GB:.9f} GB: {e.reason}; no budget known to work was found in {left:.0f} s; "
            f"{how}")
    gb = f"{smallest / GB:.9f} GB ({smallest} bytes)"
    if by not in (None, solver):
        gb += f", met by solver '{by}'"
    return InfeasibleBudgetError(
        budget_bytes, smallest, solver,
        f"budget {budget_bytes / GB:.9f} GB is below the smallest feasible budget {gb}; {how}")
