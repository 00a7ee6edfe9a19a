"""How plan(progress=...) reports on a real model: when its first line comes, its longest silence, its last line.

    .venv/bin/python scripts/check_progress.py [--model gpt2:bench] [--fraction 0.5] [--time-limit 20]

Plans an `examples.hf_zoo` model (NAME:SIZE, labels given) at a fraction of its no-recomputation peak, tracing
included, and prints every progress line with its time, then the seconds to the first line, the longest gap between
lines and the last line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from capture.module_tags import trace_model  # noqa: E402
from examples.hf_zoo import build  # noqa: E402
from graphs.simulate import reference_peak_bytes  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.core.problem import PlanningProblem  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2:bench")
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    name, size = args.model.split(":")
    model, batch = build(name, size, labels=True)
    # the budget, from a trace of a twin (so that the timed plan() traces anew)
    twin, twin_batch = build(name, size, labels=True)
    ref = PlanningProblem(trace_model(twin, twin_batch, "time")).exact_graph
    budget = int(args.fraction * reference_peak_bytes(ref))
    stamps: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    try:
        plan(model, batch, budget / GB, time_limit_s=args.time_limit,
             progress=lambda line: stamps.append((time.perf_counter() - t0, line)))
    except Exception as e:  # the last line names it
        print(f"plan() raised {type(e).__name__}")
    total = time.perf_counter() - t0
    for t, line in stamps:
        print(f"{t:6.2f}  {line}")
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])] + [total - stamps[-1][0]]
    print(f"first line after {stamps[0][0]:.2f} s; longest silence {max(gaps):.2f} s; {len(stamps)} lines in "
          f"{total:.1f} s; last line: {stamps[-1][1]}")


if __name__ == "__main__":
    main()
