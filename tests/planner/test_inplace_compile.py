"""torch.compile(model) after planner.enable(model): dynamo compiles what lies between the blocks and leaves the
planner's hooks and the blocks' forwards to run as they are (torch.compiler.disable), so the model trains as the
compiled model without the planner does; the measuring call's storage tracker leaves the thread's mode stack at the
optimizer's step, so a compiled model stepping beside it runs as it would alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import planner
from capture.measure_memory import StorageTracker, storage_bytes
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes
from tests.planner.helpers import farthest, on_a_thread_of_its_own

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402


def _train(model, opt, batch, seed):
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_compiled_after_enable_trains_as_the_compiled_model_within_the_budget():
    on_a_thread_of_its_own(_compiled_after_enable)


def _compiled_after_enable():
    torch._dynamo.reset()
    model, batch = build("llama", "test")
    batch["labels"] = batch["input_ids"].clone()
    eager, alone = copy.deepcopy(model), copy.deepcopy(model)
    low = measure_peak_bytes(per_block_checkpointed(model), batch)
    budget = int(low * 1.3)
    state = planner.enable(model, budget / 1e9, time_limit_s=2.0)
    try:
        # aot_eager: the compiled graphs run through the dispatcher, where the storage tracker sees their memory
        planned, compiled = (torch.compile(m, backend="aot_eager") for m in (model, alone))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, alone, model)]
        for k in range(3):
            for m, o in zip((eager, compiled, planned), opts):
                _train(m, o, batch, k)
            assert not _get_current_dispatch_mode_stack()
        assert farthest(model, eager) <= max(2 * farthest(alone, eager), 1e-6)
        assert [r.mode for r in state.records] == ["measure", "planned", "planned"]
        tracker = StorageTracker()
        with tracker:
            planned(**batch).loss.backward()
        assert tracker.peak_bytes + storage_bytes(list(model.parameters())) <= budget
    finally:
        planner.disable(model)


def test_a_compiled_model_stepping_beside_a_measuring_call_runs_as_alone():
    """The measuring call's tracker stays on through the caller's backward; another compiled model (inductor)
    trained between that backward and the planned model's next call would run its backward under it."""
    on_a_thread_of_its_own(_beside)


def _beside():
    torch._dynamo.reset()
    model, batch = build("llama", "test")
    batch["labels"] = batch["input_ids"].clone()
    other, other_batch = build("llama", "test", seed=1)  # another model, no dropout
    other_batch["labels"] = other_batch["input_ids"].clone()
    other_twin = copy.deepcopy(other)
    state = planner.enable(model, 1.0, time_limit_s=2.0)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(other)
        o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (other, other_twin))
        twin_compiled = torch.compile(other_twin)
        _train(twin_compiled, o2, other_batch, 0)
        _train(model, opt, batch, 0)  # the measuring call; its tracker leaves at opt.step
        assert state.records[-1].mode == "measure" and not _get_current_dispatch_mode_stack()
        _train(compiled, o1, other_batch, 0)
        # (two compiled copies of one model differ by rounding, 1e-9 here, planner or not)
        assert farthest(other, other_twin) < 1e-6
    finally:
        planner.disable(model)
