"""Checkpointing by blocks, as people write it by hand: the baselines the planner is compared with and never loses to.

- `repeated_blocks(model)`: the children of the outermost `nn.ModuleList` or `nn.Sequential` holding two or more
  modules of one class with parameters (transformer layers, ResNet stages): the blocks per-block checkpointing wraps;
- `per_block_checkpointed(model)`: a copy of the model with torch.utils.checkpoint around each block;
- `checkpoint_candidates(model, traced, graph)`: per-block checkpointing and selective checkpointing (the matmul and
  attention outputs saved, the rest of a block recomputed) as schedules of a solver graph of the model's trace
  (solvers.heuristics.block_checkpoint), for auto's portfolio;
- `largest_checkpointed_size`: the largest size per-block checkpointing fits in a memory.
"""
from __future__ import annotations

import copy
import operator
import types

import torch

from graphs.ir import Graph
from planner.tracing import node_modules

_aten = torch.ops.aten
# the ops whose outputs selective checkpointing saves (torchtitan's and Megatron's policy): matrix products and
# attention
SAVED_BY_SELECTIVE = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
}
PER_BLOCK = "per-block checkpointing"
SELECTIVE = "selective checkpointing (matmul, attention saved)"


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """The module paths of the model's repeated blocks (see the module docstring); [] when it has none."""
    found = []
    for name, m in model.named_modules():
        kids = list(m.named_children()) if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) else []
        mods = [k for _, k in kids]
        if len(mods) > 1 and len({type(k) for k in mods}) == 1 and any(True for _ in mods[0].parameters()):
            found.append((name.count(".") if name else -1, -len(mods), name, [n for n, _ in kids]))
    if not found:
        return []
    _, _, parent, children = min(found, key=lambda f: f[:2])
    return [f"{parent}.{c}" if parent else c for c in children]


def checkpoint_candidates(model: torch.nn.Module, traced, graph: Graph,
                          modules: dict[int, str] | None = None) -> list[tuple[str, dict]]:
    """(label, solvers.heuristics.block_checkpoint options) of per-block and selective checkpointing on `graph`, a
    solver graph of `traced` (labels are traced node ids); [] when the model has no repeated blocks. `modules`:
    `node_modules(traced)` where the caller has it."""
    names = repeated_blocks(model)
    if not names:
        return []
    modules = node_modules(traced) if modules is None else modules
    index = graph.label_to_id
    blocks: list[list[int]] = [[] for _ in names]
    for gid, path in modules.items():
        for k, name in enumerate(names):
            if path == name or path.startswith(name + "."):
                blocks[k].append(index[gid])
                break
    if not any(blocks):
        return []
    by_name = {n.name: n for n in traced.joint_module.graph.nodes}

    def saved_op(fx_name: str) -> bool:
        n = by_name[fx_name]
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]  # a secondary output of a saved op (attention's log-sum-exp) is saved with it
        return getattr(n.target, "overloadpacket", None) in SAVED_BY_SELECTIVE

    saved = sorted(index[gid] for gid, fx_names in traced.node_map.items() if any(saved_op(x) for x in fx_names))
    return [(PER_BLOCK, {"blocks": blocks}), (SELECTIVE, {"blocks": blocks, "saved": saved})]


def per_block_checkpointed(model: torch.nn.Module, *, selective: bool = False) -> torch.nn.Module | None:
    """A copy of `model` whose repeated blocks (`repeated_blocks`) each run under torch.utils.checkpoint
    (non-reentrant, RNG state preserved): the usual hand-written baseline; None when the model has none. With
    `selective`, selective activation checkpointing instead (torch.utils.checkpoint's
    create_selective_checkpoint_contexts): the outputs of the ops in SAVED_BY_SELECTIVE are saved, the rest of each
    block is recomputed."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    names = repeated_blocks(model)
    if not names:
        return None
    wrapped = copy.deepcopy(model)
    options: dict = {"use_reentrant": False}
    if selective:
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    for blk in (wrapped.get_submodule(name) for name in names):
        plain = blk.forward
        blk.forward = types.MethodType(lambda self, *a, _f=plain, **kw: checkpoint(_f, *a, **options, **kw), blk)
    return wrapped


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def largest_checkpointed_size(make, budget_bytes: int, *, start: int = 1, limit: int = 256) -> int | None:
    """The largest size n (from `start`, at most `limit`) whose step `make(n)` under per-block checkpointing fits
    `budget_bytes`, measured (storage-tracking mode on CPU); None when not even `start` fits or the model has no
    repeated blocks. The baseline `max_batch` is compared with."""
    from planner.measure import measure_peak_bytes

    best = None
    for n in range(start, limit + 1):
        model, sample = make(n)
        wrapped = per_block_checkpointed(model)
        if wrapped is None or measure_peak_bytes(wrapped, sample) > budget_bytes:
            return best
        best = n
    return best
