from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.generate import random_dag, random_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import Schedule
from graphs.simulate import reference_peak_bytes, simulate
from solvers.bounds.subgraph_bound import relaxed_min_budget, subgraph_floor_bytes
from solvers.heuristics.lowest_memory import lowest_memory_sequence
from tests.solvers.exhaustive import min_feasible_budget

small_graphs = st.one_of(
    st.builds(random_dag, st.integers(2, 8), st.integers(0, 10**6), retain_prob=st.sampled_from([0.0, 0.3])),
    st.builds(random_training_graph, st.integers(2, 4), st.integers(0, 10**6)),
)

RESNET50_MIN_BUDGET = 4110417920  # met by lowest_memory (0.108 x the reference peak)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_graphs, data=st.data())
def test_the_relaxation_over_any_node_set_never_exceeds_the_true_smallest_budget(graph, data):
    # the relaxation is a floor for every schedule whatever the set S: check it on random sets against the
    # exhaustive search over all schedules (with some fixed bytes too)
    graph = Graph(graph.nodes, fixed_bytes=data.draw(st.integers(0, 6)), name=graph.name)
    truth = min_feasible_budget(graph)
    nodes = data.draw(st.sets(st.integers(0, graph.n - 1), min_size=1))
    sink = data.draw(st.sampled_from(sorted(nodes)))
    cap = reference_peak_bytes(graph) + graph.single_op_bound_bytes()
    b = relaxed_min_budget(graph, nodes, sink, cap)
    assert b is not None and b <= truth
    # a larger set is at least as tight
    more = nodes | data.draw(st.sets(st.integers(0, graph.n - 1)))
    b_more = relaxed_min_budget(graph, more, sink, cap)
    assert b_more is not None and b <= b_more <= truth
    # and the relaxation needs at least the sink's own inputs and output
    need = int(graph.sizes[sink]) + sum(int(graph.sizes[i]) for i in set(graph.inputs[sink])) + graph.fixed_bytes
    assert b >= need


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_graphs)
def test_the_floor_never_exceeds_the_true_smallest_budget(graph):
    truth = min_feasible_budget(graph)
    found = subgraph_floor_bytes(graph, truth - 1)
    if found is not None:
        assert found.budget_bytes <= truth
        if found.capped:
            assert found.budget_bytes == truth  # proven: nothing below `truth` fits, and `truth` does


def test_two_branches_whose_results_meet_need_more_than_any_single_operation():
    # s feeds two branches; x = s's 4-byte child, y = its 4-byte child; a and b are 1-byte results of a heavy
    # (8-byte) step each, and j reads both results. Any order must hold one branch's result (1 byte) while the
    # other branch's 8-byte step runs beside its 4-byte input: 4 + 8 + 1 = 13 > 12, the single-operation bound.
    nodes = (Node(0, "s", 1.0, 4), Node(1, "x", 1.0, 8, (0,)), Node(2, "a", 1.0, 1, (1,)),
             Node(3, "y", 1.0, 8, (0,)), Node(4, "b", 1.0, 1, (3,)), Node(5, "j", 1.0, 1, (2, 4)))
    g = Graph(nodes)
    assert g.single_op_bound_bytes() == 12
    truth = min_feasible_budget(g)
    assert truth == 13
    found = subgraph_floor_bytes(g, truth - 1)
    assert found is not None and found.capped and found.budget_bytes == 13
    # fixed bytes (parameters, inputs) shift everything by as much
    g5 = Graph(nodes, fixed_bytes=5)
    assert min_feasible_budget(g5) == 18
    found = subgraph_floor_bytes(g5, 17)
    assert found is not None and found.capped and found.budget_bytes == 18
    assert relaxed_min_budget(g5, found.nodes, found.sink, 18) == 18


def test_resnet50s_smallest_budget_is_proven_by_the_relaxation(bench_dir):
    g = load_benchmark(bench_dir / "resnet50.json")
    sim = simulate(g, Schedule.from_sequence(g, lowest_memory_sequence(g)))
    assert sim.peak_bytes == RESNET50_MIN_BUDGET  # met by a schedule
    found = subgraph_floor_bytes(g, RESNET50_MIN_BUDGET - 1)
    assert found is not None and found.capped and found.budget_bytes == RESNET50_MIN_BUDGET
    assert g.nodes[found.sink].backward and len(found.nodes) <= 24
    assert g.single_op_bound_bytes() < RESNET50_MIN_BUDGET
    # one byte more and the same part of the graph fits
    assert relaxed_min_budget(g, found.nodes, found.sink, RESNET50_MIN_BUDGET, max_states=10**6) == RESNET50_MIN_BUDGET


def test_min_budget_reports_the_relaxation_as_its_proof():
    from solvers.bounds.min_budget import min_budget

    nodes = (Node(0, "s", 1.0, 4), Node(1, "x", 1.0, 8, (0,)), Node(2, "a", 1.0, 1, (1,)),
             Node(3, "y", 1.0, 8, (0,)), Node(4, "b", 1.0, 1, (3,)), Node(5, "j", 1.0, 1, (2, 4)))
    mb = min_budget(Graph(nodes), time_limit_s=20)
    assert mb.budget_bytes == 13 and mb.proven and mb.lower_bound_bytes == 13
    assert mb.proof.startswith("subgraph relaxation, for every schedule")
    assert simulate(Graph(nodes), mb.result.schedule).peak_bytes <= 13


def test_auto_says_when_no_schedule_of_any_kind_fits():
    import pytest

    from graphs.errors import InfeasibleBudgetError
    from solvers.base import solve

    nodes = (Node(0, "s", 1.0, 4), Node(1, "x", 1.0, 8, (0,)), Node(2, "a", 1.0, 1, (1,)),
             Node(3, "y", 1.0, 8, (0,)), Node(4, "b", 1.0, 1, (3,)), Node(5, "j", 1.0, 1, (2, 4)))
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(Graph(nodes), 12, "auto", time_limit_s=20)  # the single-operation bound, one byte short
    assert "no schedule of any kind fits (subgraph relaxation" in e.value.reason
    assert e.value.min_budget_bytes == 13
