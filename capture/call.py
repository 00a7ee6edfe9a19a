"""How a model is called: positional tensors and keyword arguments, flattened to the traced graph's user inputs.

A sample input is a tensor, a tuple or list of tensors (positional arguments), a dict of keyword arguments
(`model(**batch)`, as transformers models are called), or a pair `(args, kwargs)` of both. Tensor keyword
arguments become user inputs after the positional ones, in the dict's order; other keyword values (None, flags such
as `use_cache=False`) are constants of the traced graph, and a call with other values is refused.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

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
