"""How a model is called: positional tensors and keyword arguments, flattened to the traced graph's user inputs.

A sample input is a tensor, a tuple or list of tensors (positional arguments), a dict of keyword arguments
(`model(**batch)`, as transformers models are called), or a pair `(args, kwargs)` of both. Tensor keyword
arguments become user inputs after the positional ones, in the dict's order; other keyword values (None, flags such
as `use_cache=False`) are constants of the traced graph, and a call with other values is refused (`CallSpec`).

`FlatCall` is any call (args, kwargs) flattened with torch's pytree: its structure and non-tensor leaves (each tensor
a `TENSOR` slot), a hashable key, and `rebuild(tensors)`. A planned block's call, a random op's arguments and the
in-place planner's key of a training call are each one. A key/value cache object (capture.kv_cache.is_cache) is one
leaf, keyed by its class alone: a fresh cache per call (as transformers models make one) keeps the key.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from capture.kv_cache import is_cache
from graphs.errors import SpecialisationError, TraceError


@dataclass(frozen=True)
class CallSpec:
    num_args: int  # positional tensors
    tensor_keys: tuple[str, ...]  # keyword arguments that are tensors, in order
    constants: tuple[tuple[str, Any], ...] = ()  # keyword arguments that are not tensors

    @staticmethod
    def of(sample: Any) -> tuple["CallSpec", tuple[torch.Tensor, ...]]:
        """The call spec of a sample input and its tensors in user-input order (TraceError for other forms)."""
        if isinstance(sample, torch.Tensor):
            args, kwargs = (sample,), {}
        elif isinstance(sample, Mapping):
            args, kwargs = (), dict(sample)
        elif (isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], (tuple, list))
              and isinstance(sample[1], Mapping)):
            args, kwargs = tuple(sample[0]), dict(sample[1])
        elif isinstance(sample, (tuple, list)):
            args, kwargs = tuple(sample), {}
        else:
            raise TraceError(f"sample input is a {type(sample).__name__}: give a tensor, a tuple of tensors, a dict "
                             "of keyword arguments, or (args, kwargs)")
        for k, t in enumerate(args):
            if not isinstance(t, torch.Tensor):
                raise TraceError(f"sample input {k} is a {type(t).__name__}: positional inputs must be tensors "
                                 "(pass other values as keyword arguments)")
        keys = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        constants = tuple((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
        return CallSpec(len(args), keys, constants), (*args, *(kwargs[k] for k in keys))

    def flatten(self, args: tuple, kwargs: Mapping) -> tuple[torch.Tensor, ...]:
        """The user-input tensors of a call; SpecialisationError when it is not a call of this form."""
        if len(args) != self.num_args:
            raise SpecialisationError(f"traced with {self.num_args} positional inputs, got {len(args)}")
        want = set(self.tensor_keys) | {k for k, _ in self.constants}
        if set(kwargs) != want:
            raise SpecialisationError(f"traced with keyword arguments {sorted(want)}, got {sorted(kwargs)}")
        for k, v in self.constants:
            if isinstance(kwargs[k], torch.Tensor) or kwargs[k] != v:
                raise SpecialisationError(f"keyword argument {k!r} was {v!r} when traced, got {kwargs[k]!r}")
        for k in self.tensor_keys:
            if not isinstance(kwargs[k], torch.Tensor):
                raise SpecialisationError(f"keyword argument {k!r} was a tensor when traced, got "
                                          f"{type(kwargs[k]).__name__}")
        return (*args, *(kwargs[k] for k in self.tensor_keys))

    def split(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) of a call from its user-input tensors."""
        tensors = tuple(tensors)
        kwargs = dict(zip(self.tensor_keys, tensors[self.num_args:]))
        kwargs.update(self.constants)
        return tensors[:self.num_args], kwargs

    def call(self, model: torch.nn.Module, tensors) -> Any:
        args, kwargs = self.split(tensors)
        return model(*args, **kwargs)

    def describe(self) -> str:
        parts = [f"{self.num_args} positional"] if self.num_args else []
        parts += [f"{k}=<tensor>" for k in self.tensor_keys] + [f"{k}={v!r}" for k, v in self.constants]
        return ", ".join(parts) or "no arguments"


class _TensorSlot:
    """Marks where a call's tensors go among its leaves (the one instance `TENSOR`, pickled as that name)."""

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self):
        return "TENSOR"


TENSOR = _TensorSlot()


_NAMES: dict = {}  # dtype or device -> its name (str() of either costs more than a dictionary's lookup)


def _name(x) -> str:
    name = _NAMES.get(x)
    if name is None:
        name = _NAMES[x] = str(x)
    return name


def tensor_meta(t: torch.Tensor, strides: bool = True) -> tuple:
    """(shape, strides, dtype, device, requires_grad) of a tensor, strides left out with strides=False."""
    return (tuple(t.shape), *((tuple(t.stride()),) if strides else ()), _name(t.dtype), _name(t.device),
            t.requires_grad)


@dataclass(frozen=True)
class FlatCall:
    """A call (args, kwargs) flattened (torch.utils._pytree), its tensors taken out.

    constants: the leaves, `TENSOR` where a tensor goes. key: hashable, equal for calls of one structure with equal
    non-tensor leaves and tensors of equal metadata: the structure, each tensor's `tensor_meta`, each other leaf's
    type and value, or, where it cannot be hashed, its type and id (by_id=False: its type alone); a key/value cache
    (capture.kv_cache.is_cache: one leaf, whatever pytree knows of its class) its type alone, whatever it holds.
    hashable: every other non-tensor leaf can be hashed (else calls cannot be compared by value)."""

    spec: Any  # the pytree spec of (args, kwargs)
    constants: tuple
    key: tuple
    hashable: bool

    @staticmethod
    def of(args, kwargs=None, *, strides: bool = True, by_id: bool = True,
           leaf_type: type = torch.Tensor) -> tuple["FlatCall", list]:
        """The flat call and its tensors in order; `leaf_type` says what a tensor is (torch.fx.Node for an fx
        node's arguments, keyed by position alone)."""
        leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})), is_leaf=is_cache)
        tensors = [x for x in leaves if isinstance(x, leaf_type)]
        constants = tuple(TENSOR if isinstance(x, leaf_type) else x for x in leaves)
        hashable = True
        parts = []
        for x in leaves:
            if isinstance(x, leaf_type):
                parts.append(("tensor", *tensor_meta(x, strides)) if isinstance(x, torch.Tensor) else ("tensor",))
                continue
            if is_cache(x):
                parts.append((type(x).__name__, "cache"))
                continue
            try:
                hash(x)
                parts.append((type(x).__name__, x))
            except TypeError:
                hashable = False
                parts.append((type(x).__name__, id(x)) if by_id else (type(x).__name__,))
        return FlatCall(spec, constants, (str(spec), tuple(parts)), hashable), tensors

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) of the call with `tensors` in the slots, in order."""
        it = iter(tensors)
        return tree_unflatten([next(it) if c is TENSOR else c for c in self.constants], self.spec)
