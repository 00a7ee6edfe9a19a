"""Per-block and selective checkpointing as schedules of a graph, and auto never returning a costlier schedule where
one of them fits."""
from __future__ import annotations

import pytest

from graphs.errors import InfeasibleBudgetError
from graphs.generate import decoder_training_graph
from graphs.schedule import Schedule
from graphs.simulate import reference_peak_bytes, simulate
from solvers.base import solve
from solvers.heuristics.block_checkpoint import block_checkpoint_sequence

LAYERS, PER_LAYER = 4, 13  # decoder_training_graph: an embedding, 13 forward nodes a layer, a final norm


def _decoder():
    g = decoder_training_graph(LAYERS, seed=1, seq=64, width=32, heads=2)
    n_forward = 1 + LAYERS * PER_LAYER + 1
    grad = {i: n_forward + (n_forward - i) for i in range(n_forward)}  # the id of forward node i's gradient
    blocks = []
    for k in range(LAYERS):
        fwd = list(range(1 + k * PER_LAYER, 1 + (k + 1) * PER_LAYER))
        blocks.append(fwd + [grad[i] for i in fwd])
    saved = [v for b in blocks for v in b if g.nodes[v].name.split("_")[0] in ("addmm", "bmm")]
    return g, blocks, saved


def test_per_block_recomputes_each_block_once_and_nothing_outside():
    g, blocks, _ = _decoder()
    sim = simulate(g, Schedule.from_sequence(g, block_checkpoint_sequence(g, blocks)))
    inside = {v for b in blocks for v in b}
    assert all(sim.compute_counts[v] == 1 for v in range(g.n) if v not in inside)
    assert all(sim.compute_counts[v] <= 2 for v in inside)
    assert sim.recomputed and all(not g.nodes[v].backward for v in sim.recomputed)
    assert sim.peak_bytes < reference_peak_bytes(g)


def test_selective_keeps_its_saved_values_and_costs_no_more():
    g, blocks, saved = _decoder()
    per_block = simulate(g, Schedule.from_sequence(g, block_checkpoint_sequence(g, blocks)))
    selective = simulate(g, Schedule.from_sequence(g, block_checkpoint_sequence(g, blocks, saved)))
    assert all(selective.compute_counts[v] == 1 for v in saved)
    assert selective.total_cost <= per_block.total_cost
    assert selective.peak_bytes >= per_block.peak_bytes  # it keeps more


def test_the_solver_names_its_peak_when_over_budget():
    g, blocks, _ = _decoder()
    peak = simulate(g, Schedule.from_sequence(g, block_checkpoint_sequence(g, blocks))).peak_bytes
    assert solve(g, peak, "block_checkpoint", blocks=blocks).peak_bytes == peak
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(g, peak - 1, "block_checkpoint", blocks=blocks)
    assert e.value.min_budget_bytes == peak


@pytest.mark.parametrize("selective", [False, True])
def test_auto_never_returns_a_costlier_schedule_than_a_candidate_that_fits(selective):
    g, blocks, saved = _decoder()
    options = {"blocks": blocks, "saved": saved if selective else []}
    baseline = solve(g, 10**15, "block_checkpoint", **options)
    label = "selective" if selective else "per-block"
    # capped by iterations, not time: the candidate is tried first and costs milliseconds
    res = solve(g, baseline.peak_bytes, "auto", time_limit_s=2, candidates=[(label, options)])
    assert res.total_cost <= baseline.total_cost * (1 + 1e-12)
    assert any(t["solver"] == label and t["outcome"] == "heuristic" for t in res.info["tried"])
