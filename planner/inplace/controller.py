"""Planning in place, per block: `enable(model, budget_gb)` and `disable(model)`.

The model stays the user's object and class. Each repeated block (capture.module_tags.repeated_blocks, or
`blocks=`) gets a forward of its own (an instance attribute, as the block's hooks still run around it) that runs one
of the block's options (inplace.block_region: kept, checkpointed whole, selective checkpointing with a per-operator
save policy, or, with `planned=True`, a schedule planned for the block alone; with `compile=True` the first three
run under torch.compile, planner.inplace.compiled_options); everything outside the blocks runs as written. Module
hooks, DDP, FSDP2's per-block hooks and the HF Trainer see the model they know.

The plan is made lazily, per key of a training call (the shapes, dtypes and non-tensor values of the model's
inputs, the autocast state, which parameters require grad):

1. The first training call with a new key measures: every block runs checkpointed whole, and the memory the step
   holds is read at each block's start, after the last block and at the model's return (a storage tracker on CPU,
   the allocator's counters on CUDA). A block called with a key of its own not seen before is profiled there, once
   per key (one block traced at a time; identical blocks share it). The probe stays on through the caller's own
   backward of that call and reads it as it runs: what is held when each block's backward begins, the peak of the
   loss's and head's backward before the blocks', and the peak after the first block's to the end (what the
   caller's loop really keeps, its outputs or not). Without a backward, the model assumes the caller holds the
   outputs through it.
2. From the next call with that key on, one option per block is chosen by dynamic programming over the chain
   (solvers.exact.option_chain) for the least recompute within the budget; the choice is cached. The memory at each
   site is the measured one plus what the options change there (the stashes of earlier blocks, the block's own
   forward and backward) and the parameters' gradients the call creates beyond those of the measuring call.
3. A later call of the structure no larger than a measured one runs that one's choice among the whole-block options;
   one longer, up to 3 times its sequence length, within its bounds (planner.inplace.scaling: on CPU the measuring
   call and the block profile also read every site and figure at longer lengths), runs the choice at those bounds
   without measuring anything, unless no choice meets the budget there (it then measures).

A budget no choice meets raises InfeasibleBudgetError, at the measuring call when its forward alone cannot fit,
else at the next call, naming the least budget a choice meets. In eval mode or without gradients the model runs as
it is.
"""
from __future__ import annotations

import gc
import math
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from capture.call import FlatCall
from capture.kv_cache import cache_tensors, is_cache
from capture.measure_memory import local_tensor, module_tensors, storage_bytes
from capture.state import autocast_as, autocast_state, cuda_devices_in_use
from graphs.errors import ArgumentError, InfeasibleBudgetError
from planner.core.arguments import choice_arg, flag_arg, module_arg, progress_arg, resolve_blocks
from planner.core.progress import Reporter
from planner.core.units import GB, budget_bytes_from_gb, seconds_value
from planner.inplace import scaling
from planner.inplace.block_region import (
    BlockCall,
    BlockProfile,
    OptionKind,
    original_forward,
    parameter_flags,
    profile_block,
    structure_key,
    whole_option,
)
from planner.inplace.compiled_options import COMPILED_PREFIX, CompiledOptions
from planner.inplace.scaling import ScalingTracker
from solvers.exact.option_chain import ChainChoice, ChainSites, choose_options

_ATTR = "_remat_inplace"
# a refusal at a measuring call's return names the least budget a choice meets, its backward estimated, this much
# above it (the backward, read at the next call, can hold a little more than the estimate)
FORWARD_REFUSAL_MARGIN = 0.001
# how the planned options (`planned=True`) price recomputation: FLOPs, or each op's time measured here
ENABLE_COST_MODELS = ("flops", "time")


# ---------------------------------------------------------------------------------------------
# reading the memory a step holds
# ---------------------------------------------------------------------------------------------
class _StepTracker(ScalingTracker):
    """A storage tracker (with its bounds at longer lengths where it has a scale) that stops counting once frozen. On
    CPU it stays on the thread's mode stack from a measuring call's forward until the model's next call (or
    `disable`): the autograd engine runs the caller's backward under the modes of the caller's thread as they were
    when it began, and restores them after, so it cannot be taken off from within the backward. torch.compile works
    around it (`ignore_compile_internals`)."""

    frozen = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # dynamo compiles as if the mode were off, and the compiled code runs under it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.frozen:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _insert_below(mode) -> bool:
    """Put `mode` at the bottom of this thread's dispatch mode stack, under the caller's modes, so that theirs still
    leave in the order they entered (a mode's exit pops the top one). False, and nothing done, where an infrastructure
    mode (fake tensors, tracing) is active."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    stack = _modes()
    if any(m.is_infra_mode() for m in stack):
        return False
    above = [_pop_mode() for _ in stack]  # top first
    _push_mode(mode)
    for m in reversed(above):
        _push_mode(m)
    return True


def _take_out(mode) -> None:
    """Remove `mode` from this thread's dispatch mode stack wherever it is, the others kept in their order."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    stack = _modes()
    if not any(m is mode for m in stack) or any(m.is_infra_mode() for m in stack):
        return
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


class _Probe:
    """Live bytes created since `start()`, and their peak since the last `reset_peak()`. On CPU a storage tracker
    counts them: a measuring call leaves it on through the caller's backward (the autograd engine runs the backward
    under the modes of the thread that calls it) and freezes it when the backward ends. It sits at the bottom of the
    mode stack (pushed and removed without a mode's enter and exit), so modes the caller enters and leaves meanwhile
    nest as they would without it."""

    def __init__(self, device: torch.device, scale: int | None = None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.scale = None if self.cuda else scale  # the allocator's counters have no bounds at other lengths
        self.tracker: _StepTracker | None = None
        self.base = 0
        self.open = False  # counting (from start() to freeze() or stop())

    def start(self) -> None:
        self.open = True
        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker = _StepTracker(self.scale)
            if not _insert_below(self.tracker):  # under fake tensors or a tracer: entered as modes are
                self.tracker.__enter__()

    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base if self.cuda else self.tracker.live_bytes

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base if self.cuda else self.tracker.peak_bytes

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.reset_peak()

    @property
    def scaled(self) -> bool:
        """Whether the readings have bounds at longer lengths (`live_scaled`, `peak_scaled`, `surviving_scaled`)."""
        return self.tracker is not None and self.tracker.scale is not None

    def live_scaled(self) -> tuple[int, ...]:
        return self.tracker.live_scaled()

    def peak_scaled(self) -> tuple[int, ...]:
        return self.tracker.peak_scaled

    def surviving_scaled(self, snapshot) -> tuple[int, ...]:
        return self.tracker.bytes_still_alive_scaled(snapshot)

    def snapshot(self):
        """What is alive now (CPU; None on CUDA, where the allocator cannot tell)."""
        return None if self.cuda else self.tracker.live_storages()

    def surviving(self, snapshot) -> int | None:
        """Bytes of a snapshot still alive (None on CUDA)."""
        return None if snapshot is None else self.tracker.bytes_still_alive(snapshot)

    def freeze(self) -> None:
        self.open = False
        if self.tracker is not None:
            self.tracker.frozen = True

    def stop(self) -> None:
        self.open = False
        if self.tracker is not None:
            self.tracker.frozen = True
            stack = _modes()
            if stack and stack[-1] is self.tracker and stack[-1].__dict__.get("old_dispatch_mode_flags"):
                self.tracker.__exit__(None, None, None)  # entered as modes are, and still on top
            else:
                _take_out(self.tracker)
            self.tracker = None


def _isolated(fn: Callable):
    """`fn()` run on a thread of its own, under the caller's autocast state and CUDA device: no dispatch mode of
    the caller's (the probe's tracker, the user's) sees the work, and nothing it keeps (a traceback stored by a
    solver, say) can hold the frames of the model's forward, and with them its activations, alive."""
    import threading

    autocast = autocast_state()
    devices = cuda_devices_in_use()
    box: dict = {}

    def target():
        try:
            for device in devices:
                torch.cuda.set_device(device)
            with autocast_as(autocast):
                box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    worker = threading.Thread(target=target, name="planner-block-profile")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---------------------------------------------------------------------------------------------
# the state of one model
# ---------------------------------------------------------------------------------------------
@dataclass
class _Measured:
    """What the measuring call of a key read (bytes above the step's start)."""
    forward_start: list[int]
    after_peak: int  # from the last block's return to the model's
    model_end: int  # live at the model's return
    output_bytes: int  # the model's outputs (the caller holds them through the backward)
    output_grad_bytes: int  # the model's differentiable floating-point outputs
    first_args_bytes: int = 0  # the first block's tensor arguments made during the step (a mask, the hidden state)
    used_after: list = field(default_factory=list)  # parameters the part after the blocks uses (weak references)
    # of what was live at each block's start, the bytes still live at the model's return (what the backward finds;
    # the model's locals, such as the embeddings' outputs, are gone by then); the forward figure where unknown
    surviving: list[int] = field(default_factory=list)
    # block i -> bytes live when its backward began (the incoming gradient and the parameters' new gradients not
    # counted): what the caller's loop really holds through the blocks' backward (the outputs or not)
    backward_start: dict = field(default_factory=dict)
    # the gradients the call made included (pending or accumulated): the peak from the model's return to the last
    # block's backward (the loss's and the head's backward), and after the first block's backward to the end
    head_backward: int | None = None
    tail_backward: int | None = None
    grads_then: tuple | None = None  # InPlaceController._new_grads of the measuring call
    tail_started: bool = False  # the first block's backward has ended
    # the model's outputs' storages (weakly), and the bytes of those the caller had let go when the backward began: a
    # later call's caller may keep them through its backward, which the sites then count (`_sites`)
    output_storages: list = field(default_factory=list)
    dropped_output_bytes: int = 0
    held_output_bytes: int = 0  # of the outputs (and their cache), what the caller still held then
    first_input_grad: bool = True  # the first block has an input that requires grad (else nothing follows its backward)
    # the same readings at each ratio of scaling.RATIOS: bounds at calls of this structure whose dimensions equal to
    # `scale` are up to that ratio longer (`at`); None where the call was not read so (on CUDA, a measurement begun at
    # the first block)
    cols: "_Columns | None" = None
    scale: int | None = None

    def at(self, j: int) -> "_Measured":
        """This measurement's bounds at ratio j (scaling.RATIOS[j])."""
        c = self.cols

        def pick(v):
            return None if v is None else v[j]
        return replace(self, forward_start=[v[j] for v in c.forward_start], after_peak=c.after_peak[j],
                       model_end=c.model_end[j], output_bytes=c.output_bytes[j],
                       output_grad_bytes=c.output_grad_bytes[j], surviving=[v[j] for v in c.surviving],
                       backward_start={i: v[j] for i, v in c.backward_start.items()},
                       head_backward=pick(c.head_backward), tail_backward=pick(c.tail_backward),
                       dropped_output_bytes=c.dropped_output_bytes[j], held_output_bytes=c.held_output_bytes[j],
                       output_storages=[], cols=None, scale=None)


@dataclass
class _Columns:
    """_Measured's readings at each ratio of scaling.RATIOS (tuples of bytes, one per ratio)."""
    forward_start: list = field(default_factory=list)
    after_peak: tuple = ()
    model_end: tuple = ()
    output_bytes: tuple = ()
    output_grad_bytes: tuple = ()
    surviving: list = field(default_factory=list)
    backward_start: dict = field(default_factory=dict)
    head_backward: tuple | None = None
    tail_backward: tuple | None = None
    output_storages: list = field(default_factory=list)
    dropped_output_bytes: tuple = scaling.zero()
    held_output_bytes: tuple = scaling.zero()


class StepMode(str, Enum):
    """How a training call runs its blocks."""

    def __str__(self) -> str:  # its value in messages and tables, as a plain string would print
        return self.value

    MEASURE = "measure"  # the first call of a key: every block checkpointed, the step's memory read
    PLANNED = "planned"  # the chain's choice per block
    FALLBACK = "fallback"  # a block's key differs from the plan's: the rest of the call checkpointed


@dataclass
class _Step:
    root_key: tuple
    resident_bytes: int
    mode: "StepMode"
    keys: list = field(default_factory=list)
    choice: ChainChoice | None = None
    expected: tuple | None = None
    probe: _Probe | None = None
    measured: _Measured | None = None
    block_outputs: list = field(default_factory=list)  # autograd nodes of the blocks' outputs (measuring calls)
    snapshots: list = field(default_factory=list)  # what was live at each block's start (measuring calls, CPU)
    inputs: list = field(default_factory=list)  # the model's tensor inputs
    offset: int = 0  # a measurement begun at the first block: the bytes the step held before it (estimated)
    offset_surviving: int = 0
    grads_before: set = field(default_factory=set)  # ids of the parameters holding a gradient at the step's start
    # a call no larger than a measured one of its structure: that one's root key, whose figures bound this call's;
    # or no larger than a measured one's dimensions equal to its `scale` times scaling.RATIOS[column]: that one's root
    # key and the column, whose bounds bound this call's
    cover: tuple | None = None
    column: int | None = None
    scale: int | None = None  # the dimension of this call's inputs its readings are bounded at longer lengths of
    chosen: list = field(default_factory=list)  # the options run, by block (planned calls)
    last_output_node: object = None  # the last block's output's autograd node (planned calls)
    # the last block call's BlockCall and what BlockCall.again reads of it: (call, (its number of positional
    # arguments, its keyword arguments, their tensors)); the next block's call of the same form is read from it
    last_call: tuple | None = None


@dataclass
class StepRecord:
    """What one training call ran: its mode, the options by block, the chain's predicted peak (bytes, the step's
    resident bytes included; None for a measuring call)."""
    mode: StepMode
    options: list[str]
    predicted_peak_bytes: int | None
    budget_bytes: int


class InPlaceController:
    """The in-place planner of one model (see the module docstring); `planner.enable` returns it."""

    def __init__(self, model: torch.nn.Module, budget_bytes: int, block_names: list[str], *, time_limit_s: float,
                 compile: bool, cost_model: str, progress: bool | Callable[[str], None], planned: bool = False,
                 backend: str | Callable = "inductor"):
        self.model = model
        self.budget_bytes = int(budget_bytes)
        self.block_names = list(block_names)
        self.blocks = [model.get_submodule(n) for n in block_names]
        self.time_limit_s = float(time_limit_s)
        self.compile = compile
        self.backend = backend
        self.planned = planned
        self.cost_model = cost_model
        self.progress = progress
        self._reset_caches()
        self._handles: list = []

    def _reset_caches(self) -> None:
        # compile=True: the compiled options' functions (planner.inplace.compiled_options), by structure and name
        self._compiled = CompiledOptions(self.backend) if self.compile else None
        self.profiles: dict[tuple, BlockProfile] = {}
        self.traced_structures: set[tuple] = set()  # block structures (block_region.structure_key) traced once
        self.policies: dict[tuple, list] = {}  # block structure -> its selective options' policies (first shape's)
        self.uncovered: set[tuple] = set()  # root keys whose blocks a covering measurement did not match
        # measured root key -> the elements of the least call its bounds were seen not to match (blocks called
        # otherwise): its bounds serve smaller calls alone
        self.bounds_below: dict[tuple, int] = {}
        self.measured: dict[tuple, _Measured] = {}
        self.seen_keys: dict[tuple, list[tuple]] = {}  # root key -> the blocks' key tuples seen, latest last
        self.choices: dict[tuple, ChainChoice] = {}
        self.records: list[StepRecord] = []
        self._step: _Step | None = None
        self._open_probe: _Probe | None = None
        # a planned call's caller was seen holding more of the model's outputs through its backward than the measuring
        # call's did: the chain counts them from then on (`_watch_outputs`)
        self.caller_keeps_outputs = False
        self.ddp_bucket_bytes = 0  # DDP's gradient buckets, counted in the step's resident bytes (`_resident_bytes`)
        self._release_hook = None  # the optimizer step pre-hook taking _open_probe off (_release_at_optimizer_step)
        self.plan_seconds = 0.0
        # each block's parameter_flags, read at its first call since the model's parameters (which objects, their
        # flags and devices) last changed: `_flags_token`
        self._flags: dict[int, tuple] = {}
        self._flags_token: tuple | None = None

    # ---- copying and pickling: the caches are rebuilt lazily -----------------------------------------------
    def __deepcopy__(self, memo):
        import copy

        new = InPlaceController.__new__(InPlaceController)
        memo[id(self)] = new
        new.model = copy.deepcopy(self.model, memo)
        new.budget_bytes = self.budget_bytes
        new.block_names = list(self.block_names)
        new.blocks = [copy.deepcopy(b, memo) for b in self.blocks]
        new.time_limit_s, new.compile, new.cost_model = self.time_limit_s, self.compile, self.cost_model
        new.backend = self.backend
        new.planned = self.planned
        new.progress = self.progress
        new._reset_caches()
        new._handles = copy.deepcopy(self._handles, memo)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("profiles", "traced_structures", "policies", "uncovered", "bounds_below", "measured", "seen_keys",
                  "choices", "records", "_step", "_open_probe", "_release_hook", "_say", "_compiled", "_flags",
                  "_flags_token"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_caches()

    # ---- reporting ----------------------------------------------------------------------------------------
    @cached_property
    def _say(self) -> Reporter:
        """Progress lines, timed from the first: to the logger "planner", and to stderr (progress=True) or to the
        callable `progress` (planner.core.progress.Reporter, called without its heartbeat)."""
        return Reporter(self.progress)

    def summary(self) -> str:
        last = self.records[-1] if self.records else None
        lines = [f"in-place plan: {len(self.blocks)} blocks ({type(self.blocks[0]).__name__}), budget "
                 f"{self.budget_bytes / GB:.6f} GB, {self.profiled_shapes} block shape(s) profiled in "
                 f"{self.plan_seconds:.2f} s ({len(self.profiles) - self.profiled_shapes} more within their bounds), "
                 f"{len(self.choices)} choice(s) cached"]
        if self.ddp_bucket_bytes:
            lines.append(f"  DDP's gradient buckets counted in the budget: {self.ddp_bucket_bytes / GB:.6f} GB")
        for prof in self.profiles.values():
            names = ", ".join(o.figures.name for o in prof.options)
            traced = f"{prof.nodes} nodes traced, " if prof.nodes else ""
            lines.append(f"  block shape: {traced}options {names}" + (f"; {prof.note}" if prof.note else ""))
        if last is not None:
            peak = "" if last.predicted_peak_bytes is None else \
                f", predicted peak {last.predicted_peak_bytes / GB:.6f} GB"
            lines.append(f"  last step ({StepMode(last.mode).value}){peak}: " + grouped_names(last.options))
        return "\n".join(lines)

    @property
    def profiled_shapes(self) -> int:
        """Block shapes profiled (the others run within a profiled shape's bounds)."""
        return sum(1 for p in self.profiles.values() if p.bounded_at is None)

    def explain(self) -> str:
        lines = [self.summary()]
        for prof in self.profiles.values():
            for o in prof.options:
                f = o.figures
                lines.append(f"    {f.name}: recompute cost {f.cost:.6g}, stash {f.stash_bytes} B, forward "
                             f"{f.forward_bytes} B, backward {f.backward_bytes} B")
            for name, p in prof.plans.items():
                lines.append(f"    {name}: {p.summary()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The plan as JSON-able data: per block shape its options with their figures, and the chains chosen."""
        shapes = []
        index = {}
        for k, (key, prof) in enumerate(self.profiles.items()):
            index[key] = k
            shapes.append({"nodes": prof.nodes, "note": prof.note, "plan_seconds": prof.plan_seconds,
                           "options": [vars(o.figures) for o in prof.options],
                           "schedules": {name: p.to_dict() for name, p in prof.plans.items()}})
        chains = [{"block_shapes": [index.get(k) for k in ck[1]], "resident_bytes": ck[2],
                   "options": list(c.choice), "cost": c.cost, "peak_bytes_above_resident": c.peak_bytes}
                  for ck, c in self.choices.items()]
        return {"kind": "in-place", "budget_bytes": self.budget_bytes, "blocks": self.block_names,
                "block_shapes": shapes, "chains": chains}

    # ---- hooks --------------------------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            self.model.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]
        for name, blk in zip(self.block_names, self.blocks):
            if "forward" in blk.__dict__:
                raise ValueError(f"block '{name}' already has a forward of its own (another wrapper?)")
            blk.forward = _BlockForward(self, blk)

    def _uninstall(self) -> None:
        self._stop_probes()
        for h in self._handles:
            h.remove()
        self._handles = []
        for blk in self.blocks:
            if isinstance(blk.__dict__.get("forward"), _BlockForward):
                del blk.__dict__["forward"]

    def _root_key(self, args, kwargs, params: list) -> tuple:
        """The key of a training call: its structure, its non-tensor values (an unhashable one by its type alone),
        its tensors' shapes, dtypes, devices and which require grad, the autocast state, the parameters' flags and
        devices."""
        flat, _ = FlatCall.of(args, kwargs, strides=False, by_id=False)
        return (flat.key, autocast_state(), tuple((p.requires_grad, p.dtype, p.device) for p in params))

    def _resident_bytes(self, args, kwargs, params: list, buffers: list) -> int:
        """What the step holds before it starts: the parameters, buffers, gradients and inputs, and where DDP runs the
        model (`_ddp_calling`), its gradient buckets (`ddp_bucket_bytes`), which exist from its construction (and are
        made again, the old ones freed, at its second step); where the gradients are views of the buckets
        (`gradient_as_bucket_view`) they are counted once."""
        ddp = _ddp_calling(self.model)
        self.ddp_bucket_bytes = 0 if ddp is None else _bucket_bytes(ddp)
        in_buckets = ddp is not None and ddp.gradient_as_bucket_view
        grads = [] if in_buckets else [p.grad for p in params if p.grad is not None]
        return storage_bytes([*params, *buffers, *grads, args, kwargs]) + self.ddp_bucket_bytes

    def _stop_probes(self) -> None:
        if self._step is not None and self._step.probe is not None:
            self._step.probe.stop()
        self._stop_open_probe()
        self._step = None

    def _stop_open_probe(self) -> None:
        if self._open_probe is not None:  # a measuring call's, left on through its backward
            self._open_probe.stop()
            self._open_probe = None
        if self._release_hook is not None:
            self._release_hook.remove()
            self._release_hook = None

    def _release_at_optimizer_step(self) -> None:
        """Take the open probe off the thread's mode stack at the next optimizer step (any torch optimizer's: a global
        step pre-hook, removed when it fires), which runs after the backward, in the caller's frame, where taking it
        off holds; else it goes at the model's next call. Meanwhile every op of the thread runs under it (slower, and
        a compiled backward of another model refuses a Python mode)."""
        if self._release_hook is not None:
            return
        me = weakref.ref(self)

        def release(_optimizer, _args, _kwargs):
            state = me()
            if state is not None:
                state._stop_open_probe()
            return None
        self._release_hook = register_optimizer_step_pre_hook(release)

    @torch.compiler.disable
    def _pre_forward(self, module, args, kwargs):
        self._stop_probes()
        if not (torch.is_grad_enabled() and module.training):
            return None
        params, buffers = module_tensors(self.model)  # one walk of the model a call (FSDP2 swaps them between calls)
        root_key = self._root_key(args, kwargs, params)
        token = (tuple(map(id, params)), root_key[2])
        if token != self._flags_token:
            self._flags.clear()
            self._flags_token = token
        step = _Step(root_key, self._resident_bytes(args, kwargs, params, buffers), StepMode.PLANNED)
        step.inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        step.scale = _scale_of(root_key)
        if not any(k[0] == root_key for k in self.measured):
            for cover, column in self._covering(root_key) if root_key not in self.uncovered else ():
                step.cover, step.column = cover, column
                if column is None or self._bounded_choice(step):
                    break
                step.cover = step.column = None  # no choice fits these bounds: the next, else this call measures
            if step.cover is None:
                self._start_measuring(step)
        self._step = step
        return None

    def _covering(self, root_key: tuple) -> list[tuple[tuple, int | None]]:
        """The measured calls whose figures bound this call's, the tightest first: (a measured root key, None) where
        one of this call's structure has every tensor dimension at least this call's, and (a measured root key, a
        column j) where the call is no larger than that one with its dimensions equal to its scale made
        scaling.RATIOS[j] times longer; the least bounding shape (by elements) first, at equal elements the least
        ratio (an exact cover's before any); a call tries them in turn until one's bounds admit a choice. A
        transformer's memory grows with its sequence length and batch, so the whole-block options chosen within the
        budget there hold no more here: a shorter batch of a stream is run without measuring or profiling anything,
        and a longer one within the bounds of a measured one too."""
        # by the bounding shape's elements, then by the ratio (an exact cover's 0 first)
        found = [(_elements(rk), 0.0, rk, None) for rk, _ in self.measured if _covers(rk, root_key)]
        for (rk, keys), m in self.measured.items():
            if m.cols is None or m.tail_backward is None or not all(
                    self.profiles[k].scaled is not None for k in keys if k in self.profiles) \
                    or _elements(root_key) >= self.bounds_below.get(rk, math.inf):
                continue
            for j, r in enumerate(scaling.RATIOS):
                big = _scaled_key(rk, m.scale, r)
                if _covers(big, root_key):
                    found.append((_elements(big), r, rk, j))
                    break
        found.sort(key=lambda f: f[:2])
        return [(rk, j) for _, _, rk, j in found]

    def _cover_keys(self, cover: tuple) -> tuple | None:
        """The blocks' keys of the latest measured call of root key `cover`."""
        return next((ks for ks in reversed(self.seen_keys.get(cover, [])) if ks and (cover, ks) in self.measured),
                    None)

    def _bounded_choice(self, step: _Step) -> bool:
        """For a call within a measured one's bounds (step.column): the choice among whole-block options at those
        bounds, made now; False where none meets the budget (the call then measures)."""
        expected = self._cover_keys(step.cover)
        if expected is None:
            return False
        try:
            step.choice = self._choose(step.cover, expected, step.resident_bytes, whole=True, column=step.column)
        except InfeasibleBudgetError:
            return False
        step.expected = expected
        step.chosen = [self._options(k, True)[c] for k, c in zip(expected, step.choice.choice)]
        return True

    def _start_measuring(self, step: _Step) -> None:
        step.mode = StepMode.MEASURE
        device = step.inputs[0].device if step.inputs else next(self.model.parameters()).device
        # bounds at longer lengths only where the whole call is read (not from its first block on)
        step.probe = _Probe(device, step.scale if step.offset == 0 and step.offset_surviving == 0 else None)
        step.measured = _Measured([], 0, 0, 0, 0)
        step.grads_before = {id(p) for p in self.model.parameters() if p.grad is not None}
        step.probe.start()
        if step.probe.scaled:
            step.measured.cols, step.measured.scale = _Columns(), step.scale

    def _made_in_step_bytes(self, step: _Step, tensors) -> int:
        """Bytes of `tensors` not sharing storage with the parameters, buffers or the model's inputs."""
        held = {StorageWeakRef(t.untyped_storage()) for t in (*self.model.parameters(), *self.model.buffers(),
                                                               *step.inputs)}
        return storage_bytes([t for t in tensors if StorageWeakRef(t.untyped_storage()) not in held])

    @torch.compiler.disable
    def _post_forward(self, module, args, kwargs, out):
        if out is None:  # the forward raised (this hook is always called): nothing measured, nothing left on
            self._stop_probes()
            return None
        try:
            return self._after_forward(out)
        except BaseException:
            self._stop_probes()  # nothing of the planner's stays on the thread's mode stack after an error
            raise

    def _after_forward(self, out):
        step = self._step
        if step is None:
            return None
        if step.mode is StepMode.MEASURE and step.probe is not None:
            m = step.measured
            m.after_peak = step.offset + step.probe.peak()
            m.model_end = step.offset + step.probe.live()
            m.surviving = [f if snap is None else step.offset_surviving + step.probe.surviving(snap)
                           for f, snap in zip(m.forward_start, step.snapshots)]
            c = m.cols
            if c is not None:
                c.after_peak, c.model_end = step.probe.peak_scaled(), step.probe.live_scaled()
                c.surviving = [step.probe.surviving_scaled(snap) for snap in step.snapshots]
            step.snapshots = []
            # the probe stays on through the caller's backward (see _watch_backward), until its end or the next call
            step.probe.reset_peak()
            self._open_probe = step.probe
            self._release_at_optimizer_step()
            step.probe = None
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            m.output_bytes = storage_bytes(outs)
            # what the caller may hold through the backward: the outputs, and the key/value cache among them
            held = outs + [t for c in tree_leaves(out) if is_cache(c) for t in cache_tensors(c)]
            m.output_storages = [(StorageWeakRef(t.untyped_storage()), storage_bytes([t])) for t in held]
            m.output_grad_bytes = storage_bytes([t for t in outs if t.requires_grad and t.is_floating_point()])
            if c is not None:
                c.output_bytes = scaling.storage_bytes_scaled(outs, m.scale)
                c.output_storages = [(StorageWeakRef(t.untyped_storage()), scaling.storage_bytes_scaled([t], m.scale))
                                     for t in held]
                c.output_grad_bytes = scaling.storage_bytes_scaled(
                    [t for t in outs if t.requires_grad and t.is_floating_point()], m.scale)
            m.used_after = [weakref.ref(p) for p in _parameters_reached(outs, step.block_outputs)]
            step.block_outputs = []
        if step.mode is StepMode.PLANNED and step.last_output_node is not None and not self.caller_keeps_outputs:
            self._watch_outputs(step, out)
        keys = tuple(step.keys)
        if step.mode is StepMode.MEASURE and len(step.measured.forward_start) == len(keys):
            self.measured[(step.root_key, keys)] = step.measured
        if keys:
            seen = self.seen_keys.setdefault(step.root_key, [])
            if keys in seen:
                seen.remove(keys)
            seen.append(keys)
        step.last_call = None
        self.records.append(StepRecord(step.mode, _option_names(self, step), _predicted(step), self.budget_bytes))
        if step.mode is StepMode.MEASURE and (step.root_key, keys) in self.measured and keys:
            self._check_forward_fits(step.root_key, keys, step.resident_bytes)
        self._step = None
        return None

    def _watch_outputs(self, step: _Step, out) -> None:
        """At the last block's backward of a planned call: where the caller holds more of the model's outputs (and
        their cache) than the measuring call's caller did (a loop keeping `out` after one that let it go), this step
        can exceed the chain's prediction by the difference; warn, and count them in every later choice."""
        measured = next((m for (rk, _), m in self.measured.items() if rk == (step.cover or step.root_key)), None)
        if measured is not None and step.column is not None:
            measured = measured.at(step.column)
        if measured is None or not measured.dropped_output_bytes:
            return
        leaves = tree_leaves(out)
        held = [t for t in leaves if isinstance(t, torch.Tensor)]
        held += [t for c in leaves if is_cache(c) for t in cache_tensors(c)]
        refs = {StorageWeakRef(t.untyped_storage()): storage_bytes([t]) for t in held}
        me = weakref.ref(self)

        def check(_grad_outputs):
            state = me()
            alive = sum(b for ref, b in refs.items() if not ref.expired())
            if state is not None and not state.caller_keeps_outputs and alive > measured.held_output_bytes:
                state.caller_keeps_outputs = True
                warnings.warn(
                    f"planner.enable: this call's caller holds {alive - measured.held_output_bytes} more bytes of the "
                    "model's outputs through the backward than the first call of its shape did; this step may exceed "
                    "the budget by up to that much, and every later choice counts them", RuntimeWarning, stacklevel=2)
            return None
        step.last_output_node.register_prehook(check)

    def _watch_backward(self, step: _Step, i: int, node, block_input: torch.Tensor | None) -> None:
        """Read the measuring call's backward as the caller runs it (into step.measured), bytes above the step's
        start: when block i's backward begins, what is held beyond its incoming gradient; at the last block's, the
        peak since the model returned (the loss's and the head's backward); after the first block's backward, the
        peak to the end."""
        measured, probe, offset = step.measured, step.probe, step.offset_surviving
        grads_before = step.grads_before
        cols = measured.cols  # (their offset is 0: `_start_measuring`)

        def at_end() -> None:
            if probe.open and measured.tail_started:
                measured.tail_backward = offset + probe.peak()
                if cols is not None:
                    cols.tail_backward = probe.peak_scaled()
            elif probe.open and not measured.first_input_grad:
                # no gradient flows out of the first block: the backward ends with its backward, holding what lives now
                measured.tail_backward = offset + probe.live()
                if cols is not None:
                    cols.tail_backward = probe.live_scaled()
            probe.freeze()

        def at_backward(grad_outputs):
            if not probe.open or i in measured.backward_start:
                return None
            incoming = storage_bytes([g for g in grad_outputs if g is not None])
            if i == len(measured.forward_start) - 1 and measured.head_backward is None:
                measured.head_backward = offset + probe.peak()
                everything = dict(measured.output_storages)
                measured.dropped_output_bytes = sum(b for ref, b in everything.items() if ref.expired())
                measured.held_output_bytes = sum(b for ref, b in everything.items() if not ref.expired())
                measured.output_storages = []
                if cols is not None:
                    cols.head_backward = probe.peak_scaled()
                    for ref, b in dict(cols.output_storages).items():
                        if ref.expired():
                            cols.dropped_output_bytes = scaling.add(cols.dropped_output_bytes, b)
                        else:
                            cols.held_output_bytes = scaling.add(cols.held_output_bytes, b)
                    cols.output_storages = []
                measured.grads_then = self._new_grads(measured, lambda p: id(p) in grads_before)
                torch.autograd.Variable._execution_engine.queue_callback(at_end)
            measured.backward_start[i] = offset + max(0, probe.live() - incoming)
            if cols is not None:
                cols.backward_start[i] = scaling.sub_floor(probe.live_scaled(), scaling.storage_bytes_scaled(
                    [g for g in grad_outputs if g is not None], measured.scale))
            return None

        def first_block_done(grad):
            if probe.open:
                measured.tail_started = True
                probe.reset_peak()
            return None

        node.register_prehook(at_backward)
        if i == 0 and block_input is not None:
            block_input.register_hook(first_block_done)
        elif i == 0:
            measured.first_input_grad = False

    # ---- choosing -------------------------------------------------------------------------------------------
    def _new_grads(self, measured: _Measured, has_grad: Callable[[torch.nn.Parameter], bool]) -> tuple:
        """(bytes of new gradients by block, of the parameters the part after the blocks uses, of the rest): what
        the backward creates, `has_grad(p)` telling which parameters hold one already (local shards under FSDP2)."""
        seen: set = set()

        def new_grad_bytes(params) -> int:
            total = 0
            for p in params:
                if p.requires_grad and not has_grad(p) and id(p) not in seen:
                    seen.add(id(p))
                    local = local_tensor(p)  # FSDP2: the gradient kept is the shard's
                    total += local.numel() * local.element_size()
            return total

        per_block = [new_grad_bytes(b.parameters()) for b in self.blocks]
        head = new_grad_bytes([p for p in (r() for r in measured.used_after) if p is not None])
        return per_block, head, new_grad_bytes(self.model.parameters())

    def _sites(self, measured: _Measured) -> ChainSites:
        """The chain's memory sites from a measuring call and the gradients the backward will create now."""
        per_block, head, before = self._new_grads(measured, lambda p: p.grad is not None)
        # the gradients of the parameters the part after the blocks uses exist before the blocks' backward; those of
        # the part before them (embeddings) come after it
        n = len(measured.forward_start)

        def later_of(blocks: list[int]) -> list[int]:
            return [sum(blocks[i + 1:]) for i in range(n)] if n == len(blocks) else [sum(blocks)] * n

        later = later_of(per_block)
        # the block's incoming gradient is part of its own backward_bytes (block_region.measure_option)
        read = len(measured.backward_start) == n and measured.head_backward is not None \
            and measured.tail_backward is not None and measured.grads_then is not None
        if read:
            # the measuring call's backward as the caller ran it: its readings hold the gradients it made (pending
            # or accumulated); a call making more new ones than it did adds the difference
            # (fewer where gradients the measuring call made exist now, which the call's resident bytes count; one
            # computed gradient at a time is held while it is added to the existing one)
            per_then, head_then, before_then = measured.grads_then
            later_then = later_of(per_then)
            existing = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            adding = max((g.numel() * g.element_size() for g in existing), default=0)

            def more(now: int, then: int) -> int:
                return min(max(0, now - then), now - then + adding)

            # outputs the measuring call's caller let go before its backward, held by a later caller (seen so once:
            # `_watch_outputs`) through its own
            kept = measured.dropped_output_bytes if self.caller_keeps_outputs else 0
            backward_start = tuple(measured.backward_start[i] + kept + more(later[i] + head, later_then[i] + head_then)
                                   for i in range(n))
            # the tail (after every block's backward) holds no block's stash: a site of its own
            end = measured.tail_backward + kept + more(sum(per_block) + head + before,
                                                       sum(per_then) + head_then + before_then)
            return ChainSites(tuple(measured.forward_start), backward_start,
                              max(measured.after_peak, measured.head_backward + kept + more(head, head_then)), end)
        else:  # no backward seen: what was live at the block's start and survived, and all the outputs
            alive = measured.surviving if len(measured.surviving) == n else measured.forward_start
            held = [alive[i] + measured.output_bytes for i in range(n)]
            backward_start = tuple(held[i] + later[i] + head for i in range(n))
            backward = max(measured.model_end + 2 * measured.output_grad_bytes + head,
                           held[0] + sum(per_block) + head + before if n else 0)
        return ChainSites(tuple(measured.forward_start), backward_start, max(measured.after_peak, backward))

    def _check_forward_fits(self, root_key: tuple, keys: tuple, resident_bytes: int) -> None:
        """At a measuring call's return: raise InfeasibleBudgetError now when the forward alone exceeds the budget
        under every choice (the backward, read as it runs, decides the rest at the next call)."""
        measured = self.measured[(root_key, keys)]
        options = [self.profiles[k].figures for k in keys]
        forward_least = resident_bytes + max(
            [measured.after_peak] + [f + min(o.forward_bytes for o in opts)
                                     for f, opts in zip(measured.forward_start, options)])
        if forward_least > self.budget_bytes:
            try:
                self._choose(root_key, keys, resident_bytes)  # raises, naming the least budget a choice meets
            except InfeasibleBudgetError as e:
                # the backward is not read yet (its sites are estimated): the budget named has a margin of
                # FORWARD_REFUSAL_MARGIN, so that the next call, the backward read, is met at it
                least = math.ceil((e.min_budget_bytes or 0) * (1 + FORWARD_REFUSAL_MARGIN))
                raise InfeasibleBudgetError(
                    self.budget_bytes, least, "in-place",
                    f"the forward of this call alone exceeds it under every choice of one option per block; the "
                    f"least budget a choice meets at this call, its backward estimated, is {least / GB:.6f} GB") \
                    from None

    def _choose(self, root_key: tuple, keys: tuple, resident_bytes: int, whole: bool = False,
                column: int | None = None) -> ChainChoice:
        """The chain's choice for a call of `keys` measured under `root_key`; with `whole`, among the whole-block
        options alone (`_options`); with `column`, at the measurement's and the profiles' bounds at that ratio
        (scaling.RATIOS)."""
        measured = self.measured[(root_key, keys)]
        ck = (root_key, keys, resident_bytes, len(measured.backward_start), measured.tail_backward is not None, whole,
              self.caller_keeps_outputs, column)
        hit = self.choices.get(ck)
        if hit is not None:
            return hit
        if column is None:
            options = [[o.figures for o in self._options(k, whole)] for k in keys]
        else:
            options = [[self.profiles[k].scaled[column][n] for n, o in enumerate(self.profiles[k].options)
                        if not whole or o.kind is not OptionKind.PLANNED] for k in keys]
            measured = measured.at(column)
        sites = self._sites(measured)
        try:
            choice = choose_options(options, sites, self.budget_bytes - resident_bytes)
        except InfeasibleBudgetError as e:
            least = resident_bytes + (e.min_budget_bytes or 0)
            raise InfeasibleBudgetError(
                self.budget_bytes, least, "in-place",
                f"one option per block ({', '.join(sorted({o.name for opts in options for o in opts}))}); the "
                f"least budget a choice meets at this call is {least / GB:.6f} GB") from None
        self.choices[ck] = choice
        names = [options[i][k].name for i, k in enumerate(choice.choice)]
        self._say(f"chose for {len(keys)} blocks: {grouped_names(names)}; predicted peak "
                  f"{(resident_bytes + choice.peak_bytes) / GB:.6f} GB of {self.budget_bytes / GB:.6f} GB")
        return choice

    def _bounded_profile(self, key: tuple) -> BlockProfile | None:
        """A profile for block key `key` from a profiled shape of its structure whose bounds hold at it (the least
        ratio of scaling.RATIOS at which that shape, its dimensions equal to its scale made longer, covers it), or
        None; kept as `key`'s profile. Its options run the block's own code at any shape; their figures are bounds.
        A structure's planned options are not offered at its bounded shapes; with compile=True there are no bounds
        (each shape's compiled options are measured)."""
        if self.planned or self.compile:
            return None
        like = structure_key(key)
        found = []
        for k, prof in self.profiles.items():
            if prof.scaled is None or structure_key(k) != like:
                continue
            j = next((j for j, r in enumerate(scaling.RATIOS) if _block_covers(k, key, prof.scale, r)), None)
            if j is not None:
                found.append((scaling.RATIOS[j], j, prof))
        if not found:
            return None
        _, j, prof = min(found, key=lambda f: f[0])
        bounded = self.profiles[key] = prof.at_ratio(j, key)
        return bounded

    def _options(self, key: tuple, whole: bool) -> list:
        """A profile's options; with `whole`, those that run at any shape (kept, checkpointed, selective)."""
        options = self.profiles[key].options
        return [o for o in options if o.kind is not OptionKind.PLANNED] if whole else options

    # ---- a block's call -------------------------------------------------------------------------------------
    def run_block(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        step = self._step
        if step is None or not torch.is_grad_enabled() or not block.training:
            return original_forward(block)(*args, **kwargs)
        i = len(step.keys)
        flags = self._flags.get(id(block))
        if flags is None:
            flags = self._flags[id(block)] = parameter_flags(block)
        last = step.last_call
        tensors = last[0].again(block, args, kwargs, last[1], flags) if last is not None else None
        if tensors is not None:
            call = last[0]
        else:
            call, tensors = BlockCall.of(block, args, kwargs, flags)
        step.last_call = (call, (len(args), kwargs, tensors[len(args):]))
        step.keys.append(call.key)
        if step.mode is StepMode.PLANNED and i == 0 and step.column is not None:
            # within a measured call's bounds, chosen at the call's start (`_bounded_choice`): its blocks' structure
            if structure_key(step.expected[0]) != structure_key(call.key):
                # the mask code took another path at this length: this call runs checkpointed, and the measured
                # call's bounds serve no call this large again (the next one of this key measures)
                self.uncovered.add(step.root_key)
                limit = self.bounds_below.get(step.cover, math.inf)
                self.bounds_below[step.cover] = min(limit, _elements(step.root_key))
                step.mode = StepMode.FALLBACK
        elif step.mode is StepMode.PLANNED and i == 0 and step.cover is not None:
            # blocks of the covering call's structure, in the same order: its choice among whole-block options
            like = structure_key(call.key)
            step.expected = next((ks for ks in reversed(self.seen_keys.get(step.cover, []))
                                  if ks and structure_key(ks[0]) == like and (step.cover, ks) in self.measured), None)
            if step.expected is None:  # called otherwise: this call runs checkpointed, the next one measures
                self.uncovered.add(step.root_key)
                step.mode = StepMode.FALLBACK
            else:
                step.choice = self._choose(step.cover, step.expected, step.resident_bytes, whole=True)
                step.chosen = [self._options(k, True)[c] for k, c in zip(step.expected, step.choice.choice)]
        elif step.mode is StepMode.PLANNED and i == 0:
            step.expected = next((ks for ks in reversed(self.seen_keys.get(step.root_key, []))
                                  if ks and ks[0] == call.key and (step.root_key, ks) in self.measured), None)
            if step.expected is None:
                # blocks called otherwise than in any measured call with these inputs (the mask code took another
                # path): measure from here, the bytes held before the first block estimated from an earlier
                # measurement of these inputs, its first block's arguments replaced by this one's
                earlier = next(m for (rk, _), m in reversed(self.measured.items()) if rk == step.root_key)
                args_bytes = self._made_in_step_bytes(step, tensors)
                step.offset = max(0, earlier.forward_start[0] - earlier.first_args_bytes + args_bytes)
                step.offset_surviving = max(0, earlier.surviving[0] - earlier.first_args_bytes + args_bytes) \
                    if earlier.surviving else step.offset
                self._start_measuring(step)
        if step.mode is StepMode.MEASURE:
            if i == 0:
                step.measured.first_args_bytes = self._made_in_step_bytes(step, tensors)
            step.measured.forward_start.append(step.offset + step.probe.live())
            step.snapshots.append(step.probe.snapshot())
            if step.measured.cols is not None:
                step.measured.cols.forward_start.append(step.probe.live_scaled())
        if step.cover is not None and step.mode is StepMode.PLANNED:
            if i < len(step.expected) and structure_key(step.expected[i]) == structure_key(call.key):
                return step.chosen[i].run(block, tensors, call.caches)
            step.mode = StepMode.FALLBACK  # blocks called otherwise than in the covering call: the rest checkpointed
            self.uncovered.add(step.root_key)
        prof = self.profiles.get(call.key)
        if step.mode is StepMode.MEASURE and prof is not None and prof.bounded_at is not None:
            prof = None  # a measured call's blocks are profiled at their own shape: the bounds may fit no choice
        if prof is None and step.mode is not StepMode.MEASURE:
            prof = self._bounded_profile(call.key)
        if prof is None:
            t0 = time.perf_counter()
            # with `planned`, a block structure is traced at its first shape; its other shapes get the options that
            # run at any shape (kept, checkpointed, selective)
            # (kept, checkpointed, selective); the selective options' policies are the first shape's
            structure = structure_key(call.key)
            trace = self.planned and structure not in self.traced_structures
            self.traced_structures.add(structure)
            policies = self.policies.get(structure)
            scale = step.scale if step.mode is StepMode.MEASURE and step.probe.scaled and not self.compile else None
            prof = _isolated(lambda: profile_block(block, call, tensors, time_limit_s=self.time_limit_s,
                                                   cost_model=self.cost_model, compile=self.compile, say=self._say,
                                                   planned=trace, policies=policies, scale=scale,
                                                   compiled=self._compiled))
            self.policies.setdefault(structure, prof.policies)
            if trace:  # tracing and planning leave reference cycles (fx graphs) that hold views of this call's
                gc.collect()  # tensors (the sample they traced with): collected now, not later in this step's backward
            self.plan_seconds += time.perf_counter() - t0
            self.profiles[call.key] = prof
        if step.mode is StepMode.PLANNED and i == 0:
            step.choice = self._choose(step.root_key, step.expected, step.resident_bytes)
            step.chosen = [self.profiles[k].options[c] for k, c in zip(step.expected, step.choice.choice)]
        if step.mode is StepMode.PLANNED and (i >= len(step.expected) or step.expected[i] != call.key):
            step.mode = StepMode.FALLBACK
        if step.mode is StepMode.PLANNED:
            option = step.chosen[i]  # the chain's choice, looked up once at the first block
        else:
            option = whole_option(prof.options)
        # cache objects reach the kept and checkpointed options alone; a measuring call runs a compiled option's eager
        # counterpart, whose memory its tracker sees
        run = option.measuring_run if step.mode is StepMode.MEASURE and option.measuring_run else option.run
        out = run(block, tensors, call.caches)
        if step.mode is StepMode.PLANNED:
            step.last_output_node = next((t.grad_fn for t in tree_leaves(out)
                                          if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if step.mode is StepMode.MEASURE:
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            step.block_outputs += [t.grad_fn for t in outs if t.grad_fn is not None]
            if outs and outs[0].grad_fn is not None:
                first_in = next((t for t in tensors if t.requires_grad and t.grad_fn is not None), None)
                self._watch_backward(step, i, outs[0].grad_fn, first_in)
            step.probe.reset_peak()
        return out


def _ddp_calling(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel whose forward is calling `model` now (found among the callers' frames), or None."""
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if isinstance(me, DistributedDataParallel) and me.module is model:
            return me
        frame = frame.f_back
    return None


def _bucket_bytes(ddp: DistributedDataParallel) -> int:
    """The bytes of DDP's gradient buckets: one flat copy of the gradients of the parameters it reduces."""
    ignored = set(getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    seen: dict[int, int] = {}
    for name, p in ddp.module.named_parameters():
        if p.requires_grad and name not in ignored:
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def _parameters_reached(outputs: list[torch.Tensor], stops: list) -> list[torch.Tensor]:
    """The leaf tensors requiring grad (parameters) the outputs' autograd graph reaches without passing through the
    nodes `stops` (the blocks' outputs): what the part after the blocks uses."""
    stop_ids = {id(n) for n in stops}
    seen: set = set()
    found: dict[int, torch.Tensor] = {}
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop_ids:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            found[id(var)] = var
        todo.extend(fn for fn, _ in node.next_functions)
    return list(found.values())


def _option_names(state: InPlaceController, step: _Step) -> list[str]:
    if step.mode is StepMode.PLANNED and step.chosen:
        return [o.figures.name for o in step.chosen]
    names = []
    for k in step.keys:
        if k in state.profiles:
            option = whole_option(state.profiles[k].options)
            # a measuring call runs a compiled option's eager counterpart
            measured = step.mode is StepMode.MEASURE and option.measuring_run is not None
            names.append(option.figures.name.removeprefix(COMPILED_PREFIX) if measured else option.figures.name)
    return names


def _covers(big: tuple, small: tuple) -> bool:
    """Root keys (`InPlaceController._root_key`) of one structure, every tensor dimension of `big` at least
    `small`'s."""
    (bflat, bauto, bparams), (sflat, sauto, sparams) = big, small
    if bauto != sauto or bparams != sparams or bflat[0] != sflat[0] or len(bflat[1]) != len(sflat[1]):
        return False
    for b, s in zip(bflat[1], sflat[1]):
        if b and s and b[0] == s[0] == "tensor":
            if b[2:] != s[2:] or len(b[1]) != len(s[1]) or any(x < y for x, y in zip(b[1], s[1])):
                return False
        elif b != s:
            return False
    return True


def _scale_of(root_key: tuple) -> int | None:
    """The largest dimension of a training call's tensors (the sequence length of a batch of token rows): the one
    whose longer values a measurement bounds (planner.inplace.scaling); None below 2."""
    dims = [d for p in root_key[0][1] if p and p[0] == "tensor" for d in p[1]]
    top = max(dims, default=0)
    return top if top >= 2 else None


def _scaled_key(root_key: tuple, scale: int, ratio: float) -> tuple:
    """A root key with each tensor dimension equal to `scale` made `ratio` times longer (rounded down)."""
    (spec, parts), auto, params = root_key
    longer = math.floor(scale * ratio)
    parts = tuple(("tensor", tuple(longer if d == scale else d for d in p[1]), *p[2:])
                  if p and p[0] == "tensor" else p for p in parts)
    return ((spec, parts), auto, params)


def _block_covers(big: tuple, small: tuple, scale: int, ratio: float) -> bool:
    """Block keys (BlockCall.key) of one structure, every tensor dimension of `small` at most `big`'s, those equal to
    `scale` made `ratio` times longer (rounded down); strides aside."""
    (bflat, bstate), (sflat, sstate) = big, small
    if bstate != sstate or bflat[0] != sflat[0] or len(bflat[1]) != len(sflat[1]):
        return False
    longer = math.floor(scale * ratio)
    for b, s in zip(bflat[1], sflat[1]):
        if b and s and b[0] == s[0] == "tensor" and len(b) == len(s) == 6:
            if b[3:] != s[3:] or len(b[1]) != len(s[1]):
                return False
            if any(x > (longer if y == scale else y) for x, y in zip(s[1], b[1])):
                return False
        elif b != s:
            return False
    return True


def _elements(root_key: tuple) -> int:
    return sum(math.prod(p[1]) for p in root_key[0][1] if p and p[0] == "tensor")


def _predicted(step: _Step) -> int | None:
    return None if step.choice is None else step.resident_bytes + step.choice.peak_bytes


def grouped_names(names: list[str]) -> str:
    """'planned@0.7 x 6, checkpointed x 2' (consecutive equal names grouped)."""
    out: list[list] = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ", ".join(f"{n} x {c}" if c > 1 else n for n, c in out)


class _BlockForward:
    """A block's forward under the in-place planner (an instance attribute, so `block(...)` still runs the block's
    hooks around it)."""

    def __init__(self, state: InPlaceController, block: torch.nn.Module):
        self.state = state
        self.block = block

    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        return self.state.run_block(self.block, args, kwargs)

    def __deepcopy__(self, memo):
        import copy

        return _BlockForward(copy.deepcopy(self.state, memo), copy.deepcopy(self.block, memo))


# ---------------------------------------------------------------------------------------------
# the public functions
# ---------------------------------------------------------------------------------------------
def enable(model: torch.nn.Module, budget_gb: float, *, blocks=None, time_limit_s: float = 5.0,
           compile: bool = False, progress: bool | Callable[[str], None] = False,
           cost_model: str = "flops", planned: bool = False,
           backend: str | Callable = "inductor") -> InPlaceController:
    """Plan `model` in place, per repeated block, within `budget_gb` gigabytes for the whole training step
    (see the module docstring); returns the planner (also `inplace_plan(model)`).

    blocks: module names or classes of the blocks (default: capture.module_tags.repeated_blocks).
    time_limit_s: per block structure, for tracing and planning it (`planned`).
    planned: also offer schedules the solving core plans for each block structure at its first shape, run by the
        project's executor (block_region's "planned@f").
    compile: run the blocks' kept, checkpointed and selective options under torch.compile with `backend`, each
        option's figures measured as compiled (planner.inplace.compiled_options); with `planned`, the planned
        schedules run through inductor (planner.execution.inductor).
    backend: torch.compile's backend for the compiled options ("inductor", "aot_eager", or a callable).
    """

    module_arg(model)
    if _ATTR in model.__dict__:
        raise ArgumentError("the planner is already enabled on this model: planner.disable(model) first")
    budget_bytes = budget_bytes_from_gb(budget_gb)
    time_limit_s = seconds_value(time_limit_s)
    choice_arg(cost_model, "cost_model", ENABLE_COST_MODELS)
    flag_arg(compile, "compile")
    flag_arg(planned, "planned")
    if not (isinstance(backend, str) or callable(backend)):
        raise ArgumentError(f"backend must be a torch.compile backend's name or a callable, got {backend!r}")
    progress_arg(progress)
    state = InPlaceController(model, budget_bytes, resolve_blocks(model, blocks), time_limit_s=time_limit_s,
                              compile=compile, cost_model=cost_model, progress=progress, planned=planned,
                              backend=backend)
    state._install()
    model.__dict__[_ATTR] = state
    return state


def disable(model: torch.nn.Module) -> None:
    """Undo `enable`: the blocks' own forwards again, the hooks removed."""
    state = model.__dict__.pop(_ATTR, None)
    if state is None:
        raise ValueError("the planner is not enabled on this model")
    state._uninstall()


def inplace_plan(model: torch.nn.Module) -> InPlaceController | None:
    """The in-place planner enabled on `model`, or None."""
    return model.__dict__.get(_ATTR)

