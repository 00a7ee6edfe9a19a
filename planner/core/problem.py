"""The planning problem of one trace: the graphs plan() solves and the executor's exact view, each built once.

A multi-output op (a layer norm with its statistics, attention with its log-sum-exp, a max-pool with its indices)
allocates all its outputs at every computation, but the trace makes each secondary output a node of its own. The
solvers do not know this, so they plan on a graph where such an op's node also counts its secondary outputs: every
recomputation then stays within the peak, at the price of counting some bytes twice. The executor holds less.
`PlanningProblem` keeps both views of one trace side by side, built on demand and once each:

- `solver_graph`: what the solvers plan (`planner.core.solver_graph.solver_graph`);
- `pinned_graph`: the same with secondary outputs not recomputable: the fallback where a schedule of the first
  graph does not fit as the executor holds it (`executable`);
- `exact_graph`: the executor's view, derived from the solver graph without building it again: each output counted
  once, a multi-output op holding all its outputs for the length of the op (`co_outputs`, as graphs.simulate
  takes them);

and answers what plan() asks of them: `keep_all` (the schedule without recomputation where the executor's view fits
and the solver graph does not), `executable`, `finalise` (the schedule as the executor runs it and its exact peak)
and `smallest_budget`. The three graphs share their nodes' order and labels, so node indices mean the same in each.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Schedule
from graphs.simulate import simulate
from planner.core.solver_graph import executor_sequence, secondary_outputs, solver_graph
from solvers.base import solve
from solvers.bounds.min_budget import min_budget


class GraphKind(str, Enum):
    """Which view of a planning problem a plan's schedule was solved on (kept in the plan's JSON)."""

    SOLVER = "solver"
    PINNED = "pinned"
    EXACT = "exact"


@dataclass(frozen=True)
class SmallestBudget:
    """The smallest budget a schedule plan() can run is known to meet (None: none known), how that is known, and the
    solver that met it."""

    budget_bytes: int | None
    proof: str
    solver: str | None


@dataclass(frozen=True)
class Finalised:
    """A solved schedule as the executor runs it: the result (each value freed at its last use), the computations in
    the executor's order (solver indices: a recomputed secondary output taken right after the computation of its op
    it is indexed out of) and the peak the executor reaches."""

    result: SolveResult
    executor_computes: list[int]
    exact_peak_bytes: int


class PlanningProblem:
    """The graphs and checks plan() needs for one trace (`capture.trace.TraceResult`) and the bytes of a loss computed
    outside the model (`capture.loss_workspace.LossMemory`; 0 without one). See the module docstring."""

    def __init__(self, traced, loss_bytes: int = 0, loss_held_bytes: int = 0):
        self.traced = traced
        self.loss_bytes = int(loss_bytes)
        self.loss_held_bytes = int(loss_held_bytes)  # what the loss tensor keeps to the step's end (LossMemory)

    @property
    def check_floor_bytes(self) -> int:
        """What a step holds while it checks its input against the forward's scalar reads, before it runs: the
        model, the inputs and what the check makes (`TraceResult.check_bytes`); 0 when the forward reads no values.
        No budget below it works, whatever the schedule."""
        check = getattr(self.traced, "check_bytes", 0)
        return self.traced.graph.fixed_bytes + check if check else 0

    # ---- the graphs ----------------------------------------------------------------------------
    @cached_property
    def secondaries(self) -> dict[int, list[int]]:
        """Traced id of each multi-output op -> the traced ids of its secondary outputs."""
        return secondary_outputs(self.traced)

    def _build(self, pinned: bool) -> Graph:
        return solver_graph(self.traced, self.loss_bytes, pin_secondaries=pinned, secondaries=self.secondaries,
                            loss_held_bytes=self.loss_held_bytes)

    @cached_property
    def solver_graph(self) -> Graph:
        return self._build(pinned=False)

    @cached_property
    def pinned_graph(self) -> Graph:
        return self._build(pinned=True) if self.secondaries else self.solver_graph

    @cached_property
    def co_outputs(self) -> dict[int, list[int]]:
        """Node index of each multi-output op -> the node indices of its secondary outputs."""
        index = self.solver_graph.label_to_id
        return {index[src]: [index[s] for s in secs] for src, secs in self.secondaries.items()}

    @cached_property
    def exact_graph(self) -> Graph:
        """The solver graph with every node's own bytes: a forward multi-output op's node without its secondary
        outputs' (simulate it with `co_outputs`)."""
        g = self.solver_graph
        nodes = list(g.nodes)
        for v in self.co_outputs:
            own = int(self.traced.graph.nodes[g.labels[v]].bytes)
            if nodes[v].bytes != own:
                nodes[v] = dataclasses.replace(nodes[v], bytes=own)
        if nodes == list(g.nodes):
            return g
        return Graph(tuple(nodes), fixed_bytes=g.fixed_bytes, name=g.name, labels=g.labels)

    def graph(self, kind: GraphKind) -> Graph:
        return {GraphKind.SOLVER: lambda: self.solver_graph, GraphKind.PINNED: lambda: self.pinned_graph,
                GraphKind.EXACT: lambda: self.exact_graph}[GraphKind(kind)]()

    @cached_property
    def _uncounted(self) -> dict[int, list[int]]:
        """co_outputs of the multi-output ops whose solver-graph node does not count its secondary outputs (the
        backward ones: solver_graph counts them on forward ops only)."""
        nodes = self.solver_graph.nodes
        return {v: ss for v, ss in self.co_outputs.items() if nodes[v].backward}

    # ---- what plan() asks ------------------------------------------------------------------------
    def keep_all(self, budget_bytes: int) -> SolveResult | None:
        """The schedule that keeps every value, on the exact view, where the executor holds it within the budget and
        the problem has multi-output ops (without them the solver graph is exact, and auto tries this schedule first
        itself). It computes every node once, so no schedule costs less; this finds the budgets between the two
        views' peaks, where a solver on the solver graph would recompute for nothing."""
        if not self.secondaries:
            return None
        return self._on_exact_view(budget_bytes, "checkpoint_all", "auto (checkpoint_all)")

    def best_candidate(self, budget_bytes: int, candidates) -> SolveResult | None:
        """The cheapest of `candidates` ((label, solvers.heuristics.block_checkpoint options): the checkpointing the
        user would otherwise write) on the exact view, among those the executor holds within the budget. The solver
        graph over-counts multi-output ops, so a candidate may fit here where auto, on that graph, finds it over."""
        found = [self._on_exact_view(budget_bytes, "block_checkpoint", f"auto ({label})", **options)
                 for label, options in candidates]
        return min((r for r in found if r is not None), key=lambda r: r.total_cost, default=None)

    def _on_exact_view(self, budget_bytes: int, solver: str, name: str, **options) -> SolveResult | None:
        exact = self.exact_graph
        try:
            result = solve(exact, budget_bytes, solver, **options)
        except InfeasibleBudgetError:
            return None
        if self.as_executed(result.schedule.computes)[1] > budget_bytes:
            return None
        return dataclasses.replace(result, solver=name)

    def as_executed(self, computes) -> tuple[list[int], int]:
        """The computations (node indices) in the order the executor runs them (a recomputed secondary output taken
        right after the computation of its op it is indexed out of: `executor_sequence`), and that sequence's peak
        on the exact view."""
        exact = self.exact_graph
        held = executor_sequence(exact, computes, self.co_outputs)
        return held, int(simulate(exact, Schedule.from_sequence(exact, held), self.co_outputs).peak_bytes)

    def executable(self, graph: Graph, result: SolveResult) -> SolveResult | None:
        """`result` (solved on `graph`, the solver or pinned graph) as the executor holds it, or None where that does
        not fit the budget it was solved for.

        A recomputed secondary output is indexed out of its op's newest result, which holds it from that computation
        of the op on. A forward op's node counts its secondary outputs for as long as it is resident, and the op's
        result lives no longer than that (the secondary output reads it): nothing to move there. A backward op's node
        does not count them: replay what the executor holds (`executor_sequence`)."""
        seq = executor_sequence(graph, result.schedule.computes, self._uncounted)
        if seq == list(result.schedule.computes):
            return result
        sched = Schedule.from_sequence(graph, seq)
        sim = simulate(graph, sched)
        return dataclasses.replace(result, schedule=sched, sim=sim) if sim.peak_bytes <= result.budget_bytes else None

    def finalise(self, graph: Graph, result: SolveResult) -> Finalised:
        """The same computations with each value freed at its last use (what the step's fx code does), the sequence
        the executor runs, and its peak on the exact view."""
        sched = Schedule.from_sequence(graph, result.schedule.computes)
        sim = simulate(graph, sched)
        if sim.peak_bytes > result.budget_bytes:  # cannot happen: last-use frees are optimal for a sequence
            raise RematError(f"internal error: freeing at last use raised the peak to {sim.peak_bytes}")
        held, peak = self.as_executed(sched.computes)
        return Finalised(dataclasses.replace(result, schedule=sched, sim=sim), held, peak)

    def smallest_budget(self, time_limit_s: float) -> SmallestBudget:
        """The smallest budget known to be met by a schedule plan() can run: searched on the solver graph, counting
        only the schedules that are `executable`; where none is found, on the pinned graph with the time left. Never
        below `check_floor_bytes`."""
        t0 = time.perf_counter()
        graph = self.solver_graph
        found = _search_smallest(graph, time_limit_s, adapt=lambda r: self.executable(graph, r))
        left = time_limit_s - (time.perf_counter() - t0)
        if found.budget_bytes is None and self.secondaries and left >= 1.0:
            found = _search_smallest(self.pinned_graph, left)
        floor = self.check_floor_bytes
        if found.budget_bytes is None or found.budget_bytes >= floor:
            return found
        return SmallestBudget(floor, f"the input's check against the forward's value reads holds {floor} bytes with "
                                     f"the model and its inputs (the schedule alone: {found.budget_bytes}; "
                                     f"{found.proof})", found.solver)


def _search_smallest(graph: Graph, time_limit_s: float, adapt=None) -> SmallestBudget:
    """`solvers.bounds.min_budget` on `graph`, as a SmallestBudget (budget None when no solver met any in time)."""
    try:
        mb = min_budget(graph, time_limit_s=time_limit_s, adapt=adapt)
    except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
        return SmallestBudget(None, f"no solver met any budget within {time_limit_s:g} s ({e})", None)
    # the budget the solver was given when it met the minimum: planning at it reproduces the schedule
    # (a greedy solver is not monotone in the budget, so its peak itself may not be reproducible)
    return SmallestBudget(max(mb.budget_bytes, mb.result.budget_bytes), mb.proof, mb.result.solver)
