"""Exhaustive search over the CP-SAT solver's schedule family, for tiny graphs (n <= 7 or so).

Family (C = max_computations), written out independently of solvers/cpsat_family.py:
- every node v is computed first in stage v, and stages run in the reference order 0..n-1;
- a node u may be recomputed in later stages k (u < k <= n-1), at most once per stage and at most C - 1 times
  in all (never when it is not recomputable);
- within a stage the recomputations run in ascending id order, then the stage's own node;
- values are freed at their last use (`Schedule.from_sequence`), and the simulator judges validity and peak.
Enumerates every choice of recomputation stages per node (for C = 2 that is n! sequences).
"""
from __future__ import annotations

import itertools
import math

from graphs.errors import ScheduleError
from graphs.ir import Graph
from graphs.schedule import Schedule
from graphs.simulate import simulate


def family_members(graph: Graph, max_computations: int):
    """Yield (sequence, peak_bytes, cost) for every valid member of the family."""
    n = graph.n
    choices = []
    for u in range(n):
        extra = max_computations - 1 if graph.nodes[u].recomputable else 0
        later = range(u + 1, n)
        opts = [()]
        for r in range(1, extra + 1):
            opts.extend(itertools.combinations(later, r))
        choices.append(opts)
    for pick in itertools.product(*choices):
        events = [(v, v) for v in range(n)]
        for u, stages in enumerate(pick):
            events.extend((k, u) for k in stages)
        seq = [v for _, v in sorted(events)]
        try:
            sim = simulate(graph, Schedule.from_sequence(graph, seq))
        except ScheduleError:
            continue  # a recomputation whose inputs are gone
        yield seq, sim.peak_bytes, sim.total_cost


def frontier(graph: Graph, max_computations: int) -> list[tuple[int, float]]:
    """(peak_bytes, cost) pairs over the family, sorted by peak; `optimum` reads it for any budget."""
    best: dict[int, float] = {}
    for _, peak, cost in family_members(graph, max_computations):
        if cost < best.get(peak, math.inf):
            best[peak] = cost
    return sorted(best.items())


def optimum(front: list[tuple[int, float]], budget_bytes: int) -> float | None:
    """The family's least cost within the budget, or None when no member fits."""
    costs = [c for p, c in front if p <= budget_bytes]
    return min(costs) if costs else None
