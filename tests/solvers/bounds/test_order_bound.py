"""The program-order bound: below the best program-order schedule (exhaustive oracle), above the bound for every
schedule, and the schedules the solvers return lie in its family."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.errors import GraphError, InfeasibleBudgetError, NoSolutionInTimeError
from graphs.generate import decoder_training_graph, linear_training_graph, random_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import Schedule
from graphs.simulate import reference_peak_bytes
from solvers.base import solve, solver_names
from solvers.bounds.forced_bound import _solve_program, forced_recompute_bound
from solvers.bounds.order_bound import in_program_order, life_intervals, order_bound, order_rows, undominated_in_order
from solvers.bounds.row_program import RowProgram
from tests.solvers.bounds.strategies import oracle_graphs
from tests.solvers.exhaustive import SearchTooLargeError, optimal_cost


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=oracle_graphs, frac=st.floats(0.2, 1.05))
def test_bound_never_exceeds_the_best_program_order_schedule(graph, frac):
    budget = max(graph.single_op_bound_bytes(), int(frac * reference_peak_bytes(graph)))
    try:
        best = optimal_cost(graph, budget, max_states=200_000, program_order=True)
    except SearchTooLargeError:
        return
    ob = order_bound(graph, budget, time_limit_s=None)
    assert ob is not None and ob.proven
    if not ob.fits:
        assert best is None, "the bound said no program-order schedule fits, and one does"
        return
    if best is not None:
        assert in_program_order(best[1])
        assert ob.lower_bound_cost <= best[0] * (1 + 1e-9) + 1e-9
    assert ob.lower_bound_cost >= graph.total_cost
    try:
        every = forced_recompute_bound(graph, budget, windows=False, time_limit_s=None)
    except InfeasibleBudgetError:
        return
    # its rows hold all the values the bound for every schedule counts, and more (every row: a row left out as
    # implied by another may have had a larger closure, e.g. with_random_ops(random_dag(6, 91533, retain_prob=0.0), 0)
    # at 0.5, where the two rows of one member differ in whether that member's input is resident anyway)
    full = order_bound(graph, budget, time_limit_s=None, prune_rows=False)
    if best is not None:
        assert full.lower_bound_cost <= best[0] * (1 + 1e-9) + 1e-9
    assert full.lower_bound_cost >= every.lower_bound_cost * (1 - 1e-9) - 1e-9


def test_a_value_read_by_a_later_branch_counts_in_program_order():
    # a -> b -> c, and d reads a; c and d are independent. Any order may run d before c, freeing a; in program
    # order (a, b, c, d) a is resident while c runs. At budget 8 (b and c take 8), a must run twice.
    nodes = (Node(0, "a", 5.0, 2), Node(1, "b", 1.0, 4, (0,)), Node(2, "c", 1.0, 4, (1,)), Node(3, "d", 1.0, 1, (0,)))
    g = Graph(nodes)
    assert forced_recompute_bound(g, 8, windows=False).lower_bound_cost == g.total_cost
    assert optimal_cost(g, 8)[0] == g.total_cost  # d first: nothing runs twice
    ob = order_bound(g, 8, time_limit_s=None)
    assert ob.lower_bound_cost == g.total_cost + 5.0 == optimal_cost(g, 8, program_order=True)[0]
    assert ob.recomputed == (0,)  # what its solution computes twice: a


def test_a_value_absent_between_two_pairs_of_its_readers_pays_twice():
    # b is read by e and by k; c (then d) and g (then h) are too large to sit beside it, so in program order b is
    # absent while c and while g run, and is computed again before e and again before k: three computations
    # (a, one byte, stays). One extra computation per value, wherever it is absent, counts b's second only.
    spec = [("a", 1, 1, ()), ("b", 4, 5, (0,)), ("c", 1, 8, (0,)), ("d", 1, 1, (2,)), ("e", 1, 1, (1, 3)),
            ("g", 1, 8, (4,)), ("h", 1, 1, (5,)), ("k", 1, 1, (1, 6))]
    g = Graph(tuple(Node(i, name, float(cost), size, ins) for i, (name, cost, size, ins) in enumerate(spec)))
    best = optimal_cost(g, 12, program_order=True)[0]
    assert best == g.total_cost + 8.0
    assert order_bound(g, 12, time_limit_s=None).lower_bound_cost == best
    once = RowProgram(g, "once per value")
    for row in order_rows(g, 12):
        once.add_row(row)
    assert _solve_program(once.finish(), None) == (True, 4.0)


def test_a_value_needed_by_a_recomputation_and_absent_again_is_computed_a_third_time():
    # u (read by y) and z (read by u and, late, by k) are absent while c and d run; u is computed again before y,
    # reading z, so z is computed again there; z is absent again while g and h run and computed a third time
    # before k. One extra computation per interval of z's life between its readers (u, k) counts one of the two.
    spec = [("p", 1, 1, ()), ("z", 3, 3, (0,)), ("u", 1, 3, (1,)), ("c", 1, 6, (0,)), ("d", 1, 1, (3,)),
            ("y", 1, 1, (2, 4)), ("g", 1, 6, (5,)), ("h", 1, 1, (6,)), ("k", 1, 1, (1, 7))]
    g = Graph(tuple(Node(i, name, float(cost), size, ins) for i, (name, cost, size, ins) in enumerate(spec)))
    best = optimal_cost(g, 9, program_order=True)[0]
    assert best == g.total_cost + 7.0  # z twice more (3 + 3), u once more (1)
    assert order_bound(g, 9, time_limit_s=None, second_computations=False).lower_bound_cost == g.total_cost + 4.0
    # (every row: left out as implied by the row at c, the row at g would not be there to pair with it)
    assert order_bound(g, 9, time_limit_s=None, prune_rows=False).lower_bound_cost == best


def test_a_second_computation_through_a_value_dead_at_the_row_counts(monkeypatch):
    # as above, with w between z and u (read by u alone, so dead while c runs): u's recomputation needs w, which
    # needs z; a chain of one value up from u does not reach z, one of up to CHAIN_DEPTH does
    import solvers.bounds.row_program as row_program

    spec = [("p", 1, 1, ()), ("z", 3, 3, (0,)), ("w", 1, 2, (1,)), ("u", 1, 3, (2,)), ("c", 1, 6, (0,)),
            ("d", 1, 1, (4,)), ("y", 1, 1, (3, 5)), ("g", 1, 6, (6,)), ("h", 1, 1, (7,)), ("k", 1, 1, (1, 8))]
    g = Graph(tuple(Node(i, name, float(cost), size, ins) for i, (name, cost, size, ins) in enumerate(spec)))
    best = optimal_cost(g, 8, program_order=True)[0]
    assert best == 20.0
    assert order_bound(g, 8, time_limit_s=None, prune_rows=False).lower_bound_cost == best
    monkeypatch.setattr(row_program, "CHAIN_DEPTH", 2)  # u and its inputs only
    assert order_bound(g, 8, time_limit_s=None, prune_rows=False).lower_bound_cost == 17.0


def test_rounds_of_rows_reach_the_program_over_every_row():
    # a decoder-shaped training graph of 4 layers has dozens of binding rows; the rounds solve a few of them
    # and must end at the optimum of the program over all of them
    g = decoder_training_graph(4, seed=1, seq=64, width=32, heads=2)
    budget = int(0.4 * reference_peak_bytes(g))
    rows = undominated_in_order(order_rows(g, budget), g)
    program = RowProgram(g, "all_rows", gap_of=life_intervals(g))
    for row in rows:
        program.add_row(row)
    proven, value = _solve_program(program.finish(), None)
    ob = order_bound(g, budget, time_limit_s=None, second_computations=False)
    assert proven and ob.proven and ob.rows == len(rows) and ob.rows_used < len(rows)
    assert ob.lower_bound_cost == pytest.approx(g.total_cost + value, rel=1e-9)
    # second computations only add to it (on the rows of their own rounds)
    assert order_bound(g, budget, time_limit_s=None).lower_bound_cost >= ob.lower_bound_cost * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_every_solver_returns_program_order_schedules(seed):
    # (what the bound's family claims: checked on more graphs and solvers while it was built, on traced BERT and
    # ViT at 0.8 / 0.6 / 0.4 among them)
    for g in (random_training_graph(8, seed), linear_training_graph(6 + seed)):
        ref = reference_peak_bytes(g)
        for frac, name in ((f, s) for f in (0.8, 0.6, 0.45) for s in solver_names()):
            try:
                r = solve(g, int(frac * ref), name, time_limit_s=0.5)  # as many return one as at 2 s
            except (InfeasibleBudgetError, NoSolutionInTimeError, GraphError):
                continue  # GraphError: chain_dp takes training chains only
            assert in_program_order(r.schedule), name


def test_in_program_order():
    g = Graph((Node(0, "a", 1.0, 1), Node(1, "b", 1.0, 1), Node(2, "c", 1.0, 1, (0, 1))))
    assert in_program_order(Schedule.from_sequence(g, [0, 1, 2]))
    assert in_program_order(Schedule.from_sequence(g, [0, 1, 0, 2]))  # a recomputation may come anywhere
    assert not in_program_order(Schedule.from_sequence(g, [1, 0, 2]))


def test_no_program_order_schedule_fits():
    # a (not recomputable) is read by d; in program order it is resident while c runs (b and c: 8 bytes)
    nodes = (Node(0, "a", 1.0, 2, recomputable=False), Node(1, "b", 1.0, 4), Node(2, "c", 1.0, 4, (1,)),
             Node(3, "d", 1.0, 1, (0, 2)))
    g = Graph(nodes)
    ob = order_bound(g, 9, time_limit_s=None)
    assert not ob.fits and optimal_cost(g, 9, program_order=True) is None


def test_auto_reports_the_program_order_bound_where_it_is_the_largest():
    # the graph of test_a_value_read_by_a_later_branch_counts_in_program_order: the bound for every schedule says
    # nothing runs twice (d could run first), every solver here keeps the program's order and recomputes a, and the
    # program-order bound proves that optimal for its family
    nodes = (Node(0, "a", 5.0, 2), Node(1, "b", 1.0, 4, (0,)), Node(2, "c", 1.0, 4, (1,)), Node(3, "d", 1.0, 1, (0,)))
    g = Graph(nodes)
    r = solve(g, 8, "auto", time_limit_s=10)
    assert r.total_cost == g.total_cost + 5.0 == r.lower_bound_cost
    assert r.info["bound_from"] == "order_bound" and "program-order" in r.info["bound_scope"]
    assert in_program_order(r.schedule)
