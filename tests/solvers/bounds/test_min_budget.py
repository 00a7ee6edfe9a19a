"""min_budget's `adapt`: a schedule the caller does not accept meets no budget."""
import dataclasses

import pytest

from graphs.errors import InfeasibleBudgetError
from graphs.generate import random_training_graph
from graphs.simulate import reference_peak_bytes, simulate
from solvers.bounds.min_budget import min_budget


def test_only_accepted_schedules_meet_a_budget():
    # accepting only schedules without recomputation leaves keeping every value, at the reference peak, while the
    # search on its own finds a smaller budget
    g = random_training_graph(5, seed=3)
    ref = reference_peak_bytes(g)
    assert min_budget(g, time_limit_s=5).budget_bytes < ref
    mb = min_budget(g, time_limit_s=5, adapt=lambda r: None if r.sim.recomputed else r)
    assert mb.budget_bytes == ref
    assert not mb.result.sim.recomputed and simulate(g, mb.result.schedule).peak_bytes <= mb.budget_bytes
    assert mb.lower_bound_bytes <= mb.budget_bytes


def test_the_accepted_schedule_is_the_adapted_one():
    # adapt returns a copy: what min_budget reports must be one of the copies, not the solver's own result
    g = random_training_graph(5, seed=3)
    returned = []

    def adapt(r):
        returned.append(dataclasses.replace(r))
        return returned[-1]

    mb = min_budget(g, time_limit_s=5, adapt=adapt)
    assert any(mb.result is r for r in returned)


def test_nothing_accepted_raises():
    g = random_training_graph(4, seed=1)
    with pytest.raises(InfeasibleBudgetError):
        min_budget(g, time_limit_s=5, adapt=lambda r: None)
