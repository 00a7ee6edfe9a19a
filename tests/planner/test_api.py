"""plan() and Plan: budget units, infeasible budgets, JSON round trip, re-application, refusals, explain()."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from graphs.errors import InfeasibleBudgetError, ScheduleFormatError
from graphs.schedule_json import load_result
from graphs.simulate import reference_peak_bytes
from harness.eager_compare import step_state
from planner import GB, Plan, PlanMismatchError, plan, smallest_budget
from planner.core.solver_graph import solver_graph
from planner.tools.measure import measure_peak_bytes
from planner.whole.api import budget_bytes_from_gb
from tests.models import make_gpt, make_mlp
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state


@pytest.fixture(scope="module")
def gpt():
    model, x = make_gpt(batch=2, seq=32, vocab=64, n_layers=2)
    first = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    ref = reference_peak_bytes(first.graph)
    low = plan(model, x, 0.75 * ref / GB, cost_model="flops", traced=first.traced, time_limit_s=TIME_LIMIT_S)
    return model, x, first, low, eager_state(model, x)


def test_budget_is_decimal_gigabytes():
    assert budget_bytes_from_gb(1.5) == 1_500_000_000
    assert budget_bytes_from_gb(0.000123456789) == 123456
    assert budget_bytes_from_gb(2) == 2 * 10**9
    with pytest.raises(ValueError):
        budget_bytes_from_gb(0)


def test_plan_figures(gpt):
    model, x, first, low, _ = gpt
    assert first.overhead == 0 and first.status.value == "optimal"
    assert first.predicted_peak_bytes == reference_peak_bytes(first.graph)
    assert low.predicted_peak_bytes <= low.budget_bytes < first.predicted_peak_bytes
    assert low.overhead > 0 and low.result.sim.recomputed
    if low.lower_bound_cost is not None:
        assert low.lower_bound_cost <= low.result.total_cost * (1 + 1e-9)


def test_budget_counts_everything(gpt):
    model, x, first, _, _ = gpt
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # parameters and their gradients alone are part of every peak
    assert first.predicted_peak_bytes > 2 * params
    assert first.graph.fixed_bytes >= params + x.numel() * x.element_size()


def test_infeasible_budget_names_minimum_in_gb(gpt):
    model, x, first, _, _ = gpt
    floor = first.graph.single_op_bound_bytes()
    with pytest.raises(InfeasibleBudgetError) as ei:
        plan(model, x, (floor - 1) / GB, cost_model="flops", traced=first.traced, time_limit_s=TIME_LIMIT_S)
    err = ei.value
    if err.min_budget_bytes is None:  # the search for one found none in its time (a slow machine): it says so
        assert "no budget known to work" in str(err)
        return
    assert err.min_budget_bytes >= floor
    assert f"{err.min_budget_bytes / GB:.9f} GB" in str(err)
    # the named minimum is feasible
    ok = plan(model, x, err.min_budget_bytes / GB, cost_model="flops", traced=first.traced,
              time_limit_s=TIME_LIMIT_S)
    assert ok.predicted_peak_bytes <= err.min_budget_bytes


def test_json_round_trip_and_reapply(gpt, tmp_path):
    model, x, _, low, eager = gpt
    path = tmp_path / "plan.json"
    low.to_json(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "remat-schedule" and doc["version"] == 1
    assert doc["extra"]["planner"]["fingerprint"]["inputs"] == [[list(x.shape), str(x.dtype)]]
    ls = load_result(path)  # the generic reader accepts it (replays and checks the predictions)
    assert ls.sim.peak_bytes == low.result.peak_bytes  # the solver graph's figure; the plan's is exact
    assert Plan.load(path).predicted_peak_bytes == low.predicted_peak_bytes <= low.result.peak_bytes
    loaded = Plan.load(path)
    assert loaded.predicted_peak_bytes == low.predicted_peak_bytes
    assert loaded.compute_sequence == low.compute_sequence
    assert loaded.status == low.status and loaded.overhead == pytest.approx(low.overhead)
    # re-traced on the sample input now
    m = copy.deepcopy(model)
    assert_same_state(step_state(loaded.apply(m, x), x, seed=7), eager)
    # re-traced lazily on the first call
    m2 = copy.deepcopy(model)
    assert_same_state(step_state(loaded.apply(m2), x, seed=7), eager)


def test_tampered_file_is_refused(gpt, tmp_path):
    _, _, _, low, _ = gpt
    doc = low.to_dict()
    doc["graph"]["nodes"][3]["bytes"] += 4096
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises((ScheduleFormatError, PlanMismatchError)):
        Plan.load(path).apply(make_gpt(batch=2, seq=32, vocab=64, n_layers=2)[0],
                              make_gpt(batch=2, seq=32, vocab=64, n_layers=2)[1])


def test_other_model_is_refused(gpt, tmp_path):
    _, _, _, low, _ = gpt
    other, _ = make_gpt(batch=2, seq=32, vocab=64, n_layers=3)
    with pytest.raises(PlanMismatchError, match="another model"):
        low.apply(other)
    path = tmp_path / "p.json"
    low.to_json(path)
    with pytest.raises(PlanMismatchError, match="another model"):
        Plan.load(path).apply(other)
    mlp, _ = make_mlp()
    with pytest.raises(PlanMismatchError):
        low.apply(mlp)


def test_other_input_shape_is_refused(gpt, tmp_path):
    model, x, _, low, _ = gpt
    planned = low.apply(copy.deepcopy(model))
    with pytest.raises(PlanMismatchError, match="shape"):
        planned(x[:1])
    path = tmp_path / "p.json"
    low.to_json(path)
    with pytest.raises(PlanMismatchError, match="shape"):
        Plan.load(path).apply(copy.deepcopy(model), x[:, :16])


def test_explain_groups_recomputation_by_module(gpt):
    _, _, first, low, _ = gpt
    text = low.explain()
    assert "predicted peak" in text and "overhead" in text
    groups = low.recomputed()
    assert groups and all(isinstance(k, str) for k in groups)
    assert any(k.startswith("blocks.") for k in groups), groups.keys()
    for mod in groups:
        assert (mod or "(top level)") in text
    assert "nothing is recomputed" in first.explain()


def test_solver_graph_adjustments(gpt):
    _, _, first, _, _ = gpt
    traced = first.traced
    g = solver_graph(traced)
    tangents = [nd for nd in g.nodes if nd.name == "tangents"]  # all incoming gradients: one node
    assert len(tangents) == 1 and tangents[0].retain and not tangents[0].recomputable and not tangents[0].inputs
    # dropout is recomputable (its RNG state is replayed); the model's output is not
    names = {nd.name: nd for nd in g.nodes}
    assert any(n.startswith("native_dropout") and nd.recomputable for n, nd in names.items())
    assert sum(1 for nd in g.nodes if nd.retain and not nd.backward) == 1  # only the logits


def test_a_plan_without_a_loss_says_what_it_leaves_out():
    from planner.whole.api import LossNotPlannedWarning
    from tests.models import make_mlp

    model, x = make_mlp()
    with pytest.warns(LossNotPlannedWarning, match="not a scalar loss.* 2560 bytes are reserved .*, 1280 of them"):
        plan(model, x, 1000.0, cost_model="flops", time_limit_s=5)


@pytest.mark.parametrize("loss_name", ["cross_entropy", "mse_loss"])
def test_a_loss_outside_the_model_without_loss_fn_stays_within_the_budget(loss_name):
    # the logits' loss is computed by the caller: without loss_fn the reserve covers the usual ones
    import torch.nn.functional as F

    from planner.whole.api import LossNotPlannedWarning

    model, x = make_gpt(batch=2, seq=16, vocab=128)
    target = torch.randint(0, 128, x.shape)

    def loss_fn(logits):
        if loss_name == "cross_entropy":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return F.mse_loss(logits, torch.zeros_like(logits))

    for given in (None, loss_fn):  # the reserve, and the loss measured (on CPU, MSE's mean keeps its buffer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossNotPlannedWarning)
            full = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S, loss_fn=given)
            smallest = smallest_budget(full, TIME_LIMIT_S).budget_bytes
            for budget in (smallest, (smallest + full.predicted_peak_bytes) // 2, full.predicted_peak_bytes):
                p = plan(model, x, budget / GB, cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S,
                         loss_fn=given)
                assert measure_peak_bytes(p.apply(model), x, loss_fn) <= budget


def test_a_plan_with_the_default_cost_model_reloads(tmp_path):
    # Regression: the contraction folds free views only where they cost nothing, so a plan traced with measured
    # times (the default cost model) was refused on reload when the re-trace used FLOPs ("29 graph nodes, the plan
    # has 39").
    from tests.models import make_mlp

    model, x = make_mlp()
    eager = step_state(copy.deepcopy(model), x, seed=7)
    p = plan(model, x, 1000.0, time_limit_s=5, loss_fn=lambda out: out.sum())
    assert p.cost_model == "time"
    p.to_json(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert_same_state(step_state(loaded.apply(copy.deepcopy(model), x), x, seed=7), eager)


def test_a_gradient_reaching_an_output_that_needs_none_is_ignored_as_in_eager():
    # only a model's own loss makes the backward refuse gradients of other outputs; an output that depends on
    # nothing differentiable (here a function of the input alone) takes a gradient and passes nothing on
    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), x * 2

    torch.manual_seed(0)
    model, x = TwoOutputs(), torch.randn(3, 4)
    eager = copy.deepcopy(model)
    loss_fn = lambda out: out[0].sum() + out[1].sum()  # noqa: E731
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=5, loss_fn=loss_fn)
    assert_same_state(step_state(p.apply(model), x, loss_fn, seed=1), step_state(eager, x, loss_fn, seed=1))


def test_a_budget_the_no_recomputation_schedule_meets_gets_it():
    """The solver graph counts a multi-output op's secondary outputs twice (BatchNorm's statistics, max-pool's
    indices), so its keep-everything peak is above what the executor holds. A budget between the two gets the
    keep-everything schedule (no schedule costs less), not a recomputation; one byte less does not."""
    from fractions import Fraction

    from planner.core.problem import PlanningProblem

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10)).train()
    x = torch.randn(4, 3, 16, 16)
    loss_fn = lambda out: out.sum()  # noqa: E731
    full = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S, loss_fn=loss_fn)
    keep_all = full.predicted_peak_bytes
    conservative = reference_peak_bytes(solver_graph(full.traced))
    assert conservative > keep_all  # the case this test is about
    p = plan(model, x, Fraction(keep_all, GB), cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S,
             loss_fn=loss_fn)
    assert p.overhead == 0 and p.predicted_peak_bytes == keep_all and p.solver == "auto (checkpoint_all)"
    assert PlanningProblem(full.traced).keep_all(keep_all) is not None
    assert PlanningProblem(full.traced).keep_all(keep_all - 1) is None
    assert_same_state(step_state(p.apply(copy.deepcopy(model)), x, seed=3), eager_state(model, x, seed=3))


def test_below_the_bound_with_no_budget_found_in_time_names_none(gpt, monkeypatch):
    """The single-operation bound proves the budget infeasible, but is no budget known to work: where the search for
    one finds none in its time, the error names none."""
    from planner.core.problem import PlanningProblem, SmallestBudget

    model, x, first, _, _ = gpt
    floor = first.graph.single_op_bound_bytes()
    monkeypatch.setattr(PlanningProblem, "smallest_budget",
                        lambda self, seconds: SmallestBudget(None, "nothing met a budget in the time", None))
    with pytest.raises(InfeasibleBudgetError) as ei:
        plan(model, x, (floor - 1) / GB, cost_model="flops", traced=first.traced, time_limit_s=TIME_LIMIT_S)
    assert ei.value.min_budget_bytes is None
    assert "single-operation bound" in str(ei.value) and "no budget known to work" in str(ei.value)


def test_a_schedule_the_executor_would_run_over_the_budget_is_never_returned(gpt, monkeypatch):
    # the exact view of a schedule (what the executor holds) above the budget: an error naming it, not a plan
    from graphs.errors import SolverError
    from planner.core.problem import PlanningProblem

    model, x = gpt[:2]
    first = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S, loss_fn=lambda out: out.sum())
    real = PlanningProblem.finalise

    def holding_more(self, graph, result):
        done = real(self, graph, result)
        return type(done)(done.result, done.executor_computes, result.budget_bytes + 1)

    monkeypatch.setattr(PlanningProblem, "finalise", holding_more)
    with pytest.raises(SolverError, match=r"holds \d+ bytes as the executor runs it, over the budget"):
        plan(model, x, first.predicted_peak_bytes / GB, cost_model="flops", traced=first.traced,
             time_limit_s=TIME_LIMIT_S, loss_fn=lambda out: out.sum())
