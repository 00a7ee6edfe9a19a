"""`compile(model, budget_gb)`: torch.compile per repeated block, as torchtitan compiles each decoder layer, with the
project's partitioner deciding what each compiled region saves and what its backward recomputes.

```python
model = planner.compile(model, budget_gb=2.0)            # in place; inductor, as torch.compile does by default
model = planner.compile(model, 2.0, backend="aot_eager")  # AOTAutograd without a compiler (tests, debugging)
model = planner.compile(model, 2.0, largest=longest_batch)  # a stream of lengths: planned for the longest
loss = model(x).sum(); loss.backward()                    # the first training call measures, then compiles
print(planner.compiled.api.compiled_plan(model).summary())
```

Each block (`capture.module_tags.repeated_blocks`, or `blocks=`) is compiled in place (`Module.compile`) with the
caller's torch.compile arguments; the code outside the blocks runs eagerly, as in torchtitan. The partitioner
(`planner.compiled.partitioner.PlannedPartitioner`, one for all the blocks) is inductor's `custom_partitioner_fn`,
or the `partition_fn` of AOTAutograd's backend for "aot_eager". No cached partition made for another budget is reused:
its `uuid()` is None, and the blocks compile with inductor's `fx_graph_cache` off, which also bypasses AOTAutograd's
cache (seen on torch 2.13: with the caches on, a second process got the first one's partition without asking).

The budget is for the whole training step (parameters, buffers, inputs, activations, gradients), as everywhere in the
project. The first training call (the model in training mode, gradients enabled) measures one eager step in which the
blocks hold nothing for the backward (their forwards run without autograd, their backwards are zeros), before
anything compiles (`planner.compiled.budget`, with the model's own loss or the sum of its outputs as the loss), on
`largest` where it is given, else on the call's own inputs: the resident bytes and the peak of what the code outside
the blocks makes in each phase of the step (forward, loss, backward, tail). That step holds what lies outside the
blocks, the blocks' outputs and one block's inference forward at a time, and it stops with InfeasibleBudgetError
before an operator would take it above the budget (each operator's outputs sized on the meta device first). The
budget less those is what each phase leaves to the block calls (`StepRoom`), which the partitioner fits the calls
into (`planner.compiled.partitioner`: while one call works, the others hold what their forward or their backward
left). The blocks compile at their first call after that, and again whenever torch.compile recompiles them.

A stream of input sizes: torch.compile recompiles a block once with symbolic sizes at its second shape, and that
region then serves every later size. The partitioner plans each symbolic size at the largest it can take
(`planner.compiled.sizes`): its size in the measuring step at `largest`, else the upper bound of its guard
(`torch._dynamo.mark_dynamic(x, dim, max=...)` on a block's input), else, with a warning, the size of the input that
triggered the compilation (then a later, longer input can exceed the budget); the summary tells which. `largest` also
makes the room the one left at the largest inputs, so every smaller step fits it too (as far as the code outside the
blocks holds no more for a smaller input). The planner adds no recompilation of its own: torch.compile's guards
decide, as without the planner.

A graph break inside a block makes it several regions per call; each is planned within a share of the blocks' room
(halves: `planner.compiled.partitioner.block_part`), so that together they stay within it; the eager code between them
is not counted. A module global the block reads is guarded by dynamo as without the planner: a change recompiles, and
the partitioner plans the new region as any other. The backends the partitioner reaches are "inductor" and
"aot_eager".
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from graphs.errors import ArgumentError
from planner.compiled.budget import OutsideMemory, measure_outside, step_room
from planner.compiled.partitioner import PlannedPartitioner, StepRoom
from planner.compiled.sizes import SizeChooser
from planner.core.arguments import module_arg, resolve_blocks
from planner.core.units import budget_bytes_from_gb, seconds_value

_ATTR = "_remat_compiled"
BACKENDS = ("inductor", "aot_eager")


@dataclass
class CompiledPlan:
    """What `compile` did to a model: the budget (bytes), the blocks compiled, the measurement that split the budget
    (None before the first training call), what it leaves to the blocks, and the partitioner with its decisions."""

    budget_bytes: int
    block_names: list[str]
    partitioner: PlannedPartitioner
    largest: object = field(default=None, repr=False)
    outside: OutsideMemory | None = None
    room: StepRoom | None = None
    _hook: object = field(default=None, repr=False)
    _measuring: bool = field(default=False, repr=False)

    def summary(self) -> str:
        head = f"planner.compile: budget {self.budget_bytes} B for the step, {len(self.block_names)} blocks"
        if self.outside is None:
            return head + "; not measured yet (the first training call measures)"
        o = self.outside
        made = ", ".join(f"{k} {v} B" for k, v in o.outside_peaks.items())
        at = "the largest inputs given" if self.largest is not None else "the first training call's inputs"
        head += (f"; measured at {at}: outside the blocks {o.resident_bytes} B resident and at most {made} made; "
                 f"measuring step's peak {o.eager_peak_bytes} B; left to {o.block_calls} block calls: {self.room}")
        return head + "\n" + self.partitioner.summary()

    def _pre_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.outside is not None or self._measuring or not (model.training and torch.is_grad_enabled()):
            return
        self._measuring = True
        try:
            blocks = [model.get_submodule(n) for n in self.block_names]
            if self.largest is not None:
                args, kwargs = split_call(self.largest)
            # never above the budget: InfeasibleBudgetError before an operator would take it there
            outside = measure_outside(model, args, kwargs, blocks, limit_bytes=self.budget_bytes)
            self.room = step_room(self.budget_bytes, outside)  # raises where the budget leaves the blocks nothing
            self.outside = outside
            self.partitioner.room = self.room
            self.partitioner.step_budget_bytes = self.budget_bytes
            if self.largest is not None:
                self.partitioner.sizes = SizeChooser(list(outside.block_inputs))
        finally:
            self._measuring = False


def _backend_options(partitioner: PlannedPartitioner, kwargs: dict) -> dict:
    """torch.compile's arguments for a block: the caller's, with the partitioner put where the backend reads it."""
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend", "inductor")
    if backend == "inductor":
        options = dict(kwargs.pop("options", None) or {})
        mode = kwargs.pop("mode", None)
        if mode is not None:  # torch.compile takes a mode or options, not both: a mode is a set of options
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode), **options}
        if "custom_partitioner_fn" in options:
            raise ArgumentError("options['custom_partitioner_fn'] is the planner's own: leave it out")
        options["custom_partitioner_fn"] = partitioner
        # inductor's FX graph cache, and AOTAutograd's cache with it (it is bypassed without the first), would hand
        # back a partition made for another budget without asking the partitioner
        options["fx_graph_cache"] = False
        return {**kwargs, "backend": "inductor", "options": options}
    if backend == "aot_eager":
        if kwargs.get("options") or kwargs.get("mode"):
            raise ArgumentError("mode and options are inductor's: backend='aot_eager' takes neither")
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        kwargs.pop("options", None)
        kwargs.pop("mode", None)
        return {**kwargs, "backend": aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                  partition_fn=partitioner, keep_inference_input_mutations=True)}
    raise ArgumentError(f"backend={backend!r}: the planner's partitioner reaches the backends "
                        f"{', '.join(repr(b) for b in BACKENDS)}")


def split_call(inputs) -> tuple[tuple, dict]:
    """(args, kwargs) of a model's inputs given as `planner.tools.measure.run_step` takes them: a tensor, a tuple of
    positional arguments, a dict of keyword arguments, or (args, kwargs). ArgumentError for anything else."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], Mapping):
            return tuple(inputs[0]), dict(inputs[1])
        return tuple(inputs), {}
    raise ArgumentError(f"largest is a {type(inputs).__name__}: give a tensor, a tuple of positional arguments, a "
                        "dict of keyword arguments, or (args, kwargs)")


def compile(model: torch.nn.Module, budget_gb: float, *, blocks=None, largest=None, time_limit_s: float = 10.0,
            solver: str = "auto", **torch_compile_kwargs) -> torch.nn.Module:
    """Compile `model`'s repeated blocks in place with the project's partitioner, within `budget_gb` gigabytes for
    the whole training step (see the module docstring); returns `model`.

    blocks: module names or classes of the blocks (default: capture.module_tags.repeated_blocks).
    largest: the model's inputs at the largest sizes the training will call it with (as `run_step` takes inputs), for
    a stream of sizes: the step is measured there and symbolic sizes are planned at it (module docstring). None: the
    first training call's inputs, and symbolic sizes at their guard's bound or, with a warning, their hint.
    time_limit_s: per region's solve. solver: the solver of `solvers.base` the partitioner asks ("auto").
    torch_compile_kwargs: torch.compile's (backend "inductor" or "aot_eager", mode, options, dynamic, fullgraph...).
    Raises ArgumentError for a bad argument; InfeasibleBudgetError at the first training call where the step holds
    the whole budget outside its blocks or the measuring step would go above it (stopped before it does), or at a
    region's compilation where its share is too small (wrapped by torch._dynamo in a BackendCompilerFailed, whose
    cause it is).
    """
    module_arg(model)
    if _ATTR in model.__dict__:
        raise ArgumentError("planner.compile was already applied to this model")
    budget_bytes = budget_bytes_from_gb(budget_gb)
    time_limit_s = seconds_value(time_limit_s)
    names = resolve_blocks(model, blocks)
    if largest is not None:
        split_call(largest)  # checked now
    partitioner = PlannedPartitioner(time_limit_s=time_limit_s, solver=solver)
    options = _backend_options(partitioner, torch_compile_kwargs)
    state = CompiledPlan(budget_bytes, names, partitioner, largest)
    for name in names:
        model.get_submodule(name).compile(**options)
    state._hook = model.register_forward_pre_hook(state._pre_forward, with_kwargs=True)
    model.__dict__[_ATTR] = state
    return model


def compiled_plan(model: torch.nn.Module) -> CompiledPlan | None:
    """What `compile` did to `model` (its summary, the partitioner's decisions), or None."""
    return model.__dict__.get(_ATTR)
