"""Classic baselines, each a policy for which values to keep plus the shared recomputation (keep.py).

- checkpoint_all: keep everything, no recomputation (optimal cost whenever it fits).
- chen_sqrtn: Chen et al. (2016) sqrt(n) segments: keep every ceil(sqrt(c))-th of the c candidates.
- chen_greedy: Chen et al.'s greedy segmenting under a threshold b, swept over b; the cheapest
  schedule that fits the budget wins.
Candidates are the articulation points of the forward graph (Chen's graph-aware variant), or, for
the `_linear` variants, every forward node in the reference order (the graph treated as a chain).
"""
from __future__ import annotations

import math

import networkx as nx
import numpy as np

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal
from solvers.deadline import deadline_after, passed
from solvers.heuristics.keep import schedule_from_kept, sequence_from_kept


def checkpoint_all(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    sched = Schedule.from_sequence(graph, range(graph.n))
    peak = simulate(graph, sched).peak_bytes
    if peak > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, peak, "checkpoint_all", "its only schedule keeps every value")
    # Every schedule computes every node at least once, so the graph's total cost is a lower bound.
    return Proposal(sched, Status.OPTIMAL, lower_bound_cost=graph.total_cost, info={"kept": list(range(graph.n))})


def forward_nodes(graph: Graph) -> list[int]:
    return [nd.id for nd in graph.nodes if not nd.backward]


def candidates(graph: Graph, linearized: bool) -> list[int]:
    """Checkpoint candidates in reference order (see the module docstring)."""
    fwd = forward_nodes(graph)
    if linearized:
        return fwd
    fset = set(fwd)
    ug = nx.Graph()
    ug.add_nodes_from(fwd)
    ug.add_edges_from((i, nd.id) for nd in graph.nodes if nd.id in fset for i in nd.inputs if i in fset)
    return sorted(nx.articulation_points(ug))


def sqrtn_kept(graph: Graph, linearized: bool) -> list[int]:
    cand = candidates(graph, linearized)
    if not cand:
        return []
    step = max(1, math.ceil(math.sqrt(len(cand))))
    return cand[step - 1::step]


def _sqrtn(graph: Graph, budget_bytes: int, linearized: bool, name: str) -> Proposal:
    kept = sqrtn_kept(graph, linearized)
    sched = schedule_from_kept(graph, kept)
    peak = simulate(graph, sched).peak_bytes
    if peak > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, peak, name, "its one sqrt(n) schedule peaks there")
    return Proposal(sched, Status.HEURISTIC, info={"kept": kept})


def chen_sqrtn(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    return _sqrtn(graph, budget_bytes, False, "chen_sqrtn")


def chen_sqrtn_linear(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    return _sqrtn(graph, budget_bytes, True, "chen_sqrtn_linear")


def greedy_kept(graph: Graph, linearized: bool, threshold_bytes: float, cset: set[int] | None = None) -> list[int]:
    """Chen's greedy: accumulate forward bytes; keep a candidate once the run exceeds the threshold.
    cset: the candidates, when the caller has them (a sweep over thresholds computes them once)."""
    if cset is None:
        cset = set(candidates(graph, linearized))
    kept, run = [], 0
    for v in forward_nodes(graph):
        run += int(graph.sizes[v])
        if v in cset and run > threshold_bytes:
            kept.append(v)
            run = 0
    return kept


def greedy_thresholds(graph: Graph, count: int = 64) -> list[float]:
    fwd = forward_nodes(graph)
    total = float(graph.sizes[fwd].sum()) if fwd else 0.0
    if total <= 0:
        return [0.0]
    low = max(1.0, float(graph.sizes[fwd].min()))
    return [0.0, *np.geomspace(low, total, count).tolist(), math.inf]


def _greedy(graph: Graph, budget_bytes: int, linearized: bool, name: str, time_limit_s: float | None) -> Proposal:
    deadline = deadline_after(time_limit_s)
    best = None  # (cost, peak, kept, schedule)
    min_peak = None
    seen: set[tuple[int, ...]] = set()
    thresholds = greedy_thresholds(graph)
    cset = set(candidates(graph, linearized))
    for k, b in enumerate(thresholds):
        if passed(deadline):
            if best is None:
                raise NoSolutionInTimeError(f"{name}: no threshold fitted in the {k} of {len(thresholds)} tried "
                                            f"within {time_limit_s:g} s", budget_bytes=budget_bytes,
                                            min_budget_bytes=min_peak, solver=name, seconds=time_limit_s)
            break
        kept = tuple(greedy_kept(graph, linearized, b, cset))
        if kept in seen:
            continue
        seen.add(kept)
        sched = Schedule.from_sequence(graph, sequence_from_kept(graph, kept))
        sim = simulate(graph, sched)
        min_peak = sim.peak_bytes if min_peak is None else min(min_peak, sim.peak_bytes)
        if sim.peak_bytes <= budget_bytes and (best is None or (sim.total_cost, sim.peak_bytes) < best[:2]):
            best = (sim.total_cost, sim.peak_bytes, list(kept), sched)
    if best is None:
        raise InfeasibleBudgetError(budget_bytes, min_peak, name,
                                    f"lowest peak over {len(seen)} greedy thresholds")
    return Proposal(best[3], Status.HEURISTIC, info={"kept": best[2], "thresholds_tried": len(seen)})


def chen_greedy(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    return _greedy(graph, budget_bytes, False, "chen_greedy", time_limit_s)


def chen_greedy_linear(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    return _greedy(graph, budget_bytes, True, "chen_greedy_linear", time_limit_s)
