"""Units at the edge: budgets are given in gigabytes, 1 GB = 10^9 bytes; everything inside is bytes."""
from __future__ import annotations

import math
import numbers
from fractions import Fraction

from graphs.errors import ArgumentError

GB = 10**9


def real_value(value, name: str) -> Fraction:
    """`value` as an exact fraction: a Python, numpy or 0-d tensor number that is finite (a float read in decimal,
    so 1.5 is exactly 3/2). ArgumentError names `name` otherwise."""
    if not isinstance(value, bool) and not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () \
            and hasattr(value, "item"):
        value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, Fraction):
        return value
    as_float = float(value)
    if not math.isfinite(as_float):
        raise ArgumentError(f"{name} must be a finite number, got {as_float}")
    return Fraction(repr(as_float) if isinstance(value, float) else str(value))


def _scalar(zero_d):
    """The number a 0-d tensor or array holds, as a numpy scalar of its dtype where numpy has it (so a float32 0.01
    reads as 0.01, its shortest decimal), else as a Python number."""
    try:
        return zero_d.detach().cpu().numpy()[()]
    except (AttributeError, TypeError, RuntimeError):  # a numpy array, or a dtype numpy lacks (bfloat16)
        return zero_d[()] if hasattr(zero_d, "dtype") and not hasattr(zero_d, "detach") else zero_d.item()


def budget_bytes_from_gb(budget_gb: float, name: str = "budget_gb") -> int:
    """floor(budget_gb x 10^9), read in decimal so that 1.5 GB is exactly 1_500_000_000 bytes. ArgumentError (naming
    `name`) unless it is a finite number of at least one byte."""
    value = real_value(budget_gb, name)
    if value <= 0:
        raise ArgumentError(f"{name} must be > 0 (gigabytes, 1 GB = 10^9 bytes), got {budget_gb}")
    budget_bytes = math.floor(value * GB)
    if budget_bytes < 1:
        raise ArgumentError(f"{name}={budget_gb} is less than one byte (1 GB = 10^9 bytes): give the budget in "
                            "gigabytes, e.g. 1.5 for 1.5 GB")
    return budget_bytes


def seconds_value(seconds: float, name: str = "time_limit_s") -> float:
    """A time limit in seconds: a finite number > 0 (ArgumentError naming `name` otherwise)."""
    value = real_value(seconds, name)
    if value <= 0:
        raise ArgumentError(f"{name} must be a number of seconds > 0, got {seconds}")
    return float(value)


# Recomputation is ranked by what it computes again: its FLOPs plus its bytes written, at this many FLOPs a byte (a
# balance between arithmetic and memory traffic; CPUs run near 10, GPUs far above), so that recomputing only
# elementwise ops, which FLOPs count as free, is never ranked as free as keeping everything.
FLOPS_PER_BYTE = 8.0
