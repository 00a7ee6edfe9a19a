"""Key/value cache objects among a call's arguments, and a block's forward made safe to recompute with one.

transformers models make a cache in their forward when `use_cache` is on (the library's default) and hand it to each
decoder layer, whose attention calls `cache.update(key_states, value_states, layer_idx)`: the layer's entry grows by
the new states, and what attention is to use comes back (the earlier content, then the new states). A training step
does not read it: the loss depends on the cache only through what `update` returned.

- `is_cache(x)`: x is a transformers `Cache` (`transformers.cache_utils.Cache`, looked up in `sys.modules`: only when
  transformers is imported already; this library never imports it). Nothing else is taken for a cache.
- `scratch_copy(cache)`: a copy to run a block with and throw away, as the planner's measurements of a block do:
  the cache's Python objects (itself, its layers, the caches inside it) copied, their tensors shared, so that an
  update that replaces a layer's tensors (transformers' dynamic layers) leaves the cache as it was (one that writes
  into them in place, a static cache's, writes the cache's own buffers).
- `reads_cache(forward, args, kwargs)`: whether the call reads what its caches held before it (an `update` returned
  more than the states it was given, as with a prefix passed in), run once on scratch copies: a block that does
  cannot run without its cache.
- `recompute_without_cache_updates(forward, args, kwargs)`: what to hand torch.utils.checkpoint instead of
  (forward, args, kwargs) so that the recomputation in the backward leaves the caches among the arguments as the
  forward left them (it would otherwise append every layer's keys and values a second time). The forward runs with a
  stand-in per cache that passes `update` on to the real cache and records what it returned; each recomputation
  runs with one whose `update` returns that again, rebuilt from the recomputed states (the recomputed states laid
  out as the forward's result was where the forward found the entry empty, as in training; the forward's earlier
  content concatenated before them along the sequence dim where it found some; the forward's result itself where it
  was neither), and nothing written to the real cache. Every other attribute is the real cache's (a cache inside
  it, as EncoderDecoderCache holds two, gets a stand-in of its own); the stand-ins are instances of a subclass of
  the cache's class, so the layer's isinstance checks see what they saw. The recomputation holds the real cache only
  weakly: a step that drops it after the forward (the usual `model(**batch).loss`) frees its keys and values then
  (its `update` still answered; a layer reading anything else of a cache that is gone raises ReferenceError).
"""
from __future__ import annotations

import copy
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode


def cache_class() -> type | None:
    """transformers' `Cache` class where transformers is imported, else None."""
    cls = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cls if isinstance(cls, type) else None


def is_cache(x: Any) -> bool:
    """x is a transformers key/value cache (see the module docstring)."""
    cls = cache_class()
    return cls is not None and isinstance(x, cls)


def scratch_copy(cache):
    """A copy of `cache` whose updates do not reach it (see the module docstring)."""
    new = copy.copy(cache)
    for name, value in vars(cache).items():
        if is_cache(value):
            value = scratch_copy(value)
        elif isinstance(value, list):  # the layers
            value = [copy.copy(x) if _plain_object(x) else x for x in value]
        elif isinstance(value, dict):
            value = copy.copy(value)
        else:
            continue
        vars(new)[name] = value
    return new


def cache_tensors(cache, depth: int = 4) -> list[torch.Tensor]:
    """The tensors a cache holds: in its attributes, their lists and dicts, its layers' and inner caches'."""
    found: list[torch.Tensor] = []

    def walk(x, left: int) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif left <= 0:
            return
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, left - 1)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, left - 1)
        elif is_cache(x) or _plain_object(x):
            for v in vars(x).values():
                walk(v, left - 1)
    walk(cache, depth)
    return found


def _plain_object(x) -> bool:
    return hasattr(x, "__dict__") and not isinstance(x, (type, torch.Tensor, torch.nn.Module)) and not callable(x)


# ---------------------------------------------------------------------------------------------
# what the forward's `update` calls returned, and the same rebuilt from recomputed states
# ---------------------------------------------------------------------------------------------
class _UpdateLog:
    """One cache's `update` calls in one forward of a block, in order, and the logs of the caches inside it."""

    def __init__(self):
        self.entries: list[tuple] = []  # (layer index, kind, data) per call
        self.children: dict[str, _UpdateLog] = {}


def _layer_index(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("layer_idx")


def _detached(out):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _entry(key_states, value_states, out) -> tuple[str, Any]:
    """How `update(key_states, value_states)` returned `out`: ("same", None) the new states themselves; ("copy",
    strides) a copy of them; ("prefix", (keys, values)) the earlier content (detached views of the result) before
    them along the sequence dim (-2); else ("replay", out detached)."""
    new = (key_states, value_states)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in (*new, *out))):
        return "replay", _detached(out)
    if all(o is n for o, n in zip(out, new)):
        return "same", None
    if any(o.dtype != n.dtype or o.device != n.device or o.dim() != n.dim() or o.dim() < 2 for o, n in zip(out, new)):
        return "replay", _detached(out)
    if all(o.shape == n.shape for o, n in zip(out, new)):
        return "copy", tuple(o.stride() for o in out)
    lengths = [o.shape[-2] - n.shape[-2] for o, n in zip(out, new)]
    if all(p > 0 and o.shape[:-2] == n.shape[:-2] and o.shape[-1] == n.shape[-1]
           for p, o, n in zip(lengths, out, new)):
        # checked, once per call that found earlier content (not so in training): a cache that writes the new
        # states elsewhere (a static one) is replayed instead
        with torch.no_grad():
            if all(torch.equal(o[..., p:, :], n) for p, o, n in zip(lengths, out, new)):
                return "prefix", tuple(o[..., :p, :].detach() for p, o in zip(lengths, out))
    return "replay", _detached(out)


def _laid_out(t: torch.Tensor, stride: tuple) -> torch.Tensor:
    if t.stride() == stride:
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _rebuilt(kind: str, data, key_states, value_states):
    if kind == "same":
        return key_states, value_states
    if kind == "copy":
        return _laid_out(key_states, data[0]), _laid_out(value_states, data[1])
    if kind == "prefix":
        return torch.cat([data[0], key_states], dim=-2), torch.cat([data[1], value_states], dim=-2)
    return data


# ---------------------------------------------------------------------------------------------
# the stand-ins
# ---------------------------------------------------------------------------------------------
_THREAD = threading.local()


@contextmanager
def _updating():
    """Marks this thread as inside an update (`in_cache_update`), and takes torch's selective checkpointing modes off
    the top of the dispatch mode stack meanwhile: selective checkpointing asks the recomputation to run the forward's
    operators, one for one, and the forward's update runs the cache's own while a recomputation answers from the
    record."""
    popped = []
    while True:
        stack = _get_current_dispatch_mode_stack()
        if not stack or not isinstance(stack[-1], (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
            break
        popped.append(_pop_mode())
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1
        for mode in reversed(popped):
            _push_mode(mode)


def in_cache_update() -> bool:
    """Whether this thread is inside a stand-in's `update`: the forward's real update, or a recomputation's answer
    from the record. The two run different operators; a per-operator save policy counts neither."""
    return getattr(_THREAD, "depth", 0) > 0


_OWN = ("_standin_real", "_standin_log", "_standin_replay", "_standin_at")


class _StandIn:
    """A cache's stand-in for one run of a block (the forward: `update` passed on and recorded; a recomputation:
    `update` answered from the record). Made without __init__; an attribute it does not hold itself is the real
    cache's instance attribute where that has one (a cache inside wrapped), else its class's (methods run on the
    stand-in)."""

    def __getattribute__(self, name):
        own = object.__getattribute__(self, "__dict__")
        if name in own or name in _STAND_IN_NAMES or name.startswith("__"):
            return object.__getattribute__(self, name)
        real = own["_standin_real"]()
        if real is None:
            raise ReferenceError(f"the cache a checkpointed block was called with is gone; its recomputation reads "
                                 f"{name!r} of it")
        held = getattr(real, "__dict__", {})
        if name not in held:
            return object.__getattribute__(self, name)
        value = held[name]
        if is_cache(value):  # a cache inside this one: a stand-in of its own, kept for this run
            log = own["_standin_log"].children.setdefault(name, _UpdateLog())
            value = _stand_in(_reference(value), log, own["_standin_replay"])
            own[name] = value
        return value

    def __setattr__(self, name, value):
        own = object.__getattribute__(self, "__dict__")
        real = own["_standin_real"]()
        if own["_standin_replay"] or real is None:
            own[name] = value  # a recomputation writes nothing to the real cache
        else:
            setattr(real, name, value)

    def update(self, key_states, value_states, *args, **kwargs):
        with _updating():
            return self._standin_update(key_states, value_states, *args, **kwargs)

    def _standin_update(self, key_states, value_states, *args, **kwargs):
        own = object.__getattribute__(self, "__dict__")
        log: _UpdateLog = own["_standin_log"]
        layer = _layer_index(args, kwargs)
        if not own["_standin_replay"]:
            real = own["_standin_real"]()
            out = real.update(key_states, value_states, *args, **kwargs)
            log.entries.append((layer, *_entry(key_states, value_states, out)))
            return out
        at = own["_standin_at"]
        own["_standin_at"] = at + 1
        if at >= len(log.entries) or log.entries[at][0] != layer:
            raise RuntimeError(f"the recomputation of a checkpointed block updated its cache otherwise than its "
                               f"forward did (update {at} for layer {layer!r}; the forward's: "
                               f"{[e[0] for e in log.entries]})")
        _, kind, data = log.entries[at]
        return _rebuilt(kind, data, key_states, value_states)


_STAND_IN_NAMES = frozenset(_OWN) | frozenset(vars(_StandIn))  # answered by the stand-in, even with the cache gone
_CLASSES: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _stand_in_class(cls: type) -> type:
    made = _CLASSES.get(cls)
    if made is None:
        try:
            made = type(cls.__name__, (_StandIn, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                         "__doc__": _StandIn.__doc__})
        except TypeError:  # a class that cannot be subclassed so: a plain stand-in (isinstance checks then fail)
            made = _StandIn
        _CLASSES[cls] = made
    return made


def _reference(x) -> Callable[[], Any]:
    try:
        return weakref.ref(x)
    except TypeError:
        return lambda: x


def _stand_in(ref: Callable[[], Any], log: _UpdateLog, replay: bool):
    """A stand-in for the cache `ref()` (a plain one where that is gone: `update` still answers, the rest raises)."""
    real = ref()
    cls = _StandIn if real is None else _stand_in_class(type(real))
    try:
        obj = object.__new__(cls)
    except TypeError:
        obj = object.__new__(_StandIn)
    own = object.__getattribute__(obj, "__dict__")
    own.update(_standin_real=ref, _standin_log=log, _standin_replay=replay, _standin_at=0)
    return obj


def reads_cache(forward: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether `forward(*args, **kwargs)` reads its caches' earlier content (see the module docstring); run without
    gradients, the caller restoring generators and buffers where that matters."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)), is_leaf=is_cache)
    logs: list[_UpdateLog] = []
    scratch: list = []  # the copies, held while the forward runs

    def stand_in(x):
        if not is_cache(x):
            return x
        logs.append(_UpdateLog())
        scratch.append(scratch_copy(x))
        return _stand_in(_reference(scratch[-1]), logs[-1], False)

    args, kwargs = tree_unflatten([stand_in(x) for x in leaves], spec)
    with torch.no_grad():
        forward(*args, **kwargs)

    def found(log: _UpdateLog) -> bool:
        return any(kind not in ("same", "copy") for _, kind, _ in log.entries) or any(map(found, log.children.values()))
    return any(map(found, logs))


class _Slot:
    """Where a cache argument goes in the arguments handed to torch.utils.checkpoint (the cache is not among them)."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<cache {self.index}>"


def recompute_without_cache_updates(forward: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """(fn, args, kwargs) to run under torch.utils.checkpoint in place of (forward, args, kwargs), for one call (see
    the module docstring): fn's first call is the forward, each later one a recomputation. Unchanged where no
    argument is a cache."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)), is_leaf=is_cache)
    slots = [i for i, x in enumerate(leaves) if is_cache(x)]
    if not slots:
        return forward, tuple(args), dict(kwargs)
    caches = [leaves[i] for i in slots]
    for j, i in enumerate(slots):
        leaves[i] = _Slot(j)
    bare_args, bare_kwargs = tree_unflatten(leaves, spec)
    logs = [_UpdateLog() for _ in slots]
    refs = [_reference(c) for c in caches]
    held = [caches]  # the caches, until the forward has run (the recomputations hold them weakly)

    def run(*a, **k):
        replay = not held
        stand_ins = [_stand_in(r, log, replay) for r, log in zip(refs, logs)]
        held.clear()
        a, k = tree_map(lambda x: stand_ins[x.index] if isinstance(x, _Slot) else x, (a, k))
        return forward(*a, **k)
    return run, bare_args, bare_kwargs

