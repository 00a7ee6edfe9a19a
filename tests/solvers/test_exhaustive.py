"""Checks of the exhaustive-search oracle: hand-checked cases, an independent brute force, the simulator."""
import itertools
import random

import pytest

from graphs.errors import InfeasibleBudgetError, ScheduleError
from graphs.generate import linear_training_graph, random_dag, random_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import Schedule
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from tests.solvers.exhaustive import min_feasible_budget, optimal_cost


def checked(graph, budget):
    """optimal_cost, with its schedule replayed by the simulator."""
    res = optimal_cost(graph, budget)
    if res is not None:
        cost, sched = res
        sim = simulate(graph, sched)
        assert sim.peak_bytes <= budget
        assert sim.total_cost == pytest.approx(cost)
    return res


def cost_of(graph, budget):
    res = checked(graph, budget)
    return None if res is None else res[0]


def unit_chain(n):
    return Graph(tuple(Node(i, f"n{i}", 1.0, 1, (i - 1,) if i else ()) for i in range(n)))


# ---- hand-checked cases ---------------------------------------------------------------------------

def test_chain_needs_two_values_at_once():
    g = unit_chain(3)
    assert cost_of(g, 1) is None  # computing node 1 holds node 0 and node 1
    assert cost_of(g, 2) == 3.0


def test_linear_graph_l2():
    # Backward node 3 reads the loss 2 and forward 1 and writes one value: 3 units at least.
    # At 3 units forward 0 cannot stay resident through node 3, so it is recomputed once.
    g = linear_training_graph(2)
    assert cost_of(g, 2) is None
    assert cost_of(g, 3) == 6.0
    assert cost_of(g, 4) == 5.0
    assert min_feasible_budget(g) == 3


@pytest.mark.parametrize("L", [1, 2, 3, 5, 8])
def test_linear_graph_at_three_units_recomputes_from_scratch(L):
    # At 3 units each backward node holds only its two inputs and output, so forward i is
    # recomputed from node 0 (i + 1 computations) for every backward node but the first.
    g = linear_training_graph(L)
    assert cost_of(g, 3) == (2 * L + 1) + L * (L - 1) // 2


def test_checkmate_linear_graph_l8_budget4():
    # The Checkmate MILP optimum (../shared/benchmarks/README.md); the exhaustive search is exact here.
    g = linear_training_graph(8)
    assert cost_of(g, 4) == 26.0
    assert cost_of(g, 5) == 22.0
    assert cost_of(g, reference_peak_bytes(g)) == g.total_cost


def test_non_recomputable_node_forbids_the_recomputation():
    nodes = list(linear_training_graph(2).nodes)
    nodes[0] = Node(0, "dropout", 1.0, 1, (), recomputable=False)
    g = Graph(tuple(nodes))
    assert cost_of(g, 3) is None  # the only schedule at 3 units recomputes node 0
    assert cost_of(g, 4) == 5.0


def test_retained_value_stays_resident():
    # 0 (5 bytes, retained) -> 1 -> 2: 0 must be resident at the end. At 6 bytes node 2 cannot run
    # beside 0 (7 bytes), so 0 is dropped and recomputed at the end.
    nodes = (Node(0, "a", 1.0, 5, (), retain=True), Node(1, "b", 1.0, 1, (0,)), Node(2, "c", 1.0, 1, (1,)))
    g = Graph(nodes)
    assert cost_of(g, 5) is None  # node 1 needs 0 and 1: 6 bytes
    res = checked(g, 6)
    assert res[0] == 4.0 and res[1].computes == [0, 1, 2, 0]
    assert cost_of(g, 7) == 3.0
    nodes2 = (Node(0, "a", 1.0, 5, ()), Node(1, "b", 1.0, 1, (0,)), Node(2, "c", 1.0, 1, (1,)))
    assert cost_of(Graph(nodes2), 6) == 3.0


def test_fixed_bytes_count_against_the_budget():
    g = Graph(unit_chain(3).nodes, fixed_bytes=10)
    assert cost_of(g, 11) is None
    assert cost_of(g, 12) == 3.0
    assert optimal_cost(Graph(unit_chain(1).nodes, fixed_bytes=5), 4) is None


def test_recomputation_of_a_shared_input():
    # 0 (cost 2, 4 bytes) feeds 1 and 3; 1 (3 bytes) -> 2 -> 3. Keeping 0 while 2 runs takes
    # 4 + 3 + 1 = 8 bytes; dropping 0 after 1 and recomputing it before 3 peaks at 0 + 1 = 7.
    nodes = (Node(0, "a", 2.0, 4, ()), Node(1, "b", 1.0, 3, (0,)), Node(2, "c", 1.0, 1, (1,)),
             Node(3, "d", 1.0, 1, (0, 2)))
    g = Graph(nodes)
    assert cost_of(g, 8) == 5.0
    res = checked(g, 7)
    assert res[0] == 7.0 and res[1].computes == [0, 1, 2, 0, 3]
    assert cost_of(g, 6) is None  # node 1 alone needs 0 and 1 resident: 7 bytes


# ---- an independent brute force over compute sequences --------------------------------------------

def brute_force_unit_cost(graph, budget, max_len):
    """Min over every compute sequence of length <= max_len (frees at last use, optimal for a sequence).

    Only for unit costs, where cost = length; returns None if no sequence that short fits.
    """
    n = graph.n
    for length in range(1, max_len + 1):
        for seq in itertools.product(range(n), repeat=length):
            seen = set()
            ok = True
            for v in seq:  # cheap necessary condition before the simulator
                if any(i not in seen for i in graph.inputs[v]):
                    ok = False
                    break
                seen.add(v)
            if not ok:
                continue
            try:
                sim = simulate(graph, Schedule.from_sequence(graph, seq))
            except ScheduleError:
                continue
            if sim.peak_bytes <= budget:
                return float(length)
    return None


def unit_cost(g):
    return Graph(tuple(Node(nd.id, nd.name, 1.0, nd.bytes, nd.inputs, nd.backward, nd.retain, nd.recomputable)
                       for nd in g.nodes), fixed_bytes=g.fixed_bytes)


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_on_tiny_graphs(seed):
    g = unit_cost(random_dag(4, seed, max_bytes=4, retain_prob=0.2))
    lo, hi = g.single_op_bound_bytes(), reference_peak_bytes(g)
    for budget in range(lo - 1, hi + 1):
        ex = cost_of(g, budget)
        bf = brute_force_unit_cost(g, budget, max_len=g.n + 3)
        if ex is not None and ex <= g.n + 3:
            assert bf == ex
        else:
            assert bf is None


# ---- properties --------------------------------------------------------------------------------------

def small_graphs():
    out = [random_dag(n, seed, retain_prob=0.2) for n, seed in [(5, 1), (6, 2), (7, 3), (8, 4), (8, 5)]]
    out += [random_training_graph(3, seed) for seed in range(3)]
    out += [linear_training_graph(3, costs=random.Random(s).choices(range(1, 6), k=7),
                                  sizes=random.Random(s + 1).choices(range(1, 6), k=7)) for s in range(3)]
    return out


@pytest.mark.parametrize("g", small_graphs(), ids=lambda g: g.name)
def test_monotone_in_budget_and_below_every_baseline(g):
    lo = min_feasible_budget(g)
    assert lo >= g.single_op_bound_bytes()
    assert optimal_cost(g, lo - 1) is None
    hi = reference_peak_bytes(g)
    prev = None
    for budget in range(lo, hi + 1):
        cost = cost_of(g, budget)
        assert cost is not None and cost >= g.total_cost - 1e-9
        if prev is not None:
            assert cost <= prev + 1e-9
        prev = cost
        for name in ["chen_sqrtn", "chen_greedy_linear"]:
            try:
                res = solve(g, budget, name)
            except InfeasibleBudgetError:
                continue
            assert res.total_cost >= cost - 1e-9
    assert prev == pytest.approx(g.total_cost)  # the reference order fits at its own peak
