"""The largest batch that trains in a memory: the planner (`planner.max_batch`) against per-block checkpointing.

    .venv/bin/python scripts/bench_fit.py [--models decoder conv demo] [--time-limit 5] [--out docs/results/fit.json]

For each model the budget is eager's measured peak at batch 2 (storage-tracking dispatch mode, CPU). The planner's
answer n is planned and its step measured the same way; per-block checkpointing
(`planner.core.candidates.per_block_checkpointed`: torch.utils.checkpoint around each module of the model's largest
ModuleList, non-reentrant) is measured at growing batches until it no longer fits. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from examples import hf_zoo  # noqa: E402
from examples.gpt import make_gpt_demo  # noqa: E402
from planner.tools.baselines import largest_checkpointed_size  # noqa: E402
from planner.tools.fit import max_batch  # noqa: E402
from planner.tools.measure import measure_peak_bytes  # noqa: E402
from planner.whole.api import GB, LossNotPlannedWarning  # noqa: E402
from tests.models import make_cnn, make_gpt  # noqa: E402

MODELS = {
    "demo": make_gpt_demo,
    "gpt2": lambda n: hf_zoo.build("gpt2", "test", batch=n),  # transformers, the model's own loss
    "resnet": lambda n: hf_zoo.build("resnet", "test", batch=n),
    "decoder": lambda n: make_gpt(batch=n, seq=32, vocab=64, n_layers=2),
    "conv": lambda n: make_cnn(batch=n, size=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per solve")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", LossNotPlannedWarning)
    rows = []
    for name in args.models:
        make = MODELS[name]
        model, x = make(2)
        budget = measure_peak_bytes(model, x)
        t0 = time.perf_counter()
        fit = max_batch(make, budget / GB, time_limit_s=args.time_limit)
        seconds = time.perf_counter() - t0
        model_n, x_n = make(fit.n)
        measured = measure_peak_bytes(fit.plan.apply(model_n), x_n)
        row = dict(model=name, budget_bytes=budget, n=fit.n, measured_peak_bytes=measured,
                   predicted_peak_bytes=fit.plan.predicted_peak_bytes, overhead=fit.plan.overhead,
                   next_reason=fit.next.reason if fit.next else None, traced=fit.traced_sizes, seconds=seconds,
                   checkpointing_n=largest_checkpointed_size(make, budget))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| model | budget (eager peak at batch 2) | planner: largest batch, measured peak, overhead | why the next "
          "fails | per-block checkpointing: largest batch | sizes traced | seconds |")
    print("|---|---:|---|---|---:|---|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['budget_bytes'] / 1e6:.2f} MB | {r['n']}, {r['measured_peak_bytes'] / 1e6:.2f} MB, "
              f"{100 * r['overhead']:.1f} % | {(r['next_reason'] or '')[:90]} | {r['checkpointing_n']} | "
              f"{', '.join(map(str, r['traced']))} | {r['seconds']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
