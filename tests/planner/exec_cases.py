"""The executor's acceptance check for one test model, shared by the test_executor_*.py files.

For budgets of 100 %, 70 % and 50 % of checkpoint-all's peak and the smallest feasible budget: the planned
step's gradients, updated buffers and loss are torch.equal to eager (dropout under a fixed seed included),
and its measured peak (storage-tracking mode) is within the budget and within 5 % of the predicted peak.
"""
from __future__ import annotations

import copy

import pytest

from graphs.simulate import reference_peak_bytes
from planner import GB, plan
from planner.api import smallest_budget
from planner.measure import measure_peak_bytes, step_state
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state, make, usable_registry

FRACTIONS = (1.0, 0.7, 0.5, "smallest")


class Case:
    def __init__(self, name: str):
        usable_registry()
        self.name = name
        self.model, self.x = make(name)
        self.first = plan(self.model, self.x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
        self.ref = reference_peak_bytes(self.first.graph)
        self.eager = eager_state(self.model, self.x)

    def budget(self, frac) -> tuple[int, str]:
        """The budget in bytes, and the solver to plan it with."""
        if frac == "smallest":
            found, solver = smallest_budget(self.first, time_limit_s=TIME_LIMIT_S)
            assert found is not None
            return found, solver
        return int(frac * self.ref), "auto"


def check(case: Case, frac) -> None:
    budget, solver = case.budget(frac)
    p = plan(case.model, case.x, budget / GB, solver=solver, cost_model="flops", traced=case.first.traced,
             time_limit_s=TIME_LIMIT_S)
    assert p.predicted_peak_bytes <= p.budget_bytes <= budget
    if frac != 1.0:
        assert p.predicted_peak_bytes < case.ref  # the plan really saves memory
    m = copy.deepcopy(case.model)  # the plan applies to another instance of the same model
    planned = p.apply(m)
    assert_same_state(step_state(planned, case.x, seed=7), case.eager)
    peak = measure_peak_bytes(planned, case.x)
    assert peak <= budget, f"measured {peak} > budget {budget}"
    assert abs(peak - p.predicted_peak_bytes) <= 0.05 * p.predicted_peak_bytes, (peak, p.predicted_peak_bytes)


def make_test(name: str):
    @pytest.fixture(scope="module")
    def case():
        return Case(name)

    @pytest.mark.parametrize("frac", FRACTIONS, ids=str)
    def test_budget(case, frac):
        check(case, frac)

    return case, test_budget
