"""The smallest feasible budget of a graph: met by a valid schedule, with how it is known nothing smaller works.

1. The single-operation bound (some node needs its inputs and output resident together), raised by the
   non-recomputable values that must stay resident beside some node (solvers.bounds.forced_bound.memory_floor_bytes),
   is a floor for every schedule. If a solver meets it, the minimum is proven.
2. Otherwise every registered heuristic reports the smallest budget it can meet (its InfeasibleBudgetError names
   it); the least of these, met by a schedule, is the upper end.
3. The subgraph relaxation (solvers.bounds.subgraph_bound) raises the floor, for every schedule, where a small part of
   the graph cannot be run within a budget in any order (resnet50: up to the upper end, which is then proven).
4. Bisection between the floor and that upper end, with the heuristics and then an exact solver (time-limited)
   as the feasibility test, lowers the upper end; an exact solver's proof of infeasibility raises the lower end.
   That proof is for the exact solver's schedule family, and the report says so.

A caller whose schedules must pass a further test (the planner: what its executor holds must fit too) gives
`adapt`, which maps a schedule to the one that counts, or to None where it does not meet the budget it was solved
for; such a schedule meets nothing, and the proofs (for schedules of a wider set) stay valid.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from graphs.errors import GraphError, InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.result import SolveResult
from solvers.base import solve, solver_names
from solvers.bounds.forced_bound import memory_floor_bytes
from solvers.bounds.subgraph_bound import subgraph_floor_bytes

HEURISTICS = ("checkpoint_all", "chen_greedy", "chen_greedy_linear", "dtr", "evict", "lowest_memory")
# On large graphs block_dp goes second: where the graph splits into blocks it answers in under a second (2000 nodes),
# where the greedies and evict take seconds each per bisection step (it names no budget when it fails). On small
# graphs the others are fast and it would only add its time to every step.
LARGE_NODES = 400
LARGE_HEURISTICS = ("checkpoint_all", "block_dp") + HEURISTICS[1:]
EXACT = ("cpsat", "milp")
SUBGRAPH_SHARE = 0.25  # of the time limit, at most, for the subgraph relaxation


@dataclass
class MinBudget:
    budget_bytes: int  # the smallest budget known to work: `result` meets it
    lower_bound_bytes: int  # no schedule (of the family named in `proof`) fits below this
    proof: str  # how the lower end is known
    result: SolveResult

    @property
    def proven(self) -> bool:
        return self.lower_bound_bytes >= self.budget_bytes


Adapt = Callable[[SolveResult], "SolveResult | None"]


def _try(graph: Graph, budget: int, names, time_limit_s: float | None, deadline: float | None = None,
         adapt: Adapt | None = None):
    """First schedule that fits `budget` (passed through `adapt`), the least budget any failing solver named, and
    exact proofs.

    deadline (time.perf_counter()): solvers not started by then are skipped; each gets at most what is left."""
    named: list[int] = []
    proofs: list[str] = []
    for name in names:
        if name not in solver_names():
            continue
        limit = time_limit_s
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0.5:
                break
            limit = left if limit is None else min(limit, left)
        try:
            result = solve(graph, budget, name, time_limit_s=limit)
            if adapt is not None:
                result = adapt(result)
            if result is not None:
                return result, named, proofs
        except InfeasibleBudgetError as e:
            if e.min_budget_bytes is not None:
                named.append(e.min_budget_bytes)
            if name in EXACT:
                proofs.append(f"{name}: {e.reason or 'proved infeasible'}")
        except NoSolutionInTimeError:
            pass
        except SolverError:
            pass  # a solver bug (an invalid proposal) or a backend failure: the other solvers still answer
        except GraphError:
            pass  # a solver that does not apply to this graph (block_dp without a chain of blocks)
    return None, named, proofs


def min_budget(graph: Graph, *, time_limit_s: float = 60.0, tolerance: float = 1e-3,
               adapt: Adapt | None = None) -> MinBudget:
    """Search the smallest feasible budget within about `time_limit_s` seconds.

    tolerance: stop the bisection once the unproven interval is below this fraction of the budget.
    adapt: the module docstring's further test, applied to every schedule found.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    floor = graph.single_op_bound_bytes()
    floor_name = "single-operation bound"
    floor_proof = f"{floor_name}: a node needs its inputs and output resident together"
    raised = memory_floor_bytes(graph, deadline)
    if raised > floor:
        floor_name = "forced-residency bound"
        floor, floor_proof = raised, (f"{floor_name}: a node needs its inputs and output resident together "
                                      "with the non-recomputable values that later nodes read")
    per_solve = max(1.0, time_limit_s / 8)
    heuristics = LARGE_HEURISTICS if graph.n > LARGE_NODES else HEURISTICS
    res, named, _ = _try(graph, floor, heuristics + EXACT, per_solve, deadline, adapt)
    if res is not None:
        return MinBudget(floor, floor, floor_proof + ", and a schedule meets exactly that", res)
    # Upper end: the least budget a heuristic named, confirmed by a schedule.
    best: SolveResult | None = None
    for b in sorted(set(named)):
        r, _, _ = _try(graph, b, heuristics, per_solve, deadline + per_solve, adapt)  # an upper end is needed
        if r is not None:
            best = r
            break
    if best is None:
        raise InfeasibleBudgetError(floor, None, "min_budget", "no solver met any budget it named")
    hi = best.peak_bytes  # met
    lo = floor  # floor - 1 is impossible; lo itself failed above but without proof
    proof = floor_name
    lo_proved = floor
    sub_deadline = min(deadline, time.perf_counter() + SUBGRAPH_SHARE * time_limit_s)
    sub = subgraph_floor_bytes(graph, hi - 1, deadline=sub_deadline)
    if sub is not None and sub.budget_bytes > lo_proved:
        lo_proved = sub.budget_bytes  # nothing below fits, in any schedule
        lo = max(lo, lo_proved - 1)
        proof = f"subgraph relaxation, for every schedule: {sub.describe(graph)}"
        if lo_proved >= hi:
            return MinBudget(hi, lo_proved, proof + f", and {best.solver}'s schedule meets {hi} bytes", best)
    while hi - lo > max(1, int(tolerance * hi)) and time.perf_counter() - t0 < time_limit_s:
        mid = (lo + hi) // 2
        r, _, proofs = _try(graph, mid, heuristics + EXACT, per_solve, deadline, adapt)
        if r is not None:
            best, hi = r, r.peak_bytes
        else:
            lo = mid
            if proofs:
                lo_proved, proof = mid + 1, "; ".join(proofs) + f" at {mid} bytes"
    # Final attempt to prove that just below the upper end nothing fits.
    if lo_proved < hi and time.perf_counter() - t0 < time_limit_s:
        r, _, proofs = _try(graph, hi - 1, EXACT, None, deadline, adapt)
        if r is not None:
            best, hi = r, r.peak_bytes
        elif proofs:
            lo_proved, proof = hi, "; ".join(proofs) + f" at {hi - 1} bytes"
    if lo_proved < hi:
        proof = (f"{proof} gives {lo_proved} bytes as the lower end; "
                 f"no solver met any budget below {hi} bytes within the time limit")
    return MinBudget(hi, lo_proved, proof, best)
