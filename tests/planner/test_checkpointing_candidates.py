"""The checkpointing people write by hand is in plan()'s portfolio: at the measured peak of per-block or selective
checkpointing, plan() finds a schedule that costs no more than that checkpointing's own schedule of the trace, holds
no more than the budget when run, and trains as eager does; and plan() does not give up before its time is up."""
from __future__ import annotations

import copy
import time

import pytest

from capture.module_tags import repeated_blocks
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.schedule import Schedule
from graphs.simulate import simulate
from harness.eager_compare import step_state
from planner import GB, plan
from planner.core.candidates import checkpoint_candidates
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes
from solvers.heuristics.block_checkpoint import block_checkpoint_sequence
from tests.models import make_gpt
from tests.planner.helpers import assert_same_state

pytestmark = pytest.mark.filterwarnings("ignore::planner.whole.api.LossNotPlannedWarning")


def test_the_blocks_are_the_repeated_layers():
    model, _ = make_gpt(batch=2, seq=16, vocab=64, n_layers=3)
    assert repeated_blocks(model) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("selective", [False, True], ids=["per-block", "selective"])
def test_plan_at_a_checkpointing_peak_costs_no_more_than_it(selective):
    pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e .[test])")
    from examples.hf_zoo import build

    model, batch = build("gpt2", "test", True)
    budget = measure_peak_bytes(per_block_checkpointed(model, selective=selective), batch)
    full = plan(model, batch, 1000.0, cost_model="flops", time_limit_s=3)
    label, options = checkpoint_candidates(model, full.traced, full.problem.solver_graph)[int(selective)]
    exact = full.problem.exact_graph
    own = simulate(exact, Schedule.from_sequence(exact, block_checkpoint_sequence(exact, **options)),
                   full.problem.co_outputs)
    assert own.peak_bytes <= budget  # the trace's schedule of that checkpointing holds what it measures
    p = plan(model, batch, budget / GB, cost_model="flops", time_limit_s=3, traced=full.traced)
    assert p.result.total_cost <= own.total_cost * (1 + 1e-9)
    assert any(t["solver"] == label for t in p.result.info.get("tried", [])) or label in p.solver
    planned = p.apply(copy.deepcopy(model))
    assert measure_peak_bytes(planned, batch) <= budget
    assert_same_state(step_state(planned, batch, seed=3), step_state(copy.deepcopy(model), batch, seed=3))


def test_plan_searches_on_with_the_time_it_kept_for_a_second_solve():
    # at the single-operation floor nothing is found; plan() must not give up before 90 % of its limit
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=2)
    full = plan(model, x, 1000.0, cost_model="flops", time_limit_s=3)
    floor = full.problem.solver_graph.single_op_bound_bytes()
    limit = 4.0
    t0 = time.perf_counter()
    try:
        plan(model, x, floor / GB, cost_model="flops", time_limit_s=limit, traced=full.traced)
    except NoSolutionInTimeError:
        assert time.perf_counter() - t0 >= 0.9 * limit
    except InfeasibleBudgetError:
        pass  # proven: an answer too
