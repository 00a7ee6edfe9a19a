"""The CP-SAT solver: exact over its family (checked against exhaustive search), statuses, bounds, hints.

Family of `cpsat` (C = max_computations): stage k ends with the first computation of node k (reference order)
and may recompute earlier nodes first, in ascending id order, at most once per stage; each node is computed at
most C times; values are freed at their last use. tests/solvers/cpsat_family_oracle.py enumerates that family.
"""
from __future__ import annotations

import math

import pytest

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.generate import linear_training_graph, random_dag, random_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import Schedule, Status
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from solvers.exact.cpsat_family import family_form, sequence_from_stages, stage_normal_form
from solvers.heuristics import baselines
from tests.solvers.cpsat_family_oracle import frontier, optimum


def _with_extras(g: Graph, fixed_bytes: int, retain: set[int] = frozenset(), fixed_node: int | None = None) -> Graph:
    nodes = [Node(nd.id, nd.name, nd.cost, nd.bytes, nd.inputs, nd.backward, nd.retain or nd.id in retain,
                  nd.id != fixed_node) for nd in g.nodes]
    return Graph(tuple(nodes), fixed_bytes=fixed_bytes, name=g.name)


def _budgets(g: Graph, front) -> list[int]:
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    return sorted({lo - 1, lo, hi, *(p for p, _ in front if lo <= p <= hi)})


def _cpsat_cost(g: Graph, budget: int, **kw) -> float | None:
    try:
        r = solve(g, budget, "cpsat", **kw)
    except InfeasibleBudgetError:
        return None
    assert r.status is Status.OPTIMAL
    assert r.lower_bound_cost == pytest.approx(r.total_cost)
    assert family_form(g, r.schedule.computes, kw.get("max_computations", 2)) is not None
    return r.total_cost


def _linear(seed: int) -> Graph:
    import random

    r = random.Random(seed)
    return linear_training_graph(3, costs=[r.randint(1, 5) for _ in range(7)],
                                 sizes=[r.randint(1, 5) for _ in range(7)], name=f"linear3_{seed}")


# (graph, max_computations): seeds picked so that several budgets force different recomputations
CASES = [
    (random_dag(7, 6, edge_prob=0.6, max_fan_in=2), 2),
    (_with_extras(random_dag(7, 8, edge_prob=0.6, max_fan_in=2), fixed_bytes=5, retain={4}), 2),
    (_with_extras(random_dag(7, 9, edge_prob=0.6, max_fan_in=2), fixed_bytes=0, fixed_node=2), 2),
    (random_training_graph(3, 10), 2),
    (_linear(0), 2),
    (_linear(9), 2),
    (_with_extras(_linear(11), fixed_bytes=2, retain={5}), 2),
    (_with_extras(random_dag(6, 9, edge_prob=0.6, max_fan_in=2), fixed_bytes=1, retain={3}), 3),
    (random_dag(6, 6, edge_prob=0.6, max_fan_in=2), 3),
]


@pytest.mark.parametrize("g,C", CASES, ids=[f"{g.name}-C{C}" for g, C in CASES])
def test_optimum_equals_exhaustive_search_over_the_family(g, C):
    front = frontier(g, C)
    for b in _budgets(g, front):
        want = optimum(front, b)
        got = _cpsat_cost(g, b, max_computations=C)
        assert got == want, f"budget {b}: cpsat {got}, exhaustive {want}"


@pytest.mark.parametrize("g,C", CASES, ids=[f"{g.name}-C{C}" for g, C in CASES])
def test_the_forced_bound_as_objective_floor_keeps_the_optimum(g, C):
    from graphs.errors import InfeasibleBudgetError
    from solvers.bounds.forced_bound import forced_recompute_bound

    front = frontier(g, C)
    for b in _budgets(g, front):
        want = optimum(front, b)
        try:
            known = forced_recompute_bound(g, b).lower_bound_cost
        except InfeasibleBudgetError:
            assert want is None
            continue
        got = _cpsat_cost(g, b, max_computations=C, known_lower_bound_cost=known)
        assert got == want, f"budget {b}: cpsat with the forced bound {got}, exhaustive {want}"


@pytest.mark.parametrize("g", [g for g, _ in CASES[:5]], ids=[g.name for g, _ in CASES[:5]])
def test_a_wider_family_never_costs_more(g):
    # C = 3 allows every schedule of C = 2 (auto runs the wider family first on small training graphs)
    front = frontier(g, 2)
    for budget in _budgets(g, front):
        narrow, wide = _cpsat_cost(g, budget, max_computations=2), _cpsat_cost(g, budget, max_computations=3)
        assert (narrow is None) or (wide is not None and wide <= narrow + 1e-9)


def test_feasibility_phase_finds_the_same_optimum_without_a_hint():
    g = _with_extras(_linear(0), fixed_bytes=4, retain={3})
    front = frontier(g, 2)
    for b in _budgets(g, front):
        assert _cpsat_cost(g, b, hint=False) == optimum(front, b)


def test_checkmate_linear_graph_at_budget_4():
    g = linear_training_graph(8)
    # With two computations per node nothing fits in 4: the family's proven minimum peak is 5.
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, 4, "cpsat")
    assert e.value.min_budget_bytes == 5 and "family" in e.value.reason
    assert solve(g, 5, "cpsat").total_cost == 22
    # Three computations per node reach the Checkmate MILP optimum of 26 (the families then coincide here).
    r = solve(g, 4, "cpsat", max_computations=3)
    assert (r.total_cost, r.status, r.lower_bound_cost) == (26, Status.OPTIMAL, 26)
    assert r.peak_bytes <= 4


def test_optimum_never_rises_as_the_budget_grows():
    g = random_training_graph(6, 11)
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    last = math.inf
    for b in sorted({*range(lo, hi, max(1, (hi - lo) // 8)), hi}):
        cost = _cpsat_cost(g, b)
        if cost is None:
            assert last == math.inf, f"budget {b} infeasible after a smaller one was feasible"
            continue
        assert cost <= last + 1e-9
        last = cost
    assert last == g.total_cost  # at the reference peak nothing is recomputed


@pytest.mark.parametrize("seed", [1, 2])
def test_every_baseline_in_the_family_costs_at_least_the_optimum(seed):
    g = random_training_graph(7, seed)
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    checked = 0
    for b in sorted({lo, (lo + hi) // 2, (lo + 2 * hi) // 3, hi}):
        opt = _cpsat_cost(g, b)
        for name in ("checkpoint_all", "chen_sqrtn", "chen_sqrtn_linear", "chen_greedy", "chen_greedy_linear"):
            try:
                r = solve(g, b, name)
            except InfeasibleBudgetError:
                continue
            if family_form(g, r.schedule.computes, 2) is not None:
                assert opt is not None and r.total_cost >= opt - 1e-9, (name, b)
                checked += 1
    assert checked > 0


def test_a_hint_from_a_given_sequence_is_used():
    g = random_training_graph(6, 3)
    b = reference_peak_bytes(g) - 1
    seq = baselines.chen_greedy_linear(g, reference_peak_bytes(g)).schedule.computes
    r = solve(g, reference_peak_bytes(g), "cpsat", hint=False, hint_sequence=seq)
    assert r.info["hint"] == "given" and r.total_cost == g.total_cost
    r2 = solve(g, b, "cpsat", hint=False, hint_sequence=[0, 1])  # not a family member: ignored
    assert r2.info["hint"] != "given"


def test_stage_normal_form_orders_each_stages_recomputations_once():
    # first computations 0..4 stay where they are; what runs between two of them is sorted and deduplicated
    assert stage_normal_form([0, 1, 2, 3, 1, 0, 1, 4, 2, 0]) == [0, 1, 2, 3, 0, 1, 4, 0, 2]
    assert stage_normal_form([0, 1, 2]) == [0, 1, 2]


def test_a_hint_outside_the_family_is_used_in_its_stage_normal_form():
    # DTR's schedule here recomputes out of id order within a stage (found by a search over small seeds)
    g = random_training_graph(12, 2)
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    b = int(lo + 0.3 * (hi - lo))
    seq = solve(g, b, "dtr").schedule.computes
    C = 4
    assert family_form(g, seq, C) is None
    normal = stage_normal_form(seq)
    assert family_form(g, normal, C) is not None
    sim = simulate(g, Schedule.from_sequence(g, normal))
    assert sim.peak_bytes <= b
    r = solve(g, b, "cpsat", hint=False, hint_sequence=seq, max_computations=C)
    assert r.info["hint"] == "given, stage normal form"
    assert r.total_cost <= sim.total_cost + 1e-9


def test_below_the_single_operation_bound_raises_with_that_bound():
    g = random_dag(6, 4)
    floor = g.single_op_bound_bytes()
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, floor - 1, "cpsat")
    assert e.value.min_budget_bytes == floor


def test_fractional_costs_keep_the_bound_below_the_true_cost():
    g0 = random_training_graph(3, 7)
    nodes = [Node(nd.id, nd.name, nd.cost / 3 + 1e-3 * nd.id, nd.bytes, nd.inputs, nd.backward) for nd in g0.nodes]
    g = Graph(tuple(nodes), name="fractional")
    b = (g.single_op_bound_bytes() + reference_peak_bytes(g)) // 2
    r = solve(g, b, "cpsat")
    assert r.lower_bound_cost <= r.total_cost + 1e-12
    assert r.info["cost_scaling"].startswith("floored")
    front = frontier(g, 2)
    assert r.total_cost == pytest.approx(optimum(front, b), rel=1e-6)


def test_time_limited_runs_never_claim_a_wrong_optimum(bench_dir):
    from graphs.benchmarks import benchmark_path, load_benchmark
    from graphs.simulate import budget_from_multiplier

    g = load_benchmark(benchmark_path("resnet50", bench_dir))
    b = budget_from_multiplier(g, 0.8)
    try:
        r = solve(g, b, "cpsat", time_limit_s=1.0)
    except NoSolutionInTimeError:
        return
    assert r.status in (Status.FEASIBLE, Status.HEURISTIC)
    assert r.lower_bound_cost is None or r.lower_bound_cost < r.total_cost


def test_family_form_round_trip():
    g = linear_training_graph(4)
    stages = [[0, 5, 6], [1, 5], [2], [3], [4], [5], [6], [7], [8]]
    seq = sequence_from_stages(g, stages)
    form = family_form(g, seq, 3)
    assert form is not None and [list(s) for s in form.stages] == stages
    assert family_form(g, seq, 2) is None  # node 0 is computed three times
    assert family_form(g, [1, 0], 2) is None
    simulate(g, Schedule.from_sequence(g, seq))  # a valid schedule


@pytest.mark.parametrize("seed", range(6))
def test_greedy_warm_start_is_a_family_member_within_budget(seed):
    from solvers.exact.cpsat_greedy import best_greedy_sequence

    g = random_training_graph(12, seed)
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    assert best_greedy_sequence(g, hi) == list(range(g.n))  # nothing to evict at the reference peak
    for b in range(lo, hi, max(1, (hi - lo) // 6)):
        seq = best_greedy_sequence(g, b)
        if seq is None:
            continue
        assert family_form(g, seq, 2) is not None
        assert simulate(g, Schedule.from_sequence(g, seq)).peak_bytes <= b
