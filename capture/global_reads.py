"""The module-level globals a model's forward code reads, and a cheap check that they still hold their traced values.

A traced graph bakes in every Python value its forward read: a global such as `SCALE = 2.0` in the model's module
becomes a constant of the graph, so a user who changes it between steps would train on the old value without a word.
`GlobalReads.of(model)` finds the globals the forward code reads by name (the `LOAD_GLOBAL`s, and `module.NAME` read
through a global module, of each submodule's forward method, of the methods it calls on `self` and of the plain
Python functions it calls, recursively; PyTorch's own code is left out), keeps those holding a scalar, a string,
None or a tuple of them, with their values; `check()` names the first one whose value changed since (a dictionary
look-up and an identity test each, as torch.compile guards globals). Globals read in other ways (a closure, a class
attribute, `getattr`, a mutable container's contents) are not seen.
"""
from __future__ import annotations

import dis
import inspect
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MISSING = object()


def _guardable(value: Any) -> bool:
    """A value a graph can bake in and `==` compares exactly: a scalar, a string, None, a tuple of them."""
    if isinstance(value, tuple):
        return all(_guardable(v) for v in value)
    return isinstance(value, _SCALARS)


def _same(now: Any, then: Any) -> bool:
    """Whether a global still holds its traced value (repr tells 1 from 1.0 and True, and equals itself for NaN)."""
    return now is then or (type(now) is type(then) and repr(now) == repr(then))


@dataclass(frozen=True)
class _Read:
    namespace: dict  # the globals (or module __dict__) the name is looked up in
    key: str
    name: str  # as the user writes it: "SCALE", "config.SCALE"
    where: str  # the module the namespace belongs to
    value: Any


def _user_function(fn: Any) -> types.FunctionType | None:
    """The plain Python function behind `fn` (decorators unwrapped), None for PyTorch's own code and non-functions."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        return None
    if not isinstance(fn, types.FunctionType):
        return None
    module = fn.__globals__.get("__name__", "")
    return None if module == "torch" or module.startswith("torch.") else fn


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """`code` and the code nested in it (comprehensions, lambdas, inner functions)."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


class _Walker:
    """Collects the guardable global reads of functions, following the functions and `self` methods they call."""

    def __init__(self):
        self.seen: set[types.CodeType] = set()
        self.reads: dict[tuple[int, str], _Read] = {}

    def walk(self, fn: Any, cls: type | None) -> None:
        fn = _user_function(fn)
        if fn is None or fn.__code__ in self.seen:
            return
        self.seen.add(fn.__code__)
        g = fn.__globals__
        where = g.get("__name__", "?")
        for code in _code_objects(fn.__code__):
            ins = list(dis.get_instructions(code))
            for k, i in enumerate(ins):
                if i.opname == "LOAD_GLOBAL":
                    value = g.get(i.argval, _MISSING)
                    if _guardable(value):
                        self.reads.setdefault((id(g), i.argval), _Read(g, i.argval, i.argval, where, value))
                    elif isinstance(value, types.ModuleType) and k + 1 < len(ins) \
                            and ins[k + 1].opname in ("LOAD_ATTR", "LOAD_METHOD"):
                        self._module_attribute(value, i.argval, ins[k + 1].argval)
                    elif isinstance(value, types.FunctionType):
                        self.walk(value, None)
                elif cls is not None and i.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    self.walk(inspect.getattr_static(cls, i.argval, None), cls)

    def _module_attribute(self, module: types.ModuleType, alias: str, attr: str) -> None:
        ns = vars(module)
        value = ns.get(attr, _MISSING)
        if _guardable(value) and not module.__name__.startswith("torch"):
            self.reads.setdefault((id(ns), attr), _Read(ns, attr, f"{alias}.{attr}", module.__name__, value))


class GlobalReads:
    """The globals a model's forward code reads and their values when traced (see the module docstring)."""

    def __init__(self, reads: tuple[_Read, ...]):
        self.reads = reads

    @staticmethod
    def of(model: torch.nn.Module) -> "GlobalReads":
        """The guardable globals read by the forward code of `model` and its submodules, with their values now."""
        walker = _Walker()
        for m in model.modules():
            walker.walk(type(m).forward, type(m))
        return GlobalReads(tuple(walker.reads.values()))

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.reads]

    def changed(self) -> str | None:
        """A sentence naming the first global whose value differs from the traced one, None when none does."""
        for r in self.reads:
            now = r.namespace.get(r.key, _MISSING)
            if not _same(now, r.value):
                state = "is no longer defined" if now is _MISSING else f"is {now!r}"
                return (f"the global {r.name!r} of module {r.where!r} {state}; it was {r.value!r} when the plan "
                        "was traced, and the traced graph holds that value as a constant")
        return None

    def __deepcopy__(self, memo) -> "GlobalReads":
        return self  # it watches the interpreter's own module namespaces, which a copy of a model shares
