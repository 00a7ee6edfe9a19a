import random
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.generate import random_dag, random_training_graph
from graphs.schedule import Schedule
from graphs.simulate import budget_from_multiplier, reference_peak_bytes, simulate
from solvers.base import solve
from solvers.heuristics.local_search import GapSearch
from tests.solvers.heuristics.heuristic_cases import (
    check_heuristic,
    check_not_below_optimum,
    graph_strategy,
    graph_with_random_ops,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graph_with_random_ops, frac=st.floats(0.2, 1.1), improve=st.booleans())
def test_evict_valid_within_budget_or_names_a_budget_it_meets(graph, frac, improve):
    check_heuristic(graph, max(0, int(frac * reference_peak_bytes(graph))), "evict", time_limit_s=0.3,
                    improve=improve)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=st.one_of(st.builds(random_dag, st.integers(1, 7), st.integers(0, 10**6)),
                       st.builds(random_training_graph, st.integers(1, 3), st.integers(0, 10**6))),
       frac=st.floats(0.3, 1.0))
def test_evict_never_beats_the_exhaustive_optimum(graph, frac):
    check_not_below_optimum(graph, int(frac * reference_peak_bytes(graph)), "evict", time_limit_s=0.3)


@settings(max_examples=60, deadline=None)
@given(graph=graph_strategy, seed=st.integers(0, 10**6))
def test_drop_gap_model_bounds_the_simulated_peak(graph, seed):
    # any conflict-free drop set: the model's peak is never below the simulator's
    gs = GapSearch(graph)
    rng = random.Random(seed)
    chosen: set[int] = set()
    for c in rng.sample(range(gs.m), gs.m):
        if rng.random() < 0.5 and not (gs.conf[c] & chosen):
            chosen.add(c)
    sim = simulate(graph, Schedule.from_sequence(graph, gs.sequence(chosen)))
    model_peak = int(gs.excess(chosen, 0).max())
    assert sim.peak_bytes <= model_peak
    assert sim.total_cost == graph.total_cost + gs.cost(chosen)


def test_evict_matches_the_published_optimum_on_rl100(bench_dir):
    g = load_benchmark(bench_dir / "rl100.json")
    # the drop-gap MILP proves this optimum in about a second of the 14 s it gets (72 % of the limit; the local
    # search before it takes a fixed share): a loaded machine does not cut it short
    res = check_heuristic(g, budget_from_multiplier(g, 0.9), "evict", time_limit_s=20.0)
    assert res.overhead <= 0.0085  # published optimum 0.8 % (Moccasin CP-SAT); measured 0.79 %
    assert res.overhead <= solve(g, budget_from_multiplier(g, 0.9), "dtr").overhead


def test_evict_recomputation_chains_beat_the_plain_family_on_rl100(bench_dir):
    g = load_benchmark(bench_dir / "rl100.json")
    budget = budget_from_multiplier(g, 0.8)
    # A generous limit so that the result does not depend on how loaded the machine is (with 2 s it failed once
    # under load in CI): the MILPs get 72 % of it and are solved in a few seconds; the two calls take about 13 s
    # together on an idle machine (a larger limit makes them slower: the local search before the MILPs takes a
    # fixed share of it).
    plain = check_heuristic(g, budget, "evict", time_limit_s=30.0, helpers=False, chain=0)
    res = check_heuristic(g, budget, "evict", time_limit_s=30.0)
    # published 2.3 % (Moccasin CP-SAT); measured 2.296 % with chains, 2.313 % without
    assert res.overhead <= 0.0230 < plain.overhead
    assert res.info["method"] == "drop_gap_chain_milp"


def test_evict_respects_its_time_limit(bench_dir):
    g = load_benchmark(bench_dir / "rl250.json")
    t0 = time.perf_counter()
    check_heuristic(g, budget_from_multiplier(g, 0.9), "evict", time_limit_s=1.0)
    assert time.perf_counter() - t0 < 3.0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=st.one_of(st.builds(random_dag, st.integers(2, 12), st.integers(0, 10**6)),
                       st.builds(random_training_graph, st.integers(1, 6), st.integers(0, 10**6))),
       frac=st.floats(0.5, 1.0), helpers=st.booleans(), chain=st.integers(0, 3))
def test_drop_gap_milp_is_valid_and_no_worse_than_the_search(graph, frac, helpers, chain):
    from solvers.heuristics.local_search import drop_gap_milp

    budget = int(frac * reference_peak_bytes(graph))
    gs = GapSearch(graph)
    found = gs.solve(budget, 0.0)
    chosen, bound, status = drop_gap_milp(gs, budget, 5.0, warm=found, helpers=helpers, chain=chain)
    if found is not None:
        # the search's model counts shared extensions once per drop: its sets are feasible for the MILP
        assert chosen is not None
    if chosen is None:
        return
    sim = simulate(graph, Schedule.from_sequence(graph, gs.sequence(chosen, gs.helpers)))
    assert sim.peak_bytes <= budget
    extra = sum(graph.costs[i] for i, _ in gs.helpers)  # a helper is skipped where not needed
    assert chain or all(gs.last_use[i] >= r for i, r in gs.helpers)  # chains only when asked
    assert graph.total_cost + gs.cost(chosen) - 1e-9 <= sim.total_cost
    assert sim.total_cost <= graph.total_cost + gs.cost(chosen) + extra + 1e-9
    if status == "Optimal":
        # the MILP's objective counts the helpers' recomputations too: its bound is on drops plus helpers, and
        # the drop set the search found (no helpers) is one of its solutions
        assert bound is not None and bound <= gs.cost(chosen) + extra + 1e-6
        if found is not None:
            assert gs.cost(chosen) + extra <= gs.cost(found) + 1e-6
        if chain:  # the family without chains is a subset: its optimum is never cheaper
            plain, _, plain_status = drop_gap_milp(GapSearch(graph), budget, 5.0)
            if plain_status == "Optimal":
                assert gs.cost(chosen) + extra <= gs.cost(plain) + 1e-6
