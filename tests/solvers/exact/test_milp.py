"""The Checkmate MILP: known optima, the stage-family oracle, memory model = simulator, statuses, backends."""
import numpy as np
import pulp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.benchmarks import load_benchmark
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.generate import linear_training_graph, random_dag, random_training_graph
from graphs.schedule import Schedule, Status
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from solvers.exact.milp import baseline_schedules, build_model, lp_bound, run_backend, start_values
from solvers.exact.stage_model import literal_schedule, modeled_memory, stages_from_sequence
from tests.solvers.stage_family_oracle import enumerate_optimum, stage_family_optimum

BASELINES = ["checkpoint_all", "chen_sqrtn", "chen_sqrtn_linear", "chen_greedy", "chen_greedy_linear"]


def _milp_cost(graph, budget, **kw):
    """Simulated cost of the MILP's schedule, or None when it proves the budget infeasible."""
    try:
        res = solve(graph, budget, "milp", mip_gap=0.0, **kw)
    except InfeasibleBudgetError as e:
        assert e.min_budget_bytes is None or e.min_budget_bytes > budget
        return None
    assert res.status is Status.OPTIMAL
    assert res.peak_bytes <= budget
    assert res.lower_bound_cost <= res.total_cost + 1e-9
    assert res.lower_bound_cost >= res.total_cost - 1e-6 * max(1.0, res.total_cost)  # gap 0: bound = optimum
    return res.total_cost


def test_checkmate_linear_graph_L8_budget4():
    g = linear_training_graph(8)
    assert _milp_cost(g, 4) == 26
    # Checkmate's own LP (one aggregated row per FREE variable, no dominance cuts): 22, as published.
    assert lp_bound(g, 4, tighten=False, aggregated_free=True) == pytest.approx(22.0, abs=1e-6)
    # This project's default LP (one row per hazard plus dominance cuts) is at least as tight.
    assert 22.0 - 1e-6 <= lp_bound(g, 4) <= 26.0


def test_checkmate_linear_graph_cbc_agrees():
    g = linear_training_graph(8)
    res = solve(g, 4, "milp_cbc", mip_gap=0.0)
    assert res.total_cost == 26 and res.status is Status.OPTIMAL
    assert res.lower_bound_cost == pytest.approx(26.0)


SMALL = ([random_dag(n, s, retain_prob=r) for n in (4, 5, 6, 7) for s in range(3) for r in (0.0, 0.3)]
         + [random_training_graph(k, s) for k in (2, 3) for s in range(3)]
         + [linear_training_graph(3), linear_training_graph(3, sizes=[3, 1, 2, 1, 2, 3, 1])])


def _budgets(g):
    floor, ref = g.single_op_bound_bytes(), reference_peak_bytes(g)
    return sorted({floor - 1, floor, (2 * floor + ref) // 3, (floor + 2 * ref) // 3, ref - 1, ref})


@pytest.mark.parametrize("forced_cuts", [False, True], ids=["plain", "forced_cuts"])
@pytest.mark.parametrize("g", SMALL, ids=lambda g: g.name)
def test_milp_equals_exhaustive_stage_family(g, forced_cuts):
    for b in _budgets(g):
        oracle = stage_family_optimum(g, b)
        if oracle is not None:
            sim = simulate(g, Schedule.from_sequence(g, oracle[1]))
            assert sim.peak_bytes <= b and sim.total_cost == pytest.approx(oracle[0])
        got = _milp_cost(g, b, forced_cuts=forced_cuts)
        assert got == (None if oracle is None else pytest.approx(oracle[0])), (g.name, b)


@pytest.mark.parametrize("g", [x for x in SMALL if x.n <= 5], ids=lambda g: g.name)
def test_dp_oracle_equals_plain_enumeration(g):
    for b in _budgets(g):
        a, e = stage_family_optimum(g, b), enumerate_optimum(g, b)
        assert (a is None) == (e is None)
        if a is not None:
            assert a[0] == pytest.approx(e[0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 8), seed=st.integers(0, 10**6), retain=st.sampled_from([0.0, 0.3]), data=st.data())
def test_milp_equals_oracle_property(n, seed, retain, data):
    g = random_dag(n, seed, retain_prob=retain, edge_prob=0.5)
    floor, ref = g.single_op_bound_bytes(), reference_peak_bytes(g)
    b = data.draw(st.integers(floor - 1, ref))
    oracle = stage_family_optimum(g, b)
    assert _milp_cost(g, b) == (None if oracle is None else pytest.approx(oracle[0]))


def test_infeasible_budget_names_a_working_budget():
    # single-operation bound 27, reference peak 34, and no stage schedule fits below 34.
    g = random_dag(5, 0, retain_prob=0.2)
    assert g.single_op_bound_bytes() <= 30 < reference_peak_bytes(g)
    assert stage_family_optimum(g, 30) is None
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(g, 30, "milp")
    e = ei.value
    assert e.min_budget_bytes is not None and e.min_budget_bytes > 30 and "MILP proved" in e.reason
    assert solve(g, e.min_budget_bytes, "milp").peak_bytes <= e.min_budget_bytes
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(g, g.single_op_bound_bytes() - 1, "milp")
    assert ei.value.min_budget_bytes == g.single_op_bound_bytes()


@pytest.mark.parametrize("g", [linear_training_graph(6), random_training_graph(4, 1), random_dag(9, 3)],
                         ids=lambda g: g.name)
def test_modeled_memory_is_the_simulators(g):
    """The MILP's U equals the simulated memory of the schedule its variables describe (frees included)."""
    floor, ref = g.single_op_bound_bytes(), reference_peak_bytes(g)
    for b in sorted({floor, (floor + ref) // 2, ref - 1}):
        model = build_model(g, b)
        res = run_backend(model, "highs", None, 0.0, None, None)
        if res.outcome == "infeasible":
            continue
        assert res.outcome == "optimal"
        R, S, F = model.values()
        U = modeled_memory(g, R, S, F)
        for (t, k), u in model.U.items():  # the solver's U is the exact recurrence on the rounded values
            assert (u.varValue * model.unit_bytes + g.fixed_bytes) == pytest.approx(U[t, k], abs=1e-3)
        peak_model = max([g.fixed_bytes] + [U[t, k] for t in range(g.n) for k in range(t + 1) if R[t, k]])
        lit = simulate(g, literal_schedule(g, R, S, F))
        assert lit.peak_bytes == peak_model <= b
        assert lit.total_cost == pytest.approx(res.objective)
        # freeing at last use (the returned schedule) never needs more
        from solvers.exact.stage_model import sequence_from_stages
        sim = simulate(g, Schedule.from_sequence(g, sequence_from_stages(g, R, S)))
        assert sim.peak_bytes <= peak_model and sim.total_cost <= lit.total_cost + 1e-9


@pytest.mark.parametrize("g", [linear_training_graph(6), random_training_graph(4, 2), random_dag(8, 5)],
                         ids=lambda g: g.name)
def test_baseline_schedules_are_feasible_model_points(g):
    """Every baseline sequence is in the stage family; its start values satisfy every row of the model."""
    ref = reference_peak_bytes(g)
    for b in (ref, ref - 1, (ref + g.single_op_bound_bytes()) // 2):
        found, _, _ = baseline_schedules(g, b)
        model = build_model(g, b)
        for cost, name, seq in found:
            assert stages_from_sequence(g, seq) is not None, name
            start = start_values(model, seq)
            assert start is not None, name
            for v in model.prob.variables():
                v.varValue = start[v.name]
            assert model.prob.valid(eps=1e-7), name
            assert pulp.value(model.prob.objective) == pytest.approx(cost)


@pytest.mark.parametrize("g", [linear_training_graph(5), random_training_graph(4, 3), random_dag(8, 2)],
                         ids=lambda g: g.name)
def test_every_baseline_costs_at_least_the_optimum_and_monotone(g):
    floor, ref = g.single_op_bound_bytes(), reference_peak_bytes(g)
    prev = None
    for b in range(floor, ref + 1):
        opt = _milp_cost(g, b)
        if prev is not None:
            assert opt is not None and opt <= prev + 1e-9  # more memory never costs more
        if opt is None:
            continue
        prev = opt
        for name in BASELINES:
            try:
                assert solve(g, b, name).total_cost >= opt - 1e-9, name
            except InfeasibleBudgetError:
                pass


def test_cbc_and_highs_agree():
    for g in [random_training_graph(3, 0), linear_training_graph(4), random_dag(7, 1, edge_prob=0.6)]:
        for b in _budgets(g):
            try:
                h = solve(g, b, "milp", mip_gap=0.0).total_cost
            except InfeasibleBudgetError:
                h = None
            try:
                c = solve(g, b, "milp_cbc", mip_gap=0.0).total_cost
            except InfeasibleBudgetError:
                c = None
            assert h == c, (g.name, b)


@pytest.mark.parametrize("solver", ["milp", "milp_cbc"])
@pytest.mark.parametrize("warm", [True, False])
def test_time_limit_never_claims_optimal(bench_dir, solver, warm):
    g = load_benchmark(bench_dir / "segnet.json")
    b = int(reference_peak_bytes(g) * 0.7)
    try:
        res = solve(g, b, solver, time_limit_s=1.0, warm_start=warm)
    except NoSolutionInTimeError:
        assert not warm  # with a warm start there is always an incumbent
        return
    assert res.status is Status.FEASIBLE
    assert res.peak_bytes <= b
    assert res.lower_bound_cost is None or res.lower_bound_cost <= res.total_cost


def test_warm_start_is_used(bench_dir):
    g = load_benchmark(bench_dir / "vgg16.json")
    b = int(np.ceil(0.9 * reference_peak_bytes(g)))
    res = solve(g, b, "milp", time_limit_s=60)
    assert res.info["warm_start"] in BASELINES
    assert res.status is Status.OPTIMAL
    assert res.overhead == pytest.approx(0.019677, abs=1e-5)


def test_segnet_08_reaches_the_optimum(bench_dir):
    """Regression: with a tight MIP feasibility tolerance HiGHS once declared the warm start (1.38 %) optimal."""
    g = load_benchmark(bench_dir / "segnet.json")
    b = int(np.ceil(0.8 * reference_peak_bytes(g)))
    res = solve(g, b, "milp", time_limit_s=60)
    assert res.status is Status.OPTIMAL
    assert res.overhead <= 0.00208  # 0.207 %: the stage-family optimum (Moccasin's C=2 optimum is 0.21 %)
    assert res.total_cost - res.lower_bound_cost <= 0.01 * (res.total_cost - g.total_cost) + 1e-6


def test_given_start_sequences_are_projected_and_used():
    from solvers.exact.stage_model import project_to_stage_family

    g = linear_training_graph(6)
    b = 5
    opt = solve(g, b, "milp", mip_gap=0.0)
    seq = opt.schedule.computes
    assert project_to_stage_family(g, seq) == seq  # already in the family
    assert any(a > b for a, b in zip(seq, seq[1:]))  # it recomputes something
    # the same computations with each stage's recomputations reversed and repeated: projected back
    messy, pending, nxt = [], [], 0
    for v in seq:
        if v == nxt:
            messy += pending[::-1] + pending + [v]
            pending, nxt = [], nxt + 1
        else:
            pending.append(v)
    assert messy != seq and project_to_stage_family(g, messy) == seq
    assert project_to_stage_family(g, [1, 0] + list(range(2, g.n))) is None  # 1 first: not in the family
    res = solve(g, b, "milp", mip_gap=0.0, start_sequences=[seq, list(reversed(range(g.n)))])
    assert res.info["warm_start"] in ("given_0", *BASELINES, "cost_per_byte_keep")
    assert res.total_cost == opt.total_cost


def test_forced_cuts_lift_the_relaxation_on_segnet_at_half_its_peak(bench_dir):
    # node 1 (40 % of the cost) must run twice at 0.5: the cuts lift the LP relaxation (measured LP overheads:
    # 9.5 % with them, 0.5 % without; the optimum is 40.66 %)
    from graphs.simulate import budget_from_multiplier
    from solvers.exact.milp import _run_highs

    g = load_benchmark(bench_dir / "segnet.json")
    budget = budget_from_multiplier(g, 0.5)
    with_cuts = _run_highs(build_model(g, budget, relax=True, forced_cuts=True), 60, None, None, None, relax=True)
    plain = _run_highs(build_model(g, budget, relax=True), 60, None, None, None, relax=True)
    assert with_cuts.objective / g.total_cost - 1 > 0.09
    assert plain.objective / g.total_cost - 1 < 0.01


def test_optimal_claim_matches_the_schedule_after_a_mip_start():
    # Regression (found by hypothesis): HiGHS reported objective 42 but handed back the MIP start's values
    # (cost 50); the MILP then claimed OPTIMAL for a schedule 19 % above its own bound. The oracle's optimum is 42.
    g = random_dag(6, 150763, retain_prob=0.0, edge_prob=0.5)
    assert stage_family_optimum(g, 20)[0] == pytest.approx(42.0)
    assert _milp_cost(g, 20) == pytest.approx(42.0)
