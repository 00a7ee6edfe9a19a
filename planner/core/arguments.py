"""Checks of the public API's arguments: each bad one raises ArgumentError naming the argument, what it got and
what would work, before any work starts (numbers and budgets: planner.core.units)."""
from __future__ import annotations

import difflib
from typing import Iterable

import torch

from capture.module_tags import repeated_blocks
from graphs.errors import ArgumentError


def module_arg(model, name: str = "model") -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        what = getattr(model, "__name__", None) or type(model).__name__
        raise ArgumentError(f"{name} must be a torch.nn.Module, got {type(model).__name__} {what!r}: put the "
                            "computation in a Module's forward")
    return model


def choice_arg(value, name: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}")
    return value


def flag_arg(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def progress_arg(value, name: str = "progress"):
    if not (isinstance(value, bool) or callable(value)):
        raise ArgumentError(f"{name} must be True, False or a callable taking one line of text, got "
                            f"{type(value).__name__} {value!r}")
    return value


def optional_callable_arg(value, name: str):
    if value is not None and not callable(value):
        raise ArgumentError(f"{name} must be a callable (or None), got {type(value).__name__} {value!r}")
    return value


def submodule_name_arg(model: torch.nn.Module, name: str, arg: str = "blocks") -> str:
    """`name` must name a submodule of `model` (as named_modules() spells it); the error lists the closest names."""
    names = [n for n, _ in model.named_modules() if n]
    if name in names:
        return name
    last = name.rsplit(".", 1)[-1]  # 'model.layers.0' for 'layers.0': names ending as it does come first
    same_end = sorted((n for n in names if n.rsplit(".", 1)[-1] == last), key=len)
    close = same_end[:3] or difflib.get_close_matches(name, names, n=3, cutoff=0.4) or names[:3]
    raise ArgumentError(f"{arg}: {name!r} is not a submodule of {type(model).__name__}; submodules are named as "
                        f"model.named_modules() names them, e.g. {', '.join(repr(c) for c in close)}")


def resolve_blocks(model: torch.nn.Module, blocks) -> list[str]:
    """The names of the blocks `blocks` names (module names or classes; None: the model's repeated blocks,
    capture.module_tags.repeated_blocks), outermost only, in the model's order; ArgumentError for what names none."""
    if blocks is None:
        names = repeated_blocks(model)
        if not names:
            raise ArgumentError(f"{type(model).__name__} has no repeated blocks (a ModuleList or Sequential of two or "
                                "more modules of one class): name them with blocks= (module names or classes)")
        return names
    if isinstance(blocks, (type, str)):
        blocks = [blocks]
    if not isinstance(blocks, (list, tuple, set, frozenset)) or \
            not all(isinstance(b, str) or (isinstance(b, type) and issubclass(b, torch.nn.Module)) for b in blocks):
        raise ArgumentError(f"blocks must be a module name, a Module class, or a list of those (names as "
                            f"model.named_modules() gives them, e.g. 'layers.0'), got {blocks!r}")
    classes = tuple(b for b in blocks if isinstance(b, type))
    names = [submodule_name_arg(model, b) for b in blocks if isinstance(b, str)]
    if classes:
        found = [n for n, m in model.named_modules() if isinstance(m, classes) and n]
        # the outermost only: a block inside another is planned with it
        names += [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    if not names:
        raise ArgumentError(f"no module of {model.__class__.__name__} matches blocks={blocks!r}")
    nested = next(((o, n) for o in names for n in names if n.startswith(o + ".")), None)
    if nested is not None:
        raise ArgumentError(f"blocks {nested[0]!r} and {nested[1]!r} are nested: a block is planned whole, with "
                            "whatever it contains; name the outer one or the inner ones, not both")
    order = {n: k for k, (n, _) in enumerate(model.named_modules())}
    return sorted(set(names), key=order.__getitem__)
