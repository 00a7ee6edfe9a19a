"""planner.compile (planner.compiled): torch.compile per repeated block, the project's partitioner choosing what each
compiled region saves. Tiny GPTs (width 32, dropout 0.1); "aot_eager" where it can (no compiler: seconds), one test
through inductor.

The peaks are measured with a storage tracker that dynamo compiles under (`ignore_compile_internals`):
planner.tools.measure.measure_peak_bytes's plain tracker makes dynamo run the compiled blocks eagerly, so it would
measure eager's peak."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition

from capture.joint_graph import saved_storage_bytes
from capture.measure_memory import StorageTracker
from graphs.errors import ArgumentError, InfeasibleBudgetError
from planner.compiled.api import compile as planner_compile
from planner.compiled.api import compiled_plan
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes, resident_bytes, run_step
from tests.models import make_gpt


class _CompiledStepTracker(StorageTracker):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # the compiled blocks run compiled under it


def compiled_peak_bytes(model, x) -> int:
    """planner.tools.measure.measure_peak_bytes, the compiled code running compiled."""
    for p in model.parameters():
        p.grad = None
    tracker = _CompiledStepTracker()
    with tracker:
        run_step(model, x)
    for p in model.parameters():
        p.grad = None
    return resident_bytes(model, x) + tracker.peak_bytes


class _MinCutRecorder:
    """torch's own partitioner (what backend="aot_eager" runs), noting what each region's forward saves."""

    def __init__(self):
        self.saved_bytes: list[int] = []

    def __call__(self, gm, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.saved_bytes.append(saved_storage_bytes(fw, kwargs["num_fwd_outputs"]))
        return fw, bw


def _aot_eager_with(partition_fn):
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_fn,
                        keep_inference_input_mutations=True)


def _grads(model, x, seed: int) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    run_step(model, x)
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def tight():
    """A 4-block GPT compiled per block with torch's partitioner (the reference) and with planner.compile at 80 % of
    the reference's measured peak."""
    model, x = make_gpt(batch=4, seq=32, n_layers=4)
    reference = copy.deepcopy(model)
    recorder = _MinCutRecorder()
    for block in reference.blocks:
        block.compile(backend=_aot_eager_with(recorder))
    reference_grads = _grads(reference, x, seed=1)
    reference_peak = compiled_peak_bytes(reference, x)
    planner_compile(model, 0.8 * reference_peak / 1e9, backend="aot_eager", time_limit_s=5.0)
    grads = _grads(model, x, seed=1)
    return SimpleNamespace(model=model, x=x, reference_grads=reference_grads, grads=grads, recorder=recorder,
                           reference_peak=reference_peak, plan=compiled_plan(model))


def test_the_planned_step_trains_bitwise_as_torch_compile_does(tight):
    regions = tight.plan.partitioner.regions
    assert len(regions) == 1  # the four blocks share one compiled graph
    assert regions[0].recomputed, "the budget should force recomputation, or the test shows nothing"
    assert not any("dropout" in name for name in regions[0].recomputed)
    for got, want in zip(tight.grads, tight.reference_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_below_the_no_recomputation_peak_it_saves_less_than_min_cut_and_stays_in_budget(tight):
    plan = tight.plan
    assert plan.budget_bytes < tight.reference_peak
    assert plan.partitioner.regions[0].saved_bytes < tight.recorder.saved_bytes[0]
    assert plan.partitioner.regions[0].excess <= 0
    assert compiled_peak_bytes(tight.model, tight.x) <= plan.budget_bytes
    summary = plan.summary()
    assert "left to 4 block calls" in summary and "recomputes" in summary


def test_a_second_sequence_length_recompiles_no_more_than_torch_compile():
    torch._dynamo.reset()  # dynamo marks a frame's sizes dynamic once it has seen two: start from none seen
    model, x = make_gpt(batch=2, seq=32, n_layers=2)
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    counters.clear()
    reference_grads = [_grads(reference, x[:, :t], seed=2) for t in (16, 24)]
    reference_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    planner_compile(model, 0.01, backend="aot_eager", time_limit_s=5.0)
    counters.clear()
    grads = [_grads(model, x[:, :t], seed=2) for t in (16, 24)]
    assert 0 < counters["stats"]["unique_graphs"] <= reference_graphs
    regions = compiled_plan(model).partitioner.regions
    assert [r.symbolic for r in regions] == [False, True]
    assert list(regions[1].hints.values()) == [24]  # planned at the size that made it recompile
    for got, want in zip(grads, reference_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_through_inductor_gradients_are_as_close_to_eager_as_torch_compile_s():
    """inductor with eager's random generator (`fallback_random`), so that dropout draws what eager draws and the
    gradients can be held to eager's within the distance torch.compile's own have."""
    model, x = make_gpt(batch=4, seq=32, n_layers=4)
    eager = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    for block in reference.blocks:
        block.compile(options={"fallback_random": True})
    eager_grads = _grads(eager, x, seed=3)
    reference_grads = _grads(reference, x, seed=3)
    budget = 0.8 * compiled_peak_bytes(eager, x)
    planner_compile(model, budget / 1e9, options={"fallback_random": True}, time_limit_s=5.0)
    grads = _grads(model, x, seed=3)
    regions = compiled_plan(model).partitioner.regions
    assert regions and regions[0].recomputed
    for got, ref, want in zip(grads, reference_grads, eager_grads):
        atol = 2 * (ref - want).abs().max().item() + 1e-6 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_a_budget_the_code_outside_the_blocks_fills_is_refused_at_the_first_call():
    model, x = make_gpt(n_layers=2)
    planner_compile(model, 1e-6, backend="aot_eager")
    with pytest.raises(InfeasibleBudgetError, match="parameters, buffers and inputs alone"):
        run_step(model, x)
    assert compiled_plan(model).partitioner.regions == []


def _first_call_peak(model, x) -> tuple[int, Exception | None]:
    """The first training call's peak (its measuring step and its compiled step), resident included, and the error it
    raised (None where it trained)."""
    tracker = _CompiledStepTracker()
    error = None
    try:
        with tracker:
            run_step(model, x)
    except InfeasibleBudgetError as e:
        error = e
    for p in model.parameters():
        p.grad = None
    return resident_bytes(model, x) + tracker.peak_bytes, error


def test_the_first_call_stays_within_a_budget_below_what_a_checkpointed_measuring_step_holds():
    """The measuring step holds no block's activations (its blocks run without autograd): at a budget below the peak
    of the step with every block checkpointed (what the measuring step held before), the first call, measurement and
    compilation included, stays within the budget, and so do the later ones."""
    model, x = make_gpt(batch=4, seq=32, n_layers=4)
    checkpointed = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), x)
    budget = int(0.97 * checkpointed)
    planner_compile(model, budget / 1e9, backend="aot_eager", time_limit_s=5.0)
    first, error = _first_call_peak(model, x)
    assert error is None
    plan = compiled_plan(model)
    assert plan.outside.eager_peak_bytes <= budget < checkpointed
    assert first <= budget
    assert compiled_peak_bytes(model, x) <= budget


def test_a_budget_below_the_measuring_step_is_refused_before_it_is_exceeded():
    """Where even the measuring step does not fit, the first call stops with InfeasibleBudgetError before the operator
    that would take it above the budget runs (sized on the meta device first): it never holds more than the budget,
    and the error names what the step needs at least."""
    model, x = make_gpt(batch=4, seq=32, n_layers=4)
    probe = copy.deepcopy(model)
    planner_compile(probe, 1.0, backend="aot_eager")
    run_step(probe, x)
    measuring = compiled_plan(probe).outside.eager_peak_bytes
    for budget in (measuring - 1, int(0.8 * measuring)):
        m = copy.deepcopy(model)
        planner_compile(m, budget / 1e9, backend="aot_eager")
        first, error = _first_call_peak(m, x)
        assert error is not None and "stopped before going above the budget" in str(error)
        assert first <= budget
        need = int(str(error).rsplit("needs at least ", 1)[1].split()[0])
        assert budget < need <= measuring
        assert compiled_plan(m).outside is None and compiled_plan(m).partitioner.regions == []


def test_the_arguments_are_checked():
    model, _ = make_gpt(n_layers=2)
    with pytest.raises(ArgumentError, match="backend"):
        planner_compile(model, 1.0, backend="eager")
    with pytest.raises(ArgumentError, match="aot_eager"):
        planner_compile(model, 1.0, backend="aot_eager", mode="max-autotune")
