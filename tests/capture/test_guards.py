"""Guards recompute a specialised forward's scalar reads without running the model (capture/guards.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from capture.trace import SpecialisationError, TraceError, trace
from tests.capture.test_trace_hazards import ItemModel, MaskModel


def _count_forwards(model: nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_mask_check_is_a_few_ops_and_needs_no_forward():
    torch.manual_seed(0)
    model = MaskModel().train()
    x, mask = torch.randn(2, 4, 8), torch.ones(2, 4)
    tr = trace(model, (x, mask))
    assert tr.specialisation.scalar_reads and tr.guard is not None
    assert tr.guard.num_ops <= 3  # all(mask) and its read; the linear layer is not in the slice
    calls = _count_forwards(model)
    tr.check_input(torch.randn(2, 4, 8), torch.ones(2, 4))
    assert calls[0] == 0
    other = torch.ones(2, 4)
    other[1, 3] = 0
    with pytest.raises(SpecialisationError, match="another path"):
        tr.check_input(x, other)
    assert calls[0] == 0


def test_item_read_is_replayed_on_the_new_input():
    torch.manual_seed(0)
    model = ItemModel()
    x, lengths = torch.randn(2, 5, 8), torch.tensor([3, 4])
    tr = trace(model, (x, lengths))
    assert tr.guard is not None
    tr.check_input(torch.randn(2, 5, 8), torch.tensor([4, 1]))  # max is 4 again
    with pytest.raises(SpecialisationError):
        tr.check_input(x, torch.tensor([2, 3]))


class RandomRead(nn.Module):
    """The value read depends on a random draw: replaying it would consume random numbers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = nn.functional.dropout(self.lin(x), 0.5, self.training)
        if bool((h != 0).any()):
            return h.relu()
        return h


class InPlaceRead(nn.Module):
    """Reads a value its forward computed in place: the slice holds a mutating op, which a guard does not replay."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        score = h.detach().clone()
        score.add_(1.0)
        if bool((score > -1e6).all()):
            return h.tanh()
        return h


class BufferRead(nn.Module):
    """Reads a buffer it updates in place: the value read changes from step to step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        if self.steps.item() > 0:
            return self.lin(x).tanh()
        return self.lin(x)


def test_a_read_of_a_buffer_the_forward_updates_is_refused_and_the_model_left_as_it_was():
    torch.manual_seed(0)
    model = BufferRead().train()
    with pytest.raises(TraceError, match=r"from steps, which the forward itself updates"):
        trace(model, (torch.randn(4, 8),))
    assert int(model.steps) == 0


@pytest.mark.parametrize("cls", [RandomRead, InPlaceRead])
def test_no_guard_where_the_slice_is_unsafe_and_the_forward_still_checks(cls):
    torch.manual_seed(0)
    model = cls().train()
    x = torch.randn(4, 8)
    tr = trace(model, (x,))
    assert tr.specialisation.scalar_reads and tr.guard is None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    y = torch.randn(4, 8)
    rng = torch.random.get_rng_state()
    tr.check_input(y)  # falls back to a forward; nothing of the model or the RNG changes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.random.get_rng_state())


class LongSlice(nn.Module):
    """A read at the end of a chain of eight elementwise ops: its slice is the whole chain."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        for _ in range(8):
            h = h * 1.5 + 0.1
        return h * (2.0 if h.sum() > 0 else 0.5)


def test_a_guard_replay_holds_only_what_is_still_to_be_read():
    from capture.measure_memory import peak_bytes_created_during

    model, x = LongSlice(), torch.randn(32, 64)
    traced = trace(model, x)
    assert traced.guard is not None and traced.guard.num_ops >= 17
    peak, _ = peak_bytes_created_during(traced.guard.reads, model, x)
    one = 32 * 64 * 4
    assert peak <= 3 * one, peak  # an op's inputs and output at most, not the 17 results of the chain
