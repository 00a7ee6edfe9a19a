"""Compare solvers over benchmark graphs and budget multipliers.

Writes <out>/results.json, <out>/results.md (overhead %, peak/budget, status, lower bound, gap, seconds),
<out>/pivot.md (one column per solver) and <out>/overhead_vs_budget.png (one panel per graph, one curve per solver,
the lower bound as a band).

    .venv/bin/python scripts/compare_solvers.py --graphs vgg16 unet --solvers auto chen_greedy \
        --multipliers 1.0 0.9 0.8 --time-limit 60 --out results/compare

`--multipliers` may include `min`: the graph's smallest feasible budget (solvers/min_budget.py, as
`python -m planner solve GRAPH --min-budget` reports it), found once per graph; progress is printed one line per
solve.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphs.benchmarks import CHECKMATE_GRAPHS, RANDOM_LAYERED_GRAPHS, benchmark_path, load_benchmark  # noqa: E402
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError  # noqa: E402
from graphs.simulate import budget_from_multiplier, reference_peak_bytes  # noqa: E402
from solvers.base import solve, solver_names  # noqa: E402
from solvers.bounds.min_budget import min_budget  # noqa: E402


def run_one(graph, budget: int, solver: str, time_limit: float) -> dict:
    row: dict = {"solver": solver, "budget_bytes": budget}
    t0 = time.perf_counter()
    try:
        r = solve(graph, budget, solver, time_limit_s=time_limit)
    except InfeasibleBudgetError as e:
        row.update(status="infeasible", min_budget_bytes=e.min_budget_bytes, reason=e.reason)
    except NoSolutionInTimeError:
        row.update(status="no solution in time")
    except RematError as e:
        row.update(status="error", error=str(e))
    else:
        lb = r.lower_bound_cost
        row.update(status=r.status.value, overhead=r.overhead, total_cost=r.total_cost, peak_bytes=r.peak_bytes,
                   lower_bound_cost=lb, chosen=r.info.get("chosen"),
                   gap=None if lb is None or lb <= 0 else (r.total_cost - lb) / lb)
    row["seconds"] = time.perf_counter() - t0
    return row


def fmt_row(graph: str, mult, row: dict, ref: int, total_cost: float) -> str:
    st = row["status"]
    if "overhead" in row:
        lb = row.get("lower_bound_cost")
        lb_s = "-" if lb is None else f"{100 * (lb / total_cost - 1):.2f} %"
        gap = row.get("gap")
        gap_s = "-" if gap is None else f"{100 * gap:.2f} %"
        via = f" ({row['chosen']})" if row.get("chosen") else ""
        return (f"| {graph} | {mult} | {row['solver']}{via} | {100 * row['overhead']:.2f} % | "
                f"{row['peak_bytes'] / row['budget_bytes']:.3f} | {st} | {lb_s} | {gap_s} | {row['seconds']:.1f} |")
    extra = ""
    if row.get("min_budget_bytes"):
        extra = f" (needs {row['min_budget_bytes'] / ref:.3f} x ref)"
    return f"| {graph} | {mult} | {row['solver']} | - | - | {st}{extra} | - | - | {row['seconds']:.1f} |"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    graphs = sorted({r["graph"] for r in rows}, key=lambda g: [r["graph"] for r in rows].index(g))
    cols = min(3, len(graphs))
    nrows = math.ceil(len(graphs) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, g in zip(axes.flat, graphs):
        grows = [r for r in rows if r["graph"] == g and "overhead" in r]
        for solver in sorted({r["solver"] for r in grows}):
            pts = sorted((r["budget_fraction"], 100 * r["overhead"]) for r in grows if r["solver"] == solver)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=solver)
        bounds = {}
        for r in grows:
            if r.get("lower_bound_cost") is not None:
                lb = 100 * (r["lower_bound_cost"] / r["graph_total_cost"] - 1)
                bounds[r["budget_fraction"]] = max(bounds.get(r["budget_fraction"], -1e9), lb)
        if bounds:
            xs = sorted(bounds)
            ax.fill_between(xs, [0] * len(xs), [bounds[x] for x in xs], alpha=0.15, color="gray",
                            label="below lower bound")
        ax.set_title(g)
        ax.set_xlabel("budget / reference peak")
        # linear below 1 %, logarithmic above: the optima (0.1-10 %) and the lowest-memory rebuild (up to
        # ~1500 %) share one axis
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylabel("overhead % (log above 1 %)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(graphs):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pivot(rows: list[dict]) -> str:
    """One row per graph and budget, one column per solver: overhead (auto also with its status and gap)."""
    solvers = list(dict.fromkeys(r["solver"] for r in rows))
    keys = list(dict.fromkeys((r["graph"], str(r["multiplier"])) for r in rows))
    cell = {(r["graph"], str(r["multiplier"]), r["solver"]): r for r in rows}
    out = ["| graph | budget | " + " | ".join(solvers) + " |", "| --- | --- |" + " --- |" * len(solvers)]
    for g, m in keys:
        frac = next(r["budget_fraction"] for r in rows if r["graph"] == g and str(r["multiplier"]) == m)
        label = m if m != "min" else f"min ({frac:.3f})"
        vals = []
        for s in solvers:
            r = cell.get((g, m, s))
            if r is None:
                vals.append("")
            elif "overhead" in r:
                v = f"{100 * r['overhead']:.2f} %"
                if s == "auto":
                    gap = "" if r.get("gap") is None else f", gap {100 * r['gap']:.2f} %"
                    v += f" ({r['status']}{gap}, {r['seconds']:.0f} s)"
                vals.append(v)
            else:
                vals.append("infeasible" if r["status"] == "infeasible" else r["status"])
        out.append(f"| {g} | {label} | " + " | ".join(vals) + " |")
    mins = {r["graph"]: r for r in rows if str(r["multiplier"]) == "min" and r.get("min_budget_proof")}
    if mins:
        out += ["", "| graph | smallest budget (x reference) | proven | how nothing smaller is known to fail |",
                "| --- | --- | --- | --- |"]
        for g, r in mins.items():
            out.append(f"| {g} | {r['budget_fraction']:.4f} | {'yes' if r['min_budget_proven'] else 'no'} | "
                       f"{r['min_budget_proof']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", default=list(CHECKMATE_GRAPHS + RANDOM_LAYERED_GRAPHS))
    p.add_argument("--solvers", nargs="+", default=["auto"])
    p.add_argument("--multipliers", nargs="+", default=["0.9", "0.8"])
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--out", default="results/compare")
    p.add_argument("--replot", metavar="RESULTS_JSON",
                   help="only rewrite pivot.md and the plot from an earlier run's results.json")
    args = p.parse_args(argv)
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())
        out = Path(args.replot).parent
        (out / "pivot.md").write_text(pivot(rows))
        plot(rows, out / "overhead_vs_budget.png")
        print(f"wrote {out / 'pivot.md'}, {out / 'overhead_vs_budget.png'}")
        return 0
    unknown = [s for s in args.solvers if s not in solver_names()]
    if unknown:
        p.error(f"unknown solvers {unknown}; known: {solver_names()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    md = ["| graph | budget | solver | overhead | peak / budget | status | lower bound (overhead) | gap | seconds |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    jobs = [(g, m, s) for g in args.graphs for m in args.multipliers for s in args.solvers]
    graphs = {}
    min_budgets: dict = {}
    for k, (gname, mult, solver) in enumerate(jobs, 1):
        if gname not in graphs:
            g = load_benchmark(benchmark_path(gname))
            graphs[gname] = (g, reference_peak_bytes(g))
        g, ref = graphs[gname]
        if mult == "min":
            key = ("min", gname)
            if key not in min_budgets:
                mb = min_budget(g, time_limit_s=args.time_limit)
                min_budgets[key] = mb
                print(f"    {gname}: smallest feasible budget {mb.budget_bytes / ref:.4f} x reference; {mb.proof}",
                      flush=True)
            budget = min_budgets[key].budget_bytes
            frac = budget / ref
        else:
            budget = budget_from_multiplier(g, float(mult))
            frac = float(mult)
        row = run_one(g, budget, solver, args.time_limit)
        row.update(graph=gname, multiplier=mult, budget_fraction=frac, graph_total_cost=g.total_cost,
                   reference_peak_bytes=ref)
        if mult == "min":
            mb = min_budgets[("min", gname)]
            row.update(min_budget_proof=mb.proof, min_budget_proven=mb.proven,
                       min_budget_lower_bytes=mb.lower_bound_bytes)
        rows.append(row)
        line = fmt_row(gname, mult, row, ref, g.total_cost)
        md.append(line)
        print(f"[{k}/{len(jobs)}] {line}", flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "pivot.md").write_text(pivot(rows))
    plot(rows, out / "overhead_vs_budget.png")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'overhead_vs_budget.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
