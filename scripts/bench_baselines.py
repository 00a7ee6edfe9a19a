"""The planner against the checkpointing people write by hand, each at its own measured peak: per-block
checkpointing, selective checkpointing with the matmul+attention save policy (torchtitan's and Megatron's), and
torch.compile under its activation memory budget.

    .venv/bin/python scripts/bench_baselines.py [--models gpt2:bench llama:bench gpt2:decoder512 llama:decoder512]
        [--repeats 5] [--time-limit 60] [--compile-budget 0.5] [--out docs/results/baselines.json]

Models are `examples.hf_zoo` builds NAME:SIZE with labels (the model's own loss); "decoder512" is compute-bound: 8
layers of width 512, sequence 512, GPT-2's vocabulary. For each baseline B: its measured peak P_B (storage-tracking
dispatch mode; the allocator's stream for torch.compile, whose kernels the dispatch mode cannot see), then the
planner at budget P_B: its measured peak (the same way as B's) and step time, medians of interleaved steps (eager, B
and the planner in turns); against torch.compile the plan runs compiled too (`apply(compile=True)`). Gradients are
compared bitwise with eager's under one seed. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from examples.hf_zoo import build  # noqa: E402
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import allocator_peak_bytes, interleaved_step_seconds, measure_peak_bytes, run_step  # noqa: E402


def same_grads(got, want) -> bool:
    g, w = got[0], want[0]
    strip = {k.removeprefix("module."): v for k, v in g.items()}
    return strip.keys() == w.keys() and all(
        (a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in ((strip[k], w[k]) for k in w))


def compiled_under_budget(model, batch, budget: float):
    m = torch.compile(copy.deepcopy(model))
    with torch._functorch.config.patch(activation_memory_budget=budget):
        run_step(m, batch)  # compiles under the budget
    return m


def bench_model(spec: str, args) -> list[dict]:
    name, size = spec.split(":")
    model, batch = build(name, size, labels=True)
    t0 = time.perf_counter()
    want = step_state(copy.deepcopy(model), batch, seed=3)
    baselines = {"per-block checkpointing": per_block_checkpointed(model),
                 "selective checkpointing": per_block_checkpointed(model, selective=True)}
    peaks = {label: measure_peak_bytes(m, batch) for label, m in baselines.items()}
    if args.compile_budget:
        label = f"torch.compile (budget {args.compile_budget:g})"
        try:
            baselines[label] = compiled_under_budget(model, batch, args.compile_budget)
            peaks[label] = allocator_peak_bytes(baselines[label], batch)
        except Exception as e:  # a model torch.compile cannot train
            print(f"{spec}: torch.compile failed: {type(e).__name__}: {e}", file=sys.stderr)
            baselines.pop(label, None)
    first = plan(model, batch, 1000.0, time_limit_s=args.time_limit)
    rows = []
    for label, base in baselines.items():
        t = time.perf_counter()
        try:
            p = plan(model, batch, peaks[label] / GB, time_limit_s=args.time_limit, traced=first.traced,
                     progress=args.progress)
        except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
            rows.append({"model": spec, "baseline": label, "baseline_peak_bytes": peaks[label],
                         "planner_error": f"{type(e).__name__}: {e}", "plan_seconds": time.perf_counter() - t,
                         "planner_min_budget_bytes": e.min_budget_bytes})
            print(f"{spec} {label}: {rows[-1]}", file=sys.stderr, flush=True)
            continue
        plan_s = time.perf_counter() - t
        compiled = label.startswith("torch.compile")
        planned = p.apply(copy.deepcopy(model), compile=compiled)  # against torch.compile: the plan compiled too
        ours_peak = (allocator_peak_bytes if compiled else measure_peak_bytes)(planned, batch)
        ok_base = same_grads(step_state(base, batch, seed=3), want)
        ok_ours = same_grads(step_state(planned, batch, seed=3), want)
        times = interleaved_step_seconds({"eager": model, "base": base, "ours": planned}, batch,
                                         repeats=args.repeats, warmup=1)
        eager_s = times["eager"].median_s
        rows.append({"model": spec, "baseline": label, "baseline_peak_bytes": peaks[label],
                     "baseline_step_over_eager": times["base"].median_s / eager_s, "baseline_grads_equal": ok_base,
                     "planner_peak_bytes": ours_peak, "planner_step_over_eager": times["ours"].median_s / eager_s,
                     "planner_grads_equal": ok_ours, "planner_overhead": p.overhead, "planner_solver": p.solver,
                     "planner_status": p.status.value, "plan_seconds": plan_s, "eager_step_s": eager_s})
        print(f"{spec} {label}: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{spec}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    out = ["| model | baseline | its peak (MB), step / eager | planner at that peak: peak (MB), step / eager | "
           "planner overhead (solver) | grads == eager (baseline / planner) |", "|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['baseline']} | {r['baseline_peak_bytes'] / 1e6:.2f}"
        if "planner_error" in r:
            least = r["planner_min_budget_bytes"]
            out.append(f"{head} | {r['planner_error'].split(':')[0]}"
                       + ("" if least is None else f": needs {least / 1e6:.2f}") + " | | |")
            continue
        grads = "both compiled: not bitwise" if r["baseline"].startswith("torch.compile") else \
            f"{'yes' if r['baseline_grads_equal'] else 'no'} / {'yes' if r['planner_grads_equal'] else 'NO'}"
        out.append(f"{head}, {r['baseline_step_over_eager']:.2f} | {r['planner_peak_bytes'] / 1e6:.2f}, "
                   f"**{r['planner_step_over_eager']:.2f}** | {100 * r['planner_overhead']:.2f} % "
                   f"({r['planner_solver']}) | {grads} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt2:bench", "llama:bench", "gpt2:decoder512",
                                                    "llama:decoder512"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--compile-budget", type=float, default=0.5, help="0: no torch.compile rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action="store_true", help="plan() progress lines on stderr")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--append", action="store_true", help="add the rows to those already in --out")
    ap.add_argument("--table", action="store_true", help="print the table of the rows in --out, measure nothing")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    torch.set_num_threads(args.threads)
    rows = [r for spec in args.models for r in bench_model(spec, args)]
    if args.out and args.append and Path(args.out).exists():
        rows = json.loads(Path(args.out).read_text()) + rows
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))

if __name__ == "__main__":
    main()
