"""Planned steps under bf16 autocast against eager's, and torch.compile's aot_eager against eager's, on the tiny
transformers models (examples.hf_zoo size "test"): the whole-model plan (plan() under autocast, at a generous
budget, cost model "time") and the in-place planner (planner.enable at per-block checkpointing's measured peak),
each trained 3 AdamW steps (lr 1e-3, the seed reset before each step) beside eager and aot_eager from the same
weights. Prints and writes the largest parameter difference from eager of each, and whether it is torch.equal.

    .venv/bin/python scripts/check_autocast.py [--models gpt2 llama] [--out docs/results/autocast.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import planner  # noqa: E402
from examples.hf_zoo import build  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import measure_peak_bytes  # noqa: E402

AMP = {"device_type": "cpu", "dtype": torch.bfloat16}


def train(step_module, model, batch, steps: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(steps):
        torch.manual_seed(k)
        with torch.autocast(**AMP):
            loss = step_module(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def largest_difference(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def check(name: str) -> dict:
    model, batch = build(name, "test")
    eager, aot, whole, inplace = (copy.deepcopy(model) for _ in range(4))
    train(eager, eager, batch)
    train(torch.compile(aot, backend="aot_eager"), aot, batch)
    with torch.autocast(**AMP):
        p = planner.plan(whole, batch, 1.0, cost_model="time", time_limit_s=10)
    train(p.apply(whole), whole, batch)
    with torch.autocast(**AMP):
        torch.manual_seed(0)
        budget = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), batch)
    state = planner.enable(inplace, budget / 1e9, time_limit_s=5)
    train(inplace, inplace, batch)
    row = {"model": f"{name}:test", "dropout": getattr(model.config, "resid_pdrop", 0.0) or
           getattr(model.config, "attention_dropout", 0.0)}
    for label, m in (("aot_eager", aot), ("plan", whole), ("enable", inplace)):
        d = largest_difference(m, eager)
        row[label] = {"max_param_diff": d, "equal": d == 0.0}
    row["enable_modes"] = sorted({r.mode for r in state.records})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--out")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = [check(n) for n in args.models]
    result = {"command": "scripts/check_autocast.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
              "rows": rows}
    for r in rows:
        print(f"{r['model']} (dropout {r['dropout']}): " + ", ".join(
            f"{k} {r[k]['max_param_diff']:.3g}{' (equal)' if r[k]['equal'] else ''}"
            for k in ("aot_eager", "plan", "enable")))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
