"""block_dp: the block split, the exact memory accounting of its family, optimality within the family (brute force
over every kept set of every block), and validity and bounds on larger training graphs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs.errors import GraphError, InfeasibleBudgetError
from graphs.generate import decoder_training_graph, random_dag, random_training_graph
from graphs.schedule import Schedule, Status
from graphs.simulate import budget_from_multiplier, reference_peak_bytes, simulate
from solvers.base import solve
from solvers.exact.block_dp import _Plan
from solvers.exact.blocks import split_blocks


def tiny_decoder(layers: int = 2, seed: int = 0):
    # bytes in the tens: the program counts them one by one (its grid unit is 1 byte), so it is exact here
    return decoder_training_graph(layers, seed, seq=2, width=2, heads=1, jitter=0.3)


def test_decoder_splits_into_repeated_blocks():
    g = decoder_training_graph(6, seq=8, width=8, heads=2)
    bl = split_blocks(g)
    assert bl is not None
    # every layer's residual sums are cuts; blocks of the same shape share one signature
    shapes = {}
    for b in bl.blocks:
        shapes.setdefault(b.signature, []).append(b)
    assert max(len(v) for v in shapes.values()) >= len(bl.blocks) - 2 >= 4  # all but the first and the last
    # blocks cover the forward pass in order, and their backward windows run in reverse order
    firsts = [b.first for b in bl.blocks]
    assert firsts == sorted(firsts) and firsts[0] == 0
    wins = [b.bwd_window for b in bl.blocks if b.bwd_window]
    assert all(a[0] > b[1] for a, b in zip(wins, wins[1:]))


def test_no_blocks_without_a_backward_pass():
    assert split_blocks(random_dag(30, seed=1)) is None
    with pytest.raises(GraphError):
        solve(random_dag(30, seed=1), 10**9, "block_dp")


@pytest.mark.parametrize("graph", [tiny_decoder(2, 0), tiny_decoder(3, 1), random_training_graph(12, seed=4),
                                   random_training_graph(20, seed=9)], ids=lambda g: g.name)
def test_accounting_is_exact_for_every_kept_set(graph):
    """The program's peak for a kept set equals the simulator's replay of the schedule it emits."""
    bl = split_blocks(graph)
    assert bl is not None
    plan = _Plan(graph, bl, None)
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows = [np.where(np.isin(np.arange(len(d.local)), d.forced), True, rng.random(len(d.local)) < 0.5)
                & np.isin(np.arange(len(d.local)), d.choices + d.forced) for d in plan.data]
        sim = simulate(graph, Schedule(tuple(plan.ops(rows))))
        assert plan.peak_bytes(rows) == sim.peak_bytes


def _family_schedules(graph, max_choices):
    """Brute force over every kept set of every block: (peak, cost) of every schedule of the family."""
    plan = _Plan(graph, split_blocks(graph, max_choices), None)
    per_block = []
    for d in plan.data:
        rows = []
        for bits in range(1 << len(d.choices)):
            K = np.zeros(len(d.local), dtype=bool)
            K[d.forced] = True
            for k, j in enumerate(d.choices):
                K[j] = bool(bits >> k & 1)
            rows.append(K)
        per_block.append(rows)
    out = []
    for combo in itertools.product(*per_block):
        sim = simulate(graph, Schedule(tuple(plan.ops(list(combo)))))
        out.append((sim.peak_bytes, sim.total_cost))
    return out


@pytest.mark.parametrize("graph,max_choices", [(tiny_decoder(1, 0), 6), (tiny_decoder(2, 5), 2),
                                               (random_training_graph(10, seed=2), 8),
                                               (random_training_graph(14, seed=3), 12)],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_optimal_within_its_family(graph, max_choices):
    plan = _Plan(graph, split_blocks(graph, max_choices), None)
    assert np.prod([1 << len(d.choices) for d in plan.data]) <= 5000
    ref = reference_peak_bytes(graph)
    family = _family_schedules(graph, max_choices)
    for frac in (0.95, 0.8, 0.65, 0.5):
        budget = int(frac * ref)
        want = min((c for p, c in family if p <= budget), default=None)
        if want is None:
            with pytest.raises(InfeasibleBudgetError):
                solve(graph, budget, "block_dp", max_choices=max_choices)
            continue
        r = solve(graph, budget, "block_dp", max_choices=max_choices)
        assert r.total_cost == pytest.approx(want, rel=1e-12)
        assert r.status is Status.OPTIMAL and r.lower_bound_cost <= r.total_cost + 1e-9


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 30), st.integers(0, 10**6), st.sampled_from([0.9, 0.7, 0.5]))
def test_valid_and_never_below_the_global_optimum(n_forward, seed, frac):
    g = random_training_graph(n_forward, seed=seed)
    if split_blocks(g) is None:
        return
    budget = budget_from_multiplier(g, frac)
    try:
        r = solve(g, budget, "block_dp")  # solve() replays it: valid, within the budget
    except InfeasibleBudgetError:
        return
    assert r.peak_bytes <= budget
    assert r.lower_bound_cost <= r.total_cost * (1 + 1e-12)
    if g.n <= 25:
        opt = solve(g, budget, "milp", time_limit_s=60)
        if opt.status is Status.OPTIMAL:
            # the MILP's family (Checkmate's) holds every schedule block_dp emits in the reference order
            assert opt.total_cost <= r.total_cost * (1 + 1e-6) + 1e-9


def test_cost_never_rises_with_the_budget():
    g = tiny_decoder(3, 2)
    ref = reference_peak_bytes(g)
    costs = []
    for frac in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        try:
            costs.append(solve(g, int(frac * ref), "block_dp").total_cost)
        except InfeasibleBudgetError:
            assert not costs  # a larger budget never loses feasibility
    assert costs and all(a >= b - 1e-9 for a, b in zip(costs, costs[1:]))


def test_large_decoder_planned_fast_with_a_family_bound():
    g = decoder_training_graph(24, seed=3)
    budget = budget_from_multiplier(g, 0.3)
    r = solve(g, budget, "block_dp", time_limit_s=60)
    assert r.peak_bytes <= budget
    assert r.info["blocks"] >= 24 and r.info["block_shapes"] <= 4
    assert r.lower_bound_cost <= r.total_cost
    assert (r.total_cost - r.lower_bound_cost) / r.total_cost <= 1e-3  # the grid's rounding
