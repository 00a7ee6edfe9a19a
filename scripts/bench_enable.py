"""The in-place planner (`planner.enable`): what planning a new shape costs, and its step against per-block
checkpointing at per-block checkpointing's own measured peak.

    .venv/bin/python scripts/bench_enable.py [--parts shapes decoder] [--repeats 7] [--time-limit 5]
        [--out docs/results/enable.json] [--table]

Part "shapes" (tiny models, examples.hf_zoo size "test": 2 layers, width 32, batch 4, sequence 64): the model
enabled at per-block checkpointing's measured peak, then a stream of training calls (forward, the model's own loss,
backward, gradients reset): the first call of the first shape, that shape again, the first call of a second
sequence length (32), that length again, and the first shape with no padded row. For each call: its wall time, the
seconds of profiling it added (`state.plan_seconds` before and after) and the mode it ran in.

Part "decoder" (examples.hf_zoo size "decoder512", batch 1: 8 layers of width 512, sequence 512, GPT-2's
vocabulary): per-block checkpointing's measured step peak P (storage-tracking dispatch mode, CPU), a copy of the
model enabled at exactly P (where the planner refuses P, raising InfeasibleBudgetError at a warm-up call, the error
is recorded and a fresh copy is enabled at the least budget the error names instead), two warm-up training calls
(the measuring call, then the first planned one), then the medians of interleaved steps (per-block checkpointing
and the enabled model in turns, shuffled each round), each one's measured peak, the options the enabled model
chose, and whether its gradients are `torch.equal` to per-block checkpointing's and eager's under one seed (dropout
on: the seed is reset before each compared step).

With --table, prints the tables of the JSON in --out and measures nothing.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import planner  # noqa: E402
from examples.hf_zoo import build  # noqa: E402
from graphs.errors import InfeasibleBudgetError  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner.inplace.controller import grouped_names  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, measure_peak_bytes, run_step  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _zero_grad(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def timed_call(model: torch.nn.Module, batch: dict, state) -> dict:
    """One training call (forward, the model's loss, backward; gradients reset before and after): its wall time,
    the profiling seconds it added and the mode it ran in."""
    _zero_grad(model)
    before = state.plan_seconds
    t0 = time.perf_counter()
    run_step(model, batch)
    wall = time.perf_counter() - t0
    _zero_grad(model)
    rec = state.records[-1]
    return {"wall_s": wall, "profile_s": state.plan_seconds - before, "mode": rec.mode, "options": rec.options}


def _sliced(batch: dict, seq: int) -> dict:
    return {k: v[:, :seq].clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def bench_shapes(name: str, args) -> dict:
    model, batch = build(name, "test")  # batch 4, sequence 64, row 1 padded from 48 on
    torch.manual_seed(0)
    budget = measure_peak_bytes(per_block_checkpointed(model), batch)
    state = planner.enable(model, budget / 1e9, time_limit_s=args.time_limit)
    short = _sliced(batch, 32)  # row 1 unpadded there: no tensor mask needed
    unpadded = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
    calls = {}
    for label, b in [("first shape, first call", batch), ("first shape, again", batch),
                     ("second length (32), first call", short), ("second length (32), again", short),
                     ("first shape, no padded row, first call", unpadded),
                     ("first shape, no padded row, again", unpadded)]:
        torch.manual_seed(0)
        calls[label] = timed_call(model, b, state)
        say(f"shapes {name}: {label}: {calls[label]}")
    return {"model": f"{name}:test", "budget_bytes": budget, "time_limit_s": args.time_limit,
            "calls": calls, "block_shapes_profiled": len(state.profiles), "plan_seconds_total": state.plan_seconds,
            "summary": state.summary()}


def _same_grads(got, want) -> bool:
    g, w = got[0], want[0]
    return g.keys() == w.keys() and all(
        (a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in ((g[k], w[k]) for k in w))


def enable_at(model: torch.nn.Module, budget: int, batch: dict, args, where: str):
    """A deep copy of `model` enabled at `budget` bytes and its two warm-up calls; where the budget is refused
    (InfeasibleBudgetError at a warm-up call), again at the least budget the error names. (copy, state, budget
    used, warm-ups, the refusal or None)."""
    refused = None
    while True:
        enabled = copy.deepcopy(model)
        state = planner.enable(enabled, budget / 1e9, time_limit_s=args.time_limit, progress=args.progress)
        assert state.budget_bytes == budget, (state.budget_bytes, budget)
        warmups = []
        try:
            for k in range(2):  # the measuring call (profiles the block shape), then the first planned call
                torch.manual_seed(0)
                warmups.append(timed_call(enabled, batch, state))
                say(f"{where}: warm-up {k + 1}: {warmups[-1]}")
        except InfeasibleBudgetError as e:
            if refused is not None or e.min_budget_bytes is None:
                raise
            refused = {"error": f"{type(e).__name__}: {e}", "least_budget_bytes": e.min_budget_bytes,
                       "failed_call": len(warmups) + 1, "plan_seconds": state.plan_seconds}
            say(f"{where}: refused: {refused['error']}; again at the least budget named, "
                f"{e.min_budget_bytes / 1e6:.3f} MB")
            budget = e.min_budget_bytes
            planner.disable(enabled)
            continue
        return enabled, state, budget, warmups, refused


def bench_decoder(name: str, args) -> dict:
    spec = f"{name}:decoder512"
    model, batch = build(name, "decoder512")  # batch 1, the model's own loss (labels)
    t0 = time.perf_counter()
    per_block = per_block_checkpointed(model)
    torch.manual_seed(0)
    budget = measure_peak_bytes(per_block, batch)
    say(f"decoder {spec}: per-block checkpointing peak {budget / 1e6:.2f} MB")
    # where per-block checkpointing's peak is refused: the error, and the least budget named (enabled there instead)
    enabled, state, enable_at_bytes, warmups, at_per_block = enable_at(model, budget, batch, args, f"decoder {spec}")
    torch.manual_seed(0)
    enabled_peak = measure_peak_bytes(enabled, batch)
    say(f"decoder {spec}: enabled peak {enabled_peak / 1e6:.2f} MB (budget {enable_at_bytes / 1e6:.2f} MB)")
    eager_grads = step_state(model, batch, seed=3)
    grads_pb = step_state(per_block, batch, seed=3)
    grads_en = step_state(enabled, batch, seed=3)
    equal = {"enabled == per-block checkpointing": _same_grads(grads_en, grads_pb),
             "enabled == eager": _same_grads(grads_en, eager_grads),
             "per-block checkpointing == eager": _same_grads(grads_pb, eager_grads)}
    del eager_grads, grads_pb, grads_en
    say(f"decoder {spec}: gradients torch.equal: {equal}")
    n_records = len(state.records)
    times = interleaved_step_seconds({"per_block": per_block, "enabled": enabled}, batch, repeats=args.repeats,
                                     warmup=1)
    modes = sorted({r.mode for r in state.records[n_records:]})
    last = state.records[-1]
    row = {"model": spec, "budget_bytes": enable_at_bytes, "per_block_peak_bytes": budget,
           "refused_at_per_block_peak": at_per_block, "enabled_peak_bytes": enabled_peak,
           "enabled_within_budget": enabled_peak <= enable_at_bytes,
           "enabled_within_per_block_peak": enabled_peak <= budget,
           "predicted_peak_bytes": last.predicted_peak_bytes,
           "options": last.options, "timed_modes": modes,
           "per_block_step_s": times["per_block"].median_s, "enabled_step_s": times["enabled"].median_s,
           "enabled_over_per_block": times["enabled"].median_s / times["per_block"].median_s,
           "per_block_samples_s": times["per_block"].samples_s, "enabled_samples_s": times["enabled"].samples_s,
           "repeats": args.repeats, "warmups": warmups, "plan_seconds": state.plan_seconds,
           "time_limit_s": args.time_limit, "grads_equal": equal, "summary": state.summary(),
           "seconds": time.perf_counter() - t0}
    say(f"decoder {spec}: per-block {row['per_block_step_s']:.3f} s, enabled {row['enabled_step_s']:.3f} s "
        f"(x{row['enabled_over_per_block']:.3f}), options {last.options}, {row['seconds']:.0f} s in all")
    return row


def table(result: dict) -> str:
    out = []
    if result.get("shapes"):
        out += ["| model | call | mode | wall (s) | profiling (s) |", "|---|---|---|---:|---:|"]
        for r in result["shapes"]:
            for label, c in r["calls"].items():
                out.append(f"| {r['model']} | {label} | {c['mode']} | {c['wall_s']:.3f} | {c['profile_s']:.3f} |")
        out.append("")
    if result.get("decoder"):
        out += ["| model | per-block checkpointing: peak (MB), step (s) | enabled at | enabled: peak (MB), step (s) "
                "| enabled / per-block | options chosen | grads equal (per-block, eager) | first call (s), "
                "profiling (s) |", "|---|---|---|---|---:|---|---|---|"]
        for r in result["decoder"]:
            g = r["grads_equal"]
            yes = {True: "yes", False: "NO"}
            refused = r.get("refused_at_per_block_peak")
            at = "its peak" if refused is None else \
                f"its peak refused (InfeasibleBudgetError); the least named, {r['budget_bytes'] / 1e6:.2f} MB"
            over = "" if r["enabled_within_budget"] else " (over budget)"
            out.append(f"| {r['model']} | {r['per_block_peak_bytes'] / 1e6:.2f}, {r['per_block_step_s']:.3f} | {at} | "
                       f"{r['enabled_peak_bytes'] / 1e6:.2f}{over}, {r['enabled_step_s']:.3f} | "
                       f"**{r['enabled_over_per_block']:.3f}** | {grouped_names(r['options'])} | "
                       f"{yes[g['enabled == per-block checkpointing']]}, {yes[g['enabled == eager']]} | "
                       f"{r['warmups'][0]['wall_s']:.1f}, {r['plan_seconds']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["shapes", "decoder"], choices=["shapes", "decoder"])
    ap.add_argument("--shape-models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--decoder-models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timed steps of each model")
    ap.add_argument("--time-limit", type=float, default=5.0, help="enable()'s time_limit_s per new block shape")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores thrash)")
    ap.add_argument("--progress", action="store_true", help="enable()'s progress lines on stderr")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--table", action="store_true", help="print the tables of --out, measure nothing")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result: dict = {"command": "scripts/bench_enable.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
                    "threads": args.threads}
    if "shapes" in args.parts:
        result["shapes"] = [bench_shapes(n, args) for n in args.shape_models]
    if "decoder" in args.parts:
        result["decoder"] = [bench_decoder(n, args) for n in args.decoder_models]
    result["seconds"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    say(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
