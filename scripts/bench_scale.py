"""Planning at scale: seconds, overhead, lower bound and gap on traced real models and large generated graphs.

    .venv/bin/python scripts/bench_scale.py --part small     # GPT-2-small shape, 12 and 24 layers, seq 512, batch 1
    .venv/bin/python scripts/bench_scale.py --part tiny [--size bench]  # the transformers zoo, 60 % and 40 %
    .venv/bin/python scripts/bench_scale.py --part generated # 600-2000-node generated training graphs vs DTR
    .venv/bin/python scripts/bench_scale.py --part decoders  # 707-1435-node generated decoders at 0.15 and 0.1
    [--time-limit S] [--out results/scale]

Models (`examples/hf_zoo.py`, random weights, labels given: the model's own loss) are traced once with measured op
times; `plan()` is then timed at each budget (a fraction of the no-recomputation peak; where that is below the smallest
feasible budget, at the smallest budget plan()'s InfeasibleBudgetError names). Generated graphs
(`graphs.generate.random_training_graph`, `decoder_training_graph`) are solved by `auto` and by the DTR-style
baselines at 0.5, 0.3 and 0.1 of the reference peak. Columns: nodes, budget / reference peak, seconds, overhead,
the lower bound as an overhead, what the bound covers (`every schedule`: the forced-recomputation bound; or the
family of the solver that proved it), gap = (cost - bound) / bound, and the solver whose schedule was returned.
Writes OUT/<part>.json and OUT/<part>.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from graphs.simulate import budget_from_multiplier, reference_peak_bytes  # noqa: E402
from solvers.base import solve  # noqa: E402

HEADER = ("| graph | nodes | budget / ref | seconds | overhead | bound (overhead) | bound covers | gap | solver |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")


def scope_of(info: dict) -> str:
    src = info.get("bound_from")
    if src is None:
        return "none"
    if src == "order_bound":
        return "program-order schedules"
    if src in ("forced_bound", "each_node_once"):
        return "every schedule" + (" (each node once)" if src == "each_node_once" else "")
    return f"{src}'s family"


def row_md(r: dict) -> str:
    if r.get("error"):
        return (f"| {r['graph']} | {r['nodes']} | {r['budget_fraction']:.3f} | {r['seconds']:.1f} | "
                f"{r['error']} | | | | |")
    bound = "" if r["bound_overhead"] is None else f"{100 * r['bound_overhead']:.2f} %"
    gap = "" if r["gap"] is None else f"{100 * r['gap']:.2f} %"
    return (f"| {r['graph']} | {r['nodes']} | {r['budget_fraction']:.3f} | {r['seconds']:.1f} | "
            f"{100 * r['overhead']:.2f} % | {bound} | {r['bound_covers']} | {gap} | {r['solver']} |")


def summarise(name: str, graph, frac: float, seconds: float, total_cost: float, lower: float | None, info: dict,
              solver: str, status: str) -> dict:
    base = graph.total_cost
    gap = None if lower is None or lower <= 0 else (total_cost - lower) / lower
    return dict(graph=name, nodes=graph.n, budget_fraction=frac, seconds=seconds, overhead=total_cost / base - 1,
                bound_overhead=None if lower is None else lower / base - 1, gap=gap, bound_covers=scope_of(info),
                solver=solver, status=status)


def part_models(names: list[str], size: str, fracs: list[float], time_limit: float) -> list[dict]:
    import torch

    from capture.module_tags import trace_model
    from examples.hf_zoo import build
    from planner import GB, plan
    from planner.core.solver_graph import solver_graph

    torch.set_num_threads(1)
    rows = []
    for name in names:
        model, batch = build(name, size, labels=True)
        t0 = time.perf_counter()
        traced = trace_model(model, batch, "time")
        t_trace = time.perf_counter() - t0
        graph = solver_graph(traced)
        ref = reference_peak_bytes(graph)
        label = f"{name} ({size})"
        print(f"{label}: {graph.n} nodes, traced in {t_trace:.0f} s, no-recomputation peak {ref / GB:.4f} GB",
              flush=True)
        for frac in fracs:
            budget = int(frac * ref)
            t1 = time.perf_counter()
            note = ""
            try:
                try:
                    p = plan(model, batch, budget / GB, traced=traced, time_limit_s=time_limit)
                except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
                    if e.min_budget_bytes is None:
                        raise
                    # below the smallest feasible budget (plan() names it), or nothing found below the least budget
                    # known to work: plan there
                    note = (f"{frac:.0%} raised to the smallest feasible budget" if isinstance(e, InfeasibleBudgetError)
                            else f"{frac:.0%}: nothing found in time; raised to the least budget known to work")
                    print(f"  {note}: {e.min_budget_bytes / ref:.4f} x peak ({time.perf_counter() - t1:.0f} s)",
                          flush=True)
                    budget = int(e.min_budget_bytes)
                    t1 = time.perf_counter()
                    p = plan(model, batch, budget / GB, traced=traced, time_limit_s=time_limit)
            except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
                r = dict(graph=label, nodes=graph.n, budget_fraction=budget / ref, seconds=time.perf_counter() - t1,
                         error=type(e).__name__)
            else:
                r = summarise(label, p.graph, budget / ref, time.perf_counter() - t1, p.result.total_cost,
                              p.lower_bound_cost, p.result.info, p.result.info.get("chosen", p.solver),
                              p.status.value)
                r["solve_seconds"] = p.solve_seconds
            r["requested_fraction"] = frac
            r["note"] = note
            rows.append(r)
            print("  " + row_md(r), flush=True)
    return rows


def part_generated(time_limit: float, decoders_only: bool = False) -> list[dict]:
    from graphs.generate import decoder_training_graph, random_training_graph

    if decoders_only:  # 707-1435 nodes at the tightest budgets
        graphs = [decoder_training_graph(27, seed=1), decoder_training_graph(48, seed=2),
                  decoder_training_graph(55, seed=3)]
        fracs = (0.15, 0.1)
    else:
        graphs = [random_training_graph(300, seed=1), random_training_graph(600, seed=2),
                  random_training_graph(1000, seed=3), decoder_training_graph(24, seed=1),
                  decoder_training_graph(48, seed=2), decoder_training_graph(75, seed=3)]
        fracs = (0.5, 0.3, 0.1)
    rows = []
    for g in graphs:
        for frac in fracs:
            budget = budget_from_multiplier(g, frac)
            r: dict = {}
            for solver in ("auto", "dtr", "dtr_local"):
                t0 = time.perf_counter()
                try:
                    res = solve(g, budget, solver, time_limit_s=time_limit)
                except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
                    r[solver] = None
                    if solver == "auto":
                        r = dict(graph=g.name, nodes=g.n, budget_fraction=frac, seconds=time.perf_counter() - t0,
                                 error=type(e).__name__)
                    continue
                if solver == "auto":
                    r.update(summarise(g.name, g, frac, time.perf_counter() - t0, res.total_cost,
                                       res.lower_bound_cost, res.info, res.info.get("chosen", "auto"),
                                       res.status.value))
                else:
                    r[solver] = res.total_cost / g.total_cost - 1
            rows.append(r)
            print(row_md(r) + f" dtr {fmt(r.get('dtr'))} | dtr_local {fmt(r.get('dtr_local'))} |", flush=True)
    return rows


def fmt(x) -> str:
    return "stuck" if x is None else f"{100 * x:.2f} %"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("small", "tiny", "generated", "decoders"), required=True)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds per plan (default: 60 for small and generated, 15 for tiny)")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--size", default="test", help="the zoo size for --part tiny (test or bench)")
    ap.add_argument("--sizes", nargs="+", default=["small", "small24"], help="the zoo sizes for --part small")
    ap.add_argument("--fractions", nargs="+", type=float, default=None,
                    help="budgets as fractions of the no-recomputation peak (default: 0.7 0.5 0.3 small, 0.6 0.4 tiny)")
    ap.add_argument("--out", default="results/scale")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "small":
        rows = []
        for size in args.sizes:
            rows += part_models(args.models or ["gpt2"], size, args.fractions or [0.7, 0.5, 0.3],
                                args.time_limit or 60.0)
        md = [HEADER] + [row_md(r) for r in rows]
    elif args.part == "tiny":
        rows = part_models(args.models or ["gpt2", "llama", "bert", "vit", "resnet", "convnext", "t5"], args.size,
                           args.fractions or [0.6, 0.4], args.time_limit or 15.0)
        md = [HEADER] + [row_md(r) for r in rows]
    else:
        rows = part_generated(args.time_limit or 60.0, decoders_only=args.part == "decoders")
        md = [HEADER.replace(" solver |", " solver | dtr | dtr_local |").replace("| --- |\n", "| --- |\n")
              .replace("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
                       "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |")]
        md += [row_md(r) + f" {fmt(r.get('dtr'))} | {fmt(r.get('dtr_local'))} |" for r in rows]
    stem = args.part + ("_" + args.size if args.part == "tiny" and args.size != "test" else "")
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out / (stem + '.json')}, {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
