"""Step time of the planned module at a budget that needs no recomputation (100 %), against eager.

    .venv/bin/python scripts/bench_step_time.py [--repeats 15] [--real]

For the demo GPT (examples/gpt.py) and the test models at the sizes of scripts/bench_pytorch.py, or with --real the
transformers models of examples/hf_zoo.py at their "bench" size, called with labels: the median of interleaved
repeats of forward + loss + backward, eager and planned, and their ratio.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from examples.gpt import make_gpt_demo  # noqa: E402
from planner import plan  # noqa: E402
from planner.tools.measure import interleaved_step_seconds  # noqa: E402
from scripts.bench_pytorch import BENCH_MAKERS, CONFIGS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--real", action="store_true", help="the transformers models (examples/hf_zoo.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores thrash)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.real:
        import warnings

        from examples.hf_zoo import NAMES, build

        warnings.filterwarnings("ignore")
        cases = {k: (lambda k=k: build(k, "bench", labels=True)) for k in NAMES}
    else:
        cases = {"demo gpt": make_gpt_demo, **{k: (lambda k=k: BENCH_MAKERS[k](**CONFIGS[k])) for k in CONFIGS}}
    print("| model | eager step (ms) | planned step, 100 % budget (ms) | planned / eager |")
    print("|---|---:|---:|---:|")
    for label, make in cases.items():
        model, x = make()
        p = plan(model, x, 1000.0, cost_model="flops", time_limit_s=10)
        assert p.overhead == 0
        mods = {"eager": copy.deepcopy(model), "planned": p.apply(copy.deepcopy(model))}
        t = interleaved_step_seconds(mods, x, repeats=args.repeats, warmup=2)
        e, q = t["eager"].median_s, t["planned"].median_s
        print(f"| {label} | {1e3 * e:.1f} | {1e3 * q:.1f} | {q / e:.3f} |", flush=True)


if __name__ == "__main__":
    main()
