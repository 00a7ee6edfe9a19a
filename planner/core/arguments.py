"""Checks of the public API's arguments: each bad one raises ArgumentError naming the argument, what it got and
what would work, before any work starts (numbers and budgets: planner.core.units)."""
from __future__ import annotations

import difflib
from typing import Iterable

import torch

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
