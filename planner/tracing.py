"""Tracing a model for the planner: the joint graph with each node tagged with its module, and the memory of a
loss computed outside the model."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from planner.solver_graph import strided_bytes


def trace_model(model: torch.nn.Module, sample_input, cost_model: str = "flops", device_name: str | None = None):
    """`capture.trace.trace` with each fx forward node tagged with the module that ran it.

    The tags (`meta["nn_module_stack"]`) come from forward pre/post hooks that write the current module
    path into torch.fx's node-meta context while AOTAutograd traces; `node_modules` reads them back.
    """
    import torch.fx.traceback as fx_traceback

    from capture.trace import trace

    stack: list[str] = []
    had_key = "nn_module_stack" in fx_traceback.current_meta
    saved = fx_traceback.current_meta.get("nn_module_stack")

    def pre(mod, args, name):
        stack.append(name)
        fx_traceback.current_meta["nn_module_stack"] = {"planner": (name, type(mod).__name__)}

    def post(mod, args, out, name):
        if stack:
            stack.pop()
        fx_traceback.current_meta["nn_module_stack"] = {"planner": (stack[-1] if stack else "", "")}

    handles = []
    for name, sub in model.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name)))
        handles.append(sub.register_forward_hook(lambda m, a, o, name=name: post(m, a, o, name)))
    try:
        return trace(model, sample_input, cost_model=cost_model, device_name=device_name, contract=True)
    finally:
        for h in handles:
            h.remove()
        if had_key:
            fx_traceback.current_meta["nn_module_stack"] = saved
        else:
            fx_traceback.current_meta.pop("nn_module_stack", None)


def node_modules(traced) -> dict[int, str]:
    """Graph node id -> the path of the module whose forward produced it ('' for the top level).

    Backward ops are attributed to the module of the forward op they differentiate (same seq_nr).
    """
    gm = traced.joint_module
    by_seq: dict[Any, str] = {}
    fx_mod: dict[str, str] = {}
    for n in gm.graph.nodes:
        st = n.meta.get("nn_module_stack")
        if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward" and st:
            path = list(st.values())[-1][0]
            fx_mod[n.name] = path
            by_seq.setdefault(n.meta.get("seq_nr"), path)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.name not in fx_mod and n.meta.get("seq_nr") in by_seq:
            fx_mod[n.name] = by_seq[n.meta["seq_nr"]]
    out = {}
    for gid, names in traced.node_map.items():
        c = Counter(fx_mod.get(nm, "") for nm in names)
        out[gid] = c.most_common(1)[0][0] if c else ""
    return out


def loss_workspace_bytes(model: torch.nn.Module, inputs: tuple, loss_fn, call=None) -> int:
    """Bytes `loss_fn` holds beyond the output's gradient: its peak over a forward+backward of the loss on a
    copy of the model's output (the model runs once without gradients; buffers and RNG are restored)."""
    from capture.measure_memory import StorageTracker

    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(), torch.no_grad():
            out = model(*inputs) if call is None else call.call(model, inputs)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])
    from torch.utils._pytree import tree_map

    leaves = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                      if isinstance(t, torch.Tensor) else t, out)
    tracker = StorageTracker()
    with tracker:
        loss = loss_fn(leaves)
        loss.backward()
    from torch.utils._pytree import tree_leaves as _leaves

    grads = sum(strided_bytes(t.grad) for t in _leaves(leaves) if isinstance(t, torch.Tensor) and t.grad is not None)
    return max(0, int(tracker.peak_bytes) - grads)
