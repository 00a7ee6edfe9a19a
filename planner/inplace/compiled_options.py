"""`planner.enable(model, ..., compile=True)`: a block's kept, checkpointed and selective options run under
torch.compile.

Each option becomes one compiled function of (block, tensors, call) (`CompiledOptions.runner`), fullgraph, with the
backend given to `enable` (inductor by default):

- "compiled kept": the block's class forward;
- "compiled checkpointed": `torch.utils.checkpoint` around it, with a save policy that recomputes every operator but
  the random ones (dropout's mask: on CPU a recomputation under torch.compile would draw a new one, so they are saved);
- "compiled selective@f": the same, also saving the outputs of the operators the option's eager policy keeps. The
  policy names operators by (func, occurrence) in the forward (capture.op_record); under torch.compile it is asked at
  trace time, the node tags it gives steering the compiler's partitioner. The operators it is asked about are
  counted per func and compared, after the first compiled step, with the eager recording: where a func the policy
  keeps was seen another number of times (the compiled trace ran other operators), the block keeps the eager option.

The compiled options' figures are not derived: each is measured on one compiled forward and backward of the block
(after one to compile it) from the allocator's events (`measure_compiled`: torch.profiler's memory events on CPU,
which see inductor's buffers that a dispatch mode cannot; the allocator's counters on CUDA). What they recompute is
ranked as the eager options' (FLOPs plus FLOPS_PER_BYTE a byte written), without the eager policy's per-operator
Python overhead: under torch.compile the policy runs at trace time only.

A block whose forward updates buffers (BatchNorm's running statistics), draws from Python's or numpy's generator or
is given a key/value cache runs its eager options: a checkpoint under torch.compile replays neither the user's state
nor a cache the way the eager options do (block_region's `recomputable`, capture.kv_cache). A Python side effect of a
compiled forward (transformers' output-collector hooks) is applied once, in the forward, and not replayed by the
recomputation (`skip_fwd_side_effects_in_bwd_under_checkpoint`). A block torch.compile cannot trace whole (a graph
break) keeps its eager options, with the reason in the profile's note.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from capture.measure_memory import profiler_allocations, storage_bytes
from capture.state import restored
from planner.inplace.forwards import GradientSeed, original_forward

COMPILED_PREFIX = "compiled "
# what a compiled option's recompilations may take per option function (each option has a code object of its own:
# `_own_code`); past it dynamo would silently run the function eagerly
RECOMPILE_LIMIT = 16
_DYNAMO_CONFIG = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
_BACKWARD_MARK = "planner::compiled_option_backward"


def is_random(func) -> bool:
    """An operator that draws from a generator (dropout's): saved by the compiled options, never recomputed."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _own_code(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo keeps its compiled entries (and its recompile count) per code
    object, and every option's function is one closure of the same code."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class _Traced:
    """What one compiled option's policy was asked about at its traces: per func, how many times in a forward."""
    counts: dict = field(default_factory=dict)


def _forward(block, tensors, call):

    args, kwargs = call.rebuild(tensors)
    return original_forward(block)(*args, **kwargs)


def _checkpointed(saved: frozenset, traced: _Traced):
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def context_fn():
        counts: tuple[dict, dict] = ({}, {})

        def policy(ctx, func, *args, **kwargs):
            seen = counts[bool(ctx.is_recompute)]
            k = seen.get(func, 0)
            seen[func] = k + 1
            if not ctx.is_recompute:
                traced.counts[func] = max(traced.counts.get(func, 0), k + 1)
            if (func, k) in saved or is_random(func):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def run(block, tensors, call):
    
        args, kwargs = call.rebuild(tensors)
        return checkpoint(original_forward(block), *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return run


class CompiledOptions:
    """The compiled option functions of one enabled model, by (block structure, option name): a structure's shapes
    share its policies (block_region.BlockProfile.policies), so one function serves them, recompiled by dynamo at
    another shape."""

    def __init__(self, backend: str | Callable = "inductor"):
        self.backend = backend
        self._functions: dict[tuple, tuple[Callable, _Traced]] = {}

    def function(self, structure: tuple, name: str, saved: frozenset | None) -> tuple[Callable, _Traced]:
        """The compiled function of option `name` (saved=None: kept; else checkpointed with `saved` kept)."""
        key = (structure, name)
        if key not in self._functions:
            traced = _Traced()
            fn = _forward if saved is None else _checkpointed(saved, traced)
            fn = _own_code(fn, f"planner_{name.replace('@', '_at_').replace('.', '_')}_{len(self._functions)}")
            self._functions[key] = (torch.compile(fn, backend=self.backend, fullgraph=True), traced)
        return self._functions[key]

    def runner(self, structure: tuple, name: str, saved: frozenset | None, call,
               eager: Callable | None = None) -> tuple[Callable, _Traced]:
        """(run(block, tensors, caches=()) -> output, what its policy saw at its traces) for a call of the structure.
        Under a Python dispatch mode that torch.compile refuses (a storage tracker measuring the step) it runs
        `eager`, the option's eager counterpart, where given."""
        fn, traced = self.function(structure, name, saved)

        def run(block, tensors, caches=()):
            if eager is not None and _refused_mode():
                return eager(block, tensors, caches)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, **_DYNAMO_CONFIG):
                return fn(block, list(tensors), call)
        return run, traced


def _refused_mode() -> bool:
    """A dispatch mode torch.compile does not run under is on this thread's stack."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not m.is_infra_mode() and not m.ignore_compile_internals()
               for m in _get_current_dispatch_mode_stack())


def matches_recording(traced: _Traced, records: list, saved: frozenset) -> str | None:
    """None where every func the policy keeps an output of was asked about as many times at the compiled trace as
    the eager recording ran it (so (func, occurrence) names the same operator); else why not."""
    eager: dict = {}
    for r in records:
        eager[r.func] = eager.get(r.func, 0) + 1
    for func in sorted({f for f, _ in saved}, key=str):
        if traced.counts.get(func, 0) != eager.get(func, 0):
            return (f"{func} ran {traced.counts.get(func, 0)} times in the compiled trace, {eager.get(func, 0)} "
                    "in the eager recording")
    return None


class ProfilerBusyError(RuntimeError):
    """The CPU reading of a compiled option needs torch.profiler, and another session was running (two at once crash
    the process)."""


def profiler_running() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled())


def _mark_time(prof, name: str) -> int:
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name == name:
            return e.start_time_ns
        stack.extend(e.children)
    raise RuntimeError(f"the profiler recorded no '{name}' event")


def warm(block: torch.nn.Module, run, tensors: list[torch.Tensor]) -> None:
    """One forward and backward of a compiled option from fresh leaves of `tensors` (the block's state restored
    after): what compiles it."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    wrt = [p for p in block.parameters() if p.requires_grad] + [t for t in inputs if t.requires_grad]
    with restored(block):
        out = run(block, inputs)
        diff = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
                and t.grad_fn is not None and t.is_floating_point()]
        if diff and wrt:
            torch.autograd.grad(sum(t.sum() for t in diff), wrt, allow_unused=True)


def measure_compiled(block: torch.nn.Module, run, tensors: list[torch.Tensor]) -> tuple[int, int, int]:
    """(stash_bytes, forward_bytes, backward_bytes) of a compiled option (block_region.measure_option's figures),
    read from the allocator: on CPU torch.profiler's memory events (every allocation, inductor's buffers included;
    frees of what was allocated before are not counted), on CUDA its peak and current counters."""

    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    params = [p for p in block.parameters() if p.requires_grad]
    wrt = params + [t for t in inputs if t.requires_grad]
    device = next((t.device for t in (*params, *inputs)), torch.device("cpu"))

    def forward():
        out = run(block, inputs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out, outs, [t for t in outs if t.requires_grad and t.grad_fn is not None and t.is_floating_point()]

    def backward(diff):
        if diff and wrt:
            total = sum(GradientSeed.apply(t).sum() for t in diff)
            grads = torch.autograd.grad(total, wrt, grad_outputs=torch.ones_like(total), allow_unused=True)
            del grads, total

    with restored(block):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            out, outs, diff = forward()
            torch.cuda.synchronize(device)
            forward_peak = torch.cuda.max_memory_allocated(device) - base
            live = torch.cuda.memory_allocated(device) - base
            torch.cuda.reset_peak_memory_stats(device)
            backward(diff)
            torch.cuda.synchronize(device)
            backward_peak = torch.cuda.max_memory_allocated(device) - base
        else:
            from torch.profiler import ProfilerActivity, profile, record_function

            if profiler_running():
                raise ProfilerBusyError("a torch.profiler session was running: the compiled option's memory could "
                                        "not be read")
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out, outs, diff = forward()
                with record_function(_BACKWARD_MARK):
                    pass
                backward(diff)
            mark = _mark_time(prof, _BACKWARD_MARK)
            sizes: dict[int, int] = {}
            held = forward_peak = backward_peak = 0
            live = None
            for t, size, ptr in profiler_allocations(prof):
                if live is None and t >= mark:
                    live = held
                if size > 0:
                    sizes[ptr] = sizes.get(ptr, 0) + size
                    held += size
                elif ptr in sizes:
                    held -= sizes.pop(ptr)
                if live is None:
                    forward_peak = max(forward_peak, held)
                else:
                    backward_peak = max(backward_peak, held)
            if live is None:
                live = held
            backward_peak = max(backward_peak, live)
        out_bytes = storage_bytes(outs)
        del out, outs, diff
    stash = max(0, live - out_bytes)
    return int(stash), int(forward_peak), int(max(0, backward_peak - out_bytes))
