"""A loss computed inside the model: on CPU, mse_loss, smooth_l1_loss and binary_cross_entropy return their mean as a
0-d view of the unreduced loss, so the scalar holds a buffer of the inputs' size through the backward. The capture
counts that buffer (fake tensors say 4 bytes), and the planned step stays within its budget."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner import GB, plan, smallest_budget
from planner.tools.measure import measure_peak_bytes
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state

LOSSES = {
    "mse_loss": lambda h, y: F.mse_loss(h, y),
    "smooth_l1_loss": lambda h, y: F.smooth_l1_loss(h, y),
    "binary_cross_entropy": lambda h, y: F.binary_cross_entropy(torch.sigmoid(h), torch.sigmoid(y)),
}


class WithLoss(nn.Module):
    def __init__(self, loss: str):
        super().__init__()
        self.loss = loss
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 48)

    def forward(self, x, y):
        return LOSSES[self.loss](self.c(torch.relu(self.b(torch.relu(self.a(x))))), y)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_an_in_model_loss_keeping_its_buffer_stays_within_the_budget(loss):
    torch.manual_seed(0)
    model, sample = WithLoss(loss), (torch.randn(16, 20, 32), torch.randn(16, 20, 48))
    unreduced = 16 * 20 * 48 * 4
    assert LOSSES[loss](torch.randn(16, 20, 48), sample[1]).untyped_storage().nbytes() == unreduced
    full = plan(model, sample, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    smallest = smallest_budget(full, TIME_LIMIT_S).budget_bytes
    want = eager_state(model, sample)
    for budget in (smallest, (smallest + full.predicted_peak_bytes) // 2, full.predicted_peak_bytes):
        p = plan(model, sample, budget / GB, cost_model="flops", traced=full.traced, time_limit_s=TIME_LIMIT_S)
        planned = p.apply(model)
        assert measure_peak_bytes(planned, sample) <= budget
        assert_same_state(eager_state(planned, sample), want)
