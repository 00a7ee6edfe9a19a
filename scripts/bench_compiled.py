"""planner.compile against torch.compile's own memory budget, at equal measured peak.

    .venv/bin/python scripts/bench_compiled.py [--models qwen2 llama] [--layers 8] [--width 512] [--seq 512]
        [--batch 1] [--budgets 0.5 0.3] [--repeats 7] [--time-limit 20] [--threads 1] [--out docs/results/compiled.json]

For each transformers decoder (random weights from a small config, nothing downloaded; the model computes its own
loss from labels; batch `--batch` rows of `--seq` tokens), on CPU inductor:
1. torch.compile of the whole model, and of each decoder layer alone with the rest eager (torchtitan's way, and
   planner.compile's), each with torch's partitioner at activation_memory_budget 1.0 (min-cut) and at each of
   `--budgets` (`MinCutAt`: the budget is the region's partitioner's own, so that it holds whenever the region
   compiles); each one's step peak measured from the allocator's stream (torch.profiler with profile_memory:
   inductor's buffers included, planner.tools.measure.allocator_peak_bytes);
2. planner.compile(model, budget) (per decoder layer, inductor, the project's partitioner) at the peak of each
   per-layer torch.compile under a budget: compiled, its step peak measured the same way; where it measures above
   the target, compiled again with the budget lowered by the excess; where it measures well below it (under
   EQUAL_SLACK), again with the budget raised by the shortfall, keeping the largest budget that measures at most the
   target (EQUAL_PEAK_TRIES compiles at most);
3. step times: medians of interleaved steps (planner.tools.measure.interleaved_step_seconds: forward, the model's
   loss, backward), eager and every compiled variant in one round robin; gradients compared with eager's (relative
   norm of the difference over all parameters).
Prints one line per variant; --out writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: E402

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError  # noqa: E402
from harness.eager_compare import relative_difference, step_state  # noqa: E402
from planner.compiled.api import compile as planner_compile  # noqa: E402
from planner.compiled.api import compiled_plan  # noqa: E402
from planner.core.units import GB  # noqa: E402
from planner.tools.measure import (  # noqa: E402
    allocator_peak_bytes,
    first_step_seconds,
    interleaved_step_seconds,
)

MODELS = ("qwen2", "llama")
EQUAL_PEAK_TRIES = 4
EQUAL_SLACK = 0.97  # a plan measuring below this share of the target is compiled again with a larger budget


def build(name: str, layers: int, width: int, seq: int, batch: int, vocab: int, seed: int = 0):
    """(model in train mode, keyword batch with labels): a Qwen2 or Llama decoder of heads of 64."""
    import transformers as T

    heads = max(1, width // 64)
    common = dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, num_key_value_heads=heads,
                  intermediate_size=int(2.6875 * width), vocab_size=vocab, max_position_embeddings=seq,
                  use_cache=False)
    cls, cfg = {"qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config), "llama": (T.LlamaForCausalLM, T.LlamaConfig)}[name]
    torch.manual_seed(seed)
    model = cls(cfg(**common)).train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    return model, {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long), "labels": ids,
                   "use_cache": False}


class MinCutAt(CustomPartitionerFn):
    """torch's own partitioner under activation_memory_budget `budget`, as inductor's custom partitioner: the budget
    holds whenever the region compiles, and each budget is a backend of its own (torch.compile calls with equal
    options share their compiled code: a second budget compiled after a first would silently reuse it)."""

    def __init__(self, budget: float):
        self.budget = budget

    def __call__(self, gm, joint_inputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self):
        return None


def torch_compiled(model, batch, budget: float, per_layer: bool):
    """A copy of `model` compiled by torch.compile, whole or each decoder layer alone (the rest eager: torchtitan's
    way, and planner.compile's), with torch's partitioner at activation_memory_budget `budget`; compiled now (its
    first step). Returns (module, first step s)."""
    m = copy.deepcopy(model)
    options = {"custom_partitioner_fn": MinCutAt(budget), "fx_graph_cache": False}
    if per_layer:
        for layer in m.model.layers:
            layer.compile(options=options)
    else:
        m = torch.compile(m, options=options)
    return m, first_step_seconds(m, batch)


def planned(model, batch, budget_bytes: int, time_limit_s: float):
    """planner.compile of a copy of `model` at `budget_bytes`, compiled now: (module, first step s, measured peak),
    or None where the budget is refused."""
    m = copy.deepcopy(model)
    planner_compile(m, budget_bytes / GB, time_limit_s=time_limit_s)
    try:
        first = first_step_seconds(m, batch)
    except Exception as e:  # noqa: BLE001 - torch._dynamo wraps the planner's refusal
        cause = e.__cause__ or e
        if isinstance(cause, (InfeasibleBudgetError, NoSolutionInTimeError)) or "InfeasibleBudgetError" in str(e):
            why = str(cause).splitlines()[-1][:300]
            print(f"  planner.compile at {budget_bytes} bytes: refused ({why})", flush=True)
            return None
        raise
    return m, first, allocator_peak_bytes(m, batch)


def at_equal_peak(model, batch, target_bytes: int, time_limit_s: float):
    """The planner at the largest budget tried whose compiled step measures at most `target_bytes` (see the module
    docstring): (module, budget, first step s, measured peak, tries), or None."""
    budget = target_bytes
    best = None
    for tries in range(1, EQUAL_PEAK_TRIES + 1):
        got = planned(model, batch, budget, time_limit_s)
        if got is None:
            break
        module, first, peak = got
        print(f"  planner.compile at {budget} bytes measures {peak} (target {target_bytes})", flush=True)
        if peak <= target_bytes:
            if best is None or budget > best[1]:
                best = (module, budget, first, peak, tries)
            if peak >= EQUAL_SLACK * target_bytes:
                break
            budget += target_bytes - peak
        else:
            budget -= peak - target_bytes
        if budget <= 0:
            break
    return best


def bench_model(name: str, args) -> list[dict]:
    model, batch = build(name, args.layers, args.width, args.seq, args.batch, args.vocab)
    shape = dict(model=name, layers=args.layers, width=args.width, seq=args.seq, batch=args.batch,
                 threads=args.threads)
    eager_grads, _, _ = step_state(model, batch, seed=11)
    modules = {"eager": model}
    rows = {"eager": {**shape, "variant": "eager", "peak_bytes": allocator_peak_bytes(model, batch)}}
    for per_layer in (False, True):
        for b in (1.0, *args.budgets):
            label = "torch.compile" + (" per layer" if per_layer else "") + ("" if b == 1.0 else f"@{b}")
            m, first = torch_compiled(model, batch, b, per_layer)
            modules[label] = m
            rows[label] = {**shape, "variant": label, "per_layer": per_layer, "activation_memory_budget": b,
                           "peak_bytes": allocator_peak_bytes(m, batch), "first_step_s": first}
            print(f"{name}: {label} measures {rows[label]['peak_bytes']} bytes, first step {first:.1f} s", flush=True)
    for b in args.budgets:
        target = rows[f"torch.compile per layer@{b}"]["peak_bytes"]
        label = f"planner@{b}"
        found = at_equal_peak(model, batch, target, args.time_limit)
        if found is None:
            rows[label] = {**shape, "variant": label, "target_peak_bytes": target,
                           "error": "no budget tried measures at most the target"}
            continue
        module, budget, first, ours, tries = found
        plan = compiled_plan(module)
        modules[label] = module
        rows[label] = {**shape, "variant": label, "target_peak_bytes": target, "budget_bytes": budget,
                       "peak_bytes": ours, "first_step_s": first, "compiles": tries,
                       "regions": [dict(saved_bytes=r.saved_bytes, recomputed=len(r.recomputed),
                                        excess=r.excess, solves=r.solves, boundary=r.held.boundary,
                                        grads=r.held.grads, peak=r.held.peak,
                                        status=r.status) for r in plan.partitioner.regions],
                       "summary": plan.summary()}
    times = interleaved_step_seconds(modules, batch, repeats=args.repeats)
    for label, m in modules.items():
        rows[label]["step_s"] = times[label].median_s
        rows[label]["step_samples_s"] = times[label].samples_s
        if label != "eager":
            g, _, _ = step_state(m, batch, seed=11)
            g = {k.removeprefix("_orig_mod."): v for k, v in g.items()}
            rows[label]["grad_vs_eager"] = relative_difference(g, eager_grads)
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.3],
                    help="torch.compile's activation_memory_budget values")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--time-limit", type=float, default=20.0, help="the planner's time limit per region (s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # cold compiles, for torch.compile and the planner alike
    torch._functorch.config.enable_autograd_cache = False
    # every compile here is a new backend of the same layer code: keep them all instead of falling back to eager
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    rows = []
    for name in args.models:
        rows += bench_model(name, args)
    for r in rows:
        if "step_s" in r:
            print(f"{r['model']:6s} {r['variant']:28s} peak {r['peak_bytes'] / 1e6:8.2f} MB  step "
                  f"{r['step_s'] * 1e3:8.1f} ms  grads vs eager {r.get('grad_vs_eager', 0.0):.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
