"""Units at the edge: budgets are given in gigabytes, 1 GB = 10^9 bytes; everything inside is bytes."""
from __future__ import annotations

import math
from fractions import Fraction

GB = 10**9


def budget_bytes_from_gb(budget_gb: float) -> int:
    """floor(budget_gb x 10^9), read in decimal so that 1.5 GB is exactly 1_500_000_000 bytes."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float, Fraction)):
        raise TypeError(f"budget_gb must be a number, not {type(budget_gb).__name__}")
    value = Fraction(str(budget_gb)) if isinstance(budget_gb, float) else Fraction(budget_gb)
    if value <= 0:
        raise ValueError(f"budget_gb must be > 0, got {budget_gb}")
    return math.floor(value * GB)
