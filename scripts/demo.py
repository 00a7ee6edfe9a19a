"""The README's main job: plan the bundled U-Net training graph at several budgets with every solver.

Run with `make demo` (or `.venv/bin/python scripts/demo.py [GRAPH.json]`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphs.benchmarks import load_benchmark  # noqa: E402
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from graphs.simulate import budget_from_multiplier, reference_peak_bytes  # noqa: E402
from solvers.base import solve, solver_names  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "unet.json"


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else EXAMPLE
    graph = load_benchmark(path)
    ref = reference_peak_bytes(graph)
    print(f"{graph.name}: {graph.n} nodes, reference peak {ref / 1e9:.3f} GB, "
          f"single-operation bound {graph.single_op_bound_bytes() / ref:.3f} of it")
    print(f"{'solver':<20} {'budget':>6} {'status':<10} {'peak/budget':>11} {'overhead':>9} {'seconds':>8}")
    for mult in (1.0, 0.9, 0.8, 0.7):
        budget = budget_from_multiplier(graph, mult)
        for name in solver_names():
            try:
                r = solve(graph, budget, name, time_limit_s=30)
            except InfeasibleBudgetError as e:
                print(f"{name:<20} {mult:>6.2f} {'infeasible':<10} needs {e.min_budget_bytes / ref:.3f} x reference")
                continue
            except NoSolutionInTimeError:
                print(f"{name:<20} {mult:>6.2f} no solution in time")
                continue
            print(f"{name:<20} {mult:>6.2f} {r.status.value:<10} {r.peak_bytes / budget:>11.3f} "
                  f"{100 * r.overhead:>8.2f}% {r.solve_seconds:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
