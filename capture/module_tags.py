"""A model's modules in its trace: the joint graph with each node tagged with the module that ran it
(`trace_model`, `node_modules`), and the model's repeated blocks (`repeated_blocks`)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

from capture.trace import trace


def trace_model(model: torch.nn.Module, sample_input, cost_model: str = "flops", device_name: str | None = None):
    """`capture.trace.trace` with each fx forward node tagged with the module that ran it.

    The tags (`meta["nn_module_stack"]`) come from forward pre/post hooks that write the current module
    path into torch.fx's node-meta context while AOTAutograd traces; `node_modules` reads them back.
    """
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


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """The module paths of the model's repeated blocks: the children of the outermost `nn.ModuleList` or
    `nn.Sequential` holding two or more modules of one class with parameters (transformer layers, ResNet stages),
    the blocks per-block checkpointing wraps; [] when it has none."""
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
