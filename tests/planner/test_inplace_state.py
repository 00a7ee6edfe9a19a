"""planner.enable and the user's state: nothing of it is consumed or updated twice. Blocks that update buffers
(BatchNorm's running statistics and step counter, a running mean the block's output reads), that draw from Python's
and numpy's generators, or that branch on a tensor's value train under the in-place planner exactly as eager does,
at a budget that makes it checkpoint and at one that keeps everything, measuring call included: parameters, buffers,
losses and the generators' states after each step are eager's."""
from __future__ import annotations

import copy
import random

import numpy
import pytest
import torch

import planner
from capture.state import host_rng_state, restored, restored_rng, same_host_rng
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes

LIMIT_S = 2.0  # per new block shape
PROFILE_LIMIT_S = 12.0  # for a block profiled on its own: time for a schedule of its own to be found
WIDTH = 16
HUGE_GB = 100.0


class _Mlp(torch.nn.Module):
    """A gated MLP: enough intermediate tensors for schedules of the block's own (planned options) to exist."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.gate = torch.nn.Linear(width, 4 * width), torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)) * torch.sigmoid(self.gate(x)))


class _EmaBlock(torch.nn.Module):
    """Updates a running mean of its input and reads it back: a recomputation from the updated buffer differs."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = _Mlp(width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.5).add_(0.5 * x.mean(0))
        return x + self.mlp(x - self.ema)


class _NormBlock(torch.nn.Module):
    def __init__(self, width: int, momentum):
        super().__init__()
        self.mlp = _Mlp(width)
        self.bn = torch.nn.BatchNorm1d(width, momentum=momentum)

    def forward(self, x):
        return x + self.mlp(self.bn(x))


class _DrawingBlock(torch.nn.Module):
    """Scales its output by draws from Python's and numpy's global generators."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = _Mlp(width)

    def forward(self, x):
        scale = 1.0 + 0.5 * random.random() + 0.5 * float(numpy.random.rand())
        return x + scale * self.mlp(x)


class _BranchBlock(torch.nn.Module):
    """Takes a branch on the value of its hidden state."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = _Mlp(width)
        self.taken: list[bool] = []  # the branch each run took

    def forward(self, x):
        h = x + self.mlp(x)
        self.taken.append(bool(h.mean() > 0.2))
        if h.mean() > 0.2:
            h = h * 3
        return h


class _Net(torch.nn.Module):
    def __init__(self, make_block, depth: int = 3, width: int = WIDTH):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(make_block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).square().mean()


BLOCKS = {
    "batchnorm": lambda w: _NormBlock(w, 0.1),
    "batchnorm-cumulative": lambda w: _NormBlock(w, None),  # momentum=None reads num_batches_tracked
    "ema": _EmaBlock,
    "drawing": _DrawingBlock,
    "branch": _BranchBlock,
}


def _seed(k: int) -> None:
    torch.manual_seed(k)
    random.seed(k)
    numpy.random.seed(k)


def _train(name: str, budget: str, optimizer: str = "sgd", shifts=(0.0, 0.1, 0.2)):
    """Trains a model of `name` blocks and an eager copy side by side, one step per input shift, comparing them after
    each step; returns the planner and the eager copy."""
    torch.manual_seed(0)
    model = _Net(BLOCKS[name]).train()
    x = torch.randn(128, 8) + 0.3
    eager = copy.deepcopy(model)
    # halfway from per-block checkpointing's peak to eager's, some blocks checkpointed (at per-block checkpointing's
    # peak itself no choice fits a BatchNorm block: the checkpointed option holds a copy of the statistics the forward
    # updated until its backward, which torch.utils.checkpoint alone does not, updating them twice instead)
    if budget == "checkpointing":
        _seed(1)
        low = measure_peak_bytes(per_block_checkpointed(model), (x,))
        _seed(1)
        budget_gb = (low + measure_peak_bytes(copy.deepcopy(model), (x,))) / 2 / 1e9
    else:
        budget_gb = HUGE_GB
    state = planner.enable(model, budget_gb, time_limit_s=LIMIT_S)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    opt_e, opt_p = make(eager.parameters()), make(model.parameters())
    for k, shift in enumerate(shifts):
        losses, rngs = [], []
        for m, opt in ((eager, opt_e), (model, opt_p)):
            _seed(100 + k)
            loss = m(x + shift)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            rngs.append((host_rng_state(), torch.get_rng_state()))
        assert torch.equal(losses[0], losses[1]), (k, losses, state.records[-1])
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p, q), (k, n, state.records[-1])
        for (n, b), c in zip(model.named_buffers(), eager.buffers()):
            assert torch.equal(b, c), (k, n, b, c, state.records[-1])
        assert same_host_rng(rngs[0][0], rngs[1][0]), (k, state.records[-1])
        assert torch.equal(rngs[0][1], rngs[1][1]), k
    planner.disable(model)
    return state, eager


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("budget", ["checkpointing", "huge"])
@pytest.mark.parametrize("name", ["batchnorm", "batchnorm-cumulative", "ema"])
def test_blocks_updating_buffers_train_as_eager(name, budget, optimizer):
    """BatchNorm's running statistics and num_batches_tracked (momentum=None computes its factor from it), and a
    running mean the block's output reads, are eager's after every step: the measuring call (every block
    checkpointed), the checkpointed option and profiling update them once per step, and a recomputation reads them
    as the forward did."""
    state, _ = _train(name, budget, optimizer)
    if name.startswith("batchnorm"):
        for block in state.blocks:
            assert block.bn.num_batches_tracked.item() == 3
    assert [r.mode for r in state.records] == ["measure", "planned", "planned"]
    if budget == "checkpointing":
        assert any(o != "kept" for r in state.records[1:] for o in r.options), state.records
    else:
        assert all(o == "kept" for r in state.records[1:] for o in r.options), state.records


@pytest.mark.parametrize("budget", ["checkpointing", "huge"])
def test_a_block_drawing_from_python_and_numpy_trains_as_eager(budget):
    """Profiling and recomputing draw nothing of the user's: losses, parameters and Python's, numpy's and torch's
    generators after each step are eager's, kept blocks' included."""
    state, _ = _train("drawing", budget)
    assert [r.mode for r in state.records] == ["measure", "planned", "planned"]


@pytest.mark.parametrize("budget", ["checkpointing", "huge"])
def test_a_block_branching_on_a_value_trains_as_eager(budget):
    """The branch is taken in some steps and not in others (the measuring call's): each step is eager's."""
    state, eager = _train("branch", budget, shifts=(0.0, -3.0, 0.0))
    assert all(b.taken[0] is False and True in b.taken for b in eager.blocks), [b.taken for b in eager.blocks]
    assert [r.mode for r in state.records] == ["measure", "planned", "planned"]


def test_the_checkpointed_option_recomputes_from_the_forwards_state_and_leaves_the_steps():
    """One checkpointed block on its own: its recomputation (in the backward) sees the buffers and the Python and
    numpy generators as the forward began with them, and leaves them as the forward left them."""
    from planner.inplace.block_region import BlockCall, _checkpointed_runner

    seen = []

    class Probe(_EmaBlock):
        def forward(self, x):
            seen.append((self.ema.clone(), random.random(), float(numpy.random.rand())))
            return super().forward(x)

    torch.manual_seed(0)
    block = Probe(4).train()
    x = torch.randn(5, 4, requires_grad=True)
    call, tensors = BlockCall.of(block, (x,), {})
    run = _checkpointed_runner(call)
    _seed(3)
    out = run(block, tensors)
    after_forward = (block.ema.clone(), host_rng_state())
    out.sum().backward()
    assert len(seen) == 2  # the forward and its recomputation
    assert torch.equal(seen[0][0], seen[1][0]) and seen[0][1:] == seen[1][1:]
    assert torch.equal(block.ema, after_forward[0]) and same_host_rng(host_rng_state(), after_forward[1])


def test_restored_puts_back_python_and_numpy_generators():
    block = _EmaBlock(4)
    _seed(5)
    before = host_rng_state()
    with restored(block):
        random.random()
        numpy.random.rand(3)
        block(torch.randn(2, 4))
    assert same_host_rng(host_rng_state(), before) and not block.ema.any()
    with pytest.raises(RuntimeError), restored_rng():
        random.random()
        raise RuntimeError
    assert same_host_rng(host_rng_state(), before)


def _profiled(name: str, planned: bool = True):
    """A block of `name` profiled on its own (block_region.profile_block, its planned options too) at an input of 128
    rows, with its call."""
    from planner.inplace.block_region import BlockCall, profile_block

    torch.manual_seed(0)
    block = BLOCKS[name](WIDTH).train()
    x = torch.randn(128, WIDTH, requires_grad=True)
    call, tensors = BlockCall.of(block, (x,), {})
    _seed(0)
    before, buffers = host_rng_state(), {n: b.clone() for n, b in block.named_buffers()}
    prof = profile_block(block, call, tensors, time_limit_s=PROFILE_LIMIT_S, planned=planned)
    assert same_host_rng(host_rng_state(), before)  # profiling drew nothing of the user's, updated no buffer
    assert all(torch.equal(b, buffers[n]) for n, b in block.named_buffers())
    return block, x, prof


def test_a_block_drawing_from_python_or_numpy_has_no_schedule_of_its_own():
    """A traced schedule would replay the trace's draws as constants and draw nothing: a block whose forward draws
    from Python's or numpy's generator keeps only the whole-block options, the reason in its note."""
    _, _, prof = _profiled("drawing")
    assert {"kept", "checkpointed"} <= {o.figures.name for o in prof.options} and not prof.plans
    assert not any(o.figures.name.startswith("planned") for o in prof.options)
    assert "no schedule found" in prof.note or "draws from Python's or numpy's generator" in prof.note, prof.note


def test_a_planned_option_of_a_block_reading_its_step_counter_runs_at_a_later_step():
    """BatchNorm with momentum=None computes its factor as 1 / float(num_batches_tracked): the traced schedule takes
    it from the counter at run time (capture.counter_momentum), so a later step (another count) runs as eager."""
    block, x, prof = _profiled("batchnorm-cumulative")
    planned = [o for o in prof.options if o.figures.name.startswith("planned")]
    if not planned:
        pytest.skip(f"no schedule of the block's own here: {prof.note}")
    for _ in range(2):  # the steps before: num_batches_tracked is 2, the trace saw 0
        block(x)
    eager = copy.deepcopy(block)
    want = eager(x)
    got = planned[0].run(block, [x])
    assert torch.equal(got, want)
    assert all(torch.equal(b, c) for b, c in zip(block.buffers(), eager.buffers()))


def test_buffer_updates_sees_a_buffer_the_forward_registers_and_one_it_updates():
    """BufferUpdates.run on a block without buffers (its fast path) still names a buffer the forward registers; on
    one with buffers, the one it updates in place and not the one it leaves."""
    from planner.inplace.recompute import BufferUpdates

    class Registers(torch.nn.Module):
        def forward(self, x):
            if not hasattr(self, "seen"):
                self.register_buffer("seen", x.detach().sum().reshape(1))
            return x * 2

    updates = BufferUpdates()
    updates.run(Registers(), {}, Registers().forward, torch.ones(2))  # another instance's forward: nothing of this
    assert updates.names == set()
    block = Registers()
    assert updates.run(block, {}, block, torch.ones(2))[1] == {"seen"} and updates.names == {"seen"}

    class Counts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))
            self.register_buffer("fixed", torch.ones(()))

        def forward(self, x):
            self.steps += 1
            return x * self.fixed

    counts = Counts()
    assert BufferUpdates().run(counts, {}, counts, torch.ones(2))[1] == {"steps"}
