"""Forwards that read a value in Python: a tensor's value (`.item()`, `if h.mean() > t:`), a module-level global, a
draw from Python's or numpy's generator. The planned step equals eager's, or a project error names the cause before
a wrong value is returned."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from capture.state import host_rng_state, same_host_rng
from graphs.errors import PlanMismatchError, TraceError
from harness.eager_compare import step_state
from planner import plan
from planner.whole.api import smallest_budget
from tests.planner.helpers import assert_same_state, eager_state

SCALE = 2.0  # read by ScaledBlock's helper; a test changes it between steps
USE_TANH = True  # read by ScaledBlock's method


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _plan(model, x, budget_gb=1000.0, **kw):
    return plan(model, x, budget_gb, cost_model="flops", time_limit_s=3, **kw)


class Total(nn.Module):
    """The loss as the model's last layer (plan() then reserves no memory for a loss of its own)."""

    def forward(self, x):
        return x.sum()


class ItemScale(nn.Module):
    """Chooses a Python constant from a value read with .item()."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        c = 2.0 if h.detach().mean().item() > 0 else 0.5
        return self.b(h * c).sum()


class WeightRead(nn.Module):
    """Bakes a value read from a parameter into the graph (int() specialises it): a capture that saw other
    parameter values than the real ones gives another loss."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        k = int(self.a.weight.abs().sum().item() * 1000)
        return (self.a(x) * (k / 1000)).sum()


@pytest.mark.parametrize("shift", [2.0, -2.0])  # the sample's data takes one branch, then the other
def test_item_read_of_parameter_data_plans_as_eager(shift):
    torch.manual_seed(0)
    for model, x in [(ItemScale(), torch.randn(16, 8) + shift), (WeightRead(), torch.randn(4, 8))]:
        want = eager_state(model, x)
        p = _plan(model, x)
        assert_same_state(step_state(p.apply(model), x, seed=7), want)


class NormThenRead(nn.Module):
    """BatchNorm in a forward that then reads a value. On the input (which needs no gradient), the capture on real
    values met torch's meta kernel making an input gradient the kernel does not (`_has_storage()` TypeError). After a
    Linear, the guard's replay of the read's slice ran the batch norm again on the running statistics themselves
    (native_batch_norm writes them without its schema saying so): they moved twice a step."""

    def __init__(self, first: bool):
        super().__init__()
        self.pre = nn.Identity() if first else nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn(self.pre(x))
        c = 2.0 if h.detach().mean().item() > 0 else 0.5
        return (self.lin(h) * c).sum()


@pytest.mark.parametrize("first", [True, False])
def test_batchnorm_in_a_forward_that_reads_a_value_plans_as_eager(first):
    torch.manual_seed(0)
    model, x = NormThenRead(first), torch.randn(16, 8)
    eager = copy.deepcopy(model)
    step = _plan(model, x).apply(model)
    for k in range(3):  # the same batch: the read is a float the plan is specialised to
        step(x).backward()
        eager(x).backward()
        for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
            assert torch.equal(a, b), (k, name)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))


def test_batchnorm_without_momentum_plans_as_eager_at_every_step():
    # momentum=None makes the factor 1 / float(num_batches_tracked), a value of a buffer the forward itself
    # increments: the trace takes it from the counter at run time (capture.counter_momentum), so the running
    # statistics follow eager's bit for bit at every step, not only the first
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 4), Total())
    eager = copy.deepcopy(model)
    x = torch.randn(16, 8)
    step = _plan(model, x).apply(model)
    assert model[1].momentum is None  # the capture's stand-in is gone
    for k in range(4):
        x = torch.randn(16, 8) + k
        step(x).backward()
        eager(x).backward()
        for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
            assert torch.equal(a, b), (k, name)
        for a, b in zip(model.parameters(), eager.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert int(model[1].num_batches_tracked) == 4


class BranchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        h = self.lin(h).relu()
        if h.mean() > 0.2:
            h = h * 3
        return h


class ThreeBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(BranchBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def test_branch_on_a_mean_equals_eager_and_the_other_branch_is_refused_by_its_line():
    torch.manual_seed(2)
    model = ThreeBlocks()
    x = torch.randn(16, 8) + 1
    full = _plan(model, x)
    assert [v for _, v in full.traced.specialisation.scalar_reads] == [True, True, False]  # both branches taken
    budget = smallest_budget(full, time_limit_s=3).budget_bytes
    p = plan(model, x, budget / 1e9, cost_model="flops", time_limit_s=3, traced=full.traced)
    assert p.compute_sequence != full.compute_sequence  # a schedule that recomputes
    planned = p.apply(model)
    for inp in (x, x + 0.01):  # the sample and another input on the same path
        assert_same_state(step_state(planned, inp, seed=7), eager_state(model, inp))
    with pytest.raises(PlanMismatchError, match=r"read #2 \(_local_scalar_dense at .*test_value_reads.py:\d+ "
                                                r"\(if h.mean\(\) > 0.2:\)\) gave True where the trace saw False"):
        planned(x * 2)


def helper(h):
    return h * SCALE


class ScaledBlock(nn.Module):
    """Reads SCALE in a helper function and USE_TANH in a method, both module-level globals."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        return self._act(helper(self.lin(h)))

    def _act(self, h):
        return h.tanh() if USE_TANH else h.relu()


def test_changed_global_is_refused_by_name_and_the_traced_value_runs_as_eager(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(ScaledBlock(), ScaledBlock(), Total())
    x = torch.randn(4, 8)
    p = _plan(model, x)
    assert sorted(p.traced.global_reads.names) == ["SCALE", "USE_TANH"]
    planned = p.apply(model)
    assert_same_state(step_state(planned, x, seed=7), eager_state(model, x))
    for name, value, shown in [("SCALE", 3.0, "3.0"), ("SCALE", 2, "2"), ("USE_TANH", False, "False")]:
        with monkeypatch.context() as mp:
            mp.setitem(globals(), name, value)
            with pytest.raises(PlanMismatchError, match=rf"global '{name}' of module '{__name__}' is {shown}; "
                                                        "it was .* when the plan was traced"):
                planned(x)
    assert_same_state(step_state(planned, x, seed=7), eager_state(model, x))  # the traced values back: it runs


class PythonDraw(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) * random.random()).sum()


class NumpyDraw(PythonDraw):
    def forward(self, x):
        return (self.lin(x) * float(np.random.rand())).sum()


@pytest.mark.parametrize("cls, named", [(PythonDraw, "Python's global generator"),
                                        (NumpyDraw, "numpy's global generator")])
def test_host_random_draw_is_refused_by_name_and_consumes_none_of_the_users_draws(cls, named):
    torch.manual_seed(0)
    before = host_rng_state()
    with pytest.raises(TraceError, match=rf"draws from {named} .* which a traced graph cannot replay.*torch's "
                                         "generator instead"):
        _plan(cls(), torch.randn(4, 8))
    assert same_host_rng(host_rng_state(), before)


class OuterProductRead(nn.Module):
    """A branch on a value only the read computes: the (B, 64, 64) product is dead in the graph (the step never
    makes it) but the check before each step replays it (its guard's slice)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        big = (x.unsqueeze(-1) * x.unsqueeze(-2)).sum() > 0
        return (self.lin(x) * (2.0 if big else 0.5)).sum()


def test_what_the_check_before_the_step_holds_is_in_the_plan():
    from graphs.errors import InfeasibleBudgetError
    from planner.tools.measure import measure_peak_bytes

    torch.manual_seed(0)
    model, x = OuterProductRead(), torch.randn(16, 64)
    product = 16 * 64 * 64 * 4
    full = _plan(model, x)
    assert full.traced.guard is not None and full.traced.check_bytes >= product
    floor = full.traced.graph.fixed_bytes + full.traced.check_bytes
    assert full.predicted_peak_bytes >= floor
    assert measure_peak_bytes(full.apply(model), x) <= full.predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="value reads") as info:
        _plan(model, x, budget_gb=(floor - 1) / 1e9, traced=full.traced)
    assert info.value.min_budget_bytes >= floor
    p = _plan(model, x, budget_gb=info.value.min_budget_bytes / 1e9, traced=full.traced)
    assert measure_peak_bytes(p.apply(model), x) <= p.budget_bytes


class ReadAfterDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.lin(x))
        return (h * (2.0 if h.detach().mean().item() > 0 else 0.5)).sum()


def test_a_read_of_a_value_made_from_random_draws_is_refused_at_plan_time():
    # every step draws another dropout mask, so reads another value: a traced step would keep the trace's
    torch.manual_seed(0)
    model, x = ReadAfterDropout(), torch.randn(16, 8)
    rng = torch.get_rng_state()
    with pytest.raises(TraceError, match=r"test_value_reads.py:\d+ .*computed from random draws \(bernoulli"):
        _plan(model, x)
    assert torch.equal(torch.get_rng_state(), rng)  # planning drew nothing of the user's
    model.eval()  # no draws in eval mode: it plans and runs as eager
    want = eager_state(model, x)
    assert_same_state(step_state(_plan(model, x).apply(model), x, seed=7), want)


@pytest.mark.parametrize("draw", [None, "python", "numpy_uniform", "numpy_normal", "numpy_cached_normal"])
def test_drew_from_host_tells_each_draw_of_the_global_generators(draw):
    """The cheap check a checkpointed block's forward makes (numpy's generator read in place) says what comparing the
    full states says, the normal taken from numpy's cached second value of a pair (no move of its MT19937 state)
    included."""
    from capture.state import drew_from_host, host_rng_mark

    random.seed(1)
    np.random.seed(1)
    if draw == "numpy_cached_normal":
        np.random.normal()  # a pair made, its second value cached
    mark = host_rng_mark()
    {"python": random.random, "numpy_uniform": np.random.random, "numpy_normal": np.random.normal,
     "numpy_cached_normal": np.random.normal, None: lambda: None}[draw]()
    assert drew_from_host(mark) == (draw is not None)
    assert drew_from_host(mark) == (not same_host_rng(mark[0], host_rng_state()))
