"""The planner against PyTorch's own tools at equal measured peak memory, on the test models.

    .venv/bin/python scripts/bench_pytorch.py [--models mlp cnn gpt gpt_untied unet] [--repeats 5]
        [--budget 0.5 [0.2 ...]] [--dropout P]

For each model:
1. per-block torch.utils.checkpoint (use_reentrant=False, RNG state preserved): its measured peak P1;
2. PyTorch's memory-budget partitioner (aot_module + min_cut_rematerialization_partition, with
   torch._functorch.config.activation_memory_budget = --budget, no compiler): its measured peak P2;
3. the planner at budget P1 and at budget P2 (cost model "time").
Peaks are measured with the storage-tracking dispatch mode (CPU); step times are medians of interleaved repeats
(forward, loss, backward); gradients and BatchNorm buffers are compared bitwise with eager under one seed.
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from harness.eager_compare import step_state  # noqa: E402
from planner import GB, plan  # noqa: E402
from planner.tools.measure import interleaved_step_seconds, measure_peak_bytes  # noqa: E402
from tests.models import MAKERS, make_gpt_untied  # noqa: E402

# gpt_untied: dropout and an untied head, so that PyTorch's partitioner (which refuses tied weights) runs on it
BENCH_MAKERS = {**MAKERS, "gpt_untied": make_gpt_untied}

# Medium sizes: large enough that kernels, not Python, dominate a step on this CPU.
CONFIGS = {
    "mlp": dict(batch=1024, width=256, depth=8),
    "cnn": dict(batch=16, ch=16, size=32, blocks=3),
    "gpt": dict(batch=4, seq=128, vocab=256, d_model=128, n_heads=4, n_layers=4),
    "gpt_untied": dict(batch=4, seq=128, vocab=256, d_model=128, n_heads=4, n_layers=4),
    "unet": dict(batch=4, ch=8, size=64),
}
# The blocks that torch.utils.checkpoint wraps, per model.
BLOCKS = {
    "mlp": lambda m: [m.body[i] for i in range(0, len(m.body), 2)],
    "cnn": lambda m: list(m.blocks),
    "gpt": lambda m: list(m.blocks),
    "gpt_untied": lambda m: list(m.blocks),
    "unet": lambda m: [*m.downs, m.mid, *m.up_convs],
}


def with_block_checkpoints(model: nn.Module, name: str) -> nn.Module:
    m = copy.deepcopy(model)
    blocks = BLOCKS[name](m)
    if name == "mlp":  # checkpoint Linear + ReLU together: wrap pairs of the Sequential
        body = m.body
        pairs = [nn.Sequential(body[i], body[i + 1]) for i in range(0, len(body), 2)]
        m.body = nn.Sequential(*pairs)
        blocks = pairs
    for blk in blocks:
        inner = blk.forward
        blk.forward = types.MethodType(lambda self, *a, _f=inner: checkpoint(_f, *a, use_reentrant=False), blk)
    return m


def with_memory_budget_partitioner(model: nn.Module, x, budget: float):
    from functorch.compile import aot_module, min_cut_rematerialization_partition, nop

    m = copy.deepcopy(model)
    compiled = aot_module(m, fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
    with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
        state = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.random.fork_rng():
            compiled(x).sum().backward()  # compile now (the partitioner runs at the first call)
        m.load_state_dict(state)
        for p in m.parameters():
            p.grad = None
    wrapper = nn.Module()
    wrapper.inner = m
    wrapper.forward = types.MethodType(lambda self, *a: compiled(*a), wrapper)
    return wrapper, m


def equal_state(a, b) -> tuple[bool, bool, float]:
    """(gradients equal, buffers equal, largest |ga - gb| / |gb| (Frobenius norms) over the gradients)."""
    ga, ba, _ = a
    gb, bb, _ = b
    # by position: the checkpointed MLP nests its layers under other names
    if len(ga) != len(gb) or len(ba) != len(bb):
        return False, False, float("nan")
    grads = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                for x, y in zip(ga.values(), gb.values()))
    bufs = all(torch.equal(x, y) for x, y in zip(ba.values(), bb.values()))
    rel = max(((x - y).norm() / y.norm().clamp_min(1e-30)).item()
              for x, y in zip(ga.values(), gb.values()) if x is not None and y is not None)
    return grads, bufs, rel


def strip_prefix(state, prefix: str):
    g, b, loss = state
    return ({k.removeprefix(prefix): v for k, v in g.items()}, {k.removeprefix(prefix): v for k, v in b.items()}, loss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, nargs="+", default=[0.5],
                    help="activation_memory_budget(s) of PyTorch's partitioner (each < 1 gets its rows)")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--dropout", type=float, default=None,
                    help="override the dropout probability of the GPT models (e.g. 0 to isolate its effect)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on 2 shared cores thrash)")
    ap.add_argument("--plot", help="also draw time / eager against measured peak per model into this PNG")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        config = dict(CONFIGS[name])
        if args.dropout is not None:
            if not name.startswith("gpt"):
                ap.error(f"--dropout applies to the GPT models only, not {name}")
            config["dropout"] = args.dropout
        model, x = BENCH_MAKERS[name](**config)
        eager = copy.deepcopy(model)
        ref_state = step_state(copy.deepcopy(model), x, seed=3)
        ckpt = with_block_checkpoints(model, name)
        p_ckpt = measure_peak_bytes(with_block_checkpoints(model, name), x)  # a twin: ckpt stays unstepped
        first = plan(model, x, 1000.0, time_limit_s=args.time_limit)
        ours_ckpt = plan(model, x, p_ckpt / GB, time_limit_s=args.time_limit, traced=first.traced)
        mods = {
            "eager": eager,
            "checkpoint per block": ckpt,
            "planner @ checkpoint's peak": ours_ckpt.apply(copy.deepcopy(model)),
        }
        for budget in args.budget:
            pt_label = f"PyTorch partitioner (budget {budget})"
            try:
                pt, _ = with_memory_budget_partitioner(model, x, budget)
                p_pt = measure_peak_bytes(pt, x)
                pt, _ = with_memory_budget_partitioner(model, x, budget)  # a fresh one for the equality check
                ours_pt = plan(model, x, p_pt / GB, time_limit_s=args.time_limit, traced=first.traced)
                mods[pt_label] = pt
                at = "planner @ partitioner's peak" + (f" ({budget})" if len(args.budget) > 1 else "")
                mods[at] = ours_pt.apply(copy.deepcopy(model))
            except Exception as e:  # PyTorch's capture refuses some models (e.g. tied weights)
                reason = str(e).splitlines()[0][:90]
                rows.append((name, pt_label, float("nan"), float("nan"), float("nan"), None, None, reason))
        # gradients and buffers of each module's first step (before the measurements below step them again)
        states = {label: step_state(m, x, seed=3) for label, m in mods.items()}
        times = interleaved_step_seconds(mods, x, repeats=args.repeats, warmup=1)
        base = times["eager"].median_s
        for label, m in mods.items():
            peak = measure_peak_bytes(m, x)
            st = states[label]
            if label.startswith("planner"):
                st = strip_prefix(st, "module.")
            elif label.startswith("PyTorch"):
                st = strip_prefix(st, "inner.")
            g_ok, b_ok, rel = equal_state(st, ref_state)
            note = "" if g_ok else f"gradients differ from eager by up to {rel:.3g} in relative norm"
            rows.append((name, label, peak / 1e6, 1e3 * times[label].median_s, times[label].median_s / base,
                         g_ok, b_ok, note))
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print("| model | method | measured peak (MB) | step (ms) | time / eager | grads == eager | buffers == eager |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in rows:
        if r[5] is None:
            print(f"| {r[0]} | {r[1]} | fails: {r[7]} | | | | |")
            continue
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.1f} | {r[4]:.3f} | {'yes' if r[5] else 'NO'} | "
              f"{'yes' if r[6] else 'NO'} |")
    for r in rows:
        if r[5] is not None and r[7]:
            print(f"{r[0]} / {r[1]}: {r[7]}")
    if args.plot:
        plot_rows(rows, args.plot)


def plot_rows(rows, path: str) -> None:
    """One panel per model: step time / eager against measured peak, a marker per method (hollow where the
    gradients differ from eager's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.2), squeeze=False)
    style = {"eager": ("k", "o"), "checkpoint per block": ("tab:orange", "s"), "PyTorch": ("tab:purple", "^"),
             "planner": ("tab:blue", "D")}
    for ax, name in zip(axes[0], models):
        for r in rows:
            if r[0] != name or r[5] is None:
                continue
            key = next(k for k in style if r[1].startswith(k))
            color, marker = style[key]
            ax.scatter(r[2], r[4], color=color if r[5] else "none", edgecolors=color, marker=marker, s=40,
                       label=key if key != "PyTorch" else "PyTorch partitioner")
        ax.set_title(name)
        ax.set_xlabel("measured peak (MB)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("step time / eager")
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
