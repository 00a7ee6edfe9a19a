"""Where torch's fake tensors give another layout than the CPU kernel returns, the capture follows the kernel
(capture/meta_overrides.py): a BatchNorm1d over a transposed (B, T, C) activation returns a contiguous (B, C, T)
output on CPU, whose transpose a Linear must copy to flatten; a trace that believed the fake strides chose a `view`
that fails on the real tensor."""
import copy

import pytest
import torch
import torch.nn as nn

from planner import GB, plan, smallest_budget
from planner.tools.measure import default_loss, measure_peak_bytes
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state


def plans_at_smallest_and_full(model, x):
    """(plan, budget) at the smallest budget and at the no-recomputation peak, the step's loss the outputs' sum."""
    full = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S, loss_fn=default_loss)
    smallest = smallest_budget(full, TIME_LIMIT_S).budget_bytes
    for budget in (smallest, full.predicted_peak_bytes):
        yield plan(model, x, budget / GB, cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S,
                   loss_fn=default_loss), budget


class NormOverTime(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.lin, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, 8)

    def forward(self, x):  # x: (batch, time, channels)
        h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.relu(self.lin(h)))


@pytest.mark.parametrize("shape", [(4, 10, 16), (10, 4, 16)], ids=["batch-first", "time-first"])
def test_batch_norm_over_a_transposed_activation_plans_and_equals_eager(shape):
    torch.manual_seed(0)
    model, x = NormOverTime().train(), torch.randn(*shape)
    want = eager_state(model, x)
    for p, budget in plans_at_smallest_and_full(model, x):
        assert_same_state(eager_state(p.apply(model), x), want)  # a step of a copy: the buffers stay as they are
        assert measure_peak_bytes(p.apply(copy.deepcopy(model)), x) <= budget


class LinearOverTime(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.BatchNorm1d(16), nn.Linear(10, 12)

    def forward(self, x):  # x: (batch, time=10, channels=16); the Linear reads the norm's contiguous (B, C, T) output
        return self.lin(self.norm(x.transpose(1, 2)))


def test_the_trace_runs_the_kernel_eager_runs_on_the_real_layout():
    # eager flattens the contiguous output with a view and runs addmm; a trace that believed the fake (strided)
    # output ran mm + add, whose bias gradient differed in the last bits
    torch.manual_seed(0)
    model, x = LinearOverTime().train(), torch.randn(4, 10, 16)
    p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S, loss_fn=default_loss)
    assert "aten.addmm" in p.traced.joint_module.code
    assert_same_state(eager_state(p.apply(model), x), eager_state(model, x))


class ConvOverAGrid(nn.Module):
    """Tokens (B, T, D) laid out as a (B, D, 2, T/2) image: a channels-last-strided view, so the convolutions compute
    their weight gradients channels-last, which autograd would copy into the parameters' layout."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 32, 3, padding=1), nn.Conv2d(32, 24, 3, padding=1)

    def forward(self, x):
        b, t, d = x.shape
        h = torch.relu(self.c1(x.transpose(1, 2).reshape(b, d, 2, t // 2)))
        return self.c2(h).flatten(2).transpose(1, 2)


def test_a_gradient_in_another_layout_than_its_parameter_is_counted():
    torch.manual_seed(0)
    model, x = ConvOverAGrid().train(), torch.randn(2, 8, 8)
    want = eager_state(model, x)
    for p, budget in plans_at_smallest_and_full(model, x):
        assert_same_state(eager_state(p.apply(model), x), want)
        assert measure_peak_bytes(p.apply(copy.deepcopy(model)), x) <= p.predicted_peak_bytes <= budget

