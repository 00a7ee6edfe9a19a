"""The compiled path: plan.apply(model, compile=True) runs the planned halves as inductor kernels (CPU here)."""
from __future__ import annotations

import copy

import pytest
import torch

from graphs.simulate import reference_peak_bytes
from harness.eager_compare import relative_difference, step_state
from planner import GB, plan
from planner.core.plan_type import Plan
from planner.tools.measure import allocator_peak_bytes, measure_peak_bytes
from tests.models import make_gpt
from tests.planner.helpers import TIME_LIMIT_S


@pytest.fixture(scope="module")
def dropout_plan():
    """A GPT with dropout planned low enough that a dropout is recomputed in the backward."""
    model, x = make_gpt(batch=2, seq=32, vocab=64, n_layers=2)
    first = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    ref = reference_peak_bytes(first.graph)
    for frac in (0.8, 0.7, 0.6):
        p = plan(model, x, frac * ref / GB, cost_model="flops", traced=first.traced, time_limit_s=TIME_LIMIT_S)
        if any(p.graph.nodes[v].name.startswith("native_dropout") for v in p.result.sim.recomputed):
            return model, x, first, p
    pytest.fail("no plan recomputed a dropout; the compiled RNG replay would go untested")


def test_compiled_plan_draws_what_eager_draws(dropout_plan):
    """Each dropout is drawn on eager's generator in eager's order and redrawn from its saved state: the compiled
    step's gradients equal eager's to inductor's rounding, at a budget where a dropout is recomputed."""
    model, x, _, low = dropout_plan
    planned = low.apply(copy.deepcopy(model), compile=True)
    got = step_state(planned, x, seed=7)  # the call that compiles
    after_planned = torch.rand(4)
    eager = step_state(copy.deepcopy(model), x, seed=7)
    after_eager = torch.rand(4)
    assert planned.compile_seconds is not None and planned.compile_seconds > 0
    assert torch.allclose(got[2], eager[2], rtol=1e-5, atol=1e-6)
    assert relative_difference(got[0], eager[0]) < 1e-5
    # the global generator advanced as eager's did, at the call that compiled and at a compiled call: the next draw
    # is the same
    assert torch.equal(after_planned, after_eager)
    again = step_state(planned, x, seed=7)
    assert torch.equal(torch.rand(4), after_eager)
    assert torch.equal(again[2], got[2])


def test_compiled_peak_is_measured_and_near_the_prediction(dropout_plan):
    """The allocator's stream counts inductor's buffers (a dispatch mode does not see them): the compiled step's
    measured peak is within 15 % of the plan's prediction on this small model and below its no-recomputation
    peak."""
    model, x, first, low = dropout_plan
    planned = low.apply(copy.deepcopy(model), compile=True)
    step_state(planned, x, seed=1)  # compile
    measured = allocator_peak_bytes(planned, x)
    assert measured <= 1.15 * low.predicted_peak_bytes
    assert measured < first.predicted_peak_bytes
    # the dispatch mode misses the compiled kernels' own buffers
    assert measure_peak_bytes(planned, x) < measured


def test_a_json_plan_applies_compiled(dropout_plan, tmp_path):
    """One plan for both paths: the JSON of a plan made for eager applies compiled (re-traced at the first call)."""
    model, x, _, low = dropout_plan
    low.to_json(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    m = copy.deepcopy(model)
    got = step_state(loaded.apply(m, compile=True), x, seed=3)
    want = step_state(low.apply(copy.deepcopy(model)), x, seed=3)
    assert relative_difference(got[0], want[0]) < 1e-5


def test_allocator_peak_counts_what_the_step_allocates():
    """On an eager step the allocator's peak is at least the dispatch mode's (it also sees kernel scratch)."""
    model, x = make_gpt(batch=2, seq=16, vocab=64, n_layers=1)
    a = allocator_peak_bytes(model, x)
    d = measure_peak_bytes(model, x)
    assert d <= a <= 1.25 * d


def test_stashed_values_the_compiled_backward_never_reads_are_not_kept(monkeypatch):
    """A BatchNorm net's eager backward ops read values inductor's decomposed backward does not: the compiled
    forward stops returning them, which lowers the measured peak and leaves the gradients as they were."""
    import planner.execution.inductor as compiled
    from tests.models import make_cnn
    model, x = make_cnn(batch=4, ch=8, size=16, blocks=2)
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    prune = compiled._prune_unread_stash
    dropped = []

    def spy(f_gm, b_gm, first_stash, num_stash):
        keep = prune(f_gm, b_gm, first_stash, num_stash)
        dropped.append(num_stash - sum(1 for k in keep if k < num_stash))
        return keep

    monkeypatch.setattr(compiled, "_prune_unread_stash", spy)
    pruned = p.apply(copy.deepcopy(model), compile=True)
    got = step_state(pruned, x, seed=5)
    assert dropped and dropped[0] > 0
    low = allocator_peak_bytes(pruned, x)
    monkeypatch.setattr(compiled, "_prune_unread_stash",
                        lambda f_gm, b_gm, first, n: list(range(sum(1 for q in b_gm.graph.nodes
                                                                    if q.op == "placeholder"))))
    kept = p.apply(copy.deepcopy(model), compile=True)
    want = step_state(kept, x, seed=5)
    assert low < allocator_peak_bytes(kept, x)
    assert relative_difference(got[0], want[0]) < 1e-6


def test_a_compiled_step_updates_batchnorm_buffers_inside_its_forward(monkeypatch):
    """BatchNorm's running statistics are written by the compiled forward itself (no new tensors handed back for the
    step to copy in): after two steps every buffer, num_batches_tracked included, and every gradient equal eager's."""
    import planner.execution.inductor as compiled
    from tests.models import make_cnn
    model, x = make_cnn(batch=4, ch=8, size=16, blocks=2)
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    copies = []
    inner = compiled._inductor

    def spy(gm, example, *, is_backward):
        if not is_backward:
            copies.append(sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default))
        return inner(gm, example, is_backward=is_backward)

    monkeypatch.setattr(compiled, "_inductor", spy)
    eager_model = copy.deepcopy(model)
    planned = p.apply(copy.deepcopy(model), compile=True)
    n_updated = len(list(model.buffers()))
    for seed in (5, 6):
        want = step_state(eager_model, x, seed=seed)
        got = step_state(planned, x, seed=seed)
        assert relative_difference(got[0], want[0]) < 1e-5
    assert copies == [n_updated]  # one in-graph copy per BatchNorm buffer
    for name, b in want[1].items():
        assert torch.allclose(got[1][name].double(), b.double(), rtol=1e-5, atol=1e-6), name


def test_pointwise_stash_values_are_rebuilt_in_the_compiled_backward(monkeypatch):
    """A BatchNorm+ReLU output the eager backward reads stashed is rebuilt by the compiled backward from the
    BatchNorm's input, statistics and parameters (all stashed or resident anyway): the forward stops returning it,
    the measured peak is no higher, and the gradients are those of the step that stashes it."""
    import planner.execution.inductor as compiled
    from tests.models import make_cnn
    model, x = make_cnn(batch=4, ch=8, size=16, blocks=2)
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    inner = compiled.rebuild_pointwise_stash
    moved = []

    def spy(*args):
        got = inner(*args)
        moved.append(got.moved)
        return got

    monkeypatch.setattr(compiled, "rebuild_pointwise_stash", spy)
    rebuilt = p.apply(copy.deepcopy(model), compile=True)
    got = step_state(rebuilt, x, seed=5)
    assert moved and any(name.startswith(("relu", "alias")) for name in moved[0]), moved
    low = allocator_peak_bytes(rebuilt, x)
    monkeypatch.setattr(compiled, "REBUILD_POINTWISE", False)
    stashed = p.apply(copy.deepcopy(model), compile=True)
    want = step_state(stashed, x, seed=5)
    assert low <= allocator_peak_bytes(stashed, x)
    assert relative_difference(got[0], want[0]) < 1e-5
    eager = step_state(copy.deepcopy(model), x, seed=5)
    assert relative_difference(got[0], eager[0]) < 1e-5
