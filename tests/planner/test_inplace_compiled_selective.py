"""planner.enable(model, ..., compile=True): the blocks' kept, checkpointed and selective options run under
torch.compile (planner.inplace.compiled_options), each option's figures measured as compiled; the measuring call runs
the eager checkpointed option, whose memory its storage tracker sees.

The reference for the parameters is torch.compile of the same blocks (same backend) without the planner: the planned
model is to be as close to eager as that. aot_eager here (seconds); inductor was run by hand (docs/training.md)."""
from __future__ import annotations

import copy

import pytest
import torch

import planner
from capture.measure_memory import StorageTracker, allocation_peak_bytes, profiler_allocations
from planner.inplace.compiled_options import COMPILED_PREFIX, _Traced, matches_recording
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes, resident_bytes
from tests.planner.helpers import farthest, on_a_thread_of_its_own

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402


def _step(model, batch, opt, seed, read: str | None = None) -> int | None:
    """One AdamW step; with `read`, the step's peak bytes (parameters, buffers and batch included): "tracker" (a
    storage tracker: eager code) or "allocator" (torch.profiler's memory events: compiled code too)."""
    torch.manual_seed(seed)
    peak = None
    if read == "tracker":
        tracker = StorageTracker()
        with tracker:
            model(**batch).loss.backward()
        peak = tracker.peak_bytes
    elif read == "allocator":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(**batch).loss.backward()
        peak = allocation_peak_bytes(profiler_allocations(prof))
    else:
        model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return None if peak is None else resident_bytes(model, batch) + peak


def test_compiled_selective_blocks_train_as_the_compiled_blocks_within_the_budget():
    on_a_thread_of_its_own(_compiled_selective)


def _compiled_selective():
    torch._dynamo.reset()
    model, batch = build("llama", "test")  # no dropout: compiled and eager draw alike
    eager, alone = copy.deepcopy(model), copy.deepcopy(model)
    for layer in alone.model.layers:
        layer.compile(backend="aot_eager")  # torch.compile of the same blocks, without the planner
    low = measure_peak_bytes(per_block_checkpointed(model), batch)
    high = measure_peak_bytes(model, batch)
    budget = int(low + 0.3 * (high - low))  # between: a selective option on a block, the other kept
    state = planner.enable(model, budget / 1e9, compile=True, backend="aot_eager")
    try:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, alone, model)]
        for k in range(3):
            _step(eager, batch, opts[0], k)
            _step(alone, batch, opts[1], k)
            peak = _step(model, batch, opts[2], k, read="tracker" if k == 0 else "allocator")
            record = state.records[-1]
            assert peak <= budget, (k, record, peak, budget)
            if k:  # what the compiled options were measured to hold is what the step holds
                assert record.predicted_peak_bytes <= budget
                assert abs(peak - record.predicted_peak_bytes) <= 0.02 * record.predicted_peak_bytes
        assert [r.mode for r in state.records] == ["measure", "planned", "planned"]
        assert state.records[0].options == ["checkpointed", "checkpointed"]  # its eager counterpart: tracked
        chosen = state.records[-1].options
        assert all(name.startswith(COMPILED_PREFIX) for name in chosen)
        assert any(name.startswith(COMPILED_PREFIX + "selective@") for name in chosen), chosen
        assert farthest(model, eager) <= max(2 * farthest(alone, eager), 1e-6)
        (prof,) = state.profiles.values()
        assert "compile=True" not in prof.note
    finally:
        planner.disable(model)


def test_a_policy_seeing_other_operators_under_compile_is_refused():
    """A selective policy names operators by (func, occurrence) in the eager recording; where the compiled trace
    asked it about a kept func another number of times, the names would point elsewhere: the eager option stays."""
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor

    class R:
        def __init__(self, func):
            self.func = func
    records = [R(mm), R(add), R(mm)]
    assert matches_recording(_Traced({mm: 2, add: 1}), records, frozenset({(mm, 1)})) is None
    assert matches_recording(_Traced({mm: 3, add: 1}), records, frozenset({(mm, 1)})) is not None
    assert matches_recording(_Traced({mm: 2}), records, frozenset({(add, 0)})) is not None


def test_a_block_updating_buffers_runs_its_eager_options():
    on_a_thread_of_its_own(_buffers)


def _buffers():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                                      torch.nn.ReLU()) for _ in range(2)])
    x = torch.randn(8, 16)
    eager = copy.deepcopy(model)
    state = planner.enable(model, 1.0, compile=True, backend="aot_eager")
    try:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
        for _ in range(2):
            for m, o in zip((eager, model), opts):
                out = m(x)
                out.square().mean().backward()
                del out
                o.step()
                o.zero_grad()
        for prof in state.profiles.values():
            assert "updates buffers" in prof.note
            assert not any(o.figures.name.startswith(COMPILED_PREFIX) for o in prof.options)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values()))
    finally:
        planner.disable(model)


def _dropout_gradients():
    model, batch = build("gpt2", "test")
    assert model.config.resid_pdrop > 0 and model.config.attn_pdrop > 0
    eager_peak = measure_peak_bytes(copy.deepcopy(model), batch)
    ckpt_peak = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), batch)
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    state = planner.enable(planned, (ckpt_peak + 0.3 * (eager_peak - ckpt_peak)) / 1e9, compile=True,
                           backend="aot_eager")
    for seed in range(3):
        for m in (eager, planned):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            m(**batch).loss.backward()
        for (name, p), q in zip(planned.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), (seed, name, state.records[-1].options)
    assert any(o.startswith(COMPILED_PREFIX + "selective") for o in state.records[-1].options), state.records[-1]


def test_a_compiled_selective_block_with_dropout_gives_the_forwards_own_masks_gradients():
    # with dropout in the blocks, the compiled selective and kept options under aot_eager give eager's gradients
    # (inductor draws its own masks; that the compiled options save dropout's outputs is what keeps its recomputation
    # on the forward's masks there, which aot_eager's RNG-restoring recomputation cannot tell apart)
    on_a_thread_of_its_own(_dropout_gradients)
