"""How the step's budget is shared among the compiled regions: one eager step, measured, tells what lies outside them.

`measure_outside(model, args, kwargs, blocks)` runs one eager training step (`planner.tools.measure.run_step`: the
model's own loss where it returns one, else the sum of its floating-point outputs; compiled code forced eager) in which
the blocks hold nothing for the backward but their inputs: each block call runs its forward without autograd
(`_HoldingNothing`), keeps its inputs for the backward as a compiled region or a checkpoint does, and its backward
hands the block's inputs zero gradients of their shapes, without running the block's backward. The code outside the
blocks runs as in a real step, on the values the blocks really compute. The step runs under a dispatch
mode that sees every storage an operator creates (`capture.measure_memory`'s way) and tells apart those created
inside a block (between its forward pre-hook and forward hook, and between its full backward pre-hook and backward
hook) from the rest. So the measuring step holds what lies outside the blocks, the blocks' outputs, and one block
call's inference forward at a time (a compiled step holds the first two as well, and runs each block's forward
too, fused where inductor fuses), and it never goes above the budget where `measure_outside` is given one
(`limit_bytes`): each operator's output is sized on the meta device before it runs, and where it would take the step
above the budget the step stops there with InfeasibleBudgetError (an operator with no meta kernel is checked right
after it runs). It notes the peak of the live bytes created outside the blocks in each of four phases of the step:

- forward: up to the end of a block's forward (the embeddings, and whatever runs between blocks);
- loss: from the end of a block's forward to the first block's backward (the head, the loss, their gradients; the
  moments between two blocks' forwards count here too);
- backward: during a block's backward (what the head's backward left);
- tail: from the end of a block's backward to the next one's start, and to the step's end (the embeddings'
  backward).

The step's RNG, buffers and gradients are left as they were (the blocks' parameters get no gradient in it). The
block calls' arguments are noted (their sizes only, `planner.compiled.sizes.block_call_locals`): at the model's
largest inputs they tell the largest size of each symbolic size of a region (`planner.compiled.sizes`).

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
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from capture.loss_workspace import default_loss
from capture.measure_memory import StorageTracker, _fresh_outputs, storage_bytes
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


class _OverBudget(Exception):
    """The measuring step was about to hold more than its limit (`_BlockAttributingTracker.limit`)."""

    def __init__(self, live: int, more: int, func, inside: bool, phase: str):
        super().__init__(live, more, func, inside, phase)
        self.live, self.more, self.func, self.inside, self.phase = live, more, func, inside, phase


class _BlockAttributingTracker(StorageTracker):
    """Live bytes of the storages created under it, inside blocks (`depth` > 0) and outside, and their peaks (which
    storages are new is StorageTracker's to say). With a `limit` (bytes), an operator whose outputs (sized on the meta
    device first) would take the live bytes above it is not run: `_OverBudget` is raised instead."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.depth = 0
        self.phase = "forward"
        self.live = [0, 0]  # outside, inside
        self.outside_peaks = dict.fromkeys(PHASES, 0)
        self.total_peak = 0
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.limit is not None:
            more = _meta_output_bytes(func, args, kwargs or {})
            if more is not None and sum(self.live) + more > self.limit:
                raise _OverBudget(sum(self.live), more, func, self.depth > 0, self.phase)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _add(self, key: StorageWeakRef, st, t: torch.Tensor) -> None:
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
        if self.limit is not None and sum(self.live) > self.limit:  # an operator the meta device could not size
            raise _OverBudget(sum(self.live), 0, None, self.depth > 0, self.phase)


_DEVICE_ARGS: dict = {}


def _meta_output_bytes(func, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the storages `func(*args, **kwargs)` would create, from a run on the meta device (no data, no
    generator drawn; the dispatch modes off): 0 for an operator whose schema lets an output alias an input (a view, an
    in-place operator: a fresh storage of such an operator is caught after it runs), None where the meta device
    cannot run it (a tensor subclass, no meta kernel, a data-dependent size)."""
    if not _fresh_outputs(func):
        return 0
    has_device = _DEVICE_ARGS.get(func)
    if has_device is None:
        has_device = _DEVICE_ARGS[func] = any(a.name == "device" for a in func._schema.arguments)
    flat = tree_leaves((args, kwargs))
    if not has_device and not any(isinstance(t, torch.Tensor) for t in flat):
        return None  # it would allocate where it stands: not sized beforehand

    def meta(t):
        if isinstance(t, torch.Tensor):
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                raise TypeError("a tensor subclass")
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return t

    try:
        with _disable_current_modes():
            margs, mkwargs = tree_map(meta, (args, kwargs))
            if has_device:
                mkwargs = {**mkwargs, "device": torch.device("meta")}
            out = func(*margs, **mkwargs)
            sizes = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                     for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    except Exception:  # noqa: BLE001 - not sized: checked after it runs
        return None
    return int(sum(sizes.values()))


def measure_outside(model: torch.nn.Module, args: tuple, kwargs: dict, blocks: list[torch.nn.Module],
                    loss_fn: Callable | None = None, limit_bytes: int | None = None) -> OutsideMemory:
    """One eager step of `model(*args, **kwargs)` split between `blocks` and the rest (see the module docstring).

    limit_bytes: the step's budget; InfeasibleBudgetError, before the operator that would take the measuring step
    above it runs, where it would (None: no limit)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    resident = storage_bytes([*model.parameters(), *model.buffers(), *tensors])
    if limit_bytes is not None and resident > limit_bytes:
        raise InfeasibleBudgetError(limit_bytes, None, "compile",
                                    f"the parameters, buffers and inputs alone hold {resident} bytes")
    tracker = _BlockAttributingTracker(None if limit_bytes is None else limit_bytes - resident)
    calls = [0]
    block_inputs: list[dict] = []

    forwards = {b: b.forward for b in blocks}  # before they are replaced

    def note_inputs(block, args, kwargs):
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
    try:
        for b in blocks:
            b.forward = functools.partial(_holding_nothing, b.forward)
        for p in grads:
            p.grad = None
        with restored(model), torch.compiler.set_stance("force_eager"), tracker:
            out = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(out)
            loss.backward()
            del out, loss
    except _OverBudget as e:
        where = f"inside a block's {e.phase}" if e.inside else f"outside the blocks, in the step's {e.phase} phase"
        op = f"{e.func} would make {e.more} bytes more" if e.func is not None else "an operator took it there"
        raise InfeasibleBudgetError(
            limit_bytes, None, "compile",
            f"the measuring step (eager; the blocks holding nothing for the backward) "
            f"stopped before going above the budget: it held {resident + e.live} bytes ({resident} resident: "
            f"parameters, buffers, inputs) and, {where}, {op}: the step needs at least "
            f"{resident + e.live + e.more} bytes") from None
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


class _HoldingNothing(torch.autograd.Function):
    """A block call in the measuring step: its forward run without autograd (it saves nothing for the backward but
    its inputs), its backward the zero gradients of its tensor inputs' shapes (the block's own backward is not run).
    `run` is the block's forward; `spec` the pytree spec of its arguments; `out_spec` a list the outputs' spec is put
    in."""

    @staticmethod
    def forward(ctx, run, spec, out_spec, *flat):
        args, kwargs = tree_unflatten(list(flat), spec)
        out = run(*args, **kwargs)
        leaves, tree = tree_flatten(out)
        out_spec[:] = [tree]
        ctx.inputs = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in flat]
        # the inputs held to the backward, as a compiled region (and a checkpoint) holds those its backward reads: one
        # made outside the blocks (the embeddings' output) counts outside until then
        ctx.save_for_backward(*(t for t in flat if isinstance(t, torch.Tensor)))
        ctx.mark_non_differentiable(*(t for t in leaves if isinstance(t, torch.Tensor)
                                      and not (t.is_floating_point() or t.is_complex())))
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *_):
        zeros = [None if m is None or not need else torch.zeros(m[0], dtype=m[1], device=m[2])
                 for m, need in zip(ctx.inputs, ctx.needs_input_grad[3:])]
        return (None, None, None, *zeros)


def _holding_nothing(forward, *args, **kwargs):
    flat, spec = tree_flatten((args, kwargs))
    out_spec: list = []
    leaves = _HoldingNothing.apply(forward, spec, out_spec, *flat)
    return tree_unflatten(list(leaves), out_spec[0])


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
