"""The smallest budget plan() can meet on the transformers zoo, as `smallest_budget` names it, against the search on
the graph with secondary outputs pinned alone (what it named until 2026-12-03); then plan() at the named budget,
its measured peak and its gradients against eager.

    .venv/bin/python scripts/bench_smallest_budget.py [--models gpt2 bert vit] [--size test] [--time-limit 30]

Each model (examples/hf_zoo.py, random weights, labels given) is traced once with measured op times on one torch
thread. Budgets are printed in bytes and as a share of the no-recomputation peak; the peak is measured with the
storage-tracking dispatch mode (tools.measure); gradients and buffers are compared bitwise with eager's under one
seed.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from capture.module_tags import trace_model  # noqa: E402
from examples.hf_zoo import NAMES, build  # noqa: E402
from graphs.simulate import reference_peak_bytes  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.core.problem import _search_smallest  # noqa: E402
from planner.core.solver_graph import solver_graph
from planner.tools.measure import measure_peak_bytes  # noqa: E402
from planner.whole.api import smallest_budget
from scripts.bench_real_models import same_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "bert", "vit"], choices=NAMES)
    ap.add_argument("--size", default="test")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds for each smallest-budget search")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print("| model | pinned graph alone | smallest_budget | plan() at it: overhead | measured peak | within | "
          "gradients equal |\n| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for name in args.models:
        model, batch = build(name, args.size, labels=True)
        ref_model = copy.deepcopy(model)
        traced = trace_model(model, batch, "time")
        ref = reference_peak_bytes(solver_graph(traced))
        t0 = time.perf_counter()
        old = _search_smallest(solver_graph(traced, pin_secondaries=True), args.time_limit).budget_bytes
        t1 = time.perf_counter()
        new = smallest_budget(traced, args.time_limit).budget_bytes
        t2 = time.perf_counter()
        if new is None:
            print(f"| {name} | {old} | none found in {args.time_limit:g} s | | | | |", flush=True)
            continue
        p = plan(model, batch, new / GB, traced=traced, time_limit_s=args.time_limit)
        measured = measure_peak_bytes(p.apply(copy.deepcopy(ref_model)), batch, None)
        want = step_state(copy.deepcopy(ref_model), batch, None, seed=3)
        got = step_state(p.apply(copy.deepcopy(ref_model)), batch, None, seed=3)

        old_cell = "none" if old is None else f"{old} ({old / ref:.3f}, {t1 - t0:.1f} s)"
        print(f"| {name} | {old_cell} | {new} ({new / ref:.3f}, {t2 - t1:.1f} s) | "
              f"{100 * p.overhead:.2f} % | {measured} | {measured <= new} | {same_state(got, want)} |", flush=True)


if __name__ == "__main__":
    main()
