"""Command line: `python -m planner solve GRAPH.json (--budget-multiplier M | --budget-bytes B) --solver NAME ...`.

Exit status: 0 on success, 2 for an infeasible budget or bad input, 3 when no schedule was found in time.
"""
from __future__ import annotations

import argparse
import sys

from graphs.benchmarks import load_benchmark
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.schedule_json import save_result
from graphs.simulate import budget_from_multiplier, reference_peak_bytes
from solvers.base import solve, solver_names


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m planner", description="Optimal activation-checkpoint planner")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("solve", help="solve a benchmark graph (node-link JSON) under a memory budget")
    s.add_argument("graph", help="graph file: a benchmark node-link JSON")
    b = s.add_mutually_exclusive_group(required=True)
    b.add_argument("--budget-multiplier", type=float, help="budget = ceil(M x reference peak)")
    b.add_argument("--budget-bytes", type=int, help="budget in bytes")
    b.add_argument("--min-budget", action="store_true",
                   help="find the smallest feasible budget, print how it is known, and write its schedule")
    s.add_argument("--solver", default=None, help=f"one of: {', '.join(solver_names())} (required with a budget)")
    s.add_argument("--time-limit", type=float, default=None, help="seconds for the solver (exact solvers)")
    s.add_argument("--out", help="write the schedule as remat-schedule JSON here")
    return p


def cmd_min_budget(args: argparse.Namespace, graph, ref: int) -> int:
    from solvers.min_budget import min_budget

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
        raise SystemExit("--solver is required with --budget-multiplier or --budget-bytes")
    if args.budget_bytes is not None:
        budget = args.budget_bytes
    else:
        if args.budget_multiplier <= 0:
            raise SystemExit("--budget-multiplier must be > 0")
        budget = budget_from_multiplier(graph, args.budget_multiplier)
    result = solve(graph, budget, args.solver, time_limit_s=args.time_limit)
    if args.out:
        save_result(args.out, graph, result, extra={"reference_peak_bytes": ref})
    print(f"{graph.name}: {result.summary()} reference_peak={ref}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "solve":
            return cmd_solve(args)
    except InfeasibleBudgetError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 2
    except NoSolutionInTimeError as e:
        print(f"no solution: {e}", file=sys.stderr)
        return 3
    except RematError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1
