"""What real models do and toy models do not: data-dependent reads, tied parameters, dict-like
outputs; plus the errors for what cannot be traced and the three cost models."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from capture.costs import DEVICES, roofline_seconds
from capture.measure_memory import peak_bytes_created_during
from capture.trace import SpecialisationError, TraceError, trace
from graphs.simulate import reference_peak_bytes
from tests.models import make_mlp


class ItemModel(nn.Module):
    """Reads a count with .item() and slices by it (a data-dependent shape)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, lengths):
        k = int(lengths.max().item())
        return self.lin(x[:, :k]).relu()


class MaskModel(nn.Module):
    """Branches on torch.all(mask), as attention-mask builders do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.lin(x)
        if torch.all(mask):
            return h.tanh()
        return (h * mask.unsqueeze(-1)).sigmoid()


class TiedModel(nn.Module):
    """One weight under two names (embedding and output head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx).relu())


class ModelOutput(OrderedDict):
    """A dict-like output object (as some libraries return)."""


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        return ModelOutput(logits=h, loss=h.pow(2).mean(), extra=None)


def _eager_grads(model, inputs, reduce):
    model.zero_grad(set_to_none=True)
    reduce(model(*inputs)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _traced_grads(tr, inputs):
    primals = [p.detach() for p in tr.primals(*inputs)]
    outs = tr.run_joint(primals, tr.tangents_like())
    return {tr.param_names[ref]: outs[k] for k, (kind, ref) in enumerate(tr.output_kinds) if kind == "grad"}


def _check_grads_and_peak(model, inputs, reduce):
    tr = trace(model, inputs)
    want = _eager_grads(model, inputs, reduce)
    got = _traced_grads(tr, inputs)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)
    primals = [p.detach() for p in tr.primals(*inputs)]
    peak, out = peak_bytes_created_during(tr.joint_module, primals, tr.tangents_like())
    del out
    real = tr.graph.fixed_bytes + peak
    assert reference_peak_bytes(tr.graph) == real
    return tr


def _sum_all(out):
    if isinstance(out, dict):
        return sum(v.sum() for v in out.values() if isinstance(v, torch.Tensor))
    return out.sum()


def test_item_read_is_specialised_and_recorded():
    torch.manual_seed(0)
    model = ItemModel()
    x, lengths = torch.randn(2, 6, 8), torch.tensor([3, 5])
    tr = _check_grads_and_peak(model, (x, lengths), _sum_all)
    assert any(v == 5 for _, v in tr.specialisation.scalar_reads)
    tr.check_input(torch.randn(2, 6, 8), torch.tensor([5, 1]))  # same max: same path
    with pytest.raises(SpecialisationError, match="another path"):
        tr.check_input(x, torch.tensor([2, 4]))
    with pytest.raises(SpecialisationError, match="shape"):
        tr.check_input(torch.randn(3, 6, 8), lengths)


def test_all_mask_branch_is_specialised():
    torch.manual_seed(0)
    model = MaskModel()
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5)
    mask[1, 3:] = 0
    tr = _check_grads_and_peak(model, (x, mask), _sum_all)
    assert tr.specialisation.scalar_reads  # the torch.all() read
    tr.check_input(x, mask.clone())
    with pytest.raises(SpecialisationError):
        tr.check_input(x, torch.ones(2, 5))


def test_tied_parameters_trace_once_with_summed_gradient():
    torch.manual_seed(0)
    model = TiedModel()
    idx = torch.randint(0, 16, (3, 7))
    tr = _check_grads_and_peak(model, (idx,), _sum_all)
    assert tr.param_names == ["emb.weight"]  # the head's weight is the same parameter


def test_dict_like_output():
    torch.manual_seed(0)
    model = DictModel()
    x = torch.randn(4, 8)
    # an output with its own scalar `loss` is differentiated for that loss alone (capture.trace.own_loss_leaf)
    tr = _check_grads_and_peak(model, (x,), lambda out: out["loss"])
    assert [j for j in tr.tangent_outputs] == [1]  # one tangent: the loss's (leaf 1), none for the logits
    assert tr.output_spec.kind == "mapping" and tr.output_spec.keys == ("logits", "loss", "extra")
    primals = [p.detach() for p in tr.primals(x)]
    outs = tr.run_joint(primals, tr.tangents_like())
    leaves = [outs[k] for k, (kind, _) in enumerate(tr.output_kinds) if kind == "output"]
    rebuilt = tr.output_spec.unflatten(leaves)
    assert isinstance(rebuilt, ModelOutput) and rebuilt["extra"] is None
    torch.testing.assert_close(rebuilt["logits"], model(x)["logits"])


def test_output_without_tensors_is_refused():
    class NoTensor(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return {"n": 3, "name": "x"}

    with pytest.raises(TraceError, match="carries no tensors"):
        trace(NoTensor(), torch.randn(2, 2))


def test_nothing_to_differentiate_is_refused():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(TraceError, match="no output of the model requires grad"):
        trace(model, torch.randn(2, 4))


def test_input_mutation_is_refused():
    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    with pytest.raises(TraceError, match="mutates its input #0"):
        trace(Mutates(), torch.randn(2, 4))


def test_unknown_cost_model_and_device():
    model, x = make_mlp(batch=4, width=8, depth=1)
    with pytest.raises(ValueError, match="cost_model"):
        trace(model, x, cost_model="magic")
    with pytest.raises(ValueError, match="unknown device"):
        trace(model, x, cost_model="roofline", device_name="tpu9")


def test_time_and_roofline_costs():
    model, x = make_mlp(batch=16, width=32, depth=2)
    t_time = trace(model, x, cost_model="time", time_repeats=3)
    assert t_time.cost_unit == "seconds"
    assert all(c >= 0 for c in t_time.graph.costs) and t_time.graph.total_cost > 0
    t_roof = trace(model, x, cost_model="roofline", device_name="h100")
    dev = DEVICES["h100"]
    mm_nodes = [v for v, names in t_roof.node_map.items() if any(n.startswith("addmm") for n in names)]
    assert mm_nodes
    for v in range(t_roof.graph.n):
        flops = sum(t_roof.flops[n] for n in t_roof.node_map[v])
        # each node costs at least its compute-bound time, and memory-bound ops are not free
        assert t_roof.graph.nodes[v].cost >= flops / dev.peak_flops * (1 - 1e-9)
    assert roofline_seconds(10**12, 0, dev) == pytest.approx(1 / 989)
    assert roofline_seconds(0, 3.35e12, dev) == pytest.approx(1.0)
    # the FLOP counts do not depend on the cost model
    assert t_roof.total_flops == t_time.total_flops == trace(model, x).total_flops


def test_model_state_is_left_untouched():
    bn = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8)).train()
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    rng = torch.get_rng_state()
    trace(bn, x)
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


class SharedSubmodule(nn.Module):
    """One Linear reachable by two paths (`a.0` and `b.0`), called twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8))
        self.b = nn.Sequential(self.a[0])

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_a_submodule_reached_by_two_paths_keeps_its_parameters_and_plans_as_eager():
    # torch.func.functional_call(tie_weights=True) swapped such a module's tensors once per path and left a traced
    # FunctionalTensor in the user's model
    from harness.eager_compare import step_state
    from planner import plan
    from tests.planner.helpers import assert_same_state

    torch.manual_seed(0)
    model, x = SharedSubmodule(), torch.randn(4, 8)
    weight = model.a[0].weight
    trace(model, x)
    assert model.a[0].weight is weight and model.b[0].weight is weight
    p = plan(model, x, 1.0, cost_model="flops", time_limit_s=5)
    assert type(model.a[0].weight) is nn.Parameter and model.b[0].weight is weight
    want = step_state(copy.deepcopy(model), x, seed=1)
    assert_same_state(step_state(p.apply(model), x, seed=1), want)
