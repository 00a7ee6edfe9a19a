"""BatchNorm with momentum=None in a traced step (capture.counter_momentum): the factor 1 / num_batches_tracked comes
from the counter at run time, so the running statistics equal eager's at every step; the model is left as it was."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from capture.trace import trace
from graphs.errors import TraceError
from planner import plan


class TwiceAndTwoD(nn.Module):
    """One cumulative BatchNorm1d called twice in a forward (its counter goes up by 2 a step) and a BatchNorm2d."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.bn2 = nn.BatchNorm2d(2, momentum=None)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn(self.a(x)).relu()
        h = self.bn(h * 2)
        g = self.bn2(h.reshape(4, 2, 4, 4))
        return self.b(g.reshape(16, 8)).square().sum()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
            and all(torch.equal(x.grad, y.grad) for x, y in zip(a.parameters(), b.parameters())))


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_cumulative_batchnorm_called_twice_trains_as_eager(fraction):
    torch.manual_seed(0)
    model = TwiceAndTwoD()
    eager = copy.deepcopy(model)
    x = torch.randn(16, 8)
    full = plan(copy.deepcopy(model), x, budget_gb=1.0).predicted_peak_bytes
    budget_gb = 1.0 if fraction else full * 0.8 / 1e9
    step = plan(model, x, budget_gb=budget_gb).apply(model)
    for k in range(3):
        x = torch.randn(16, 8) * (k + 1)
        step(x).backward()
        eager(x).backward()
        assert _same(model, eager), k
    assert int(model.bn.num_batches_tracked) == 6 and int(model.bn2.num_batches_tracked) == 3


def test_the_graph_reads_the_counter_and_no_stand_in_is_left():
    model = TwiceAndTwoD()
    traced = trace(model, torch.randn(16, 8))
    targets = [n.target for n in traced.joint_module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.remat.batch_norm_counted.default) == 3
    assert torch.ops.aten._native_batch_norm_legit_functional.default not in targets
    assert model.bn.momentum is None and model.bn2.momentum is None
    assert int(model.bn.num_batches_tracked) == 0  # the capture changed nothing of the model


def test_eval_mode_and_fixed_momentum_are_left_as_they_are():
    model = TwiceAndTwoD().eval()
    targets = {n.target for n in trace(model, torch.randn(16, 8)).joint_module.graph.nodes}
    assert torch.ops.remat.batch_norm_counted.default not in targets
    fixed = TwiceAndTwoD()
    fixed.bn.momentum = 0.1
    targets = [n.target for n in trace(fixed, torch.randn(16, 8)).joint_module.graph.nodes]
    assert targets.count(torch.ops.remat.batch_norm_counted.default) == 1  # bn2 only


def test_an_error_in_the_forward_leaves_the_momentum_as_it_was():
    class Failing(TwiceAndTwoD):
        def forward(self, x):
            self.bn(x)
            raise RuntimeError("the model's own error")

    model = Failing()
    with pytest.raises(TraceError, match="the model's own error"):
        trace(model, torch.randn(16, 8))
    assert model.bn.momentum is None and model.bn2.momentum is None


class ReadAfterInPlace(nn.Module):
    """A cumulative BatchNorm, an in-place op and a value read: the read's slice mutates, so there is no guard and
    each call's check runs the forward again; that run must read what the trace read (not the layer's counter)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn(self.a(x))
        h = h * 1.0
        h.mul_(2.0)
        return self.b(h / (1.0 + float(h.detach().abs().max()))).sum()


def test_the_check_without_a_guard_reads_as_the_trace_did():
    torch.manual_seed(0)
    model, x = ReadAfterInPlace(), torch.randn(16, 8)
    eager = copy.deepcopy(model)
    traced = plan(model, x, budget_gb=1.0)
    assert traced.traced.guard is None
    step = traced.apply(model)
    for k in range(3):
        step(x).backward()
        eager(x).backward()
        assert _same(model, eager), k
