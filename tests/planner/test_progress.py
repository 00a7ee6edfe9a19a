"""plan(progress=...) reports as it goes: a line before tracing, the search's steps with the best overhead and the
bound, heartbeats while a step runs long, and a last line naming the overhead; the logger gets the same lines."""
from __future__ import annotations

import logging
import time

import pytest

from planner import GB, plan
from planner.core.progress import Reporter
from solvers.progress import SearchState
from tests.models import make_gpt

pytestmark = pytest.mark.filterwarnings("ignore::planner.whole.api.LossNotPlannedWarning")


def test_plan_reports_from_start_to_the_overhead():
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=2)
    lines: list[str] = []
    full = plan(model, x, 1000.0, cost_model="flops", time_limit_s=3, progress=lines.append)
    assert "tracing" in lines[0]
    assert lines[-1].startswith("[") and "done: overhead 0.00 %" in lines[-1]
    lines.clear()
    p = plan(model, x, int(0.85 * full.reference_peak_bytes) / GB, cost_model="flops", time_limit_s=3,
             traced=full.traced, progress=lines.append)
    steps = [ln for ln in lines if "solving: " in ln and "best overhead" in ln]
    assert steps, lines  # auto tells each step it starts
    assert f"overhead {100 * p.overhead:.2f} %" in lines[-1]


def test_a_failure_is_the_last_line():
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=1)
    lines: list[str] = []
    with pytest.raises(Exception):
        plan(model, x, 1000 / GB, cost_model="flops", time_limit_s=2, progress=lines.append)
    assert "stopped: InfeasibleBudgetError" in lines[-1]


def test_the_heartbeat_repeats_the_state_while_a_step_runs():
    lines: list[str] = []
    with Reporter(lines.append, every_s=0.05) as say:
        say.search(SearchState("cpsat", 110.0, 105.0, 100.0))
        time.sleep(0.5)
    assert "solving: cpsat; best overhead 10.00 %, bound 5.00 %, gap 5.00 points" in lines[0]
    assert any(ln.endswith("(still running)") for ln in lines[1:]), lines


def test_the_logger_gets_the_lines(caplog):
    with caplog.at_level(logging.INFO, logger="planner"):
        with Reporter(False) as say:
            say("tracing")
    assert any("tracing" in r.getMessage() for r in caplog.records)
