"""Guards: recompute the scalars a traced forward read from tensors, without running the model.

A forward that reads tensor values (`if torch.all(mask):`, `.item()`) is traced specialised to the values it read;
an input is safe to run on the traced graph only if the forward would read the same values from it. Rerunning the
whole forward to find out costs a forward per step. Instead, while the forward runs once at trace time, every aten
op is logged with where its tensor arguments came from (a user input, a parameter or buffer, an earlier op, or a
tensor from elsewhere, kept as a constant), and each scalar read's backward slice is kept: usually a handful of ops
on the inputs (a mask's comparison and reduction). `Guard.reads(*inputs)` replays the slices on new inputs.

Why replaying the slices is enough: the path a forward takes up to its k-th read is fixed by the reads before it,
so if reads 1..k-1 agree, the k-th read's slice is the straight-line program that computes it on the new input.
A slice that would mutate state (an in-place op, a buffer update) or draw random numbers cannot be replayed
safely: no guard is built then, and the caller falls back to rerunning the forward. Batch norm in training writes its
running statistics though its schema does not say so (`native_batch_norm`): the log counts that write, and a replay
runs it on copies of the statistics.
"""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from capture.counter_momentum import counted_momenta
from capture.random_draws import draws_random
from capture.state import restored
from graphs.errors import TraceError

SCALAR_TYPES = (bool, int, float, complex)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep  # torch's layers: their reads are named
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT_DIRS = tuple(os.path.join(_ROOT, package) + os.sep for package in ("capture", "planner"))

@dataclass(frozen=True)
class _Ref:
    """Where a tensor argument comes from: ("input", i), ("state", name), ("op", index, output position)."""

    kind: str
    key: Any
    pos: int = 0

@dataclass
class _Op:
    func: Any
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list  # leaves with tensors replaced by _Ref, or kept as constants (tensors from elsewhere)
    deps: tuple[int, ...]  # indices of the ops whose outputs it reads
    unsafe: bool  # mutates its inputs or draws random numbers
    written_only: frozenset = frozenset()  # the state it writes without reading (batch norm's running statistics)
    draws: bool = False  # draws random numbers (dropout in training)


_aten = torch.ops.aten
# Batch norms that update their running statistics (arguments 3 and 4) in training (argument 5) though their schemas
# do not declare the write. In training their result does not depend on those statistics' values.
_STAT_WRITERS = frozenset(op for op in (
    getattr(getattr(_aten, name, None), "default", None)
    for name in ("native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm"))
    if op is not None)


def _stat_writes(func, args) -> tuple[int, ...]:
    """The positions of the running statistics `func` writes without saying so, or ()."""
    if func not in _STAT_WRITERS or len(args) < 6 or not args[5]:
        return ()
    return tuple(i for i in (3, 4) if isinstance(args[i], torch.Tensor))

class _OpLogger(TorchDispatchMode):
    """Logs every op with the provenance of its tensor arguments, and the scalar reads."""

    def __init__(self, inputs: tuple, state: dict[str, torch.Tensor]):
        super().__init__()
        self.where = WeakIdKeyDictionary()
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                self.where[t] = _Ref("input", i)
        for name, t in state.items():
            self.where.setdefault(t, _Ref("state", name))
        self.ops: list[_Op] = []
        self.reads: list[tuple[int, str, Any]] = []  # (op index, op name, value)
        self.sites: list[str] = []  # where in the model's code each read happened
        self.mutated: set[str] = set()  # names of the parameters and buffers the forward writes in place

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        logged, deps = [], set()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                ref = self.where.get(x)
                if ref is None:
                    logged.append(x)  # made outside the forward and the model's state: a constant
                else:
                    logged.append(ref)
                    if ref.kind == "op":
                        deps.add(ref.key)
            else:
                logged.append(x)
        schema = getattr(func, "_schema", None)
        draws = draws_random(func, args, kwargs)
        unsafe = bool(schema is not None and schema.is_mutable) or draws
        if schema is not None and schema.is_mutable:  # the model's state this op writes in place
            for arg, value in zip(schema.arguments, args):
                ref = self.where.get(value) if isinstance(value, torch.Tensor) else None
                if ref is not None and ref.kind == "state" and arg.alias_info is not None and arg.alias_info.is_write:
                    self.mutated.add(ref.key)
        written_only = set()
        for i in _stat_writes(func, args):
            ref = self.where.get(args[i])
            if ref is not None and ref.kind == "state":
                self.mutated.add(ref.key)
                written_only.add(ref.key)
        k = len(self.ops)
        self.ops.append(_Op(func, spec, logged, tuple(sorted(deps)), unsafe, frozenset(written_only), draws))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for pos, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self.where[o] = _Ref("op", k, pos)
        if isinstance(out, SCALAR_TYPES):
            self.reads.append((k, str(func.overloadpacket.__name__), out))
            self.sites.append(_user_site())
        return out

def _user_site() -> str:
    """`file:line (source)` of the line of the model's code that read: the innermost frame outside PyTorch (its layers'
    forwards in torch.nn.modules excepted, BatchNorm reading its step counter) and outside this project."""
    f = sys._getframe(1)
    while f is not None and _library_frame(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    source = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f"{f.f_code.co_filename}:{f.f_lineno} ({source})"

def _library_frame(filename: str) -> bool:
    """Whether code in `filename` is PyTorch's internals or this project's, not the model's."""
    if filename.startswith(_TORCH_DIR):
        return not filename.startswith(_TORCH_MODULES_DIR)
    return filename.startswith(_PROJECT_DIRS)

class Guard:
    """The backward slices of a forward's scalar reads, replayable on new inputs (see the module docstring)."""

    def __init__(self, ops: list[_Op], read_ops: list[int]):
        self.ops = ops  # the slice, in program order (indices into the original log are remapped)
        self.read_ops = read_ops  # positions in self.ops whose results are the reads, in read order
        # after op j, the results no later op reads: a replay holds only what is still to be read
        last_use = {}
        for j, op in enumerate(ops):
            for x in op.leaves:
                if isinstance(x, _Ref) and x.kind == "op":
                    last_use[x.key] = j
        keep = set(read_ops)
        self._dead_after: list[list[int]] = [[] for _ in ops]
        for k in range(len(ops)):
            if k not in keep:
                self._dead_after[last_use.get(k, k)].append(k)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def reads(self, model: torch.nn.Module, *inputs: torch.Tensor) -> tuple[Any, ...]:
        """The scalars the traced forward would read from `inputs`, in order (no grad, nothing mutated)."""
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        results: list[Any] = []
        with torch.no_grad():
            for op in self.ops:
                leaves = []
                for x in op.leaves:
                    if isinstance(x, _Ref):
                        if x.kind == "input":
                            leaves.append(inputs[x.key])
                        elif x.kind == "state":
                            leaves.append(state[x.key])
                        else:
                            r = results[x.key]
                            leaves.append(r[x.pos] if isinstance(r, (tuple, list)) else r)
                    else:
                        leaves.append(x)
                args, kwargs = tree_unflatten(leaves, op.spec)
                writes = _stat_writes(op.func, args)
                if writes:  # the replay must not move the running statistics: it writes to copies
                    args = tuple(a.clone() if i in writes else a for i, a in enumerate(args))
                results.append(op.func(*args, **kwargs))
                for k in self._dead_after[len(results) - 1]:
                    results[k] = None
        return tuple(results[k] for k in self.read_ops)

def record_reads_and_guard(model: torch.nn.Module, inputs: tuple, call=None, *, refuse_self_updating: bool = False
                           ) -> tuple[tuple[tuple[str, Any], ...], Guard | None, tuple[str, ...]]:
    """Run the forward once (no grad; buffers and RNG restored), returning its scalar reads as (op, value),
    a Guard that recomputes them (None when a read's slice cannot be replayed safely) and where in the model's code
    each read happened (`file:line (source)`). `inputs` are the user input tensors; `call` (a capture.call.CallSpec)
    says how they are passed (None: positionally). With `refuse_self_updating`, a read computed from a parameter or
    buffer the forward writes in place, or a number (not a bool) from random draws (dropout in training), raises
    TraceError (its value changes from step to step)."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    devices = {t.device.index for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda} - {None}
    log = _OpLogger(inputs, state)
    # BatchNorm momentum=None reads its counter: not a read of the traced graph (capture.counter_momentum)
    with restored(model, devices), counted_momenta(model), torch.no_grad(), log:
        if call is None:
            model(*inputs)
        else:
            call.call(model, inputs)
    reads = tuple((name, value) for _, name, value in log.reads)
    if refuse_self_updating:
        for (k, name, value), site in zip(log.reads, log.sites):
            updated = sorted(_state_read(log, k) & log.mutated)
            if updated:
                raise TraceError(
                    f"the forward reads a value ({name} = {value!r} at {site}) from {', '.join(updated)}, which the "
                    "forward itself updates: a traced step would keep the value of the step it was traced on, and "
                    "the next step reads another (BatchNorm with momentum=None reads its step counter so); plan in "
                    "place with planner.enable(model, budget_gb), which runs the model's code as written, or give "
                    "the layer a fixed momentum")
            # a number made from random draws differs at every step (a branch's bool may well not: it is checked)
            drawn = () if isinstance(value, bool) else sorted(
                {str(log.ops[j].func.overloadpacket.__name__) for j in _slice_of(log, k) if log.ops[j].draws})
            if drawn:
                raise TraceError(
                    f"the forward reads a value ({name} = {value!r} at {site}) computed from random draws "
                    f"({', '.join(drawn)}): every step reads another, and a traced step would keep the one it was "
                    "traced on; plan in place with planner.enable(model, budget_gb), which runs the model's code as "
                    "written, or read the value before the random op (or in eval mode)")
    return reads, _slice(log), tuple(log.sites)


def _slice_of(log: _OpLogger, k: int) -> set[int]:
    """The ops op k's value is computed from, op k included."""
    seen, stack = set(), [k]
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            stack.extend(log.ops[j].deps)
    return seen


def _state_read(log: _OpLogger, k: int) -> set[str]:
    """Names of the parameters and buffers the ops up to and including op k's value are computed from."""
    names = set()
    for j in _slice_of(log, k):
        op = log.ops[j]
        names.update(x.key for x in op.leaves
                     if isinstance(x, _Ref) and x.kind == "state" and x.key not in op.written_only)
    return names

def _slice(log: _OpLogger) -> Guard | None:
    if not log.reads:
        return None
    keep: set[int] = set()
    stack = [k for k, _, _ in log.reads]
    while stack:
        k = stack.pop()
        if k in keep:
            continue
        keep.add(k)
        stack.extend(log.ops[k].deps)
    order = sorted(keep)
    if any(log.ops[k].unsafe for k in order):
        return None
    new_index = {k: j for j, k in enumerate(order)}
    ops = []
    for k in order:
        op = log.ops[k]
        leaves = [_Ref("op", new_index[x.key], x.pos) if isinstance(x, _Ref) and x.kind == "op" else x
                  for x in op.leaves]
        ops.append(_Op(op.func, op.spec, leaves, (), False))  # replay needs no dependency lists
    return Guard(ops, [new_index[k] for k, _, _ in log.reads])
