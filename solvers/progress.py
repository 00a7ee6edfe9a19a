"""What a long search tells its caller as it goes: the step running, the best cost so far and the bound.

A solver that reports takes `progress=`, a callable given a `SearchState` whenever a step starts or ends (auto
reports; the single solvers do not). The caller decides what to show and how often (planner.core.progress prints
a line at least every few seconds, whatever the solver's steps take).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SearchState:
    """step: what runs now (a solver's name, or a bound's). best_cost: the cheapest schedule found so far (None:
    none yet). bound_cost: the largest lower bound known so far (None: none yet). base_cost: the cost of computing
    every node once (overheads are cost / base_cost - 1)."""

    step: str
    best_cost: float | None
    bound_cost: float | None
    base_cost: float

    def overhead(self, cost: float | None) -> float | None:
        return None if cost is None or self.base_cost <= 0 else cost / self.base_cost - 1.0

    def describe(self) -> str:
        best, bound = self.overhead(self.best_cost), self.overhead(self.bound_cost)
        text = f"{self.step}; best overhead " + ("none yet" if best is None else f"{100 * best:.2f} %")
        if bound is not None:
            text += f", bound {100 * max(bound, 0.0):.2f} %"
            if best is not None:
                text += f", gap {100 * max(best - bound, 0.0):.2f} points"
        return text


Progress = Callable[[SearchState], None]
