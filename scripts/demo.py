"""The README's main job: plan the bundled GPT-style model's training step at three memory budgets and run it.

For 100 %, 70 % and 50 % of checkpoint-all's peak (keeping every activation), `plan()` picks what to
recompute; the planned module then trains one step. Printed per budget: the budget, the predicted and the
measured peak (storage-tracking mode on CPU, max_memory_allocated on CUDA), the predicted overhead, the
measured step time against eager PyTorch (median of interleaved repeats), and whether every gradient and
the loss are bitwise equal to eager's (dropout included, same seed).

Run with `make demo` (or `.venv/bin/python scripts/demo.py [--time-limit S] [--repeats N]`).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from examples.gpt import gpt_loss, make_gpt_demo  # noqa: E402
from graphs.errors import InfeasibleBudgetError  # noqa: E402
from graphs.simulate import reference_peak_bytes  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, measure_peak_bytes  # noqa: E402

MB = 1e6


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per budget")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per module")
    ap.add_argument("--cost-model", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores thrash)")
    args = ap.parse_args(argv[1:])
    torch.set_num_threads(args.threads)

    model, tokens = make_gpt_demo()
    loss_fn = lambda logits: gpt_loss(logits, tokens)  # noqa: E731
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params / 1e6:.2f} M parameters, input {tuple(tokens.shape)}")

    t0 = time.perf_counter()
    full = plan(model, tokens, 1000.0, cost_model=args.cost_model, time_limit_s=args.time_limit, loss_fn=loss_fn)
    ref = reference_peak_bytes(full.graph)
    print(f"traced in {full.trace_seconds:.1f} s ({full.traced.aten_node_count} aten ops -> {full.graph.n} nodes, "
          f"cost model {full.cost_model}); the cross-entropy loss holds {full.loss_bytes / MB:.2f} MB; "
          f"checkpoint-all peak {ref / MB:.2f} MB")

    eager = copy.deepcopy(model)
    eager_grads, _, eager_loss = step_state(eager, tokens, loss_fn, seed=1)
    eager_peak = measure_peak_bytes(eager, tokens, loss_fn)
    print(f"eager PyTorch: measured peak {eager_peak / MB:.2f} MB\n")

    head = (f"{'budget':>14} {'predicted':>10} {'measured':>10} {'overhead':>9} {'time/eager':>10} "
            f"{'grads==eager':>12}  status / solver")
    print(head)
    print("-" * len(head))
    ok = True
    for frac in (1.0, 0.7, 0.5):
        budget = int(frac * ref)
        label = f"{frac:.0%} {budget / MB:7.2f} MB"
        try:
            p = full if frac == 1.0 else plan(model, tokens, budget / GB, cost_model=args.cost_model,
                                               time_limit_s=args.time_limit, traced=full.traced, loss_fn=loss_fn)
        except InfeasibleBudgetError as e:
            print(f"{label:>14} infeasible: the smallest feasible budget is {e.min_budget_bytes / MB:.2f} MB")
            continue
        planned = p.apply(copy.deepcopy(model))
        grads, _, loss = step_state(planned, tokens, loss_fn, seed=1)
        equal = same(grads, eager_grads) and torch.equal(loss, eager_loss)
        peak = measure_peak_bytes(planned, tokens, loss_fn)
        times = interleaved_step_seconds({"eager": eager, "planned": planned}, tokens, loss_fn,
                                         repeats=args.repeats, warmup=1)
        ratio = times["planned"].median_s / times["eager"].median_s
        ok &= equal and peak <= budget
        print(f"{label:>14} {p.predicted_peak_bytes / MB:8.2f}MB {peak / MB:8.2f}MB {100 * p.overhead:8.2f}% "
              f"{ratio:10.3f} {str(equal):>12}  {p.status.value} / {p.solver} ({p.solve_seconds:.1f} s)")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s. `python -m planner show PLAN.json` explains a saved plan "
          "(what is recomputed, by module).")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
