"""plan() builds what it needs once: one solver graph per solve (a fallback to the pinned graph adds one; the
executor's exact view is derived from the solver graph, not built), one walk of the trace for the multi-output ops,
and the step's fx halves once across plan(), apply() and the first call. The in-place profiler builds, per block
structure, one planning problem and one solver graph for all the options it solves, and never calls plan()."""
from __future__ import annotations

import copy

import pytest
import torch

import planner
import planner.core.plan_type as plan_module
import planner.core.problem as problem_module
import planner.core.solve as solve_module
import planner.execution.runtime as runtime_module
from graphs.errors import InfeasibleBudgetError
from harness.eager_compare import step_state
from planner import GB, Plan, plan
from tests.models import make_gpt
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state

pytestmark = pytest.mark.filterwarnings("ignore::planner.whole.api.LossNotPlannedWarning")

@pytest.fixture
def counts(monkeypatch):
    """Counts of solver-graph builds, trace walks for secondary outputs and builds of the step's halves."""
    seen = {"solver_graph": 0, "secondary_outputs": 0, "build_step": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(problem_module, "solver_graph", counting("solver_graph", problem_module.solver_graph))
    monkeypatch.setattr(problem_module, "secondary_outputs",
                        counting("secondary_outputs", problem_module.secondary_outputs))
    build = counting("build_step", plan_module.build_step)
    for module in (solve_module, plan_module, runtime_module):
        monkeypatch.setattr(module, "build_step", build)
    return seen


@pytest.fixture(scope="module")
def gpt():
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=2)
    return model, x, plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)


def test_one_solver_graph_per_solve_and_one_step_build(gpt, counts):
    model, x, full = gpt
    assert full.problem.secondaries  # layer norms: the case with two views
    p = plan(model, x, int(0.85 * full.reference_peak_bytes) / GB, cost_model="flops", traced=full.traced,
             time_limit_s=TIME_LIMIT_S)
    assert p.result.sim.recomputed  # a real solve, not the keep-everything schedule
    fallback = p.graph_kind == "pinned"
    assert counts["solver_graph"] == (2 if fallback else 1)
    assert counts["secondary_outputs"] == 1
    assert counts["build_step"] == 1  # plan() builds the halves: the check that the executor can run it
    step = p.apply(copy.deepcopy(model))
    assert counts["build_step"] == 1  # apply() takes them
    state = step_state(step, x, seed=3)
    step_state(step, x, seed=4)
    assert counts["build_step"] == 1  # nor does any call
    assert_same_state(state, eager_state(model, x, seed=3))


def test_a_fallback_builds_one_more_graph(gpt, counts, monkeypatch):
    model, x, full = gpt
    # a schedule the executor cannot hold as solved: plan() solves again on the graph with secondary outputs pinned
    monkeypatch.setattr(problem_module.PlanningProblem, "executable", lambda self, graph, result: None)
    p = plan(model, x, int(0.85 * full.reference_peak_bytes) / GB, solver="dtr", cost_model="flops",
             traced=full.traced, time_limit_s=TIME_LIMIT_S)
    assert p.graph_kind == "pinned"
    assert counts["solver_graph"] == 2 and counts["secondary_outputs"] == 1 and counts["build_step"] == 1


def test_keeping_everything_solves_on_the_exact_view_without_another_build(gpt, counts):
    model, x, full = gpt
    p = plan(model, x, 1000.0, cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S)
    assert p.overhead == 0 and p.graph_kind == "exact"
    assert counts["solver_graph"] == 1 and counts["build_step"] == 1


def test_an_infeasible_budget_reuses_the_problems_graph(gpt, counts):
    model, x, full = gpt
    with pytest.raises(InfeasibleBudgetError):
        plan(model, x, 1000 / GB, cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S)
    # the solve and the smallest-budget search share the solver graph; the search may fall back to the pinned one
    assert counts["solver_graph"] in (1, 2) and counts["secondary_outputs"] == 1 and counts["build_step"] == 0


def test_a_loaded_plan_builds_its_graph_and_halves_once(gpt, counts, tmp_path):
    model, x, full = gpt
    full.to_json(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    step = loaded.apply(copy.deepcopy(model), x)  # traces, checks the graph, builds the halves
    assert counts["solver_graph"] == 1 and counts["build_step"] == 1
    step_state(step, x, seed=3)
    assert counts["build_step"] == 1


def test_apply_for_inductor_builds_its_halves_once(gpt, counts):
    model, x, full = gpt
    step = full.apply(copy.deepcopy(model), compile=True)
    assert counts["build_step"] == 1 and step._halves is not None  # compiled by inductor at the first call


def test_the_in_place_profiler_builds_one_problem_and_one_graph_per_block_structure(counts, monkeypatch):
    """Two block structures (a call whose rows are all unpadded gets no mask in its blocks, a padded one a mask),
    each planned at every fraction a schedule meets: one planning problem and one solver graph each, one step build
    per planned option, and no call of the public plan()."""
    import planner.inplace.block_region as region_module
    import planner.whole.api as api_module

    problems = []
    real = region_module.PlanningProblem

    def counting_problem(*args, **kwargs):
        problems.append(real(*args, **kwargs))
        return problems[-1]

    monkeypatch.setattr(region_module, "PlanningProblem", counting_problem)
    monkeypatch.setattr(api_module, "plan", lambda *a, **k: pytest.fail("the in-place planner called plan()"))
    pytest.importorskip("transformers")
    from examples.hf_zoo import build

    model, batch = build("llama", "test")  # row 1 has 48 tokens, the others 64
    batch["labels"] = batch["input_ids"].clone()
    ctl = planner.enable(model, budget_gb=1000.0, time_limit_s=2.0, planned=True)
    try:
        for length in (40, 64):  # two block structures, each at its first shape
            model(**{k: v[:, :length] if torch.is_tensor(v) else v for k, v in batch.items()}).loss.backward()
        profiles = list(ctl.profiles.values())
        assert len(profiles) == 2 and len(problems) == 2 and all(p.nodes for p in profiles)
        planned = sum(len(p.plans) for p in profiles)
        assert planned >= 2  # an option planned below the block's peak for each structure (the counts below mean it)
        assert counts["solver_graph"] == 2 and counts["secondary_outputs"] == 2
        assert counts["build_step"] == planned
    finally:
        planner.disable(model)
