"""Checkpointing by blocks, as people write it by hand, as candidate schedules of a whole-model plan:
`checkpoint_candidates(model, traced, graph)` gives per-block checkpointing and selective checkpointing (the matmul
and attention outputs saved, the rest of a block recomputed) of the model's repeated blocks
(`capture.module_tags.repeated_blocks`) as schedules of a solver graph of its trace
(solvers.heuristics.block_checkpoint), for auto's portfolio: plan() never loses to them. The same checkpointing run
by torch (the baselines the benchmarks measure) is `harness.baselines`."""
from __future__ import annotations

import operator

import torch

from capture.module_tags import node_modules, repeated_blocks
from graphs.ir import Graph

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
    by_name = traced.fx_nodes

    def saved_op(fx_name: str) -> bool:
        n = by_name[fx_name]
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]  # a secondary output of a saved op (attention's log-sum-exp) is saved with it
        return getattr(n.target, "overloadpacket", None) in SAVED_BY_SELECTIVE

    saved = sorted(index[gid] for gid, fx_names in traced.node_map.items() if any(saved_op(x) for x in fx_names))
    return [(PER_BLOCK, {"blocks": blocks}), (SELECTIVE, {"blocks": blocks, "saved": saved})]
