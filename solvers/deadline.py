"""One deadline for a solver and every helper it calls.

A deadline is a `time.perf_counter()` value (None: no limit). A solver turns its `time_limit_s` into one deadline
on entry and hands that deadline (or an earlier one, for a share of the time) to every helper; every loop that can
run long checks it. Work past it is cut: what was found so far is returned, or NoSolutionInTimeError raised.
"""
from __future__ import annotations

import time

from graphs.errors import NoSolutionInTimeError


def deadline_after(seconds: float | None) -> float | None:
    """The deadline `seconds` from now (None for no limit)."""
    return None if seconds is None else time.perf_counter() + float(seconds)


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until `deadline`, at least 0 (None for no limit)."""
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


def passed(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def earlier(deadline: float | None, seconds: float | None) -> float | None:
    """The earlier of `deadline` and `seconds` from now: the deadline of a share of the time."""
    other = deadline_after(seconds)
    if deadline is None:
        return other
    return deadline if other is None else min(deadline, other)


def check(deadline: float | None, what: str, **figures) -> None:
    """Raise NoSolutionInTimeError ("<what>: time limit reached") once `deadline` has passed."""
    if passed(deadline):
        raise NoSolutionInTimeError(f"{what}: time limit reached", **figures)
