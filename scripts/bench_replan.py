"""How long `planner.enable()` takes to plan a call of a new sequence length, on a compute-bound decoder.

    .venv/bin/python scripts/bench_replan.py [--model qwen2] [--layers 8] [--width 512] [--first 256]
        [--lengths 272 300 320 352 384 448 512] [--out FILE]

A transformers decoder from a config with the library's defaults (random weights; `--layers` layers of `--width`,
8 heads, vocabulary 32000, batch 1), enabled at a budget midway between per-block checkpointing's and eager's
measured peaks at the longest length. The first training call (`--first` tokens) measures; each later call has a
length not seen before. For each call: its mode (measure, planned, fallback), the planner's own time in it (the
pre-forward hook, the chain's choice and the block profiles made from a measured shape's bounds, timed around those
methods; not the step), and the call's wall time. A call within the bounds of the measured one is planned without
running anything of the model's beyond the step itself. One torch thread.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.inplace import controller  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import measure_peak_bytes  # noqa: E402

TIMED = ("_pre_forward", "_choose", "_bounded_profile")
VOCAB = 32000


def make_model(name: str, layers: int, width: int) -> torch.nn.Module:
    import transformers as T

    common = dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=8, intermediate_size=4 * width,
                  vocab_size=VOCAB)
    config = {"qwen2": lambda: T.Qwen2Config(num_key_value_heads=4, **common),
              "llama": lambda: T.LlamaConfig(num_key_value_heads=8, **common)}[name]()
    torch.manual_seed(0)
    cls = {"qwen2": T.Qwen2ForCausalLM, "llama": T.LlamaForCausalLM}[name]
    return cls(config).train()


def batch(length: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def timers(spent: dict) -> list:
    """Wrap the controller's planning methods to add their wall time to `spent`; returns the originals."""
    originals = []
    for name in TIMED:
        f = getattr(controller.InPlaceController, name)
        originals.append((name, f))

        def wrapped(*a, _f=f, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t
        setattr(controller.InPlaceController, name, functools.wraps(f)(wrapped))
    return originals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2", choices=["qwen2", "llama"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--first", type=int, default=256)
    ap.add_argument("--lengths", type=int, nargs="+", default=[272, 300, 320, 352, 384, 448, 512])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = make_model(args.model, args.layers, args.width)
    longest = batch(max([args.first, *args.lengths]))
    eager_peak = measure_peak_bytes(copy.deepcopy(model), longest)
    ckpt_peak = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), longest)
    budget = (eager_peak + ckpt_peak) // 2
    spent = {"s": 0.0}
    timers(spent)  # before enable(): its hooks bind the methods
    state = planner.enable(model, budget / 1e9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for length in [args.first, *args.lengths]:
        spent["s"] = 0.0
        t = time.perf_counter()
        model(**batch(length)).loss.backward()
        wall = time.perf_counter() - t
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = state.records[-1]
        rows.append({"length": length, "mode": str(rec.mode.value), "planning_ms": round(1e3 * spent["s"], 2),
                     "wall_s": round(wall, 3), "options": rec.options})
        print(f"length {length:4d}: {rows[-1]['mode']:9s} planning {rows[-1]['planning_ms']:7.2f} ms, call "
              f"{wall:.3f} s, {controller.grouped_names(rec.options)}", flush=True)
    result = {"what": "planner.enable: planning time of each new length", "args": vars(args),
              "torch": torch.__version__, "budget_bytes": budget, "eager_peak_bytes": eager_peak,
              "checkpointed_peak_bytes": ckpt_peak, "calls": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
