"""LP rounding: valid schedules within budget, never below the optimum, LP value as its bound."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.errors import InfeasibleBudgetError
from graphs.generate import linear_training_graph, random_dag, random_training_graph
from graphs.schedule import Schedule, Status
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from solvers.exact.lp_round import schedule_for_kept
from solvers.exact.milp import lp_bound
from solvers.exact.stage_model import recompute_for_kept, stages_from_sequence
from tests.solvers.stage_family_oracle import stage_family_optimum


def test_linear_graph_L8_budget4():
    g = linear_training_graph(8)
    res = solve(g, 4, "lp_round")
    assert res.peak_bytes <= 4
    assert res.total_cost >= 26  # the MILP optimum of the family
    assert res.lower_bound_cost == pytest.approx(lp_bound(g, 4))
    assert 22 - 1e-6 <= res.lower_bound_cost <= 26
    assert res.status is Status.HEURISTIC  # 26 > LP value 22.07: no optimality claim


def test_checkpoint_all_fits_is_optimal():
    g = linear_training_graph(4)
    res = solve(g, reference_peak_bytes(g), "lp_round")
    assert res.status is Status.OPTIMAL and res.total_cost == g.total_cost


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["dag", "train"]), seed=st.integers(0, 10**6), n=st.integers(3, 7), data=st.data())
def test_rounding_is_valid_and_bounded_by_the_optimum(kind, seed, n, data):
    g = random_dag(n, seed, edge_prob=0.5, retain_prob=0.2) if kind == "dag" else random_training_graph(n // 2 + 1,
                                                                                                          seed)
    floor, ref = g.single_op_bound_bytes(), reference_peak_bytes(g)
    b = data.draw(st.integers(floor, ref))
    opt = stage_family_optimum(g, b) if g.n <= 8 else None
    try:
        res = solve(g, b, "lp_round")
    except InfeasibleBudgetError as e:
        assert e.min_budget_bytes is None or e.min_budget_bytes > b
        return
    assert res.peak_bytes <= b
    if opt is not None:
        assert res.total_cost >= opt[0] - 1e-9
        assert res.lower_bound_cost <= opt[0] + 1e-6  # the LP bounds the family optimum from below
    if res.status is Status.OPTIMAL:
        assert res.total_cost <= res.lower_bound_cost * (1 + 1e-9) + 1e-9


@pytest.mark.parametrize("g", [linear_training_graph(5), random_training_graph(4, 7),
                               random_dag(9, 4, retain_prob=0.3)], ids=lambda g: g.name)
def test_recompute_for_kept_extremes(g):
    n = g.n
    keep_all = np.tril(np.ones((n + 1, n), dtype=bool), -1)
    keep_all[n] = False
    keep_all[n, list(g.retained)] = True
    R = recompute_for_kept(g, keep_all)
    assert (R == np.eye(n, dtype=bool)).all()  # everything kept: nothing recomputed
    keep_none = np.zeros((n + 1, n), dtype=bool)
    keep_none[n, list(g.retained)] = True
    for S in (keep_all, keep_none):
        sched = schedule_for_kept(g, S)
        sim = simulate(g, sched)  # valid: raises otherwise
        assert stages_from_sequence(g, sched.computes) is not None  # stays in the stage family
        assert sim.total_cost >= g.total_cost
    assert simulate(g, schedule_for_kept(g, keep_all)).total_cost == g.total_cost


def test_rounded_schedule_of_random_patterns_is_always_valid():
    rng = np.random.default_rng(0)
    for seed in range(20):
        g = random_training_graph(5, seed)
        n = g.n
        S = np.tril(rng.random((n + 1, n)) < 0.4, -1)
        S[n] = False
        S[n, list(g.retained)] = True
        sim = simulate(g, schedule_for_kept(g, S))
        assert sim.total_cost >= g.total_cost
        assert isinstance(schedule_for_kept(g, S), Schedule)


@pytest.mark.parametrize("g", [linear_training_graph(6), random_training_graph(5, 1),
                               random_dag(10, 2, retain_prob=0.3)], ids=lambda g: g.name)
def test_cost_per_byte_keep_sequences_are_valid_family_members(g):
    from solvers.exact.stage_model import ratio_kept_sequences

    seqs = list(ratio_kept_sequences(g))
    assert seqs
    for seq in seqs:
        simulate(g, Schedule.from_sequence(g, seq))  # valid
        assert stages_from_sequence(g, seq) is not None
    # the lowest threshold keeps every value: no recomputation at all
    assert Schedule.from_sequence(g, seqs[0]).computes == list(range(g.n))
