"""The planner on real architectures (transformers models from configs, examples/hf_zoo.py), as their users train
them: `model(**batch)` with labels, the model's own loss in the step.

    .venv/bin/python scripts/bench_real_models.py [--models gpt2 llama bert vit t5 resnet convnext]
        [--size bench] [--repeats 9] [--time-limit 30]

For each model, on one torch thread:
1. eager: its measured peak P0 and step time;
2. the model's own per-block checkpointing (`gradient_checkpointing_enable`, non-reentrant) where the model has
   it: its measured peak P1;
3. the planner (cost model "time") with no budget to speak of (1000 GB: nothing is recomputed), at P0 where its
   no-recomputation peak is above P0, and at P1.
Peaks come from the storage-tracking dispatch mode (planner.tools.measure); step times are medians of interleaved
repeats (forward with loss, backward), relative to eager; gradients and buffers are compared bitwise with eager
under one seed. Prints a markdown table (one row per model and budget).
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

from examples.hf_zoo import KIND, NAMES, build  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, measure_peak_bytes  # noqa: E402
from scripts.demo import same  # noqa: E402


def same_state(a, b) -> bool:
    """Gradients, buffers and loss of two step_state results torch.equal."""
    return same(a[0], b[0]) and same(a[1], b[1]) and torch.equal(a[2], b[2])


def with_block_checkpointing(model):
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    return m


def bench(name: str, size: str, repeats: int, time_limit_s: float) -> list[dict]:
    model, batch = build(name, size, labels=True)
    ref = copy.deepcopy(model)
    eager = copy.deepcopy(ref)
    want = step_state(copy.deepcopy(ref), batch, seed=7)
    peak0 = measure_peak_bytes(copy.deepcopy(ref), batch)
    ckpt = with_block_checkpointing(ref)
    peak1 = None if ckpt is None else measure_peak_bytes(copy.deepcopy(ckpt), batch)

    t0 = time.perf_counter()
    first = plan(model, batch, 1000.0, time_limit_s=time_limit_s)  # no budget: no recomputation
    plans = {"no recomputation": (None, first, time.perf_counter() - t0)}
    if first.predicted_peak_bytes > peak0:  # else the same plan fits eager's peak
        t0 = time.perf_counter()
        plans["eager's peak"] = (peak0, plan(model, batch, peak0 / GB, time_limit_s=time_limit_s, traced=first.traced),
                                 time.perf_counter() - t0)
    if peak1 is not None:
        t0 = time.perf_counter()
        p = plan(model, batch, peak1 / GB, time_limit_s=time_limit_s, traced=first.traced)
        plans["per-block's peak"] = (peak1, p, time.perf_counter() - t0)
    modules = {"eager": eager}
    if ckpt is not None:
        modules["per-block"] = ckpt
    for label, (_, p, _) in plans.items():
        modules[label] = p.apply(copy.deepcopy(ref))
    times = interleaved_step_seconds(modules, batch, repeats=repeats, warmup=2)
    base = times["eager"].median_s
    rows = [{"model": name, "kind": KIND[name], "nodes": first.graph.n, "what": "eager", "budget": None,
             "peak": peak0, "predicted": None, "time": 1.0, "overhead": None, "equal": True,
             "trace_s": first.trace_seconds, "plan_s": None}]
    if ckpt is not None:
        rows.append({**rows[0], "what": "per-block checkpointing", "peak": peak1,
                     "time": times["per-block"].median_s / base,
                     "equal": same_state(want, step_state(copy.deepcopy(ckpt), batch, seed=7))})
    for label, (budget, p, seconds) in plans.items():
        planned_peak = measure_peak_bytes(p.apply(copy.deepcopy(ref)), batch)
        got = step_state(p.apply(copy.deepcopy(ref)), batch, seed=7)
        rows.append({**rows[0], "what": f"planner, {label}" if budget is None else f"planner at {label}",
                     "budget": budget, "peak": planned_peak,
                     "predicted": p.predicted_peak_bytes, "time": times[label].median_s / base,
                     "overhead": p.overhead, "equal": same_state(want, got), "plan_s": seconds,
                     "status": p.status.value})
    rows[0]["eager_ms"] = 1e3 * base
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--size", default="bench", choices=("test", "bench"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| model | kind | nodes | step | budget MB | peak MB | predicted MB | time / eager | predicted overhead "
          "| grads = eager | plan s (no-recomputation row: trace + plan) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for r in bench(name, args.size, args.repeats, args.time_limit):
            mb = lambda b: "" if b is None else f"{b / 1e6:.3f}"  # noqa: E731
            what = r["what"] + (f" ({r['eager_ms']:.0f} ms)" if "eager_ms" in r else "")
            ov = "" if r["overhead"] is None else f"{100 * r['overhead']:.1f} %"
            ps = "" if r["plan_s"] is None else f"{r['plan_s']:.1f} ({r.get('status', '')})"
            print(f"| {r['model']} | {r['kind']} | {r['nodes']} | {what} | {mb(r['budget'])} | {mb(r['peak'])} | "
                  f"{mb(r['predicted'])} | {r['time']:.3f} | {ov} | {r['equal']} | {ps} |", flush=True)


if __name__ == "__main__":
    main()
