"""The peers scripts/bench_peers.py measures the planner against (planner/tools/baselines.py, auto_sac.py):
torchtitan's layer checkpointing (`layer_checkpointed`) and PyTorch's automatic selective checkpointing
(`auto_sac_checkpointed`: SACEstimator and the per-module ILP of torch.distributed._tools, a CPU benchmark standing
in for torch's runtime estimates) train as eager does, bit for bit, and hold less than eager at the step's peak
(examples.hf_zoo's llama, size "test")."""
from __future__ import annotations

import pytest
import torch

from harness.eager_compare import step_state
from planner.tools.auto_sac import auto_sac_checkpointed
from planner.tools.baselines import layer_checkpointed
from planner.tools.measure import measure_peak_bytes

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402


def _same_grads(got, want) -> bool:
    g, w = got[0], want[0]
    return g.keys() == w.keys() and all(
        (a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in ((g[k], w[k]) for k in w))


@pytest.fixture(scope="module")
def llama():
    """The model, its batch (use_cache=False) and the same batch with use_cache at the library's default (a cache
    reaches every layer), eager's gradients on each, and eager's peak."""
    model, batch = build("llama", "test")
    cached = {k: v for k, v in batch.items() if k != "use_cache"}
    return (model, batch, cached, step_state(model, batch, seed=3), step_state(model, cached, seed=3),
            measure_peak_bytes(model, batch))


@pytest.mark.parametrize("every", [1, 2])
def test_layer_checkpointed_trains_as_eager_below_its_peak(llama, every):
    model, batch, _, eager, _, eager_peak = llama
    wrapped = layer_checkpointed(model, every)
    blocks = [wrapped.model.layers[k] for k in range(len(wrapped.model.layers))]
    assert ["forward" in vars(b) for b in blocks] == [k % every == 0 for k in range(len(blocks))]
    assert _same_grads(step_state(wrapped, batch, seed=3), eager)
    assert measure_peak_bytes(wrapped, batch) < eager_peak
    with pytest.raises(ValueError):
        layer_checkpointed(model, 0)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no cache", "cache"])
def test_auto_sac_trains_as_eager_below_its_peak(llama, use_cache):
    model, batch, cached, eager, eager_cached, eager_peak = llama
    sample, want = (cached, eager_cached) if use_cache else (batch, eager)
    wrapped = auto_sac_checkpointed(model, sample, 0.25)
    policy = wrapped.auto_sac.describe()
    assert 0 < policy["saved_ops"] < policy["ops"] and policy["saved_bytes"] <= 0.25 * policy["op_output_bytes"]
    if not torch.cuda.is_available():  # torch's own runtime estimates need CUDA: their errors kept, the CPU one used
        assert policy["runtime_estimate"] == "cpu-benchmark"
        assert set(policy["stock_estimate_errors"]) == {"operator-level-benchmark", "operator-level-cost-model"}
    assert _same_grads(step_state(wrapped, sample, seed=3), want)
    assert measure_peak_bytes(wrapped, batch) < eager_peak
