import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.errors import InfeasibleBudgetError
from graphs.generate import random_dag, random_training_graph
from graphs.ir import Graph
from graphs.simulate import budget_from_multiplier, reference_peak_bytes
from solvers.base import solve
from solvers.heuristics.dtr import Rollout, dtr_den
from tests.solvers.heuristics.heuristic_cases import (
    check_heuristic,
    check_not_below_optimum,
    graph_strategy,
    graph_with_random_ops,
)


@pytest.mark.parametrize("solver", ["dtr", "dtr_local"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graph_with_random_ops, frac=st.floats(0.2, 1.1))
def test_dtr_valid_within_budget_or_names_a_budget_it_meets(solver, graph, frac):
    check_heuristic(graph, max(0, int(frac * reference_peak_bytes(graph))), solver)


@settings(max_examples=40, deadline=None)
@given(graph=graph_strategy)
def test_dtr_at_the_reference_peak_recomputes_nothing(graph):
    res = solve(graph, reference_peak_bytes(graph), "dtr")
    assert res.overhead == 0.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=st.one_of(st.builds(random_dag, st.integers(1, 7), st.integers(0, 10**6)),
                       st.builds(random_training_graph, st.integers(1, 3), st.integers(0, 10**6))),
       frac=st.floats(0.3, 1.0))
def test_dtr_never_beats_the_exhaustive_optimum(graph, frac):
    check_not_below_optimum(graph, int(frac * reference_peak_bytes(graph)), "dtr")
    check_not_below_optimum(graph, int(frac * reference_peak_bytes(graph)), "dtr_local")


def test_rollout_never_evicts_what_the_next_computation_reads():
    # a fan-in node: all four inputs must be resident together with the output
    from graphs.ir import Node

    nodes = [Node(i, f"a{i}", 1.0, 10) for i in range(4)]
    nodes.append(Node(4, "sum", 1.0, 10, (0, 1, 2, 3)))
    g = Graph(tuple(nodes))
    assert Rollout(g).run(49, dtr_den) is None  # 5 x 10 bytes are needed at once
    seq = Rollout(g).run(50, dtr_den)
    assert seq == [0, 1, 2, 3, 4]


def test_dtr_on_segnet_at_half_the_peak(bench_dir):
    g = load_benchmark(bench_dir / "segnet.json")
    res = check_heuristic(g, budget_from_multiplier(g, 0.5), "dtr")
    assert 0.0 < res.overhead < 1.0  # it must recompute, and stays a sane baseline (measured 42 %)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graph_with_random_ops, frac=st.floats(0.2, 1.1))
def test_dtr_with_eager_freeing_is_valid_too(graph, frac):
    check_heuristic(graph, max(0, int(frac * reference_peak_bytes(graph))), "dtr", zombies=False)


def test_dtr_local_reproduces_the_figures_the_issue_quotes(bench_dir):
    # The tight-budget issue quotes a DTR-style heuristic at resnet50 0.11 % / 0.31 % (0.9 / 0.8) and segnet 42 %
    # (0.5); h_DTR-local gives those (measured 0.11 / 0.31 / 42.26 %), h_DTR (the neighbourhood cost) 0.13 / 0.34.
    g = load_benchmark(bench_dir / "resnet50.json")
    assert round(100 * check_heuristic(g, budget_from_multiplier(g, 0.9), "dtr_local").overhead, 2) == 0.11
    assert round(100 * check_heuristic(g, budget_from_multiplier(g, 0.8), "dtr_local").overhead, 2) == 0.31
    s = load_benchmark(bench_dir / "segnet.json")
    assert round(100 * check_heuristic(s, budget_from_multiplier(s, 0.5), "dtr_local").overhead) == 42


def test_dtr_local_gets_stuck_on_wide_fan_in_where_dtr_does_not(bench_dir):
    g = load_benchmark(bench_dir / "rl100.json")
    budget = budget_from_multiplier(g, 0.9)
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, budget, "dtr_local")
    assert e.value.min_budget_bytes > budget
    assert solve(g, budget, "dtr").overhead < 0.02  # measured 1.63 %
