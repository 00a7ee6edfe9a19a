"""The memory-time curve: the planner's points at budgets from the no-recomputation peak to the smallest."""
from __future__ import annotations

import pytest

from planner import GB, plan
from planner.tools.curve import overhead_curve
from tests.models import make_gpt

pytestmark = pytest.mark.filterwarnings("ignore::planner.whole.api.LossNotPlannedWarning")


def test_curve_points_are_the_plans_at_those_budgets(tmp_path):
    model, x = make_gpt(batch=2, seq=32, vocab=64, n_layers=2)
    curve = overhead_curve(model, x, points=4, cost_model="flops", time_limit_s=3, torch_compile_budget=None)
    budgets = [p.budget_bytes for p in curve.points]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] == curve.reference_peak_bytes
    # the last budget is the smallest one known (a search that found none in time leaves the peak alone)
    assert budgets[-1] == (curve.smallest_budget_bytes or curve.reference_peak_bytes)
    found = [p for p in curve.points if p.overhead is not None]
    assert found and found[0].overhead == 0.0  # at the no-recomputation peak nothing is recomputed
    for p in found:
        assert p.predicted_peak_bytes <= p.budget_bytes
        assert p.lower_bound_overhead is None or p.lower_bound_overhead <= p.overhead + 1e-9
        assert p.lower_bound_overhead is None or p.bound_scope
    # plan() at a point's budget meets it, and no schedule beats the point's lower bound (time-limited searches
    # need not return the same overhead twice)
    mid = found[len(found) // 2]
    again = plan(model, x, mid.budget_bytes / GB, cost_model="flops", time_limit_s=3)
    assert again.predicted_peak_bytes <= mid.budget_bytes
    if mid.lower_bound_overhead is not None and mid.bound_covers_every_schedule:
        assert again.overhead >= mid.lower_bound_overhead - 1e-9
    # per-block checkpointing measured on the same step, and the plot drawn
    assert [m.label for m in curve.measured] == ["per-block checkpointing"]
    assert curve.measured[0].peak_bytes > 0 and curve.measured[0].step_over_eager > 0
    curve.plot(str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert curve.table().count("\n") >= len(curve.points) + 1


def test_a_curve_reuses_a_plans_trace():
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=1)
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=3)
    curve = overhead_curve(model, x, traced=p.traced, cost_model=p.cost_model, points=2, time_limit_s=2,
                           measure=False)
    assert curve.points[0].budget_bytes == curve.reference_peak_bytes and curve.points[0].overhead == 0.0
    assert len(curve.points) == (1 if curve.smallest_budget_bytes in (None, curve.reference_peak_bytes) else 2)
    assert curve.measured == []
