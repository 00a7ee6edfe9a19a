"""The memory of planning in place: does enabling the planner and training cost less memory than one eager step?

Each scenario runs in a fresh process, which reads its peak resident memory (VmHWM in /proc/self/status, reset
through /proc/self/clear_refs after the imports) above what it held after the imports:

- eager: build the model, run one eager training step (forward, backward, AdamW step);
- enabled: build the model, `planner.enable(model, half of eager's step peak)`, run 3 training steps (the first
  measures and profiles the block shape, the others run the plan).

Both import the planner's tracing code (AOTAutograd, sympy) and its solvers (OR-tools, HiGHS, PuLP) before the
baseline: a fixed cost of the library, the same for every model, reported apart. Resident memory rather than
torch.profiler's allocation events: the planner profiles a block on a thread of its own, whose allocations the
profiler does not see; the process's resident peak sees everything (the Python objects of the trace included).
glibc is told to map every block of 128 KiB or more on its own and return it when freed, so the resident peak
follows the bytes in use rather than the heap's history. Eager's step peak (for the budget) is measured in a third
process by planner.tools.measure.

    .venv/bin/python scripts/check_planning_memory.py [--layers 8 --width 256 --seq 512 --batch 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _build(args):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width,
                                   intermediate_size=4 * args.width, num_attention_heads=max(1, args.width // 64),
                                   num_key_value_heads=max(1, args.width // 64), vocab_size=args.vocab,
                                   max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def _scenario(args) -> dict:
    import torch
    import transformers  # noqa: F401 (imported before the baseline)

    import planner
    from planner.tools.measure import measure_peak_bytes

    before_imports = _status("VmRSS")
    # the planner's tracing code, imported in both scenarios before the baseline: a fixed cost of the library (its
    # modules, sympy, AOTAutograd), the same for any model, reported apart
    import torch._functorch.aot_autograd  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    import capture.trace  # noqa: F401
    import planner.inplace.controller  # noqa: F401
    import planner.whole.api  # noqa: F401
    from solvers.base import get_solver, solver_names

    for name in solver_names():  # the solvers and their libraries (OR-tools, HiGHS, PuLP)
        get_solver(name)
    import_bytes = _status("VmRSS") - before_imports
    if args.scenario == "budget":
        model, batch = _build(args)
        return {"eager_step_peak_bytes": measure_peak_bytes(model, batch)}
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    base = _status("VmRSS")
    model, batch = _build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out: dict = {"tracing_imports_bytes": import_bytes}
    if args.scenario == "eager":
        steps = 1
    else:
        state = planner.enable(model, args.budget_bytes / 1e9)
        steps = 3
    for k in range(steps):
        torch.manual_seed(k)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if args.scenario == "enabled":
        out["modes"] = [r.mode for r in state.records]
        out["options"] = state.records[-1].options
        out["predicted_peak_bytes"] = state.records[-1].predicted_peak_bytes
        out["plan_seconds"] = state.plan_seconds
    out["resident_peak_bytes"] = _status("VmHWM") - base
    return out


def _run(args, scenario: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--scenario", scenario, "--layers", str(args.layers), "--width", str(args.width),
           "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    # glibc: every block of 128 KiB or more mapped on its own and unmapped when freed (no dynamic threshold, no heap
    # kept after a free), so that the resident peak follows the bytes in use, not the heap's history
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "131072",
           "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_TOP_PAD_": "0"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{scenario} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--scenario", choices=("budget", "eager", "enabled"), default=None)
    ap.add_argument("--budget-bytes", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.scenario is not None:
        print(json.dumps(_scenario(args)))
        return 0
    eager_peak = _run(args, "budget")["eager_step_peak_bytes"]
    budget = eager_peak // 2
    eager = _run(args, "eager")
    enabled = _run(args, "enabled", budget_bytes=budget)
    ratio = enabled["resident_peak_bytes"] / eager["resident_peak_bytes"]
    result = {"model": f"Llama {args.layers} layers, width {args.width}, sequence {args.seq}, batch {args.batch}",
              "eager_step_peak_bytes": eager_peak, "budget_bytes": budget, "eager": eager, "enabled": enabled,
              "ratio": ratio}
    print(json.dumps(result, indent=1))
    print(f"resident peak: eager build + 1 step {eager['resident_peak_bytes'] / 1e6:.1f} MB; build + enable at half of "
          f"eager's step peak ({budget / 1e6:.1f} MB) + 3 steps {enabled['resident_peak_bytes'] / 1e6:.1f} MB; "
          f"ratio {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
