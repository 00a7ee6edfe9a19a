"""Shared cases and checks for the heuristics' tests: graph strategies with dropout-like nodes, and the checks
every heuristic's result must pass (a valid schedule within budget, or an infeasible budget it really meets;
never cheaper than the exhaustive optimum)."""
import dataclasses

from hypothesis import strategies as st

from graphs.errors import InfeasibleBudgetError
from graphs.generate import linear_training_graph, random_dag, random_training_graph
from graphs.ir import Graph
from graphs.schedule import Status
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from tests.solvers.exhaustive import optimal_cost


def with_random_ops(graph: Graph, mask: int) -> Graph:
    """The graph with the nodes whose bit is set in `mask` made non-recomputable (dropout-like)."""
    nodes = [dataclasses.replace(nd, recomputable=not (mask >> nd.id & 1)) for nd in graph.nodes]
    return Graph(tuple(nodes), fixed_bytes=graph.fixed_bytes, name=graph.name)


graph_strategy = st.one_of(
    st.builds(random_dag, st.integers(1, 14), st.integers(0, 10**6), retain_prob=st.sampled_from([0.0, 0.2])),
    st.builds(random_training_graph, st.integers(1, 10), st.integers(0, 10**6)),
    st.builds(lambda L: linear_training_graph(L), st.integers(1, 12)),
)
graph_with_random_ops = st.builds(with_random_ops, graph_strategy, st.integers(0, 2**14 - 1) | st.just(0))


def check_heuristic(graph: Graph, budget: int, solver: str, **options):
    """Run `solver`; check the schedule (or the infeasible budget it names, which must then work)."""
    try:
        res = solve(graph, budget, solver, **options)
    except InfeasibleBudgetError as e:
        assert e.solver == solver
        assert e.min_budget_bytes is not None and e.min_budget_bytes > budget
        assert e.min_budget_bytes >= graph.single_op_bound_bytes()
        assert e.min_budget_bytes <= max(reference_peak_bytes(graph), graph.single_op_bound_bytes())
        res = solve(graph, e.min_budget_bytes, solver, **options)
        budget = e.min_budget_bytes
    sim = simulate(graph, res.schedule)
    assert res.status is Status.HEURISTIC
    assert sim.peak_bytes <= budget
    assert sim.total_cost >= graph.total_cost - 1e-9
    for nd in graph.nodes:
        if not nd.recomputable:
            assert sim.compute_counts[nd.id] <= 1, f"non-recomputable {nd.id} computed {sim.compute_counts[nd.id]}x"
    return res


def check_not_below_optimum(graph: Graph, budget: int, solver: str, **options):
    """Run `solver`; a schedule it finds costs no less than the exhaustive optimum (and exists only if one does)."""
    best = optimal_cost(graph, budget)
    try:
        res = solve(graph, budget, solver, **options)
    except InfeasibleBudgetError:
        return
    assert best is not None, "the heuristic found a schedule where the exhaustive search says none exists"
    assert res.total_cost >= best[0] - 1e-9
