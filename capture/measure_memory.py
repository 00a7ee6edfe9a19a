"""Exact live-tensor memory on any device, seen from the dispatcher.

`StorageTracker` is a TorchDispatchMode that notices every storage an operator creates and
watches it with a weak reference, so it knows at each moment how many bytes of tensor storage
created under it are alive, whoever holds them (Python variables, autograd's saved tensors, a
tuple). Outputs that share an input's storage (views, aliases) add nothing. It cannot see kernel
scratch space that never becomes a tensor.

`peak_bytes_created_during(fn, *args)` runs `fn` under a tracker and returns the peak of live bytes
created during the call (the caller adds whatever was resident before, e.g. the inputs).
Used by the tracer's tests and reusable by the executor's.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_FRESH: dict = {}


def _fresh_outputs(func) -> bool:
    """Whether `func`'s schema declares none of its outputs an alias of an input (a view or in-place operator does)."""
    fresh = _FRESH.get(func)
    if fresh is None:
        fresh = _FRESH[func] = all(r.alias_info is None for r in func._schema.returns)
    return fresh


def _tensor_arguments(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an operator's arguments: each a tensor or a list or tuple of them (an aten schema's
    arguments nest no deeper), read without torch's pytree walk."""
    out = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in (list, tuple):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class StorageTracker(TorchDispatchMode):
    """Tracks bytes of storages created by operators run under it.

    live_bytes: bytes of those storages alive now; peak_bytes: the maximum live_bytes reached
    (right after an operator's outputs are allocated, before its dead inputs are released); created_bytes: all the
    bytes created under it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.created_bytes = 0
        self._tracked: dict[StorageWeakRef, int] = {}  # live storage -> its bytes

    def _release(self, key: StorageWeakRef, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live_bytes -= nbytes

    def live_storages(self) -> frozenset:
        """The storages alive now (to ask later, with `bytes_still_alive`, how many of them outlive a stretch)."""
        return frozenset(self._tracked)

    def bytes_still_alive(self, storages: frozenset) -> int:
        return sum(self._tracked.get(k, 0) for k in storages)

    def tracked_bytes(self, tensors) -> int:
        """Bytes of the distinct storages behind `tensors` that were created under this tracker and are alive."""
        keys = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)}
        return sum(self._tracked.get(k, 0) for k in keys)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _fresh_outputs(func):  # no output aliases an input (the schema says so): the inputs need not be looked at
            seen_inputs = frozenset()
        else:
            seen_inputs = {StorageWeakRef(t.untyped_storage()) for t in _tensor_arguments(args, kwargs)}
        for t in (out,) if isinstance(out, torch.Tensor) else \
                out if type(out) in (tuple, list) and all(isinstance(x, torch.Tensor) for x in out) else \
                tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = StorageWeakRef(st)
            if key in seen_inputs or key in self._tracked:
                continue
            self._add(key, st, t)
        self._after_op()
        return out

    def _add(self, key: StorageWeakRef, st, t: torch.Tensor) -> None:
        """Start watching a storage an operator created (`key` its weak reference, `t` the output seen through it)."""
        nbytes = int(st.nbytes())
        self._tracked[key] = nbytes
        self.live_bytes += nbytes
        self.created_bytes += nbytes
        weakref.finalize(st, self._release, key, nbytes)

    def _after_op(self) -> None:
        """After an operator's outputs are watched: the peaks."""
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def peak_bytes_created_during(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Run `fn(*args, **kwargs)` under a StorageTracker.

    Returns (peak bytes of storages created during the call that were alive at once, fn's result).
    Bytes of tensors that existed before the call (parameters, inputs) are not included.
    """
    tracker = StorageTracker()
    with tracker:
        result = fn(*args, **kwargs)
    return tracker.peak_bytes, result


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds for `t`: a DTensor's local shard (FSDP2's sharded parameters), else `t`."""
    return getattr(t, "_local_tensor", t)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (any pytree of tensors; a DTensor counts its local shard)."""
    seen: dict[int, int] = {}  # the storage's address (`_cdata`): every one is alive through the call
    _add_storages(tensors, seen)
    return sum(seen.values())


_SCALARS = (int, float, bool, str, bytes, type(None))


def _add_storages(tree, seen: dict) -> None:
    # a plain list or tuple is walked here (a training step asks this of its parameters every call; torch's pytree
    # walk costs several times more); anything else, or a container inside one, by torch's pytree
    for t in (tree if type(tree) in (list, tuple) else tree_leaves(tree)):
        if isinstance(t, torch.Tensor):
            st = local_tensor(t).untyped_storage()
            seen[st._cdata] = int(st.nbytes())
        elif not isinstance(t, _SCALARS):
            leaves = tree_leaves(t)
            if not (len(leaves) == 1 and leaves[0] is t):  # a container (else a leaf that is not a tensor)
                _add_storages(leaves, seen)


def module_tensors(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """(parameters, buffers) of `model` and its submodules, each object once, in `model.modules()`'s order: the same
    as `list(model.parameters())`, `list(model.buffers())`, read from the modules' own dictionaries at each call
    (FSDP2 swaps them between calls), at a fifth of the cost of those generators."""
    params: dict[int, torch.nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for m in _modules(model):
        for p in m._parameters.values():
            if p is not None:
                params.setdefault(id(p), p)
        for b in m._buffers.values():
            if b is not None:
                buffers.setdefault(id(b), b)
    return list(params.values()), list(buffers.values())


def has_buffers(model: torch.nn.Module) -> bool:
    """Whether `model` or a submodule registers a buffer (None included), read as `module_tensors` reads them."""
    return any(m._buffers for m in _modules(model))


def _modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`list(model.modules())`: each module once, depth first, a module before its children."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return out


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """`list(model.named_parameters())`, read from the modules' dictionaries (see `module_tensors`)."""
    params: dict[int, tuple[str, torch.nn.Parameter]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for n, p in m._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = (prefix + n, p)
        stack.extend(reversed([(prefix + n + ".", c) for n, c in m._modules.items() if c is not None]))
    return list(params.values())


def profiler_allocations(prof) -> list[tuple[int, int, int]]:
    """(time ns, size, address) of the CPU allocator's events in a torch.profiler profile (`profile_memory=True`), in
    time order (size < 0: a free). They see every allocation, compiled (inductor) kernels' included."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            out.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
        stack.extend(e.children)
    return sorted(out, key=lambda ev: ev[0])


def allocation_peak_bytes(events) -> int:
    """The most bytes held at once by allocations among `events` ((time, size, address) in time order, as
    `profiler_allocations` gives them), frees paired to allocations by address; a free of memory allocated before
    the events is ignored."""
    live: dict[int, int] = {}
    held = peak = 0
    for _, size, ptr in events:
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            held += size
            peak = max(peak, held)
        elif ptr in live:
            held -= live.pop(ptr)
    return peak
