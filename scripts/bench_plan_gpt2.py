"""Time plan() (trace + solve) on the 12-layer GPT-2-small-shaped decoder at 50 % of checkpoint-all's peak.

    .venv/bin/python scripts/bench_plan_gpt2.py [--frac 0.5] [--time-limit 60] [--cost-model auto]

Prints the trace and solve seconds, the budget, the predicted peak, the overhead and the status. Checkpoint-all's
peak is the simulator's peak of the traced graph's reference order, with no recomputation.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from capture.module_tags import trace_model  # noqa: E402
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from graphs.simulate import reference_peak_bytes  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.core.solver_graph import solver_graph
from tests.models import make_gpt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frac", type=float, default=0.5)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cost-model", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, x = make_gpt(batch=1, seq=256, vocab=args.vocab, d_model=768, n_heads=12, n_layers=12)
    t0 = time.perf_counter()
    cm = "time" if args.cost_model == "auto" else args.cost_model
    traced = trace_model(model, (x,), cm)
    t_trace = time.perf_counter() - t0
    ref = reference_peak_bytes(solver_graph(traced))
    budget = args.frac * ref
    print(f"GPT-2-small shape (12 layers, d_model 768, 12 heads, seq 256, batch 1, vocab {args.vocab}), "
          f"{traced.aten_node_count} aten ops -> {traced.graph.n} nodes, cost model {cm}; traced in {t_trace:.1f} s")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"checkpoint-all peak {ref / GB:.3f} GB; parameters alone {params / GB:.3f} GB (and as much for their "
          f"gradients); single-operation bound {solver_graph(traced).single_op_bound_bytes() / GB:.3f} GB")
    t1 = time.perf_counter()
    try:
        p = plan(model, x, budget / GB, cost_model=args.cost_model, time_limit_s=args.time_limit, traced=traced)
        outcome = (f"predicted peak {p.predicted_peak_bytes / GB:.3f} GB, overhead {100 * p.overhead:.2f}%, "
                   f"status {p.status.value}, solver {p.solver}")
    except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
        outcome = f"{type(e).__name__}: {e}"
    t_plan = time.perf_counter() - t1
    print(f"budget {budget / GB:.3f} GB ({args.frac:.0%} of checkpoint-all): plan() {t_plan:.1f} s, "
          f"trace + plan {t_trace + t_plan:.1f} s")
    print(outcome)


if __name__ == "__main__":
    main()
