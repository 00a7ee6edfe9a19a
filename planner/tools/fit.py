"""How big can I train? The largest size (batch, sequence length, any size parameter) whose step fits a budget.

`max_batch(make, budget_gb)` where `make(n) -> (model, sample_input)` builds the step at size n. Memory grows with
the size in a way two traced sizes show: the smallest feasible budget of each (`solvers.bounds.min_budget`) is
interpolated linearly to the size that should just fit; that estimate is then confirmed by planning it and the size
after it, moving by doubling steps and bisection where the estimate was off. Only the sizes on that path are
traced. A size fits when `plan()` meets the budget with an overhead of at most `max_overhead`; the answer comes
with its plan and with why the next size does not fit (the smallest feasible budget there and how it is known, or
the overhead it would cost).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from capture.call import CallSpec
from capture.loss_workspace import LossMemory, loss_memory
from capture.module_tags import trace_model
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from planner.core.units import GB, budget_bytes_from_gb
from planner.whole.api import LossNotPlannedWarning, Plan, plan, smallest_budget


@dataclass
class Attempt:
    """One size tried: whether it fits, its plan, and why not where it does not."""

    n: int
    fits: bool
    plan: Plan | None
    reason: str
    min_budget_bytes: int | None = None  # the smallest budget known to work at this size, where one is known


@dataclass
class Fit:
    """The largest size that fits (`n`, None when not even the smallest tried does) and why n + 1 does not."""

    n: int | None
    plan: Plan | None
    budget_bytes: int
    max_overhead: float | None
    next: Attempt | None  # the attempt at n + 1
    attempts: list[Attempt] = field(default_factory=list)
    estimate: int | None = None  # the size the interpolation named
    seconds: float = 0.0

    probed: list[int] = field(default_factory=list)  # the sizes traced for the interpolation

    @property
    def traced_sizes(self) -> list[int]:
        return sorted({a.n for a in self.attempts} | set(self.probed))

    def summary(self) -> str:
        gb = self.budget_bytes / GB
        if self.n is None:
            head = f"nothing fits {gb:.6g} GB: the smallest size tried, {self.next.n}, does not ({self.next.reason})"
        else:
            p = self.plan
            head = (f"largest size that fits {gb:.6g} GB: {self.n} "
                    f"(predicted peak {p.predicted_peak_bytes / GB:.6g} GB, overhead {100 * p.overhead:.2f}%, "
                    f"{p.status.value})")
            if self.next is not None:
                head += f"; {self.next.n} does not fit: {self.next.reason}"
        return head + f" [sizes traced: {', '.join(map(str, self.traced_sizes))}; {self.seconds:.1f} s]"


class _Search:
    def __init__(self, make, budget_bytes, loss_fn, max_overhead, time_limit_s, cost_model, progress):
        self.make, self.budget_bytes, self.loss_fn = make, budget_bytes, loss_fn
        self.max_overhead, self.time_limit_s, self.cost_model = max_overhead, time_limit_s, cost_model
        self.progress = progress or (lambda msg: None)
        self.attempts: dict[int, Attempt] = {}

    def _build(self, n: int):
        model, sample = self.make(n)
        return model, sample, trace_model(model, sample, "flops" if self.cost_model == "flops" else "time")

    def smallest(self, n: int) -> int | None:
        """The smallest budget known to work at size n, found without planning at the budget."""
        self.progress(f"size {n}: tracing and finding its smallest feasible budget")
        model, sample, traced = self._build(n)
        call, inputs = CallSpec.of(sample)
        loss = LossMemory() if self.loss_fn is None else loss_memory(model, inputs, self.loss_fn, call)
        return smallest_budget(traced, self.time_limit_s * PROBE_SHARE, loss_bytes=loss.workspace_bytes,
                               loss_held_bytes=loss.held_bytes).budget_bytes

    def attempt(self, n: int) -> Attempt:
        if n in self.attempts:
            return self.attempts[n]
        self.progress(f"size {n}: planning at {self.budget_bytes / GB:.6g} GB")
        model, sample, traced = self._build(n)
        try:
            with warnings.catch_warnings():
                if self.attempts:  # plan() warns once per search that the loss is outside the plan, not per size
                    warnings.simplefilter("ignore", LossNotPlannedWarning)
                p = plan(model, sample, Fraction(self.budget_bytes, GB), cost_model=self.cost_model,
                         time_limit_s=self.time_limit_s, traced=traced, loss_fn=self.loss_fn)
        except InfeasibleBudgetError as e:
            # plan() names the smallest budget known to work at this size and how that is known
            a = Attempt(n, False, None, str(e.reason or e), e.min_budget_bytes)
        except NoSolutionInTimeError as e:
            a = Attempt(n, False, None, f"no schedule found within {self.time_limit_s:g} s, none proven impossible: "
                                        f"{e}", e.min_budget_bytes)
        else:
            if self.max_overhead is not None and p.overhead > self.max_overhead:
                a = Attempt(n, False, p, f"fits only at overhead {100 * p.overhead:.2f}% > the maximum "
                                         f"{100 * self.max_overhead:.2f}%")
            else:
                a = Attempt(n, True, p, "fits")
        self.attempts[n] = a
        self.progress(f"size {n}: {a.reason if not a.fits else 'fits, overhead %.2f%%' % (100 * a.plan.overhead)}")
        return a


def max_batch(make: Callable[[int], tuple], budget_gb: float, *, loss_fn=None, max_overhead: float | None = None,
              time_limit_s: float = 5.0, cost_model: str = "auto", start: int = 1, max_n: int = 1 << 20,
              progress: Callable[[str], None] | None = None) -> Fit:
    """The largest n >= `start` whose training step `make(n)` fits `budget_gb` with overhead at most `max_overhead`
    (no limit by default), its plan, and why n + 1 does not fit. `time_limit_s` is per solve (each plan and each
    smallest-budget search). Assumes that a larger size never needs less memory."""
    t0 = time.perf_counter()
    search = _Search(make, budget_bytes_from_gb(budget_gb), loss_fn, max_overhead, time_limit_s, cost_model, progress)
    budget = search.budget_bytes
    # the smallest feasible budget grows about linearly in the size: interpolate it from two traced sizes, then
    # refine by the secant through the traced sizes nearest the budget (small sizes carry fixed costs)
    known: dict[int, int] = {}
    for n in (start, start + 1):
        found = search.smallest(n)
        if found is not None:
            known[n] = found
    estimate = _secant(known, budget, start, max_n)
    for _ in range(REFINEMENTS):
        if estimate is None or estimate in known:
            break
        found = search.smallest(estimate)
        if found is None:
            break
        known[estimate] = found
        before, estimate = estimate, _secant(known, budget, start, max_n)
        if estimate is not None and abs(estimate - before) <= 1:  # close enough: planning at the budget decides
            break
    estimate = start if estimate is None else estimate
    lo, hi = _bracket(search, estimate, start, max_n)  # lo fits (or is None), hi does not (or is None)
    while lo is not None and hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if search.attempt(mid).fits:
            lo = mid
        else:
            hi = mid
    if lo is None:
        first = search.attempt(start)
        return Fit(None, None, budget, max_overhead, first, list(search.attempts.values()), estimate,
                   time.perf_counter() - t0, sorted(known))
    nxt = search.attempt(lo + 1) if lo + 1 <= max_n else None
    return Fit(lo, search.attempt(lo).plan, budget, max_overhead, nxt, list(search.attempts.values()), estimate,
               time.perf_counter() - t0, sorted(known))


REFINEMENTS = 3  # secant steps on the smallest feasible budget before planning at the budget
PROBE_SHARE = 0.5  # of the time limit per solve, for each smallest-budget search of the interpolation


def _secant(known: dict[int, int], budget: int, start: int, max_n: int) -> int | None:
    """The size where the line through two traced sizes' smallest feasible budgets meets `budget`: the sizes
    nearest the budget from below and above where there are such, else the two largest below or smallest above."""
    if len(known) < 2:
        return None
    below = sorted(n for n, m in known.items() if m <= budget)
    above = sorted(n for n, m in known.items() if m > budget)
    if below and above:
        a, b = below[-1], above[0]
    elif below:
        a, b = below[-2], below[-1]
    else:
        a, b = above[0], above[1]
    ma, mb = known[a], known[b]
    if mb == ma:
        return None if mb > budget else max_n
    n = a + math.floor((budget - ma) * (b - a) / (mb - ma))
    return max(start, min(max_n, n))


def _bracket(search: _Search, estimate: int, start: int, max_n: int) -> tuple[int | None, int | None]:
    """(a size that fits, a larger size that does not), found from `estimate` by doubling steps; None for a side
    that does not exist (nothing fits from `start` on, or everything up to `max_n` fits)."""
    if search.attempt(estimate).fits:
        lo, step = estimate, 1
        while True:
            nxt = min(lo + step, max_n)
            if nxt == lo:
                return lo, None
            if not search.attempt(nxt).fits:
                return lo, nxt
            lo, step = nxt, 2 * step
    hi, step = estimate, 1
    while True:
        nxt = max(hi - step, start)
        if nxt == hi:
            return None, hi
        if search.attempt(nxt).fits:
            return nxt, hi
        hi, step = nxt, 2 * step
