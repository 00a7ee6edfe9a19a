"""The memory-time curve of one model: the planner's overhead against the budget, with its lower bound.

`overhead_curve(model, sample_input)` plans the step at `points` budgets evenly spaced from the no-recomputation peak
down to the smallest budget a schedule is known to meet, and keeps what each plan says: its predicted peak, its
overhead (recomputed cost over the cost of the step), its status and the lower bound on the overhead where a solver
proved one, with the schedules it covers (the plot's band uses only bounds that cover every schedule). Per-block
checkpointing (where the model has repeated blocks: `per_block_checkpointed`) and torch.compile under its
`activation_memory_budget` are measured on the same step as points of comparison (peak from the allocator's stream,
step time over eager's, medians of 5 interleaved steps). `Curve.table()` is markdown; `Curve.plot(path)` draws it
(matplotlib).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import torch

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from planner.core.plan_type import bound_covers
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import allocator_peak_bytes, interleaved_step_seconds, run_step
from planner.whole.api import GB, LossNotPlannedWarning, plan, smallest_budget


@dataclass
class CurvePoint:
    budget_bytes: int
    predicted_peak_bytes: int | None
    overhead: float | None  # None: nothing found at this budget
    lower_bound_overhead: float | None
    status: str
    solver: str | None
    bound_scope: str | None = None  # which schedules the bound covers ("every schedule", or a solver's family)

    @property
    def bound_covers_every_schedule(self) -> bool:
        return self.bound_scope == "every schedule"


@dataclass
class MeasuredPoint:
    label: str
    peak_bytes: int
    step_over_eager: float  # measured step time / eager's


@dataclass
class Curve:
    reference_peak_bytes: int
    smallest_budget_bytes: int | None
    points: list[CurvePoint]
    measured: list[MeasuredPoint] = field(default_factory=list)

    def table(self) -> str:
        lines = ["| budget | predicted peak | overhead | lower bound (schedules it covers) | status (solver) |",
                 "|---:|---:|---:|---|---|"]
        for p in self.points:
            over = "-" if p.overhead is None else f"{100 * p.overhead:.2f} %"
            lb = "-" if p.lower_bound_overhead is None else f"{100 * p.lower_bound_overhead:.2f} % ({p.bound_scope})"
            peak = "-" if p.predicted_peak_bytes is None else f"{p.predicted_peak_bytes / 1e6:.2f} MB"
            lines.append(f"| {p.budget_bytes / 1e6:.2f} MB | {peak} | {over} | {lb} | {p.status}"
                         + (f" ({p.solver})" if p.solver else "") + " |")
        for m in self.measured:
            lines.append(f"\n{m.label}: measured peak {m.peak_bytes / 1e6:.2f} MB, "
                         f"step {m.step_over_eager:.2f}x eager's")
        return "\n".join(lines)

    def plot(self, path: str, title: str = "") -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pts = [p for p in self.points if p.overhead is not None]
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        xs = [p.budget_bytes / 1e6 for p in pts]
        ax.plot(xs, [100 * p.overhead for p in pts], "o-", label="planner (predicted overhead)")
        bounded = [p for p in pts if p.lower_bound_overhead is not None and p.bound_covers_every_schedule]
        if bounded:
            ax.fill_between([p.budget_bytes / 1e6 for p in bounded], [100 * p.lower_bound_overhead for p in bounded],
                            [100 * p.overhead for p in bounded], alpha=0.25,
                            label="gap to the lower bound (every schedule)")
        for m in self.measured:
            ax.plot([m.peak_bytes / 1e6], [100 * (m.step_over_eager - 1)], "s",
                    label=f"{m.label} (measured step time)")
        ax.set_xlabel("memory budget (MB)")
        ax.set_ylabel("overhead (%)")
        ax.set_title(title or "overhead against memory budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def overhead_curve(model: torch.nn.Module, sample_input, *, points: int = 8, loss_fn=None, time_limit_s: float = 5.0,
                   cost_model: str = "auto", traced=None, measure: bool = True,
                   torch_compile_budget: float | None = 0.5,
                   progress: Callable[[str], None] | None = None) -> Curve:
    """Plan `model`'s step at `points` budgets from its no-recomputation peak down to its smallest known feasible
    budget (`time_limit_s` per solve); with `measure`, also measure per-block checkpointing and torch.compile under
    `torch_compile_budget` (None: skip it) on the same step. See the module docstring."""
    say = progress or (lambda msg: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossNotPlannedWarning)
        say("tracing and planning without recomputation")
        full = plan(model, sample_input, 1e9, cost_model=cost_model, time_limit_s=time_limit_s, traced=traced,
                    loss_fn=loss_fn)
        ref = full.reference_peak_bytes  # the peak of keeping everything on the graph plan() solves
        say("finding the smallest feasible budget")
        smallest = smallest_budget(full, time_limit_s).budget_bytes
        low = ref if smallest is None else smallest
        budgets = sorted({round(ref - k * (ref - low) / max(1, points - 1)) for k in range(points)}, reverse=True)
        out = []
        for b in budgets:
            say(f"planning at {b / 1e6:.3f} MB")
            out.append(_point(model, sample_input, b, full, cost_model, time_limit_s, loss_fn))
    measured = _measured_points(model, sample_input, loss_fn, torch_compile_budget, say) if measure else []
    return Curve(ref, smallest, out, measured)


def _point(model, sample_input, budget_bytes, full, cost_model, time_limit_s, loss_fn) -> CurvePoint:
    try:
        p = plan(model, sample_input, Fraction(budget_bytes, GB), cost_model=cost_model, time_limit_s=time_limit_s,
                 traced=full.traced, loss_fn=loss_fn)
    except InfeasibleBudgetError:
        return CurvePoint(budget_bytes, None, None, None, "infeasible", None)
    except NoSolutionInTimeError:
        return CurvePoint(budget_bytes, None, None, None, f"nothing found in {time_limit_s:g} s", None)
    base = p.result.total_cost / (1 + p.overhead)
    lb = None if p.lower_bound_cost is None or base <= 0 else max(0.0, p.lower_bound_cost / base - 1)
    scope = None
    if lb is not None:
        # at no recomputation, no schedule costs less
        scope = "every schedule" if lb == 0 else bound_covers(p.result.info, p.solver)
    return CurvePoint(budget_bytes, p.predicted_peak_bytes, p.overhead, lb, p.status.value, p.solver, scope)


def _measured_points(model, sample_input, loss_fn, torch_compile_budget, say) -> list[MeasuredPoint]:
    """Per-block checkpointing and torch.compile under `torch_compile_budget` (None: not measured), measured on the
    same step: peak from the allocator's stream (it sees compiled kernels' buffers), step time over eager's."""
    others: dict[str, torch.nn.Module] = {}
    wrapped = per_block_checkpointed(model)
    if wrapped is not None:
        others["per-block checkpointing"] = wrapped
    if torch_compile_budget is not None:
        say(f"compiling with torch.compile, activation_memory_budget {torch_compile_budget:g}")
        compiled = torch.compile(copy.deepcopy(model))
        try:
            with torch._functorch.config.patch(activation_memory_budget=torch_compile_budget):
                run_step(compiled, sample_input, loss_fn)  # compiles under the budget
        except Exception as e:  # a model torch.compile cannot train: no point, and say why
            say(f"torch.compile failed: {type(e).__name__}: {e}")
        else:
            others[f"torch.compile, budget {torch_compile_budget:g}"] = compiled
    if not others:
        return []
    say("measuring " + ", ".join(others))
    peaks = {label: allocator_peak_bytes(m, sample_input, loss_fn) for label, m in others.items()}
    times = interleaved_step_seconds({"eager": model, **others}, sample_input, loss_fn, repeats=5)
    return [MeasuredPoint(label, peaks[label], times[label].median_s / times["eager"].median_s) for label in others]
