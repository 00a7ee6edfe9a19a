from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.errors import InfeasibleBudgetError
from graphs.schedule import Schedule
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from solvers.heuristics.dtr import Rollout
from solvers.heuristics.rollout_search import SCORES
from tests.solvers.heuristics.heuristic_cases import check_heuristic, graph_with_random_ops

SEGNET_MIN_BUDGET = 8287944704  # the smallest budget found for segnet (docs/results/checkmate_sweep.md)
SEGNET_FORCED_BOUND = 7192630.0  # the forced-recomputation bound there (every schedule costs at least this)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graph_with_random_ops, frac=st.floats(0.2, 1.1))
def test_rollout_search_valid_within_budget_or_names_a_budget_it_meets(graph, frac):
    check_heuristic(graph, max(0, int(frac * reference_peak_bytes(graph))), "rollout_search", rollouts=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graph_with_random_ops, frac=st.floats(0.3, 1.0))
def test_rollout_search_is_never_worse_than_its_unperturbed_rollouts(graph, frac):
    budget = int(frac * reference_peak_bytes(graph))
    eng = Rollout(graph)
    costs = []
    for _, den, opts in SCORES:
        seq = eng.run(budget, den, max_computes=4 * graph.n + 100, **opts)
        if seq is not None:
            sim = simulate(graph, Schedule.from_sequence(graph, seq))
            if sim.peak_bytes <= budget:
                costs.append(sim.total_cost)
    try:
        res = solve(graph, budget, "rollout_search", rollouts=20)
    except InfeasibleBudgetError:
        assert not costs, "an unperturbed rollout fits, yet the search reports the budget infeasible"
        return
    assert res.peak_bytes <= budget
    if costs:  # a perturbed rollout may fit where none of the unperturbed ones does (random_dag(12, 10272) at 0.6875)
        assert res.total_cost <= min(costs) + 1e-9


def test_perturbed_rollouts_beat_dtr_at_segnets_smallest_budget(bench_dir):
    g = load_benchmark(bench_dir / "segnet.json")
    dtr = solve(g, SEGNET_MIN_BUDGET, "dtr")
    res = solve(g, SEGNET_MIN_BUDGET, "rollout_search", rollouts=400, time_limit_s=120)
    assert res.peak_bytes <= SEGNET_MIN_BUDGET
    assert res.info["perturbed"] and res.info["rollouts"] == 400
    # DTR pays 47.97 %; the bound for every schedule is 45.80 %
    assert dtr.total_cost == 7299750.0
    assert SEGNET_FORCED_BOUND <= res.total_cost < dtr.total_cost - 50000


def test_rollout_search_stops_at_a_known_bound(bench_dir):
    g = load_benchmark(bench_dir / "segnet.json")
    res = solve(g, SEGNET_MIN_BUDGET, "rollout_search", rollouts=400, stop_at_cost=7400000.0)
    assert res.info["rollouts"] == 1  # DTR's unperturbed rollout already costs less than that


def test_rollout_search_names_a_budget_it_meets_where_every_rollout_gets_stuck(bench_dir):
    g = load_benchmark(bench_dir / "resnet50.json")
    budget = int(0.1 * reference_peak_bytes(g))  # above the single-operation bound (0.0972), below what DTR meets
    try:
        solve(g, budget, "rollout_search", rollouts=10)
    except InfeasibleBudgetError as e:
        assert e.solver == "rollout_search" and e.min_budget_bytes is not None and e.min_budget_bytes > budget
        assert solve(g, e.min_budget_bytes, "rollout_search", rollouts=3).peak_bytes <= e.min_budget_bytes
    else:
        raise AssertionError("DTR's rollouts get stuck on resnet50 at 0.1 of its peak (they did when written)")


def test_a_prior_below_one_makes_the_rollouts_evict_that_value_first():
    # a (cost 10) and b (cost 1) are read by d at the end; c is too large to sit beside both, so one of them is
    # evicted and computed again for d. Every score evicts the cheap b; a prior of 1e-6 on a turns that around.
    from graphs.ir import Graph, Node

    spec = [("a", 10.0, 4, ()), ("b", 1.0, 4, ()), ("c", 1.0, 4, ()), ("e", 1.0, 1, (2,)), ("d", 1.0, 1, (0, 1))]
    g = Graph(tuple(Node(i, name, cost, size, ins) for i, (name, cost, size, ins) in enumerate(spec)))
    plain = solve(g, 9, "rollout_search", rollouts=len(SCORES))
    assert plain.total_cost == g.total_cost + 1.0 and plain.peak_bytes <= 9
    steered = solve(g, 9, "rollout_search", rollouts=len(SCORES), prior=[1e-6, 1.0, 1.0, 1.0, 1.0])
    assert steered.total_cost == g.total_cost + 10.0 and steered.peak_bytes <= 9
