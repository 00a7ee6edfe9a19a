"""Command line.

`python -m planner solve GRAPH.json (--budget-multiplier M | --budget-bytes B) --solver NAME ...`
`python -m planner plan MODULE:FACTORY --budget 1.5GB [--solver auto] [--cost-model auto] --out plan.json`
`python -m planner show plan.json`
`python -m planner fit MODULE:FACTORY --budget 24GB [--max-overhead 0.25] [--out plan.json]`
`python -m planner curve MODULE:FACTORY --out curve.png [--points 8]`

Exit status: 0 on success; 2 for an infeasible budget (proven: the message names the proof and the smallest budget
known to work) or bad input; 3 when no schedule was found within the time limit and nothing proves that none exists
(the message names the best budget known to work, where one is known).
"""
from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from pathlib import Path

from graphs.benchmarks import load_benchmark
from graphs.errors import ArgumentError, InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.schedule_json import save_result
from graphs.simulate import budget_from_multiplier, reference_peak_bytes
from solvers.base import solve, solver_names


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m planner", description="Optimal activation-checkpoint planner")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("solve", help="solve a benchmark graph (node-link JSON) under a memory budget")
    s.add_argument("graph", help="graph file: a benchmark node-link JSON")
    b = s.add_mutually_exclusive_group(required=True)
    b.add_argument("--budget-multiplier", type=_positive(float), help="budget = ceil(M x reference peak)")
    b.add_argument("--budget-bytes", type=_positive(int), help="budget in bytes")
    b.add_argument("--min-budget", action="store_true",
                   help="find the smallest feasible budget, print how it is known, and write its schedule")
    s.add_argument("--solver", default=None, help=f"one of: {', '.join(solver_names())} (required with a budget)")
    s.add_argument("--time-limit", type=_positive(float), default=None, help="seconds for the solver (exact solvers)")
    s.add_argument("--out", help="write the schedule as remat-schedule JSON here")
    pl = sub.add_parser("plan", help="trace a model and plan its training step under a memory budget")
    pl.add_argument("factory", help="MODULE:FACTORY, a function returning (model, sample_input)")
    pl.add_argument("--budget", required=True, type=parse_budget,
                    help="memory budget: 1.5GB, 800MB, 123456B, or a number of GB (1 GB = 10^9 bytes)")
    pl.add_argument("--solver", default="auto", help=f"one of: {', '.join(solver_names())}")
    pl.add_argument("--cost-model", default="auto", choices=["auto", "flops", "time", "roofline"])
    pl.add_argument("--device", default=None, help="device name for --cost-model roofline (h100, a100, ...)")
    pl.add_argument("--time-limit", type=_positive(float), default=60.0, help="seconds for the solver")
    pl.add_argument("--out", required=True, help="write the plan here (remat-schedule JSON)")
    pl.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    f = sub.add_parser("fit", help="the largest size (batch, sequence, ...) whose training step fits a budget")
    f.add_argument("factory", help="MODULE:FACTORY, a function of the size returning (model, sample_input)")
    f.add_argument("--budget", required=True, type=parse_budget, help="memory budget, as for `plan`")
    f.add_argument("--max-overhead", type=_positive(float), default=None,
                   help="largest recompute overhead accepted (0.25 = 25 %% slower compute); no limit by default")
    f.add_argument("--cost-model", default="auto", choices=["auto", "flops", "time"])
    f.add_argument("--time-limit", type=_positive(float), default=5.0, help="seconds per solve")
    f.add_argument("--start", type=_positive(int), default=1, help="the smallest size tried")
    f.add_argument("--out", help="write the plan of the answer here (remat-schedule JSON)")
    c = sub.add_parser("curve", help="overhead against budget for one model, drawn with its lower bound")
    c.add_argument("factory", help="MODULE:FACTORY, a function returning (model, sample_input)")
    c.add_argument("--out", required=True, help="the plot (PNG); the table is printed")
    c.add_argument("--points", type=_positive(int), default=8,
                   help="budgets from the no-recomputation peak down to the smallest")
    c.add_argument("--cost-model", default="auto", choices=["auto", "flops", "time"])
    c.add_argument("--time-limit", type=_positive(float), default=5.0, help="seconds per solve")
    c.add_argument("--torch-compile-budget", type=float, default=0.5,
                   help="measure torch.compile under this activation_memory_budget (0: do not)")
    sh = sub.add_parser("show", help="summarise a plan file: peak, overhead, status, what is recomputed")
    sh.add_argument("plan", help="a plan written by `plan` (remat-schedule JSON)")
    return p


def _positive(kind: type):
    """An argparse type: a finite number of `kind` > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


_UNITS = {"gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}


def parse_budget(text: str) -> int:
    """'1.5GB' -> 1_500_000_000 bytes (decimal units; a bare number is gigabytes)."""
    from decimal import Decimal, InvalidOperation

    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in ("gb", "mb", "kb", "b") if t.endswith(u)), None)
    num = t[: -len(unit)] if unit else t
    try:
        value = Decimal(num) * _UNITS[unit or "gb"]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"cannot read budget {text!r}: use e.g. 1.5GB, 800MB or 123456B") from None
    if not value.is_finite():
        raise argparse.ArgumentTypeError(f"budget must be a finite size, got {text!r}: use e.g. 1.5GB, 800MB or "
                                         "123456B")
    if value < 1:
        raise argparse.ArgumentTypeError(f"budget must be at least 1 byte, got {text!r}")
    return int(value)


def _check_callable_with(factory, args: tuple, need: str) -> None:
    """ArgumentError ("`need` and return (model, sample_input): why") where `factory`'s signature refuses `args`."""
    try:
        inspect.signature(factory).bind(*args)
    except TypeError as e:
        raise ArgumentError(f"{need} and return (model, sample_input): {e}") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass


def load_factory(spec: str):
    """Import MODULE:FACTORY and call it; it must return (model, sample_input)."""
    factory = load_size_factory(spec)
    _check_callable_with(factory, (), f"{spec} must be callable with no arguments")
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise ArgumentError(f"{spec} must return (model, sample_input), it returned {type(made).__name__}")
    return made


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.whole.api import GB, plan

    if not Path(args.out).resolve().parent.is_dir():
        raise ArgumentError(f"--out {args.out!r}: its folder does not exist")
    model, sample = load_factory(args.factory)
    p = plan(model, sample, args.budget / GB, solver=args.solver, cost_model=args.cost_model,
             time_limit_s=args.time_limit, device_name=args.device, progress=not args.quiet)
    p.to_json(args.out)
    print(p.summary())
    print(f"traced in {p.trace_seconds:.1f} s, solved in {p.solve_seconds:.1f} s; wrote {args.out}")
    return 0


def load_size_factory(spec: str):
    """Import MODULE:FACTORY (for `fit`, a function of one size parameter returning (model, sample_input))."""
    import importlib

    if ":" not in spec:
        raise ArgumentError(f"expected MODULE:FACTORY, got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:  # `python -m planner` has the working directory on sys.path; PYTHONPATH adds others
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ArgumentError(f"cannot load {spec}: {e} (MODULE is imported from the working directory and "
                            "PYTHONPATH)") from None
    if not callable(factory):
        raise ArgumentError(f"{spec} is not a function (it is {type(factory).__name__} {factory!r})")
    return factory


def cmd_fit(args: argparse.Namespace) -> int:
    from planner.core.progress import Reporter
    from planner.tools.fit import max_batch
    from planner.whole.api import GB

    make = load_size_factory(args.factory)
    _check_callable_with(make, (args.start,), f"{args.factory} must take one size (an int)")
    with Reporter(True) as say:
        fit = max_batch(make, args.budget / GB, max_overhead=args.max_overhead, time_limit_s=args.time_limit,
                        cost_model=args.cost_model, start=args.start, progress=say)
    print(fit.summary())
    if fit.n is None:
        return 2
    if args.out:
        fit.plan.to_json(args.out)
        print(f"wrote the plan of size {fit.n} to {args.out}")
    return 0


def cmd_curve(args: argparse.Namespace) -> int:
    from planner.core.progress import Reporter
    from planner.tools.curve import overhead_curve

    model, sample = load_factory(args.factory)
    t0 = time.perf_counter()
    with Reporter(True) as say:
        curve = overhead_curve(model, sample, points=args.points, cost_model=args.cost_model,
                               time_limit_s=args.time_limit, torch_compile_budget=args.torch_compile_budget or None,
                               progress=say)
    curve.plot(args.out, title=args.factory)
    print(curve.table())
    print(f"drew {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from planner.core.plan_type import Plan

    if not Path(args.plan).is_file():
        raise ArgumentError(f"no plan file at {args.plan!r}")
    p = Plan.load(args.plan)
    print(p.explain())
    return 0


def cmd_min_budget(args: argparse.Namespace, graph, ref: int) -> int:
    from solvers.bounds.min_budget import min_budget

    mb = min_budget(graph, time_limit_s=args.time_limit or 60.0)
    if args.out:
        save_result(args.out, graph, mb.result, extra={"reference_peak_bytes": ref, "min_budget": {
            "budget_bytes": mb.budget_bytes, "lower_bound_bytes": mb.lower_bound_bytes, "proof": mb.proof}})
    print(f"{graph.name}: min_budget_bytes={mb.budget_bytes} ({mb.budget_bytes / ref:.4f} x reference peak) "
          f"met by {mb.result.solver} (overhead {100 * mb.result.overhead:.3f}%); "
          f"{'proven' if mb.proven else 'not proven'}: {mb.proof}")
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    graph = load_benchmark(args.graph)
    ref = reference_peak_bytes(graph)
    if args.min_budget:
        return cmd_min_budget(args, graph, ref)
    if args.solver is None:
        raise ArgumentError("--solver is required with --budget-multiplier or --budget-bytes")
    if args.budget_bytes is not None:
        budget = args.budget_bytes
    else:
        budget = budget_from_multiplier(graph, args.budget_multiplier)
    result = solve(graph, budget, args.solver, time_limit_s=args.time_limit)
    if args.out:
        save_result(args.out, graph, result, extra={"reference_peak_bytes": ref})
    print(f"{graph.name}: {result.summary()} reference_peak={ref}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.command == "solve":
            return cmd_solve(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "show":
            return cmd_show(args)
        if args.command == "fit":
            return cmd_fit(args)
        if args.command == "curve":
            return cmd_curve(args)
    except InfeasibleBudgetError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 2
    except NoSolutionInTimeError as e:
        print(f"no schedule found in {time.perf_counter() - t0:.1f} s: {e}", file=sys.stderr)
        return 3
    except RematError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file named on the command line that cannot be read or written
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1
