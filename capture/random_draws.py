"""Which ops draw random numbers: the one test the tracer, the guards and the executor share.

An op draws when PyTorch tags it `nondeterministic_seeded` (dropout, rand, bernoulli, attention with dropout),
unless its `dropout_p` argument is a literal zero (scaled_dot_product attention without dropout draws nothing).
"""
from __future__ import annotations

from typing import Any

import torch


def draws_random(op: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """True if calling `op(*args, **kwargs)` draws random numbers."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    schema = getattr(op, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
        if "dropout_p" in names:
            k = names.index("dropout_p")
            kwargs = kwargs or {}
            val = kwargs.get("dropout_p", args[k] if k < len(args) else schema.arguments[k].default_value)
            if isinstance(val, (int, float)) and val == 0:
                return False
    return True


def node_draws_random(node: torch.fx.Node) -> bool:
    """True if the fx node's op draws random numbers (see `draws_random`)."""
    return node.op == "call_function" and draws_random(node.target, tuple(node.args), dict(node.kwargs))
