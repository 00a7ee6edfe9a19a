"""planner.compile where dynamo does more than compile once: a block reading a module global that changes (dynamo
guards on it and recompiles), a block whose forward graph breaks (several regions per block call), and a stream of
sequence lengths (symbolic sizes). Each trains as torch.compile of the same blocks does (backend "aot_eager": the
same aten ops run eagerly, so the parameters are bitwise equal), recompiles no more than it, and every step's peak
stays within the budget.

Peaks are measured with a storage tracker that dynamo compiles under (`ignore_compile_internals`), as in
test_compiled_partitioner. The last two tests run the three cases through inductor (marked slow: about 30 s): the
parameters equal torch.compile's to rounding, and the peaks come from the allocator's stream (`_AllocatorPeak`),
which sees inductor's own buffers."""
from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from capture.measure_memory import StorageTracker
from planner.compiled.api import compile as planner_compile
from planner.compiled.api import compiled_plan
from planner.tools.measure import resident_bytes, run_step
from tests.models import make_gpt

SCALE = 1.0  # read by ScaledBlock.forward: dynamo guards on it


class _CompiledStepTracker(StorageTracker):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class ScaledBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x)))) * SCALE


class BreakingBlock(ScaledBlock):
    def forward(self, x):
        h = torch.tanh(self.up(self.norm(x)))
        torch._dynamo.graph_break()
        return x + torch.sigmoid(self.down(h)) * h[..., : x.shape[-1]]


class Stack(nn.Module):
    def __init__(self, block, d: int = 32, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _step_peak(model, x, optimizer=None) -> int:
    """One training step (loss: the mean square of the output), its peak measured (resident included)."""
    tracker = _CompiledStepTracker()
    with tracker:
        loss = model(x).pow(2).mean()
        loss.backward()
        del loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return resident_bytes(model, x) + tracker.peak_bytes


def _train(model, xs, scales=None) -> list[int]:
    global SCALE
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peaks = []
    for k, x in enumerate(xs):
        SCALE = 1.0 if scales is None else scales[k]
        peaks.append(_step_peak(model, x, opt))
    SCALE = 1.0
    return peaks


def _twins(block):
    torch.manual_seed(0)
    model = Stack(block).train()
    reference = copy.deepcopy(model)
    for b in reference.blocks:
        b.compile(backend="aot_eager")
    return model, reference


def _inputs(n: int, rows: int = 512):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 8, generator=g) for _ in range(n)]


def _assert_same_parameters(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def _eager_share(model, x, share: float) -> int:
    """`share` of the eager step's measured peak at `x` (on a copy of `model`)."""
    return int(share * _step_peak(copy.deepcopy(model), x))


def test_a_block_reading_a_module_global_follows_its_changes_as_torch_compile_does():
    torch._dynamo.reset()
    model, reference = _twins(ScaledBlock)
    xs = _inputs(4)
    scales = [1.0, 1.0, 0.5, 0.5]
    budget = _eager_share(model, xs[0], 1.0)  # the planner's bound is conservative: it needs about this much
    counters.clear()
    _train(reference, xs, scales)
    reference_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # dynamo now knows SCALE changes (it would compile it as an input at once): forget it
    planner_compile(model, budget / 1e9, backend="aot_eager", time_limit_s=3.0)
    counters.clear()
    peaks = _train(model, xs, scales)
    assert counters["stats"]["unique_graphs"] == reference_graphs >= 2  # the global's change recompiled both
    regions = compiled_plan(model).partitioner.regions
    assert len(regions) == 2 and all(r.excess <= 0 for r in regions)
    _assert_same_parameters(model, reference)
    assert max(peaks) <= budget


def test_a_block_that_graph_breaks_plans_its_regions_within_one_share_of_the_room():
    torch._dynamo.reset()
    model, reference = _twins(BreakingBlock)
    xs = _inputs(3)
    budget = _eager_share(model, xs[0], 2.0)  # each region has half the room: above eager's peak to be feasible
    counters.clear()
    _train(reference, xs)
    reference_graphs = counters["stats"]["unique_graphs"]
    planner_compile(model, budget / 1e9, backend="aot_eager", time_limit_s=3.0)
    counters.clear()
    peaks = _train(model, xs)
    assert counters["stats"]["unique_graphs"] == reference_graphs
    plan = compiled_plan(model)
    regions = plan.partitioner.regions
    assert len(regions) == 2
    first, second = (r.part for r in regions)
    assert (first.position, first.breaks, first.share) == (0, True, 0.5)
    assert (second.position, second.breaks, second.share) == (1, False, 0.5)
    for r in regions:  # each within half of what the step leaves the blocks
        assert r.excess <= 0 and r.room.forward_bytes == plan.room.forward_bytes // 2
    assert "graph breaks" in plan.summary()
    _assert_same_parameters(model, reference)
    assert max(peaks) <= budget


def _lengths(n: int = 20, low: int = 4, high: int = 48) -> list[int]:
    rng = random.Random(0)
    return [8, *rng.sample(range(low, high + 1), n - 1)]


def test_a_stream_of_twenty_lengths_recompiles_as_torch_compile_and_every_step_stays_in_budget():
    model, ids = make_gpt(batch=2, seq=48, n_layers=2, dropout=0.0)
    lengths = _lengths()
    reference = copy.deepcopy(model)
    for b in reference.blocks:
        b.compile(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    reference_peaks = []
    for t in lengths:
        reference_peaks.append(_step_peak(reference, ids[:, :t]))
    reference_graphs = counters["stats"]["unique_graphs"]
    longest = max(lengths)
    budget = int(0.85 * reference_peaks[lengths.index(longest)])
    torch._dynamo.reset()
    planner_compile(model, budget / 1e9, largest=ids[:, :longest], backend="aot_eager", time_limit_s=3.0)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = [_step_peak(model, ids[:, :t]) for t in lengths]
        for p in model.parameters():
            p.grad = None
    unbounded = [str(w.message)[90:200] for w in caught if "no known largest value" in str(w.message)]
    assert not unbounded  # every size bounded
    assert 0 < counters["stats"]["unique_graphs"] <= reference_graphs
    assert max(peaks) <= budget, list(zip(lengths, peaks))
    regions = compiled_plan(model).partitioner.regions
    symbolic = [r for r in regions if r.symbolic]
    assert symbolic and all(r.bounded for r in symbolic)
    assert all(longest in r.hints.values() for r in symbolic)  # planned at the longest, not at the second length
    assert "(largest;" in compiled_plan(model).summary()


def test_without_largest_a_symbolic_region_is_planned_at_its_hint_and_warns():
    torch._dynamo.reset()
    model, ids = make_gpt(batch=2, seq=24, n_layers=2, dropout=0.0)
    planner_compile(model, 0.05, backend="aot_eager", time_limit_s=3.0)
    run_step(model, ids[:, :8])
    with pytest.warns(UserWarning, match="no known largest value"):
        run_step(model, ids[:, :16])
    symbolic = [r for r in compiled_plan(model).partitioner.regions if r.symbolic]
    assert symbolic and not symbolic[0].bounded and list(symbolic[0].hints.values()) == [16]
    assert "NOT BOUNDED" in compiled_plan(model).summary()


# ---- the same three cases through inductor (CPU): compiles take seconds each, so a few steps --------------------
class _AllocatorPeak:
    """The peak of the bytes the CPU allocator holds within the `with` (torch.profiler's memory events paired by
    address, as planner.tools.measure.allocator_peak_bytes pairs them): inductor's own buffers included, which a
    dispatch mode does not see."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        events, stack = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
            stack.extend(e.children)
        live: dict[int, int] = {}
        held = self.peak_bytes = 0
        for _, size, ptr in sorted(events, key=lambda ev: ev[0]):
            if size > 0:
                live[ptr] = live.get(ptr, 0) + size
                held += size
                self.peak_bytes = max(self.peak_bytes, held)
            elif ptr in live:
                held -= live.pop(ptr)
        return False


def _allocator_train(model, xs, scales=None) -> list[int]:
    """`_train` with each step's peak (resident included) from the allocator; the first step's includes the
    planner's measuring step and the compilations."""
    global SCALE
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peaks = []
    for k, x in enumerate(xs):
        SCALE = 1.0 if scales is None else scales[k]
        with _AllocatorPeak() as a:
            loss = model(x).pow(2).mean()
            loss.backward()
            del loss
        peaks.append(resident_bytes(model, x) + a.peak_bytes)
        opt.step()
        opt.zero_grad(set_to_none=True)
    SCALE = 1.0
    return peaks


def _inductor_twins(block):
    torch.manual_seed(0)
    model = Stack(block).train()
    reference = copy.deepcopy(model)
    for b in reference.blocks:
        b.compile(options={"fx_graph_cache": False})
    return model, reference


def _assert_close_parameters(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_through_inductor_a_module_global_and_a_graph_break_train_as_torch_compile_within_the_budget():
    for block, scales, share in ((ScaledBlock, [1.0, 1.0, 0.5], 1.0), (BreakingBlock, None, 2.0)):
        torch._dynamo.reset()
        model, reference = _inductor_twins(block)
        xs = _inputs(3)
        eager_peak = _allocator_train(copy.deepcopy(model), xs[:1])[0]
        budget = int(share * eager_peak)
        counters.clear()
        reference_peaks = _allocator_train(reference, xs, scales)
        reference_graphs = counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
        planner_compile(model, budget / 1e9, time_limit_s=3.0)
        counters.clear()
        peaks = _allocator_train(model, xs, scales)
        assert counters["stats"]["unique_graphs"] == reference_graphs, block.__name__
        regions = compiled_plan(model).partitioner.regions
        assert regions and all(r.excess <= 0 for r in regions)
        _assert_close_parameters(model, reference)
        assert max(peaks) <= budget, (block.__name__, budget, peaks, reference_peaks)


@pytest.mark.slow
def test_through_inductor_a_stream_of_twenty_lengths_recompiles_as_torch_compile_within_the_budget():
    model, ids = make_gpt(batch=2, seq=48, n_layers=2, dropout=0.0)
    lengths = _lengths()
    reference = copy.deepcopy(model)
    for b in reference.blocks:
        b.compile(options={"fx_graph_cache": False})
    torch._dynamo.reset()
    counters.clear()
    reference_peaks = []
    for t in lengths:
        with _AllocatorPeak() as a:
            run_step(reference, ids[:, :t])
        reference_peaks.append(resident_bytes(reference, ids[:, :t]) + a.peak_bytes)
        for p in reference.parameters():
            p.grad = None
    reference_graphs = counters["stats"]["unique_graphs"]
    longest = max(lengths)
    budget = int(0.85 * reference_peaks[lengths.index(longest)])
    torch._dynamo.reset()
    planner_compile(model, budget / 1e9, largest=ids[:, :longest], time_limit_s=3.0)
    counters.clear()
    peaks = []
    for t in lengths:
        with _AllocatorPeak() as a:
            run_step(model, ids[:, :t])
        peaks.append(resident_bytes(model, ids[:, :t]) + a.peak_bytes)
        for p in model.parameters():
            p.grad = None
    assert 0 < counters["stats"]["unique_graphs"] <= reference_graphs
    assert max(peaks) <= budget, list(zip(lengths, peaks))
    symbolic = [r for r in compiled_plan(model).partitioner.regions if r.symbolic]
    assert symbolic and all(r.bounded and longest in r.hints.values() for r in symbolic)
