"""transformers models called as users call them: `model(**batch)` with `labels`, the loss computed inside."""
from __future__ import annotations

import copy

import pytest
import torch

from planner import GB, plan

transformers = pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e .[test])")


def _gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # padding: the model's mask code takes its data-dependent path
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}


def _train_step(module, params, batch, seed):
    opt = torch.optim.SGD(params, lr=0.1)
    torch.manual_seed(seed)
    out = module(**batch)
    out.loss.backward()
    grads = [p.grad.clone() for p in params]
    opt.step()
    return out.loss.detach(), grads, [p.detach().clone() for p in params]


@pytest.mark.parametrize("fraction", [1.0, 0.8])
def test_dict_input_step_with_the_models_own_loss_equals_eager(fraction):
    model, batch = _gpt2()
    eager = copy.deepcopy(model)
    first = plan(model, batch, 1000.0, cost_model="flops", time_limit_s=10)
    p = plan(model, batch, fraction * first.predicted_peak_bytes / GB, cost_model="flops", time_limit_s=10,
             traced=first.traced)
    assert p.predicted_peak_bytes <= fraction * first.predicted_peak_bytes
    assert fraction == 1.0 or p.result.sim.recomputed  # below the no-recomputation peak something is recomputed
    planned = p.apply(model)
    want = _train_step(eager, list(eager.parameters()), batch, seed=5)
    got = _train_step(planned, list(model.parameters()), batch, seed=5)
    assert torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2]))


def test_a_call_of_another_form_is_refused():
    from planner import PlanMismatchError

    model, batch = _gpt2()
    p = plan(model, batch, 1000.0, cost_model="flops", time_limit_s=10)
    planned = p.apply(model)
    with pytest.raises(PlanMismatchError, match="use_cache"):
        planned(**{**batch, "use_cache": True})
    with pytest.raises(PlanMismatchError, match="keyword arguments"):
        planned(input_ids=batch["input_ids"], labels=batch["labels"])



def test_no_loss_warning_when_the_model_computes_its_loss():
    import warnings

    from planner.whole.api import LossNotPlannedWarning

    model, batch = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossNotPlannedWarning)
        plan(model, batch, 1000.0, cost_model="flops", time_limit_s=5)


def test_a_default_config_returning_its_cache_is_refused_with_the_fix():
    # use_cache is on by default: the output holds a DynamicCache, which a traced graph cannot return
    from graphs.errors import TraceError

    model, batch = _gpt2()
    del batch["use_cache"]
    with pytest.raises(TraceError, match="is a DynamicCache.*plan with use_cache=False.*planner.enable"):
        plan(model, batch, 1000.0, cost_model="flops", time_limit_s=10)
