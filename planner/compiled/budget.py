"""How the step's budget is shared among the compiled regions: one eager step, measured, tells what lies outside them.

`measure_outside(model, args, kwargs, blocks)` runs one eager training step (`planner.tools.measure.run_step`: the
model's own loss where it returns one, else the sum of its floating-point outputs; compiled code forced eager; each
block call checkpointed, `torch.utils.checkpoint` without reentrance, so that the measuring step holds little more than
one block's activations beyond what lies outside the blocks) under a dispatch mode that sees every storage an operator
creates (`capture.measure_memory`'s way) and tells apart those created inside a block (between its forward pre-hook and
forward hook, and between its full backward pre-hook and backward hook) from the rest. It notes the peak of the live
bytes created outside the blocks in each of four phases of the step:

- forward: up to the end of a block's forward (the embeddings, and whatever runs between blocks);
- loss: from the end of a block's forward to the first block's backward (the head, the loss, their gradients; the
  moments between two blocks' forwards count here too);
- backward: during a block's backward (what the head's backward left);
- tail: from the end of a block's backward to the next one's start, and to the step's end (the embeddings'
  backward).

The step's RNG, buffers and gradients are left as they were. The block calls' arguments are noted (their sizes only,
`planner.compiled.sizes.block_call_locals`): at the model's largest inputs they tell the largest size of each symbolic
size of a region (`planner.compiled.sizes`).

Run at the largest inputs the training will give (`planner.compile(..., largest=...)`), the outside peaks bound those
of every smaller input as far as the code outside the blocks holds no more for a smaller input than for a larger one
(true of embeddings, heads and losses whose sizes grow with the input's).

`step_room(budget, outside)` is then what the step leaves to the blocks in each phase: the budget less the resident
bytes (parameters, buffers, inputs) less that phase's outside peak (`StepRoom`); the partitioner fits the block calls
into it (`planner.compiled.partitioner`). Why this bounds the step: at any moment the step holds the resident bytes,
what the code outside the blocks made and still holds (at most its peak in that phase: the same eager code whether the
blocks are compiled or not) and what the blocks' regions made and still hold (what the partitioner bounds in that
phase). The bound is loose where the outside's peak and the blocks' do not meet within a phase.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from capture.loss_workspace import default_loss
from capture.measure_memory import StorageTracker, storage_bytes
from capture.state import restored
from graphs.errors import InfeasibleBudgetError
from planner.compiled.partitioner import PHASES, StepRoom
from planner.compiled.sizes import block_call_locals


@dataclass(frozen=True)
class OutsideMemory:
    """One eager step, split between the blocks and the rest (bytes).

    resident_bytes: parameters, buffers and the inputs; outside_peaks: the peak of the live bytes created outside any
    block in each phase ("forward", "loss", "backward", "tail"); eager_peak_bytes: the measuring step's peak
    (resident included; its blocks checkpointed); block_calls: how many block forwards it ran; block_inputs: each
    block call's arguments by name, tensors as their sizes (`planner.compiled.sizes.block_call_locals`)."""

    resident_bytes: int
    outside_peaks: dict[str, int]
    eager_peak_bytes: int
    block_calls: int
    block_inputs: tuple = field(default=(), repr=False)

    @property
    def outside_peak_bytes(self) -> int:
        return max(self.outside_peaks.values())


class _BlockAttributingTracker(StorageTracker):
    """Live bytes of the storages created under it, inside blocks (`depth` > 0) and outside, and their peaks (which
    storages are new is StorageTracker's to say)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.phase = "forward"
        self.live = [0, 0]  # outside, inside
        self.outside_peaks = dict.fromkeys(PHASES, 0)
        self.total_peak = 0

    def _add(self, key: StorageWeakRef, st) -> None:
        pool = 1 if self.depth > 0 else 0
        nbytes = int(st.nbytes())
        self._tracked[key] = nbytes
        self.live[pool] += nbytes
        weakref.finalize(st, self._release_from, key, pool, nbytes)

    def _release_from(self, key: StorageWeakRef, pool: int, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live[pool] -= nbytes

    def _after_op(self) -> None:
        self.outside_peaks[self.phase] = max(self.outside_peaks[self.phase], self.live[0])
        self.total_peak = max(self.total_peak, self.live[0] + self.live[1])


def measure_outside(model: torch.nn.Module, args: tuple, kwargs: dict, blocks: list[torch.nn.Module],
                    loss_fn: Callable | None = None) -> OutsideMemory:
    """One eager step of `model(*args, **kwargs)` split between `blocks` and the rest (see the module docstring)."""
    tracker = _BlockAttributingTracker()
    calls = [0]
    block_inputs: list[dict] = []

    forwards = {b: b.forward for b in blocks}  # before they are checkpointed

    def note_inputs(block, args, kwargs):
        if tracker.phase != "backward":  # not a checkpoint's recomputation
            block_inputs.extend(block_call_locals(forwards[block], args, kwargs))

    def enter_forward(*_):
        calls[0] += 1
        tracker.depth += 1
        if tracker.phase == "loss":
            tracker.phase = "forward"

    def leave_forward(*_):
        tracker.depth -= 1
        if tracker.phase == "forward":
            tracker.phase = "loss"

    def enter_backward(*_):
        tracker.depth += 1
        tracker.phase = "backward"

    def leave_backward(*_):
        tracker.depth -= 1
        tracker.phase = "tail"

    handles = []
    for b in blocks:
        handles += [b.register_forward_pre_hook(note_inputs, with_kwargs=True),
                    b.register_forward_pre_hook(enter_forward), b.register_forward_hook(leave_forward),
                    b.register_full_backward_pre_hook(enter_backward), b.register_full_backward_hook(leave_backward)]
    own_forward = {b: b.__dict__["forward"] for b in blocks if "forward" in b.__dict__}
    grads = {p: p.grad for p in model.parameters()}
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    resident = storage_bytes([*model.parameters(), *model.buffers(), *tensors])
    try:
        for b in blocks:
            b.forward = functools.partial(_checkpointed, b.forward)
        for p in grads:
            p.grad = None
        with restored(model), torch.compiler.set_stance("force_eager"), tracker:
            out = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(out)
            loss.backward()
            del out, loss
    finally:
        for b in blocks:
            if b in own_forward:
                b.forward = own_forward[b]
            else:
                b.__dict__.pop("forward", None)
        for h in handles:
            h.remove()
        for p, g in grads.items():
            p.grad = g
    return OutsideMemory(resident, dict(tracker.outside_peaks), resident + tracker.total_peak, calls[0],
                         tuple(block_inputs))


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def step_room(budget_bytes: int, outside: OutsideMemory) -> StepRoom:
    """What the step's budget leaves to the blocks in each phase (see the module docstring). InfeasibleBudgetError
    where a phase leaves nothing, naming what lies outside the blocks then."""
    if outside.block_calls == 0:
        raise InfeasibleBudgetError(budget_bytes, None, "compile",
                                    "the measured step called none of the blocks: there is nothing to plan")
    left = {phase: budget_bytes - outside.resident_bytes - peak for phase, peak in outside.outside_peaks.items()}
    for phase, room in left.items():
        if room <= 0:
            held = outside.resident_bytes + outside.outside_peaks[phase]
            raise InfeasibleBudgetError(
                budget_bytes, None, "compile",
                f"in the step's {phase} phase the code outside the blocks holds {held} bytes "
                f"({outside.resident_bytes} resident: parameters, buffers, inputs; {outside.outside_peaks[phase]} "
                f"made outside the blocks at their peak), which leaves the blocks nothing")
    return StepRoom(left["forward"], left["loss"], left["backward"], left["tail"], outside.block_calls)
