"""The compiled planner (`plan.apply(model, compile=True)`) against torch.compile's own memory budget.

    .venv/bin/python scripts/bench_compile.py [--models gpt2 bert resnet] [--size bench] [--budget 0.5]
        [--repeats 7] [--time-limit 30] [--out docs/results/compile.json]

For each real-architecture model (examples/hf_zoo: a decoder LM and an encoder with dropout, a conv net with
BatchNorm; the model computes its own loss from labels), on CPU inductor with one torch thread:
1. torch.compile(model) without a budget, and with torch._functorch.config.activation_memory_budget = --budget;
2. the planner at the measured peak of (1) under --budget, applied with compile=True; and at 100 % of the
   no-recomputation peak, compiled, as the reference of its own draws; where the compiled plan measures above (1)'s
   peak, also the plan at equal measured peak: its budget lowered by the measured excess until the compiled step
   measures at most (1)'s peak (`plan_equal_*`);
3. eager, as the reference of the gradients.
Peaks are measured from the allocator's stream (torch.profiler with profile_memory: inductor's buffers included);
step times are medians of interleaved steps (forward, loss, backward); gradients are compared with eager's and,
with dropout, each compiled variant under --budget with the same variant at full memory, under one seed (relative
norm of the difference over all parameters). Compile time is the first step's time less a median step.
Prints a markdown table; --out writes the rows as JSON.
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

from examples import hf_zoo  # noqa: E402
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from harness.eager_compare import relative_difference, step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.tools.measure import (  # noqa: E402
    allocator_peak_bytes,
    first_step_seconds,
    interleaved_step_seconds,
)


def torch_compiled(model, batch, budget: float | None):
    """torch.compile(model), compiled now (first step) under activation_memory_budget `budget`."""
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    compiled = torch.compile(m)
    with torch._functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget):
        first = first_step_seconds(compiled, batch)
    return compiled, first


EQUAL_PEAK_TRIES = 4


def at_equal_measured_peak(model, batch, target_bytes: int, measured_bytes: int, full, time_limit_s: float):
    """Where the compiled plan at torch.compile's peak measures above it (inductor holds buffers the plan does not
    model): plan again with the budget lowered by the measured excess, until the compiled step's measured peak is
    at most the target. Returns (plan, compiled module, measured peak), or None if no budget tried gets there."""
    budget = target_bytes
    for _ in range(EQUAL_PEAK_TRIES):
        budget -= measured_bytes - target_bytes
        try:
            q = plan(model, batch, budget / GB, time_limit_s=time_limit_s, traced=full.traced)
        except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
            print(f"  equal peak: nothing planned at {budget} bytes ({type(e).__name__})", flush=True)
            return None
        module = q.apply(model, compile=True)
        first_step_seconds(module, batch)
        measured_bytes = allocator_peak_bytes(module, batch)
        print(f"  equal peak: planned at {budget} bytes, compiled step measures {measured_bytes}", flush=True)
        if measured_bytes <= target_bytes:
            return q, module, measured_bytes
    return None


def bench_model(name: str, size: str, budget: float, repeats: int, time_limit_s: float) -> dict:
    torch.manual_seed(0)
    model, batch = hf_zoo.build(name, size, labels=True)
    row: dict = {"model": name, "kind": hf_zoo.KIND[name], "size": size, "budget": budget}
    eager_grads, _, _ = step_state(model, batch, seed=11)

    tc_full, tc_full_first = torch_compiled(model, batch, None)
    tc_budget, tc_budget_first = torch_compiled(model, batch, budget)
    tc_peak = allocator_peak_bytes(tc_budget, batch)
    row["torch_compile_peak_bytes"] = tc_peak
    row["torch_compile_full_peak_bytes"] = allocator_peak_bytes(tc_full, batch)

    full = plan(model, batch, 1e6, time_limit_s=time_limit_s)
    row["trace_s"] = full.trace_seconds
    t1 = time.perf_counter()
    p = plan(model, batch, tc_peak / GB, time_limit_s=time_limit_s, traced=full.traced)
    row["plan_s"] = time.perf_counter() - t1
    row.update(nodes=len(p.graph), predicted_peak_bytes=p.predicted_peak_bytes, overhead=p.overhead,
               status=p.status.value, solver=p.solver, eager_peak_bytes=full.predicted_peak_bytes)
    planned = p.apply(model, compile=True)
    planned_first = first_step_seconds(planned, batch)
    planned_full = full.apply(model, compile=True)
    first_step_seconds(planned_full, batch)
    row["plan_peak_bytes"] = allocator_peak_bytes(planned, batch)
    row["plan_eager_peak_bytes"] = allocator_peak_bytes(p.apply(model), batch)
    modules = {"eager": model, "torch_compile": tc_full, "torch_compile_budget": tc_budget,
               "plan_compiled": planned, "plan_compiled_full": planned_full}
    if row["plan_peak_bytes"] > tc_peak:
        equal = at_equal_measured_peak(model, batch, tc_peak, row["plan_peak_bytes"], full, time_limit_s)
        if equal is not None:
            q, module, peak = equal
            modules["plan_compiled_equal"] = module
            row.update(plan_equal_budget_bytes=q.budget_bytes, plan_equal_peak_bytes=peak,
                       plan_equal_predicted_peak_bytes=q.predicted_peak_bytes, plan_equal_overhead=q.overhead)

    # the dropout criterion at half of the no-recomputation peak: the compiled plan there against its own full-memory
    # gradients (recomputed random ops redraw their first draw)
    half = None
    try:
        half = plan(model, batch, 0.5 * full.predicted_peak_bytes / GB, time_limit_s=time_limit_s, traced=full.traced)
    except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
        row["plan_half_error"] = f"{type(e).__name__}: {e}"
    if half is not None:
        row.update(plan_half_budget_bytes=half.budget_bytes, plan_half_overhead=half.overhead)

    times = interleaved_step_seconds(modules, batch, repeats=repeats)
    row.update({f"{k}_step_s": v.median_s for k, v in times.items()})
    row["torch_compile_compile_s"] = tc_budget_first - times["torch_compile_budget"].median_s
    row["torch_compile_full_compile_s"] = tc_full_first - times["torch_compile"].median_s
    row["plan_compile_s"] = planned_first - times["plan_compiled"].median_s
    row["plan_inductor_s"] = planned.compile_seconds

    grads = {}
    for label, m in (("torch_compile", tc_full), ("torch_compile_budget", tc_budget), ("plan_compiled", planned),
                     ("plan_compiled_full", planned_full), ("plan_compiled_equal", modules.get("plan_compiled_equal"))):
        if m is None:
            continue
        g, _, _ = step_state(m, batch, seed=11)
        grads[label] = {k.removeprefix("_orig_mod."): v for k, v in g.items()}
        row[f"{label}_grad_vs_eager"] = relative_difference(grads[label], eager_grads)
    if half is not None:
        g, _, _ = step_state(half.apply(model, compile=True), batch, seed=11)
        row["plan_compiled_half_vs_full"] = relative_difference(g, grads["plan_compiled_full"])
    row["torch_compile_budget_vs_full"] = relative_difference(grads["torch_compile_budget"], grads["torch_compile"])
    row["plan_compiled_vs_full"] = relative_difference(grads["plan_compiled"], grads["plan_compiled_full"])
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | nodes | torch.compile peak (budget) | plan peak, measured / predicted | step eager / compile / "
        "compile budget / plan | grads vs eager: compile / plan | budget vs full: compile / plan | "
        "compile s: torch.compile / plan + inductor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = 1e6
        lines.append(
            f"| {r['model']} ({r['kind']}) | {r['nodes']} | {r['torch_compile_peak_bytes'] / mb:.2f} MB "
            f"({r['budget']}) | {r['plan_peak_bytes'] / mb:.2f} / {r['predicted_peak_bytes'] / mb:.2f} MB | "
            f"{r['eager_step_s'] * 1e3:.0f} / {r['torch_compile_step_s'] * 1e3:.0f} / "
            f"{r['torch_compile_budget_step_s'] * 1e3:.0f} / {r['plan_compiled_step_s'] * 1e3:.0f} ms | "
            f"{r['torch_compile_grad_vs_eager']:.1e} / {r['plan_compiled_grad_vs_eager']:.1e} | "
            f"{r['torch_compile_budget_vs_full']:.1e} / {r['plan_compiled_vs_full']:.1e} | "
            f"{r['torch_compile_compile_s']:.1f} / {r['plan_s']:.1f} + {r['plan_compile_s']:.1f} |")
    for r in rows:
        if "plan_equal_peak_bytes" in r:
            lines.append(f"\n{r['model']} at equal measured peak: plan budget "
                         f"{r['plan_equal_budget_bytes'] / 1e6:.2f} MB "
                         f"(predicted {r['plan_equal_predicted_peak_bytes'] / 1e6:.2f} MB, overhead "
                         f"{100 * r['plan_equal_overhead']:.1f} %), compiled step measures "
                         f"{r['plan_equal_peak_bytes'] / 1e6:.2f} MB against torch.compile's "
                         f"{r['torch_compile_peak_bytes'] / 1e6:.2f} MB; step "
                         f"{r['plan_compiled_equal_step_s'] * 1e3:.1f} "
                         f"ms against {r['torch_compile_budget_step_s'] * 1e3:.1f} ms; gradients vs eager "
                         f"{r['plan_compiled_equal_grad_vs_eager']:.1e}")
    for r in rows:
        if "plan_compiled_half_vs_full" in r:
            lines.append(f"\n{r['model']} planned at half of the no-recomputation peak (overhead "
                         f"{100 * r['plan_half_overhead']:.1f} %): compiled gradients vs its own at full memory "
                         f"{r['plan_compiled_half_vs_full']:.1e}")
        elif "plan_half_error" in r:
            lines.append(f"\n{r['model']} at half of the no-recomputation peak: {r['plan_half_error']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt2", "bert", "resnet"], choices=hf_zoo.NAMES)
    ap.add_argument("--size", default="bench", choices=list(hf_zoo.SIZES))
    ap.add_argument("--budget", type=float, default=0.5, help="torch.compile's activation_memory_budget")
    ap.add_argument("--repeats", type=int, default=51)
    ap.add_argument("--time-limit", type=float, default=30.0, help="the planner's time limit per plan (s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # compile times from a cold start, for torch.compile and the planner alike
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = []
    for name in args.models:
        row = bench_model(name, args.size, args.budget, args.repeats, args.time_limit)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
