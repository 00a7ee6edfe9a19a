"""Where a step's time goes: eager, the planner's executor and selective checkpointing, op by op.

    .venv/bin/python scripts/profile_step.py [--model llama:decoder512] [--budget-gb 1000] [--top 20] [--repeats 7]
        [--threads 1]

Plans `examples.hf_zoo` model NAME:SIZE (with labels) at the budget, then profiles one training step of each of the
three (torch.profiler, CPU activities, after one warm-up step) and prints each op's self time and call count side
by side, the biggest first, with the totals; then the median step times over interleaved steps. At a budget above
eager's peak the plan recomputes nothing, so any difference between its step and eager's is the executor's own cost.
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from examples.hf_zoo import build  # noqa: E402
from planner import plan  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, run_step  # noqa: E402


def op_self_ms(module, batch) -> tuple[dict[str, float], dict[str, int]]:
    """Self CPU milliseconds and call counts per op over one step (after a warm-up step)."""
    run_step(module, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(module, batch)
    ms: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for event in prof.key_averages():
        ms[event.key] += event.self_cpu_time_total / 1e3
        calls[event.key] += event.count
    return ms, calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama:decoder512", help="examples.hf_zoo NAME:SIZE")
    ap.add_argument("--budget-gb", type=float, default=1000.0)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    name, _, size = args.model.partition(":")
    model, batch = build(name, size or "bench", labels=True)
    planned = plan(model, batch, args.budget_gb, time_limit_s=args.time_limit)
    print(f"plan: overhead {planned.overhead:.2%}, {planned.solver}, {planned.status}")
    modules = {"eager": model, "planner": planned.apply(copy.deepcopy(model)),
               "selective": per_block_checkpointed(model, selective=True)}
    profiles = {label: op_self_ms(m, batch) for label, m in modules.items()}

    ops = set().union(*(ms.keys() for ms, _ in profiles.values()))
    ops = sorted(ops, key=lambda op: -max(ms[op] for ms, _ in profiles.values()))[: args.top]
    print(f"{'op (self ms / calls)':40s}" + "".join(f"{label:>22s}" for label in profiles))
    for op in ops:
        print(f"{op[:40]:40s}" + "".join(f"{ms[op]:13.1f} /{calls[op]:7d}" for ms, calls in profiles.values()))
    print(f"{'total':40s}" + "".join(f"{sum(ms.values()):13.1f}{'':9s}" for ms, _ in profiles.values()))

    timed = interleaved_step_seconds(modules, batch, repeats=args.repeats, warmup=1)
    print("median step s: " + ", ".join(f"{label} {t.median_s:.3f}" for label, t in timed.items()))


if __name__ == "__main__":
    main()
