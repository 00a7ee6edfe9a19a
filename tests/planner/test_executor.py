"""The drop-in planned module: optimizer steps, eval mode, RNG replay of recomputed dropout, misuse."""
from __future__ import annotations

import copy

import pytest
import torch

from graphs.simulate import reference_peak_bytes
from harness.eager_compare import step_state
from planner import GB, ExecutorError, plan
from planner.execution.step_builder import build_step
from tests.models import make_cnn, make_gpt
from tests.planner.helpers import TIME_LIMIT_S, assert_same_state, eager_state


@pytest.fixture(scope="module")
def cnn():
    model, x = make_cnn(batch=4, size=16)
    first = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    low = plan(model, x, 0.6 * reference_peak_bytes(first.graph) / GB, cost_model="flops", traced=first.traced,
               time_limit_s=TIME_LIMIT_S)
    return model, x, low


@pytest.fixture(scope="module")
def gpt():
    model, x = make_gpt(batch=2, seq=32, vocab=64, n_layers=3)
    first = plan(model, x, 1000.0, cost_model="flops", time_limit_s=TIME_LIMIT_S)
    return model, x, first


def test_training_loop_matches_eager(cnn):
    """Three SGD steps with momentum: parameters and BatchNorm statistics stay bitwise equal to eager."""
    model, x, low = cnn
    eager = copy.deepcopy(model)
    planned_model = copy.deepcopy(model)
    planned = low.apply(planned_model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(planned.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, opt in ((eager, opt_e), (planned, opt_p)):
            opt.zero_grad()
            out = m(x)
            loss = torch.nn.functional.cross_entropy(out, torch.arange(x.shape[0]) % 10)
            loss.backward()
            opt.step()
    for (n, a), (_, b) in zip(eager.state_dict().items(), planned_model.state_dict().items()):
        assert torch.equal(a, b), n
    assert list(planned.state_dict()) == [f"module.{k}" for k in eager.state_dict()]


def test_eval_and_no_grad_run_the_original(cnn):
    model, x, low = cnn
    m = copy.deepcopy(model)
    planned = low.apply(m)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.eval()
    with torch.no_grad():
        assert torch.equal(planned(x), m(x))
    m.train()
    with torch.no_grad():
        planned(x)  # no grad: the original model runs (and updates its statistics as eager would)
    assert not torch.equal(before["stem.1.running_mean"], m.state_dict()["stem.1.running_mean"])


def test_a_reassigned_parameter_is_the_one_trained_and_a_removed_submodule_is_refused(cnn):
    """The planned step reads each parameter from its owning module at every call: a parameter replaced after
    planning (same shape) is the one used and given the gradient; a submodule the plan names, once deleted, raises."""
    from planner import PlanMismatchError

    model, x, low = cnn
    m = copy.deepcopy(model)
    planned = low.apply(m)
    name, old = next((n, p) for n, p in m.named_parameters() if p.dim() == 4)
    owner_name, _, leaf = name.rpartition(".")
    owner = m.get_submodule(owner_name)
    setattr(owner, leaf, torch.nn.Parameter(torch.randn_like(old)))
    eager = copy.deepcopy(m)
    planned(x).sum().backward()
    eager(x).sum().backward()
    new = owner._parameters[leaf]
    assert old.grad is None and new.grad is not None
    assert torch.allclose(new.grad, eager.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
    top = owner_name.split(".")[0]
    delattr(m, top)
    with pytest.raises(PlanMismatchError, match=f"no submodule '{top}'"):
        planned(x)


def test_backward_twice_is_refused(cnn):
    model, x, low = cnn
    planned = low.apply(copy.deepcopy(model))
    loss = planned(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


def test_recomputed_dropout_replays_its_random_numbers(gpt):
    """At a low budget dropout masks are recomputed; gradients still equal eager bitwise."""
    model, x, first = gpt
    ref = reference_peak_bytes(first.graph)
    eager = eager_state(model, x, seed=11)
    found = False
    for frac in (0.8, 0.7, 0.6):
        p = plan(model, x, frac * ref / GB, cost_model="flops", traced=first.traced, time_limit_s=TIME_LIMIT_S)
        recomputed = {p.graph.nodes[v].name for v in p.result.sim.recomputed}
        if any(n.startswith("native_dropout") for n in recomputed):
            found = True
            assert_same_state(step_state(p.apply(copy.deepcopy(model)), x, seed=11), eager)
            break
    assert found, "no plan recomputed a dropout; the RNG replay went untested"


def test_random_ops_out_of_eager_order_are_refused(gpt):
    model, x, first = gpt
    traced = first.traced
    seq = list(first.compute_sequence)
    drops = [v for v in seq if traced.graph.nodes[v].name.startswith("native_dropout")]
    a, b = drops[0], drops[1]
    # move the second dropout's first computation before the first one (keeping its inputs available is not
    # the point: the check on the random order fires first)
    swapped = [b if v == a else a if v == b else v for v in seq]
    with pytest.raises(ExecutorError):
        build_step(traced, swapped)


def test_forward_output_after_backward_start_is_refused(gpt):
    model, x, first = gpt
    traced = first.traced
    seq = list(first.compute_sequence)
    out_node = next(v for v in seq if traced.graph.nodes[v].retain and not traced.graph.nodes[v].backward
                    and any(n.startswith("mm") for n in traced.node_map[v]))
    seq.remove(out_node)
    seq.append(out_node)
    with pytest.raises(ExecutorError, match="after the backward has begun"):
        build_step(traced, seq)
