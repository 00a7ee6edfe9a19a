"""Trace a 12-layer GPT-2-small-shaped decoder and report trace time and node counts.

    .venv/bin/python scripts/bench_trace.py [--layers 12] [--seq 256] [--batch 1] [--vocab 50257]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from capture.trace import trace  # noqa: E402
from graphs.simulate import reference_peak_bytes  # noqa: E402
from tests.models import make_gpt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, x = make_gpt(batch=args.batch, seq=args.seq, vocab=args.vocab, d_model=args.d_model,
                        n_heads=args.heads, n_layers=args.layers)
    t0 = time.perf_counter()
    tr = trace(model, x)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    merged = trace(model, x, merge_chains=True)
    seconds_merged = time.perf_counter() - t1
    g = tr.graph
    print(f"model: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}; torch threads {args.threads}")
    phases = ", ".join(f"{k} {v:.1f}" for k, v in tr.phase_seconds.items())
    print(f"trace seconds (default: alias contraction): {seconds:.1f} ({phases})")
    print(f"trace seconds (merge_chains=True): {seconds_merged:.1f}")
    print(f"aten nodes: {tr.aten_node_count}")
    print(f"contracted nodes: {g.n} ({100 * g.n / tr.aten_node_count:.1f}%); "
          f"with merge_chains: {merged.graph.n} ({100 * merged.graph.n / tr.aten_node_count:.1f}%)")
    print(f"fixed bytes: {g.fixed_bytes}; reference-order peak: {reference_peak_bytes(g)} "
          f"(merge_chains: {reference_peak_bytes(merged.graph)}); FLOPs: {tr.total_flops:.4g}")


if __name__ == "__main__":
    main()
