"""Measure the CP-SAT solver on benchmark graphs: `python -m scripts.measure_cpsat [--limit S] GRAPH... [--mult M...]`.

Prints one line per (graph, multiplier): status, overhead, lower bound, gap, seconds (wall, including the hint
and the model build), hint used, and CP-SAT's own status. Used to produce the figures in the CP-SAT report.
"""
from __future__ import annotations

import argparse
import json
import time

from graphs.benchmarks import benchmark_path, load_benchmark
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.simulate import budget_from_multiplier
from solvers.base import solve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--mult", nargs="+", type=float, default=[0.9, 0.8])
    ap.add_argument("--limit", type=float, default=60.0)
    ap.add_argument("--C", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], help="extra SatParameters field=value (JSON value)")
    ap.add_argument("--log", action="store_true")
    a = ap.parse_args(argv)
    params = {}
    for p in a.param:
        k, v = p.split("=", 1)
        params[k] = json.loads(v)
    for name in a.graphs:
        g = load_benchmark(benchmark_path(name))
        for m in a.mult:
            b = budget_from_multiplier(g, m)
            t = time.perf_counter()
            try:
                r = solve(g, b, "cpsat", time_limit_s=a.limit, max_computations=a.C, parameters=params, log=a.log)
                gap = r.info.get("gap")
                lb = "none" if r.lower_bound_cost is None else f"{100 * (r.lower_bound_cost / g.total_cost - 1):.3f}%"
                gp = "none" if gap is None else f"{100 * gap:.3f}%"
                print(f"{name} {m} status={r.status.value} overhead={100 * r.overhead:.3f}% "
                      f"lb_overhead={lb} gap={gp} "
                      f"seconds={time.perf_counter() - t:.1f} hint={r.info.get('hint')} "
                      f"cpsat={r.info.get('cpsat_status')} feasibility_phase={r.info.get('feasibility_phase')}",
                      flush=True)
            except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
                print(f"{name} {m} {type(e).__name__}: {e} seconds={time.perf_counter() - t:.1f}", flush=True)


if __name__ == "__main__":
    main()
