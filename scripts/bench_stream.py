"""A training stream as most recipes feed it: each batch padded to its own longest row, so nearly every batch has a
length of its own. The whole run's wall time, planning included, for eager, transformers'
`gradient_checkpointing_enable()` and `planner.enable()`, each on its own copy of one model in the same process.

    .venv/bin/python scripts/bench_stream.py [--model qwen2] [--width 64] [--steps 30] [--budget-share 0.5]
        [--repeats 1] [--trainer] [--check-peaks] [--out FILE]

The model: a transformers decoder built from a small config with the library's defaults (`use_cache` on), random
weights: 4 layers of `--width` (4 heads, MLP twice as wide). The stream: `--steps` batches of 4 rows, each row's
length drawn from 16-192 (seeded), padded to the batch's longest row (pad id, attention mask 0, labels -100), one
AdamW step per batch. The planner's budget lies `--budget-share` of the way from per-block checkpointing's measured
peak to eager's, both measured at the longest batch of the stream. Reported per engine: the run's wall time, and for
the planner its profiling seconds, the number of training calls that measured (every block checkpointed) and the
block shapes profiled; and whether the planner's parameters equal eager's at the end; with --check-peaks, every
step's measured peak against the budget. With --repeats R the three engines run R times, interleaved (eager,
gradient checkpointing, enable, then again), each time on a fresh copy: the figures are medians, the runs listed.
With --trainer each engine is transformers' Trainer (AdamW, `--steps` optimizer steps of 4 rows) over 4 x `--steps`
rows of 16-192 tokens (seeded; the longest 192), shuffled by the Trainer, through a collator that pads each batch to
its longest row; the budget is measured on a batch of that longest row and three others padded to it, and the peaks
(--check-peaks) are measured on the batches the planner's Trainer was fed, in their order.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import planner  # noqa: E402
from planner.tools.baselines import per_block_checkpointed  # noqa: E402
from planner.tools.measure import measure_peak_bytes  # noqa: E402

VOCAB = 512


def make_model(name: str, width: int = 64) -> torch.nn.Module:
    import transformers as T

    common = dict(num_hidden_layers=4, hidden_size=width, num_attention_heads=4, intermediate_size=2 * width,
                  vocab_size=VOCAB)
    config = {"qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **common),
              "llama": lambda: T.LlamaConfig(num_key_value_heads=4, **common)}[name]()
    torch.manual_seed(0)
    cls = {"qwen2": T.Qwen2ForCausalLM, "llama": T.LlamaForCausalLM}[name]
    return cls(config).train()


def stream(steps: int, seed: int = 0) -> list[dict]:
    """Batches of 4 rows of random lengths, each padded to its longest row."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        lengths = [rng.randint(16, 192) for _ in range(4)]
        longest = max(lengths)
        ids = torch.zeros(4, longest, dtype=torch.long)
        mask = torch.zeros(4, longest, dtype=torch.long)
        for r, n in enumerate(lengths):
            ids[r, :n] = torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(rng.randint(0, 2**31)))
            mask[r, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` unpadded rows of 16-192 tokens (one of 192), for the Trainer."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 191) for _ in range(n - 1)] + [192]
    rng.shuffle(lengths)
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=gen)} for k in lengths]


def pad_to_longest(features: list[dict]) -> dict:
    """The batch of `features` padded to its longest row: pad id 0, attention mask 0, labels -100."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for r, f in enumerate(features):
        ids[r, :len(f["input_ids"])] = f["input_ids"]
        mask[r, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run_trainer(model: torch.nn.Module, data: list[dict], steps: int, fed: list | None = None) -> float:
    """Seconds of `trainer.train()`: `steps` AdamW steps of 4 rows (see the module docstring); the batches fed are
    appended to `fed`."""
    import transformers as T

    def collate(features):
        batch = pad_to_longest(features)
        if fed is not None:
            fed.append({k: v.clone() for k, v in batch.items()})
        return batch

    with tempfile.TemporaryDirectory() as out:
        args = T.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3,
                                   report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=3,
                                   dataloader_num_workers=0, disable_tqdm=True)
        trainer = T.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        t0 = time.perf_counter()
        trainer.train()
        return time.perf_counter() - t0


def run(model: torch.nn.Module, batches: list[dict]) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for k, batch in enumerate(batches):
        torch.manual_seed(k)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2", choices=("qwen2", "llama"))
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-share", type=float, default=0.5)
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--trainer", action="store_true", help="each engine is transformers' Trainer")
    ap.add_argument("--check-peaks", action="store_true", help="measure every step's peak on a second enabled copy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = make_model(args.model, args.width)
    if args.trainer:
        data = rows(4 * args.steps)
        top = max(range(len(data)), key=lambda i: len(data[i]["input_ids"]))
        longest = pad_to_longest([data[top]] + [d for i, d in enumerate(data) if i != top][:3])
    else:
        batches = stream(args.steps)
        longest = max(batches, key=lambda b: b["input_ids"].shape[1])
    eager_peak = measure_peak_bytes(copy.deepcopy(base), longest)
    ckpt_peak = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(base)), longest)
    budget = ckpt_peak + args.budget_share * (eager_peak - ckpt_peak)
    row: dict = {"model": args.model, "width": args.width, "steps": args.steps, "trainer": args.trainer,
                 "eager_peak_bytes": eager_peak, "per_block_peak_bytes": ckpt_peak, "budget_bytes": int(budget)}

    def train(model, fed=None):
        return run_trainer(model, data, args.steps, fed) if args.trainer else run(model, batches)

    runs: dict[str, list[float]] = {"eager_s": [], "gradient_checkpointing_s": [], "enable_s": []}
    for _ in range(args.repeats):
        eager = copy.deepcopy(base)
        runs["eager_s"].append(train(eager))
        gc_model = copy.deepcopy(base)
        gc_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        runs["gradient_checkpointing_s"].append(train(gc_model))
        enabled = copy.deepcopy(base)
        state = planner.enable(enabled, budget / 1e9, time_limit_s=args.time_limit)
        fed: list = []
        runs["enable_s"].append(train(enabled, fed))
    if args.trainer:
        batches = fed
    row["lengths"] = len({b["input_ids"].shape[1] for b in batches})
    for name, values in runs.items():
        row[name] = statistics.median(values)
    row["runs"] = runs
    row["enable_profiling_s"] = state.plan_seconds
    row["enable_measuring_calls"] = sum(1 for r in state.records if r.mode == "measure")
    row["enable_block_shapes_profiled"] = sum(1 for p in state.profiles.values()
                                              if getattr(p, "bounded_at", None) is None)
    row["enable_equal_to_eager"] = all(torch.equal(a, b) for a, b in zip(enabled.parameters(), eager.parameters()))
    if args.check_peaks:  # the same stream on a fresh copy, each step's peak measured (storage-tracking mode)
        checked = copy.deepcopy(base)
        planner.enable(checked, budget / 1e9, time_limit_s=args.time_limit)
        peaks = [measure_peak_bytes(checked, batch) for batch in batches]
        row["enable_max_step_peak_bytes"] = max(peaks)
        row["enable_steps_over_budget"] = sum(p > budget for p in peaks)
    print(json.dumps(row, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
