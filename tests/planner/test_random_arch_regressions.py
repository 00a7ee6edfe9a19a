"""Regressions found by the random architectures (tests/random_arch.py), each reduced to a model of a few layers.

Seeds 84 and 142: a chunk (or split) of a fixed tensor (the input; in the backward, the incoming gradient) that one
op reads directly and another through a view (a Linear's flattening `view`). The trace marks such views of fixed
memory (`TraceResult.fixed_views`: the split, its getitems, the views of them) as reading nothing, so the
contraction folds the `view` into the Linear's node and the getitem into the direct reader's, a later node. The
executor made a fixed view that was not at hand again only along a chain of view ops (`free_view_root`), which
stops at the getitem: plan() failed at every budget with "'view' reads fx value 'getitem_1' before the schedule
computes it" (in the backward: "the backward reads fx value 'getitem', which the forward part never computes"), and
the solver graph did not make the backward group reading such a view of the gradient wait for it.
"""
from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn as nn

from harness.eager_compare import step_state
from planner import GB, plan, smallest_budget
from planner.core.solver_graph import solver_graph
from planner.execution.step_builder import fixed_view_roots
from planner.tools.measure import default_loss, measure_peak_bytes
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state


class ChunkedInput(nn.Module):
    """Seed 84, reduced: the input's second chunk feeds a Linear (through a view) and a sigmoid gate (directly)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return self.lin(b) * torch.sigmoid(b) + a


class _ChunkedGradientFn(torch.autograd.Function):
    """cat(a * b, a + b), whose backward chunks the incoming gradient and reads the first chunk through a view
    (a matmul of its flattening) before it reads it directly."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.cat([a * b, a + b], -1)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga, gb = g.chunk(2, -1)
        flat = ga.reshape(-1, ga.shape[-1]) @ b.reshape(-1, b.shape[-1]).t()
        return ga * b + gb + flat.sum(0).view(a.shape[0], a.shape[1], 1), a * gb


class ChunkedGradient(nn.Module):
    """The backward side of the same: the model's output is the custom function's, its gradient a tangent."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return _ChunkedGradientFn.apply(self.a(x), self.b(x))


def _model(name: str):
    torch.manual_seed(0)
    if name == "chunked_input":
        return ChunkedInput(), torch.randn(4, 16, 16)
    return ChunkedGradient(), torch.randn(4, 16, 8)


def _plan(model, x, budget_gb: float, traced=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(model, x, budget_gb, cost_model="flops", time_limit_s=TIME_LIMIT_S, traced=traced)


@pytest.mark.parametrize("name", ["chunked_input", "chunked_gradient"])
def test_a_view_of_a_chunk_of_fixed_memory_plans_and_trains_as_eager(name):
    model, x = _model(name)
    first = _plan(model, x, 1000.0)  # the no-recomputation budget: failed here before the fix
    traced = first.traced
    # the case the fix is about: a fixed view whose chain to its placeholder passes a getitem (not a view op)
    getitems = [n for n in traced.fixed_views if traced.fx_nodes[n].target is operator.getitem]
    assert getitems, "the model no longer makes the pattern this test is about"
    assert all(fixed_view_roots(traced.fx_nodes[n], traced.fixed_views) for n in getitems)

    smallest = smallest_budget(first, TIME_LIMIT_S).budget_bytes
    assert smallest is not None
    eager = eager_state(model, x, seed=7)
    for budget in (first.predicted_peak_bytes, smallest):
        p = first if budget == first.predicted_peak_bytes else _plan(model, x, budget / GB, traced=traced)
        assert p.predicted_peak_bytes <= budget
        assert_same_state(step_state(p.apply(copy.deepcopy(model)), x, seed=7), eager)
        assert measure_peak_bytes(p.apply(copy.deepcopy(model)), x, default_loss) <= budget


def test_a_backward_group_reading_a_view_of_a_chunk_of_the_gradient_waits_for_the_gradient():
    model, x = _model("chunked_gradient")
    first = _plan(model, x, 1000.0)
    traced = first.traced
    g = solver_graph(traced)
    tangents = g.label_to_id[traced.graph.n]
    tangent_phs = [n for n in traced.joint_module.graph.nodes if n.op == "placeholder"][traced.num_primals:]
    checked = 0
    for gid, names in traced.node_map.items():
        mine = {traced.fx_nodes[nm] for nm in names}
        read = {a for m in mine for a in m.all_input_nodes if a not in mine}
        if any(set(fixed_view_roots(a, traced.fixed_views) or ()) & set(tangent_phs) for a in read):
            assert tangents in g.inputs[g.label_to_id[gid]], f"traced node {gid} ({names}) does not read the tangents"
            checked += 1
    assert checked
