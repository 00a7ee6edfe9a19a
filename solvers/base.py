"""The solver interface, the registry, and the one entry point that checks every result.

A solver is a function `(graph, budget_bytes, *, time_limit_s=None, **options) -> Proposal`.
`solve()` runs it, replays its schedule in the simulator and returns a SolveResult; a schedule
that is invalid or over budget is never returned (that would be a solver bug: SolverError).
Solvers never import torch.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Callable

from graphs.errors import InfeasibleBudgetError, ScheduleError, SolverError, UnknownSolverError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.deadline import passed


@dataclass
class Proposal:
    """What a solver function hands back to `solve()` before it is checked."""

    schedule: Schedule
    status: Status
    lower_bound_cost: float | None = None
    info: dict = field(default_factory=dict)


SolverFn = Callable[..., Proposal]

# name -> "module:function"; imported lazily so that an optional backend costs nothing until used.
_REGISTRY: dict[str, str] = {
    "checkpoint_all": "solvers.heuristics.baselines:checkpoint_all",
    "chen_sqrtn": "solvers.heuristics.baselines:chen_sqrtn",
    "chen_sqrtn_linear": "solvers.heuristics.baselines:chen_sqrtn_linear",
    "chen_greedy": "solvers.heuristics.baselines:chen_greedy",
    "chen_greedy_linear": "solvers.heuristics.baselines:chen_greedy_linear",
    "chain_dp": "solvers.exact.chain_dp:chain_dp",
    "milp": "solvers.exact.milp:milp",
    "milp_cbc": "solvers.exact.milp:milp_cbc",
    "lp_round": "solvers.exact.lp_round:lp_round",
    "cpsat": "solvers.exact.cpsat:cpsat",
    "dtr": "solvers.heuristics.dtr:dtr",
    "dtr_local": "solvers.heuristics.dtr:dtr_local",
    "evict": "solvers.heuristics.evict:evict",
    "rollout_search": "solvers.heuristics.rollout_search:rollout_search",
    "lowest_memory": "solvers.heuristics.lowest_memory:lowest_memory",
    "block_dp": "solvers.exact.block_dp:block_dp",
    "block_checkpoint": "solvers.heuristics.block_checkpoint:block_checkpoint",
    "auto": "solvers.auto:auto",
}


def register(name: str, target: str) -> None:
    """Register a solver as "module:function" under `name`."""
    _REGISTRY[name] = target


def solver_names() -> list[str]:
    return list(_REGISTRY)


def get_solver(name: str) -> SolverFn:
    if name not in _REGISTRY:
        raise UnknownSolverError(f"unknown solver '{name}'; known: {', '.join(_REGISTRY)}")
    module, attr = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def bisect_smallest(fails: int, works: int, feasible: Callable[[int], bool | None],
                    deadline: float | None = None) -> tuple[int, int]:
    """Bisection for the smallest budget in (fails, works] where `feasible` holds: returns (lo, hi), lo failing
    and hi working. `feasible(works)` is taken to hold and `fails` to fail. The search stops early, with a wider
    interval, once `deadline` (time.perf_counter()) passes or `feasible` answers None (it did not finish in time);
    otherwise hi == lo + 1. Exact when feasibility is monotone in the budget, else hi is some budget that works."""
    lo, hi = int(fails), int(works)
    while hi - lo > 1 and not passed(deadline):
        mid = (lo + hi) // 2
        ok = feasible(mid)
        if ok is None:
            break
        if ok:
            hi = mid
        else:
            lo = mid
    return lo, hi


def check_budget_floor(graph: Graph, budget_bytes: int, solver: str) -> None:
    """Raise InfeasibleBudgetError when the budget is below the single-operation bound.

    Exact solvers call this first: below that bound no schedule exists, whatever the solver.
    """
    floor = graph.single_op_bound_bytes()
    if budget_bytes < floor:
        raise InfeasibleBudgetError(budget_bytes, floor, solver, FLOOR_REASON)


# the reason check_budget_floor gives: its min_budget_bytes is a bound no budget below can meet, not a budget known
# to be met
FLOOR_REASON = "single-operation bound: some node needs its inputs and output resident together"


def solve(graph: Graph, budget_bytes: int, solver: str = "checkpoint_all", *, time_limit_s: float | None = None,
          **options) -> SolveResult:
    """Run `solver` on `graph` under `budget_bytes` and return a simulator-checked SolveResult.

    Raises InfeasibleBudgetError (naming the smallest budget the solver can meet),
    NoSolutionInTimeError, UnknownSolverError, or SolverError for an invalid proposal.
    """
    fn = get_solver(solver)
    budget_bytes = int(budget_bytes)
    t0 = time.perf_counter()
    prop = fn(graph, budget_bytes, time_limit_s=time_limit_s, **options)
    seconds = time.perf_counter() - t0
    return finish(graph, budget_bytes, solver, prop, seconds)


def finish(graph: Graph, budget_bytes: int, solver: str, prop: Proposal, seconds: float) -> SolveResult:
    """Simulate a proposal and wrap it; raises SolverError if it is invalid or over budget."""
    try:
        sim = simulate(graph, prop.schedule)
    except ScheduleError as e:
        raise SolverError(f"solver '{solver}' produced an invalid schedule: {e}") from e
    if sim.peak_bytes > budget_bytes:
        raise SolverError(f"solver '{solver}' produced a schedule peaking at {sim.peak_bytes} bytes, "
                          f"over the budget of {budget_bytes}")
    lb = prop.lower_bound_cost
    if lb is not None and lb > sim.total_cost * (1 + 1e-9) + 1e-9:
        raise SolverError(f"solver '{solver}' claims lower bound {lb} above its own cost {sim.total_cost}")
    return SolveResult(prop.schedule, prop.status, solver, budget_bytes, seconds, sim, lb, dict(prop.info))
