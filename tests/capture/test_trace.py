"""Acceptance tests of the tracer on the four test models (small sizes)."""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from capture.costs import EXTRA_FLOP_FORMULAS
from capture.measure_memory import peak_bytes_created_during
from capture.trace import trace
from graphs.simulate import reference_peak_bytes
from tests.models import MAKERS

_CACHE: dict = {}


def traced(name: str, contract: bool = True):
    key = (name, contract)
    if key not in _CACHE:
        model, x = MAKERS[name]()
        _CACHE[key] = (model, x, trace(model, x, contract=contract))
    return _CACHE[key]


def eager_flops(model, x) -> int:
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fc:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def eager_saved_bytes(model, x) -> int:
    """Bytes of the distinct storages autograd saves for the backward, less parameters and inputs."""
    fixed = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(), x]}
    saved: dict = {}

    def pack(t):
        st = t.untyped_storage()
        key = StorageWeakRef(st)
        if key not in fixed:
            saved[key] = (int(st.nbytes()), t)  # keep t alive so that storages are not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(b for b, _ in saved.values())


def measured_peak(tr, x) -> int:
    primals = [p.detach() for p in tr.primals(x)]
    peak, out = peak_bytes_created_during(tr.joint_module, primals, tr.tangents_like())
    del out
    return tr.graph.fixed_bytes + peak


@pytest.mark.parametrize("name", list(MAKERS))
def test_flops_match_eager_flop_counter(name):
    model, x, tr = traced(name)
    want = eager_flops(model, x)
    assert want > 0
    assert abs(tr.total_flops - want) <= 0.01 * want
    assert tr.graph.total_cost == pytest.approx(tr.total_flops)  # cost_model="flops"


@pytest.mark.parametrize("name", list(MAKERS))
def test_saved_bytes_match_eager_saved_tensors(name):
    model, x, tr = traced(name)
    eager = eager_saved_bytes(model, x)
    ours = tr.forward_bytes_for_backward()
    if name == "gpt":
        # Eager CPU dropout keeps a float32 noise tensor for its backward; the traced graph uses
        # aten.native_dropout, which keeps a bool mask: 3 bytes less per element, per dropout.
        masks = [n for n in tr.joint_module.graph.nodes if n.target == torch.ops.aten.native_dropout.default]
        assert masks
        eager -= sum(3 * m.meta["val"][1].numel() for m in masks)
    assert abs(ours - eager) <= 0.05 * eager, (ours, eager)


@pytest.mark.parametrize("name", list(MAKERS))
def test_simulated_peak_equals_measured_peak(name):
    model, x, tr = traced(name)
    sim = reference_peak_bytes(tr.graph)
    real = measured_peak(tr, x)
    assert abs(sim - real) <= 0.02 * real, (sim, real)
    assert sim == real  # alias contraction is exact on these models


@pytest.mark.parametrize("name", list(MAKERS))
def test_merged_chains_never_underestimate_the_peak(name):
    model, x, tr = traced(name)
    merged = trace(model, x, merge_chains=True)
    assert merged.graph.n <= tr.graph.n
    assert merged.graph.total_cost == pytest.approx(tr.graph.total_cost)
    sim = reference_peak_bytes(merged.graph)
    real = measured_peak(merged, x)
    assert real <= sim <= 1.02 * real, (sim, real)


@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_uncontracted_graph_peak_is_exact(name):
    model, x, tr = traced(name, contract=False)
    assert tr.graph.n == tr.aten_node_count
    assert reference_peak_bytes(tr.graph) == measured_peak(tr, x)


@pytest.mark.parametrize("name", list(MAKERS))
def test_graph_structure(name):
    model, x, tr = traced(name)
    g = tr.graph
    # every aten op belongs to exactly one graph node
    covered = [nm for names in tr.node_map.values() for nm in names]
    ops = [n.name for n in tr.joint_module.graph.nodes if n.op == "call_function"]
    assert sorted(covered) == sorted(ops) and len(covered) == tr.aten_node_count
    assert g.n < tr.aten_node_count
    # fixed = parameters + buffers + inputs + tangents
    tangents = tr.tangents_like()
    expect = sum(p.untyped_storage().nbytes() for p in tr.primals(x)) + sum(t.nbytes for t in tangents)
    assert g.fixed_bytes == expect
    # one retained node per parameter gradient at least, and both phases present
    n_grads = sum(1 for k, _ in tr.output_kinds if k == "grad")
    assert n_grads == len(tr.param_names)
    assert len(g.retained) >= 1
    assert any(nd.backward for nd in g.nodes) and not all(nd.backward for nd in g.nodes)
    # forward nodes come before the backward nodes that read them (ids are topological)
    for nd in g.nodes:
        assert all(i < nd.id for i in nd.inputs)


def test_dropout_is_not_recomputable():
    model, x, tr = traced("gpt")
    fx = {n.name: n for n in tr.joint_module.graph.nodes}
    drop = [
        v for v, names in tr.node_map.items()
        if any(fx[nm].target == torch.ops.aten.native_dropout.default for nm in names)
    ]
    assert drop
    assert all(not tr.graph.nodes[v].recomputable for v in drop)
    others = [nd for nd in tr.graph.nodes if nd.recomputable]
    assert others  # the rest stay recomputable


def test_joint_module_gradients_equal_eager():
    model, x = MAKERS["cnn"]()
    model.eval()  # BatchNorm in eval: no buffer updates, deterministic
    tr = trace(model, x)
    primals = [p.detach() for p in tr.primals(x)]
    outs = tr.run_joint(primals, tr.tangents_like())
    assert len(outs) == len(tr.output_kinds)
    model(x).sum().backward()
    params = dict(model.named_parameters())
    for k, (kind, ref) in enumerate(tr.output_kinds):
        if kind == "grad":
            name = tr.param_names[ref]
            torch.testing.assert_close(outs[k], params[name].grad, rtol=1e-4, atol=1e-5)


def test_contraction_reduces_node_count_and_keeps_flops():
    _, _, full = traced("gpt", contract=False)
    _, _, small = traced("gpt")
    assert small.graph.n < 0.5 * full.graph.n
    assert small.graph.total_cost == pytest.approx(full.graph.total_cost)
    assert small.aten_node_count == full.aten_node_count


@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_fake_analysis_equals_real_run(name):
    model, x, tr = traced(name)
    real = trace(model, x, real_run=True)
    assert real.graph.nodes == tr.graph.nodes
    assert real.graph.fixed_bytes == tr.graph.fixed_bytes
    assert real.flops == tr.flops
