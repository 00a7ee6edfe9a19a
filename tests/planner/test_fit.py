"""max_batch: the largest batch whose planned step fits a memory budget, against per-block checkpointing."""
from __future__ import annotations

import pytest

from planner.core.plan_type import GB
from planner.tools.baselines import largest_checkpointed_size
from planner.tools.fit import max_batch
from planner.tools.measure import measure_peak_bytes
from tests.models import make_cnn, make_gpt

pytestmark = pytest.mark.filterwarnings("ignore::planner.whole.api.LossNotPlannedWarning")

MAKERS = {
    "decoder": lambda n: make_gpt(batch=n, seq=32, vocab=64, n_layers=2),
    "conv net": lambda n: make_cnn(batch=n, size=16),
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_max_batch_beats_per_block_checkpointing_at_eager_memory_of_batch_2(kind):
    make = MAKERS[kind]
    model, x = make(2)
    budget_bytes = measure_peak_bytes(model, x)
    fit = max_batch(make, budget_bytes / GB, cost_model="flops", time_limit_s=3)
    assert fit.n is not None and fit.n >= 2
    # the batch named trains within the budget, measured
    model_n, x_n = make(fit.n)
    assert measure_peak_bytes(fit.plan.apply(model_n), x_n) <= budget_bytes
    assert fit.plan.predicted_peak_bytes <= budget_bytes
    # the next one is refused, with the reason
    assert fit.next is not None and fit.next.n == fit.n + 1 and not fit.next.fits and fit.next.reason
    assert fit.n >= largest_checkpointed_size(make, budget_bytes, limit=64)
    # the interpolation saves tracing every size: the two sizes it starts from, the answer and the one after,
    # and the sizes a search from a wrong estimate passes through
    assert {1, 2, fit.n, fit.n + 1} <= set(fit.traced_sizes)
    assert str(fit.n) in fit.summary()


def test_max_overhead_caps_the_answer():
    make = MAKERS["decoder"]
    model, x = make(2)
    budget_bytes = measure_peak_bytes(model, x)
    free = max_batch(make, budget_bytes / GB, cost_model="flops", time_limit_s=3)
    capped = max_batch(make, budget_bytes / GB, cost_model="flops", time_limit_s=3, max_overhead=0.0)
    assert capped.n is not None and capped.n <= free.n
    assert capped.plan.overhead == 0.0
    if capped.next is not None and capped.next.plan is not None:
        assert "overhead" in capped.next.reason


def test_nothing_fits_a_tiny_budget():
    fit = max_batch(MAKERS["decoder"], 1e-6, cost_model="flops", time_limit_s=2)
    assert fit.n is None and fit.plan is None
    assert fit.next.n == 1 and not fit.next.fits
    assert "nothing fits" in fit.summary()


def test_fit_command_prints_the_answer_and_writes_its_plan(tmp_path, capsys):
    from planner.core.plan_type import Plan
    from planner.tools.cli import main
    model, x = make_gpt(batch=2)
    budget = measure_peak_bytes(model, x)
    out = tmp_path / "fit.json"
    rc = main(["fit", "tests.models:make_gpt", "--budget", f"{budget}B", "--cost-model", "flops",
               "--time-limit", "2", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0
    assert "largest size that fits" in printed.out and "does not fit" in printed.out
    assert "planning at" in printed.err  # progress while it runs
    n = int(printed.out.split("GB: ")[1].split(" ")[0])
    assert n >= 2 and Plan.load(out).predicted_peak_bytes <= budget
