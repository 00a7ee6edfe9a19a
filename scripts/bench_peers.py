"""The in-place planner (`planner.enable`) against what users would pick instead, each at the peer's own measured
peak memory.

    .venv/bin/python scripts/bench_peers.py [--models qwen2 llama] [--size decoder512] [--repeats 7]
        [--peers ...] [--out docs/results/peers.json] [--table]

Models: transformers decoders built here from their configs, the library's defaults otherwise (`use_cache` left at
its default: each forward makes a key/value cache that reaches every layer), random weights under seed 0:
Qwen2 (Qwen2ForCausalLM) and Llama (LlamaForCausalLM). Size "decoder512": 8 layers of width 512, 8 heads and 8
key/value heads, MLP width 1024 (twice the width, as examples/hf_zoo.py builds its llama), GPT-2's vocabulary (50257),
batch 1, sequence 512; size "small" (quick checks): 2 layers of width 64, 2 heads, MLP width 128, vocabulary 1000,
batch 2, sequence 64. The batch: input_ids (drawn under seed 1), an all-ones attention_mask, labels = input_ids (the
model's own loss). Each step: forward, loss, backward, gradients reset (planner.tools.measure.run_step).

Peers (each a wrapped deep copy of the model, planner/tools/baselines.py and auto_sac.py):
- per_block: torch.utils.checkpoint (non-reentrant) around every decoder layer (`per_block_checkpointed`);
- layer_every_2, layer_every_3: torchtitan's layer checkpointing, layers 0, k, 2k, ... checkpointed, the others eager
  (`layer_checkpointed(model, k)`);
- sac_matmul_attention: selective checkpointing saving matmul and attention outputs
  (`per_block_checkpointed(model, selective=True)`);
- auto_sac_0.75, auto_sac_0.5, auto_sac_0.25: PyTorch's automatic SAC (`auto_sac_checkpointed`): SACEstimator
  (torch.distributed._tools) over one layer under FakeTensorMode, then the per-module ILP
  (`get_optimal_checkpointing_policy_per_module`) saving at most that fraction of the layer's op-output bytes; torch's
  own runtime estimates need CUDA, so on CPU their exact errors are recorded and a perf_counter benchmark of each op
  stands in (the JSON's `auto_sac.stock_estimate_errors`, `auto_sac.runtime_estimate`). A peer that cannot be built
  has its exact error recorded, in the JSON and the table, and the run goes on.
Reference points: eager (the model as it is), with the budget its measured peak and ten times that (where enable()
should keep every block).

For each point: the peer's step peak P (planner.tools.measure.measure_peak_bytes: a storage-tracking dispatch mode,
CPU; seed 0), a fresh deep copy of the unwrapped model enabled at P (10 P for eager x10), two warm-up training calls
(the measuring call, then the first planned one; where enable() refuses the budget, raising InfeasibleBudgetError at
a warm-up call, the error is recorded and a fresh copy is enabled at the least budget it names, as
scripts/bench_enable.py does), the enabled model's peak (same mode), its gradients against eager's
(harness.eager_compare.step_state under one seed, torch.equal on every gradient; the peer's too), then the medians
of `--repeats` interleaved steps of the peer and the enabled model (planner.tools.measure.interleaved_step_seconds,
one untimed round first, the order shuffled each round). Recorded: the options enable() chose (`state.records[-1]`
after the timed steps), `state.summary()`, whether the enabled peak is within P, enabled step / peer step and
"faster" (that ratio below 1). A model's line "faster at N of M peer points" counts the peers that ran (the eager
references left out).

Torch runs with --threads threads (1 by default, as scripts/bench_enable.py: 2 threads on 2 shared cores thrash).
With --table, prints the table of the JSON in --out and measures nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import planner  # noqa: E402
from harness.eager_compare import step_state  # noqa: E402
from planner.inplace.controller import grouped_names  # noqa: E402
from planner.tools.auto_sac import auto_sac_block_stats, auto_sac_checkpointed  # noqa: E402
from planner.tools.baselines import layer_checkpointed, per_block_checkpointed  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, measure_peak_bytes  # noqa: E402
from scripts.bench_enable import _same_grads, enable_at, say  # noqa: E402

MODELS = ("qwen2", "llama")
SIZES = {"decoder512": dict(layers=8, width=512, heads=8, seq=512, batch=1, vocab=50257),
         "small": dict(layers=2, width=64, heads=2, seq=64, batch=2, vocab=1000)}
AUTO_FRACTIONS = (0.75, 0.5, 0.25)
PEERS = ("per_block", "layer_every_2", "layer_every_3", "sac_matmul_attention",
         *(f"auto_sac_{f}" for f in AUTO_FRACTIONS))
REFERENCES = ("eager", "eager_x10")
DESCRIBE = {"per_block": "per-block checkpointing", "layer_every_2": "layer checkpointing, every 2nd",
            "layer_every_3": "layer checkpointing, every 3rd", "sac_matmul_attention": "SAC (matmul, attention saved)",
            **{f"auto_sac_{f}": f"auto SAC, memory fraction {f}" for f in AUTO_FRACTIONS},
            "eager": "eager (budget its peak)", "eager_x10": "eager (budget 10x its peak)"}


def build(name: str, size: str) -> tuple[torch.nn.Module, dict]:
    """(model in train mode, batch): the decoder `name` of size `size` (see the module docstring)."""
    import transformers as T

    s = SIZES[size]
    common = dict(num_hidden_layers=s["layers"], hidden_size=s["width"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["heads"], intermediate_size=2 * s["width"], vocab_size=s["vocab"])
    cls, cfg = {"qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config), "llama": (T.LlamaForCausalLM, T.LlamaConfig)}[name]
    torch.manual_seed(0)
    model = cls(cfg(**common)).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, s["vocab"], (s["batch"], s["seq"]), generator=gen)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_peer(label: str, model: torch.nn.Module, batch: dict, cache: dict) -> torch.nn.Module:
    if label == "per_block":
        return per_block_checkpointed(model)
    if label.startswith("layer_every_"):
        return layer_checkpointed(model, int(label.rsplit("_", 1)[1]))
    if label == "sac_matmul_attention":
        return per_block_checkpointed(model, selective=True)
    if label.startswith("auto_sac_"):
        if "stats" not in cache:  # one estimate per model, for the three fractions
            cache["stats"] = auto_sac_block_stats(model, batch)
        return auto_sac_checkpointed(model, batch, float(label.rsplit("_", 1)[1]), stats=cache["stats"])
    if label in REFERENCES:
        return model
    raise ValueError(label)


def bench_point(name: str, label: str, model: torch.nn.Module, batch: dict, eager: dict, cache: dict, args) -> dict:
    where = f"{name} {label}"
    row: dict = {"model": f"{name}:{args.size}", "peer": label, "peer_description": DESCRIBE[label],
                 "reference": label in REFERENCES}
    t0 = time.perf_counter()
    try:
        peer = make_peer(label, model, batch, cache)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here: its exact error, and the run goes on
        row["error"] = f"{type(e).__name__}: {e}"
        say(f"{where}: cannot build the peer: {row['error']}")
        return row
    if hasattr(peer, "auto_sac"):
        row["auto_sac"] = peer.auto_sac.describe()
        row["auto_sac"]["estimate_seconds"] = cache["stats"].estimate_seconds
    try:
        torch.manual_seed(0)
        peak = measure_peak_bytes(peer, batch)
        budget = 10 * peak if label == "eager_x10" else peak
        say(f"{where}: peer peak {peak / 1e6:.3f} MB, budget {budget / 1e6:.3f} MB")
        row["peer_grads_equal_eager"] = _same_grads(step_state(peer, batch, seed=3), eager)
        enabled, state, used, warmups, refused = enable_at(model, budget, batch, args, where)
        torch.manual_seed(0)
        enabled_peak = measure_peak_bytes(enabled, batch)
        grads_equal = _same_grads(step_state(enabled, batch, seed=3), eager)
        n_records = len(state.records)
        times = interleaved_step_seconds({"peer": peer, "enabled": enabled}, batch, repeats=args.repeats, warmup=1)
    except Exception as e:  # noqa: BLE001 - e.g. the peer's own step failing: recorded, the run goes on
        row["error"] = f"{type(e).__name__}: {e}"
        say(f"{where}: failed: {row['error']}")
        return row
    last = state.records[-1]
    ratio = times["enabled"].median_s / times["peer"].median_s
    row.update({
        "peer_peak_bytes": peak, "budget_bytes": budget, "enabled_at_bytes": used, "refused": refused,
        "enabled_peak_bytes": enabled_peak, "enabled_within_peer_peak": enabled_peak <= peak,
        "enabled_within_budget": enabled_peak <= used, "predicted_peak_bytes": last.predicted_peak_bytes,
        "options": last.options, "options_grouped": grouped_names(last.options),
        "timed_modes": sorted({str(r.mode) for r in state.records[n_records:]}),
        "peer_step_s": times["peer"].median_s, "enabled_step_s": times["enabled"].median_s,
        "enabled_over_peer": ratio, "faster": ratio < 1,
        "peer_samples_s": times["peer"].samples_s, "enabled_samples_s": times["enabled"].samples_s,
        "grads_equal_eager": grads_equal, "warmups": warmups, "plan_seconds": state.plan_seconds,
        "summary": state.summary(), "seconds": time.perf_counter() - t0})
    if label in REFERENCES:
        row["keeps_every_block"] = all(o == "kept" for o in last.options)
    say(f"{where}: peer {row['peer_step_s']:.3f} s, enabled {row['enabled_step_s']:.3f} s (x{ratio:.3f}), enabled "
        f"peak {enabled_peak / 1e6:.3f} MB, options {row['options_grouped']}, grads == eager {grads_equal}")
    planner.disable(enabled)
    return row


def bench_model(name: str, args) -> list[dict]:
    model, batch = build(name, args.size)
    eager = step_state(model, batch, seed=3)
    cache: dict = {}
    rows = []
    for label in args.peers:
        rows.append(bench_point(name, label, model, batch, eager, cache, args))
        gc.collect()
    return rows


def _mb(b) -> str:
    return "" if b is None else f"{b / 1e6:.2f}"


def table(result: dict) -> str:
    yes = {True: "yes", False: "NO", None: ""}
    out = ["| model | peer | peer peak (MB) | peer step (s) | enabled peak (MB) | enabled step (s) | ratio | "
           "options chosen | grads == eager |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            error = " ".join(r["error"].split()).replace("|", "\\|")  # one table cell
            out.append(f"| {r['model']} | {r['peer_description']} | error: {error} | | | | | | |")
            continue
        peak = _mb(r["peer_peak_bytes"])
        if r["budget_bytes"] != r["peer_peak_bytes"]:
            peak += f" (budget {_mb(r['budget_bytes'])})"
        enabled = _mb(r["enabled_peak_bytes"])
        if r["refused"] is not None:
            enabled += f" (budget refused; enabled at the least named, {_mb(r['enabled_at_bytes'])})"
        if not r["enabled_within_budget"]:
            enabled += " (over budget)"
        elif not r["enabled_within_peer_peak"] and not r["reference"]:
            enabled += " (over peer peak)"
        out.append(f"| {r['model']} | {r['peer_description']} | {peak} | {r['peer_step_s']:.4f} | {enabled} | "
                   f"{r['enabled_step_s']:.4f} | **{r['enabled_over_peer']:.3f}** | {r['options_grouped']} | "
                   f"{yes[r['grads_equal_eager']]} |")
    out.append("")
    for m in dict.fromkeys(r["model"] for r in result["rows"]):
        ran = [r for r in result["rows"] if r["model"] == m and not r["reference"] and "error" not in r]
        failed = [r["peer"] for r in result["rows"] if r["model"] == m and "error" in r]
        line = f"{m}: faster at {sum(r['faster'] for r in ran)} of {len(ran)} peer points"
        out.append(line + (f" ({', '.join(failed)} did not run)" if failed else "") + "  ")
    auto = [r for r in result["rows"] if "auto_sac" in r]
    if auto:
        a = auto[0]["auto_sac"]
        errors = "; ".join(f"{k}: {v}" for k, v in a["stock_estimate_errors"].items()) or "none"
        out += ["", f"auto SAC runtime estimate: {a['runtime_estimate']} (torch's own estimates' errors here: "
                    f"{errors})"]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--size", default="decoder512", choices=list(SIZES))
    ap.add_argument("--peers", nargs="+", default=[*PEERS, *REFERENCES], choices=[*PEERS, *REFERENCES])
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timed steps of each model")
    ap.add_argument("--time-limit", type=float, default=5.0, help="enable()'s time_limit_s per new block shape")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores thrash)")
    ap.add_argument("--progress", action="store_true", help="enable()'s progress lines on stderr")
    ap.add_argument("--out", default="docs/results/peers.json", help="the JSON written (read with --table)")
    ap.add_argument("--table", action="store_true", help="print the table of --out, measure nothing")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result: dict = {"command": "scripts/bench_peers.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
                    "size": args.size, "threads": args.threads, "repeats": args.repeats, "rows": []}
    for name in args.models:
        result["rows"] += bench_model(name, args)
    result["seconds"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    say(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
