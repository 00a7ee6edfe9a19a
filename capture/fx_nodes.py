"""Small facts about the nodes and values of a traced joint graph that every layer above reads the same way."""
from __future__ import annotations

import torch.fx


def free_view_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder that `node` is a chain of view ops of (e.g. `t(view(tangents_1))`), else None.
    Such values cost nothing and hold no memory of their own, so they can be made wherever needed."""
    while node.op == "call_function":
        if not getattr(node.target, "is_view", False) or len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return node if node.op == "placeholder" else None


def strided_bytes(val) -> int:
    """Bytes of the storage a tensor of this shape and stride needs (what the trace counted for it)."""
    if val.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()))
    return int(span * val.element_size())


def nodes_by_name(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """fx node name -> node of a graph module (`TraceResult.fx_nodes` keeps it for a trace)."""
    return {n.name: n for n in gm.graph.nodes}
