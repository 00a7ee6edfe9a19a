"""Whole-model plans under autocast, and a model that changes under its plan: eager's result or PlanMismatchError,
never a silently wrong gradient; a planned module deep-copies and pickles; wrappers are refused with the order that
works (transformers models from tiny configs)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import planner
from graphs.errors import PlanMismatchError

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402

AMP = {"device_type": "cpu", "dtype": torch.bfloat16}


def _train(module, params_of, batch, steps=3, amp=True):
    opt = torch.optim.AdamW(params_of.parameters(), lr=1e-3)
    for k in range(steps):
        torch.manual_seed(k)
        with torch.autocast(**AMP, enabled=amp):
            loss = module(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _largest_difference(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_planned_under_bf16_autocast_trains_as_eager_or_as_aot_eager(name):
    model, batch = build(name, "test")  # GPT-2's config has dropout 0.1
    eager, aot = copy.deepcopy(model), copy.deepcopy(model)
    with torch.autocast(**AMP):
        p = planner.plan(model, batch, 1.0, cost_model="time", time_limit_s=10)
    assert p.fingerprint["autocast"] == [["cpu", "bfloat16"]]
    _train(p.apply(model), model, batch)
    _train(eager, eager, batch)
    if name == "llama":
        assert all(torch.equal(x, y) for x, y in zip(model.parameters(), eager.parameters()))
    else:
        # dropout on bf16 values: the capture's graph differs from eager's as torch.compile's aot_eager does (the
        # README states the limit); the plan adds nothing to it
        _train(torch.compile(aot, backend="aot_eager"), aot, batch)
        assert _largest_difference(model, eager) <= _largest_difference(aot, eager)


def test_a_plan_called_in_another_precision_is_refused():
    model, batch = build("llama", "test")
    with torch.autocast(**AMP):
        in_amp = planner.plan(model, batch, 1.0, cost_model="flops", time_limit_s=10).apply(model)
    with pytest.raises(PlanMismatchError, match="autocast"):
        in_amp(**batch)
    fp32 = planner.plan(model, batch, 1.0, cost_model="flops", time_limit_s=10).apply(model)
    with torch.autocast(**AMP), pytest.raises(PlanMismatchError, match="no autocast"):
        fp32(**batch)


def test_changing_parameters_after_apply_is_refused():
    model, batch = build("llama", "test")
    planned = planner.plan(model, batch, 1.0, cost_model="flops", time_limit_s=10).apply(model)
    planned(**batch).loss.backward()
    first = next(model.parameters())
    first.requires_grad_(False)  # frozen after apply
    with pytest.raises(PlanMismatchError, match="requires_grad"):
        planned(**batch)
    first.requires_grad_(True)
    planned(**batch).loss.backward()  # as planned again
    model.to(torch.float64)
    with pytest.raises(PlanMismatchError, match="dtype"):
        planned(**batch)


def test_a_planned_module_deep_copies_and_pickles_and_trains_as_eager():
    model, batch = build("gpt2", "test")
    eager = copy.deepcopy(model)
    planned = planner.plan(model, batch, 1.0, cost_model="flops", time_limit_s=10).apply(model)
    planned(**batch).loss.backward()  # built and run once before copying
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(planned)
    assert twin.module is not model
    _train(twin, twin.module, batch, amp=False)
    _train(eager, eager, batch, amp=False)
    assert all(torch.equal(x, y) for x, y in zip(twin.module.parameters(), eager.parameters()))
    buf = io.BytesIO()
    torch.save(planned, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    reference = copy.deepcopy(model)
    _train(loaded, loaded.module, batch, amp=False)  # traced again at its first call, checked against the plan
    _train(reference, reference, batch, amp=False)
    assert all(torch.equal(x, y) for x, y in zip(loaded.module.parameters(), reference.parameters()))


def test_wrappers_are_refused_naming_the_order_that_works():
    model, batch = build("gpt2", "test")
    with pytest.raises(ValueError, match="torch.compile"):
        planner.plan(torch.compile(model), batch, 1.0)
    fsdp = pytest.importorskip("torch.distributed.fsdp")

    class Sharded(fsdp.FSDPModule, torch.nn.Module):  # what fully_shard makes of a module's class
        pass

    sharded = object.__new__(Sharded)  # FSDPModule.__new__ would build the unsharded class
    torch.nn.Module.__init__(sharded)
    with pytest.raises(ValueError, match="enable"):
        planner.plan(sharded, batch, 1.0)
