"""Does the in-place planner's cost of a block's options rank them as their measured time does?

    .venv/bin/python scripts/check_option_costs.py [--models qwen2 llama] [--sizes decoder512 small] [--repeats 25]
        [--out docs/results/option_costs.json]

For each model and size (scripts/bench_peers.py builds them: transformers decoders from their configs with the
library's defaults), the first decoder layer's call is caught on one forward, stopped there; the layer is profiled
as `enable()` profiles it (planner.inplace.block_region.profile_block), and each of its options (kept, checkpointed,
every selective option) runs one forward and backward from fresh leaves, `--repeats` rounds in a shuffled order each
round. Reported per option: the predicted cost (planner.inplace.option_costs, FLOPs), the medians of its forward and
backward seconds, and its extra time over kept; per block, the Spearman rank correlation between predicted cost and
measured extra time, and, for every pair of options whose measured extra times differ by more than `--margin`
(default 2 ms) both ways, whether the prediction orders them the same way. Torch runs with one thread.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from planner.inplace.block_region import BlockCall, profile_block  # noqa: E402
from scripts.bench_peers import build  # noqa: E402


class _Caught(Exception):
    pass


def _block_call(model: torch.nn.Module, batch: dict):
    """The first decoder layer, its call and tensors as a training step gives them: the forward is stopped there, so
    the key/value cache among its arguments holds nothing yet (a finished forward would have filled it)."""
    layer = model.model.layers[0]
    got = {}

    def catch(_module, args, kwargs):
        got["call"] = (args, kwargs)
        raise _Caught

    handle = layer.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    except _Caught:
        pass
    finally:
        handle.remove()
    call, tensors = BlockCall.of(layer, *got["call"])
    # the hidden states need a gradient, as between layers of a training step
    tensors = [t.detach().requires_grad_(t.is_floating_point() and t.dim() == 3) for t in tensors]
    return layer, call, tensors


def _timed(layer, option, tensors, params) -> tuple[float, float]:
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    t0 = time.perf_counter()
    out = option.run(layer, inputs, ())
    first = out[0] if isinstance(out, tuple) else out
    loss = first.sum()
    t1 = time.perf_counter()
    torch.autograd.grad(loss, params + [t for t in inputs if t.requires_grad], allow_unused=True)
    return t1 - t0, time.perf_counter() - t1


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def check(name: str, size: str, repeats: int, margin_s: float) -> dict:
    model, batch = build(name, size)
    layer, call, tensors = _block_call(model, batch)
    profile = profile_block(layer, call, tensors, time_limit_s=20)
    options = profile.options
    params = list(layer.parameters())
    fwd: list[list[float]] = [[] for _ in options]
    bwd: list[list[float]] = [[] for _ in options]
    for o in options:  # one untimed round
        _timed(layer, o, tensors, params)
    order = list(range(len(options)))
    for _ in range(repeats):
        random.shuffle(order)
        for i in order:
            f, b = _timed(layer, options[i], tensors, params)
            fwd[i].append(f)
            bwd[i].append(b)
    total = [statistics.median(f) + statistics.median(b) for f, b in zip(fwd, bwd)]
    rows = [{"option": o.figures.name, "predicted_cost": o.figures.cost, "stash_bytes": o.figures.stash_bytes,
             "forward_s": statistics.median(f), "backward_s": statistics.median(b), "extra_s": t - total[0]}
            for o, f, b, t in zip(options, fwd, bwd, total)]
    agree = disagree = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            dt = rows[i]["extra_s"] - rows[j]["extra_s"]
            if abs(dt) <= margin_s:
                continue
            dp = rows[i]["predicted_cost"] - rows[j]["predicted_cost"]
            agree, disagree = (agree + 1, disagree) if dt * dp > 0 else (agree, disagree + 1)
    rho = spearman([r["predicted_cost"] for r in rows], [r["extra_s"] for r in rows])
    return {"model": name, "size": size, "repeats": repeats, "margin_s": margin_s, "options": rows,
            "spearman": rho, "pairs_ordered_as_measured": agree, "pairs_ordered_otherwise": disagree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2", "llama"])
    ap.add_argument("--sizes", nargs="+", default=["decoder512", "small"])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--margin", type=float, default=2e-3, help="seconds: closer measured options are not compared")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in args.models:
        for size in args.sizes:
            r = check(name, size, args.repeats, args.margin)
            results.append(r)
            print(f"{name} {size}: Spearman {r['spearman']:.3f}, pairs apart by more than {args.margin * 1e3:g} ms "
                  f"ordered as measured {r['pairs_ordered_as_measured']}, otherwise {r['pairs_ordered_otherwise']}")
            for row in r["options"]:
                print(f"  {row['option']:16s} predicted {row['predicted_cost'] / 1e8:8.2f} (1e8)  "
                      f"fwd {row['forward_s'] * 1e3:7.2f} ms  bwd {row['backward_s'] * 1e3:7.2f} ms  "
                      f"extra {row['extra_s'] * 1e3:7.2f} ms  stash {row['stash_bytes'] / 1e6:6.2f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
