"""The forced-recomputation bound: below every schedule's cost (exhaustive oracle), and tight where it should be."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.errors import InfeasibleBudgetError
from graphs.ir import Graph, Node
from graphs.simulate import budget_from_multiplier, reference_peak_bytes
from solvers.base import solve
from solvers.bounds.forced_bound import conflict_rows, forced_recompute_bound
from tests.solvers.bounds.strategies import oracle_graphs, small_graphs
from tests.solvers.exhaustive import SearchTooLargeError, optimal_cost
from tests.solvers.heuristics.heuristic_cases import with_random_ops


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=oracle_graphs, frac=st.floats(0.2, 1.05))
def test_bound_never_exceeds_the_exhaustive_optimum(graph, frac):
    budget = max(graph.single_op_bound_bytes(), int(frac * reference_peak_bytes(graph)))
    try:
        best = optimal_cost(graph, budget, max_states=200_000)
    except SearchTooLargeError:
        return
    try:
        fb = forced_recompute_bound(graph, budget)
    except InfeasibleBudgetError:
        assert best is None, "the bound called a budget infeasible that a schedule meets"
        return
    assert fb.proven
    if best is not None:
        assert fb.lower_bound_cost <= best[0] * (1 + 1e-9) + 1e-9
    assert fb.lower_bound_cost >= graph.total_cost


def test_one_large_value_that_must_be_recomputed():
    # a -> b -> c -> d, and d also reads a: while c runs (inputs b, output c), a must be resident unless
    # it is computed twice. With room for b, c and d's inputs but not a as well, a must run twice.
    nodes = (Node(0, "a", 10.0, 4), Node(1, "b", 1.0, 4, (0,)), Node(2, "c", 1.0, 4, (1,)),
             Node(3, "d", 1.0, 1, (0, 2)))
    g = Graph(nodes)
    rows = conflict_rows(g, 11)
    assert [(r.node, r.members) for r in rows] == [(2, (0,))]
    fb = forced_recompute_bound(g, 11)
    assert fb.recomputed == (0,) and fb.lower_bound_cost == g.total_cost + 10.0
    assert optimal_cost(g, 11)[0] == fb.lower_bound_cost  # and a schedule reaches it
    assert forced_recompute_bound(g, 12).lower_bound_cost == g.total_cost  # a fits beside b and c


def test_non_recomputable_values_can_prove_a_budget_infeasible():
    nodes = (Node(0, "a", 1.0, 4, recomputable=False), Node(1, "b", 1.0, 4, (0,)), Node(2, "c", 1.0, 4, (1,)),
             Node(3, "d", 1.0, 1, (0, 2)))
    g = Graph(nodes)
    assert g.single_op_bound_bytes() == 9  # d: a, c and d; b -> c: b and c
    with pytest.raises(InfeasibleBudgetError):
        forced_recompute_bound(g, 11)  # while c runs, a (not recomputable) must be resident: 12 bytes
    assert optimal_cost(g, 11) is None and optimal_cost(g, 12) is not None


def test_segnet_at_half_its_peak_must_run_its_first_convolution_twice(bench_dir):
    # node 1 (40.2 % of the cost, 0.104 of the reference peak) is read by node 75, and node 74 alone needs
    # 0.416 of the peak: at 0.5 node 1 cannot stay resident across node 74.
    g = load_benchmark(bench_dir / "segnet.json")
    fb = forced_recompute_bound(g, budget_from_multiplier(g, 0.5))
    assert 1 in fb.recomputed
    assert fb.lower_bound_cost / g.total_cost - 1 > 0.40
    res = solve(g, budget_from_multiplier(g, 0.5), "dtr")
    assert res.total_cost >= fb.lower_bound_cost


def test_checkmate_graphs_at_90_percent(bench_dir):
    # the bound meets the proven optima there (vgg19 0.10 %, unet 1.13 %, segnet 0.10 %, measured)
    for name, overhead in (("vgg19", 0.0010), ("unet", 0.0113), ("segnet", 0.0010)):
        g = load_benchmark(bench_dir / f"{name}.json")
        fb = forced_recompute_bound(g, budget_from_multiplier(g, 0.9))
        assert fb.lower_bound_cost / g.total_cost - 1 == pytest.approx(overhead, abs=5e-5), name


def test_memory_floor_and_min_budget_with_a_non_recomputable_value():
    from solvers.bounds.forced_bound import memory_floor_bytes
    from solvers.bounds.min_budget import min_budget

    nodes = (Node(0, "a", 1.0, 4, recomputable=False), Node(1, "b", 1.0, 4, (0,)), Node(2, "c", 1.0, 4, (1,)),
             Node(3, "d", 1.0, 1, (0, 2)))
    g = Graph(nodes)
    assert g.single_op_bound_bytes() == 9 and memory_floor_bytes(g) == 12
    mb = min_budget(g, time_limit_s=20)
    assert mb.budget_bytes == 12 and mb.proven and "non-recomputable" in mb.proof
    plain = Graph(tuple(dataclasses.replace(nd, recomputable=True) for nd in nodes))
    assert memory_floor_bytes(plain) == 9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=st.builds(with_random_ops, small_graphs, st.integers(0, 255)))
def test_memory_floor_is_a_floor(graph):
    from solvers.bounds.forced_bound import memory_floor_bytes

    floor = memory_floor_bytes(graph)
    assert floor >= graph.single_op_bound_bytes()
    try:
        below = optimal_cost(graph, floor - 1, max_states=200_000)
    except SearchTooLargeError:
        return
    assert below is None


def test_a_time_limit_too_short_to_scan_says_so(bench_dir):
    from graphs.errors import NoSolutionInTimeError

    g = load_benchmark(bench_dir / "rl1000.json")
    with pytest.raises(NoSolutionInTimeError):
        forced_recompute_bound(g, budget_from_multiplier(g, 0.5), time_limit_s=1e-6)


def test_windows_count_a_value_that_must_run_three_times():
    # s -> a -> b -> c; d reads a and c; end reads d and s. At budget 9 neither a nor s fits beside b and c, nor s
    # beside a, c and d: a is rebuilt between c and d (from s, which is rebuilt for it), and s once more after d
    # for end. The plain rows see one extra run of s and of a (16); the windows see s run three times (21), which
    # is the exhaustive optimum.
    nodes = (Node(0, "s", 5.0, 1), Node(1, "a", 1.0, 4, (0,)), Node(2, "b", 1.0, 5, (1,)), Node(3, "c", 1.0, 4, (2,)),
             Node(4, "d", 1.0, 1, (1, 3)), Node(5, "end", 1.0, 1, (4, 0)))
    g = Graph(nodes)
    assert g.single_op_bound_bytes() == 9
    assert forced_recompute_bound(g, 9, windows=False).lower_bound_cost == 16.0
    assert forced_recompute_bound(g, 9).lower_bound_cost == 21.0 == optimal_cost(g, 9)[0]


def test_windows_on_segnet_at_its_smallest_budget(bench_dir):
    # 42.18 % plain, 45.80 % with windows (measured): the stage MILP's proven optimum there (45.80 %, 182 s),
    # so no schedule of any order beats that family's best
    g = load_benchmark(bench_dir / "segnet.json")
    b = g.single_op_bound_bytes()
    plain = forced_recompute_bound(g, b, windows=False).lower_bound_cost / g.total_cost - 1
    # no time limit: the window program's optimum is reached only when it finishes (~5 s idle, 20 s at auto's
    # budget), and a time-limited run on a loaded machine stops below it
    windows = forced_recompute_bound(g, b, time_limit_s=None).lower_bound_cost / g.total_cost - 1
    assert round(100 * plain, 2) == 42.18 and round(100 * windows, 2) == 45.80


def test_closures_count_the_inputs_an_absent_value_needs_again():
    # x -> s (the scores: costly) -> p (the softmax: cheap) -> o -> l -> m; d reads m and p (as the backward reads
    # the softmax's output). At budget 6, p does not fit beside o and l, so it runs again after them; that needs s,
    # which does not fit there either and runs again too (from x, which does). The plain rows see p's second run
    # only (17); the closures see s's as well (27), the exhaustive optimum.
    nodes = (Node(0, "x", 1.0, 1), Node(1, "s", 10.0, 2, (0,)), Node(2, "p", 1.0, 2, (1,)), Node(3, "o", 1.0, 1, (2,)),
             Node(4, "l", 1.0, 4, (3,)), Node(5, "m", 1.0, 1, (4,)), Node(6, "d", 1.0, 1, (5, 2)))
    g = Graph(nodes)
    assert forced_recompute_bound(g, 6, windows=False, closures=False).lower_bound_cost == 17.0
    assert forced_recompute_bound(g, 6, windows=False).lower_bound_cost == 27.0 == optimal_cost(g, 6)[0]
