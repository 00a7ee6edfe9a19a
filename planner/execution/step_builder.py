"""Building a planned step: a schedule of a traced graph -> the eager forward and backward fx modules.

`build_step(traced, compute_sequence)` rewrites the joint fx graph of a `capture.trace.TraceResult`
in schedule order: each computation of a graph node copies the fx nodes it covers (`traced.node_map`),
a node computed again is a recomputation (a second copy), and every later reader uses the newest copy.
fx code frees each value right after its last use, so the order of the copies determines the frees,
exactly as `Schedule.from_sequence` assumes.

The sequence is split where the first value that depends on a tangent (an incoming gradient) is
computed: what comes before is the forward module, what comes after is the backward module. Values
of the forward module that the backward reads are handed over ("stashed") and freed by the backward
at their last use (the backward takes its arguments boxed in a list that it clears, so nothing else
keeps them alive). A forward output, an updated buffer and the first computation of a random op
(dropout) must come before the split, random ops in the order eager PyTorch draws them;
`build_step` checks this and raises ExecutorError otherwise. A random op may be recomputed:
the generator state is saved before its first computation and replayed around every recomputation
(then restored), so the recomputed mask is bitwise the first one and the global RNG stream is
untouched.

With `for_inductor=True` the modules are built for inductor (`planner.execution.inductor`): a random op is a
`planner.execution.random_ops` custom op instead (a draw that returns the generator state it started from, chained in
eager's order, and a redraw from that state), since inductor would replace it with its own generator.
The runtime (`planner.execution.runtime`) runs the halves as one autograd function.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from capture.fx_nodes import free_view_root
from capture.random_draws import node_draws_random
from graphs.errors import ExecutorError
from planner.execution import random_ops
from planner.execution.rng import get_rng_state, set_rng_state


# ---------------------------------------------------------------------------------------------
# Boxed calling convention: the backward clears its argument list so that stashed values die at
# their last use instead of living until the function returns.
# ---------------------------------------------------------------------------------------------
class _BoxedCodeGen(torch.fx.graph.CodeGen):
    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def: bool = False):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def {self._func_name}(self, boxed){maybe_return_annotation}:"
        if not names:
            return head + "\n    boxed.clear()"
        return head + "\n    " + ", ".join(names) + ", = boxed\n    boxed.clear()"


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(tree_leaves(out.args[0], is_leaf=lambda x: x is None))


def tangent_dependent(gm: torch.fx.GraphModule, num_primals: int) -> set[torch.fx.Node]:
    """The fx nodes whose value depends on a tangent placeholder (the incoming gradients)."""
    phs = _placeholders(gm.graph)
    dep: set[torch.fx.Node] = set(phs[num_primals:])
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


@dataclass
class StepHalves:
    """The two halves of a planned training step.

    forward_module(*primals) -> [*user output leaves, *buffer updates, *stash]
    backward_module([*stash, *tangents]) (boxed, the list is cleared) -> [grad or None per primal]
    """

    forward_module: torch.fx.GraphModule
    backward_module: torch.fx.GraphModule
    num_outputs: int
    buffer_updates: list[str]  # buffer name per buffer-update output, in order
    buffer_update_primals: list[int]  # the primal (forward input) index of each updated buffer, in that order
    num_stash: int
    tangent_order: list[int]  # backward tangent inputs: the tangent placeholder index of each
    tangent_specs: list[tuple]  # (shape, stride, dtype) of every traced tangent
    tangent_outputs: list[int]  # output leaf index of every tangent
    own_loss_leaf: int | None  # the model's own loss, the only output differentiated (TraceResult.own_loss_leaf)
    grad_of_primal: list[bool]  # per primal: the backward returns a gradient for it




def build_step(traced, sequence: Sequence[int], split: int | None = None, *,
                     for_inductor: bool = False) -> StepHalves:
    """Build the forward and backward fx modules that run `sequence` (graph node ids, recomputations
    repeated) of `traced` (a TraceResult). The backward begins at position `split` of the sequence
    (default and upper limit: the first computation that depends on a tangent); the planner passes the
    position where its schedule hands over to the loss, so that nothing the schedule computes after the
    loss runs before it. Raises ExecutorError if the sequence cannot run as a training step (see the
    module docstring).

    `for_inductor`: modules for inductor (`planner.execution.inductor`): every random fx node becomes a
    `planner.execution.random_ops` custom op (draw in the forward, redraw from the saved state in a recomputation), and
    no Python-level kernels are substituted."""
    gm = traced.joint_module
    by_name = traced.fx_nodes
    phs = _placeholders(gm.graph)
    n_primals = traced.num_primals
    primal_phs, tangent_phs = phs[:n_primals], phs[n_primals:]
    fx_index = {n: i for i, n in enumerate(gm.graph.nodes)}
    fixed = frozenset(traced.fixed_views)
    dep = tangent_dependent(gm, n_primals)
    members = {gid: [by_name[name] for name in names] for gid, names in traced.node_map.items()}
    seq = [int(v) for v in sequence]

    first_dep = next((p for p, v in enumerate(seq) if any(m in dep for m in members[v])), len(seq))
    if split is not None and split > first_dep:
        raise ExecutorError(f"the backward cannot begin at computation {split}: computation {first_dep} already "
                            "needs the incoming gradient")
    split = first_dep if split is None else split
    outs = _output_nodes(gm)
    kinds = traced.output_kinds
    _check_forward_part(traced, seq, split, members, outs, kinds, fx_index)

    # ---- forward module -----------------------------------------------------------------------
    fg = torch.fx.Graph()
    env_f: dict[torch.fx.Node, torch.fx.Node] = {}
    for ph in primal_phs:
        env_f[ph] = fg.placeholder(ph.name)
        env_f[ph].meta = dict(ph.meta)
    random_groups = {gid for gid, ms in members.items() if any(node_draws_random(m) for m in ms)}
    recomputed_random = {gid for gid in random_groups if seq.count(gid) > 1}
    done: set[int] = set()

    last_draw: list[torch.fx.Node] = []  # the compiler path's previous draw state: draws keep eager's order
    rng_devices: dict[str, str] = {}  # the compiler path: the device of each saved generator state

    def emit_for_inductor(graph: torch.fx.Graph, env: dict, v: int) -> None:
        """Copy group v into `graph`, each random fx node as a draw (first time) or a redraw (random_ops)."""
        for m in members[v]:
            if not node_draws_random(m):
                env[m] = graph.node_copy(m, lambda a: _lookup(env, a, m, graph, fixed))
                continue
            key, tensor_args = random_ops.register(m)
            tensors = [_lookup(env, a, m, graph, fixed) for a in tensor_args]
            n_out = random_ops.num_outputs(key)
            if v not in done:
                r = graph.call_function(torch.ops.remat.draw.default, (tensors, list(last_draw[-1:]), key))
                env[_rng_key(m.name)] = state = graph.call_function(operator.getitem, (r, n_out))
                rng_devices[_rng_key(m.name)] = random_ops.device_of(key)
                last_draw[:] = [state]
            else:
                r = graph.call_function(torch.ops.remat.redraw.default,
                                        (tensors, _lookup(env, _rng_key(m.name), None), key))
            r.meta["val"] = None
            if random_ops.returns_one_tensor(key):
                env[m] = graph.call_function(operator.getitem, (r, 0))
                env[m].meta = dict(m.meta)
            else:
                env[m] = r
        done.add(v)

    def emit(graph: torch.fx.Graph, env: dict, v: int) -> None:
        """Copy group v into `graph`; a random group's recomputation replays its first RNG state."""
        if for_inductor:
            return emit_for_inductor(graph, env, v)
        device = _group_device(members[v])
        if v in recomputed_random and v not in done:
            env[_rng_key(v)] = graph.call_function(get_rng_state, (device,))
        replay = v in random_groups and v in done
        if replay:
            current = graph.call_function(get_rng_state, (device,))
            graph.call_function(set_rng_state, (device, _lookup(env, _rng_key(v), None)))
        for m in members[v]:
            env[m] = graph.node_copy(m, lambda a: _lookup(env, a, m, graph, fixed))
            if device == "cpu" and _fast_dropout_backward_applies(m):
                env[m].target = dropout_backward_cpu
        if replay:
            graph.call_function(set_rng_state, (device, current))
        done.add(v)

    for v in seq[:split]:
        emit(fg, env_f, v)

    # ---- backward module: first find what it reads from outside -------------------------------
    buffer_slots = {traced.num_primals - traced.num_user_inputs - len(traced.buffer_names) + k: name
                    for k, name in enumerate(traced.buffer_names)}
    updated = {name for kind, name in kinds if kind == "buffer_update"}
    slot_of = {name: k for k, name in buffer_slots.items()}
    external: dict[torch.fx.Node, None] = {}
    seen_b: set[torch.fx.Node] = set()
    replayed_b: set[int] = set()
    for v in seq[split:]:
        if v in random_groups and v not in replayed_b:
            replayed_b.add(v)
            if for_inductor:
                for m in members[v]:
                    if node_draws_random(m):
                        external.setdefault(_rng_key(m.name), None)
            else:
                external.setdefault(_rng_key(v), None)
        for m in members[v]:
            for a in m.all_input_nodes:
                if a in seen_b or a in tangent_phs:
                    continue
                roots = fixed_view_roots(a, fixed)
                if roots is not None and (any(r in tangent_phs for r in roots) or a not in env_f):
                    # a view of fixed memory: made where it is read, from its placeholders
                    for r in roots:
                        if r not in tangent_phs:
                            external.setdefault(r, None)
                    continue
                external.setdefault(a, None)
            seen_b.add(m)
    grad_nodes = [(k, o) for k, (o, kd) in enumerate(zip(outs, kinds)) if kd[0] == "grad"]
    for _, o in grad_nodes:
        if o is not None and o not in seen_b and o not in tangent_phs:
            external.setdefault(o, None)
    stash_src: list[torch.fx.Node] = []
    for a in external:
        if a not in env_f:
            raise ExecutorError(f"the backward reads fx value '{_key_name(a)}', which the forward part never computes")
        stash_src.append(a)

    bg = torch.fx.Graph()
    bg.set_codegen(_BoxedCodeGen())
    env_b: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in stash_src:
        env_b[a] = bg.placeholder(f"saved_{_key_name(a)}")
        if isinstance(a, torch.fx.Node):
            env_b[a].meta = dict(a.meta)
        elif a in rng_devices:
            env_b[a].meta["rng_state_device"] = rng_devices[a]
    read_b = {a for v in seq[split:] for m in members[v] for a in m.all_input_nodes}
    read_b |= {r for a in list(read_b) for r in (fixed_view_roots(a, fixed) or ())}
    used_tangents = [j for j, t in enumerate(tangent_phs) if t in read_b or any(o is t for _, o in grad_nodes)]
    for j in used_tangents:
        t = tangent_phs[j]
        env_b[t] = bg.placeholder(t.name)
        env_b[t].meta = dict(t.meta)
    for v in seq[split:]:
        emit(bg, env_b, v)
    grads: list[Any] = [None] * n_primals
    for k, o in grad_nodes:
        idx = kinds[k][1]
        grads[idx] = None if o is None else env_b[o]
    bg.output(grads)

    # ---- forward outputs: user leaves, buffer updates, stash (clones of buffers it will mutate) -
    leaf_nodes: list[torch.fx.Node | None] = [None] * traced.output_spec.num_leaves
    buf_out: list[torch.fx.Node] = []
    buf_names: list[str] = []
    for o, (kind, what) in zip(outs, kinds):
        if kind == "output":
            leaf_nodes[what] = _lookup(env_f, o, None)
        elif kind == "buffer_update":
            buf_out.append(env_f[o])
            buf_names.append(what)
    stash_out = []
    for a in stash_src:
        node = env_f[a]
        if isinstance(a, torch.fx.Node) and a in primal_phs and buffer_slots.get(primal_phs.index(a)) in updated:
            # the forward will overwrite this buffer in place; the backward needs the old value
            node = fg.call_function(torch.ops.aten.clone.default, (node,))
        stash_out.append(node)
    fg.output([*leaf_nodes, *buf_out, *stash_out])

    fmod = torch.fx.GraphModule(gm, fg, class_name="PlannedForward")
    bmod = torch.fx.GraphModule(gm, bg, class_name="PlannedBackward")
    specs = [(tuple(t.meta["val"].shape), tuple(t.meta["val"].stride()), t.meta["val"].dtype) for t in tangent_phs]
    return StepHalves(
        forward_module=fmod,
        backward_module=bmod,
        num_outputs=len(leaf_nodes),
        buffer_updates=buf_names,
        buffer_update_primals=[slot_of[name] for name in buf_names],
        num_stash=len(stash_out),
        tangent_order=used_tangents,
        tangent_specs=specs,
        tangent_outputs=list(traced.tangent_outputs),
        own_loss_leaf=traced.own_loss_leaf,
        grad_of_primal=[g is not None for g in grads],
    )



def dropout_backward_cpu(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """aten.native_dropout_backward on CPU, bit for bit (the same products in the same order: grad * mask, then
    * scale), without its cast of the bool mask to the gradient's dtype: the mask is read as uint8, which
    multiplies as its 0/1 values. About 2.5x faster on a (2, 4, 128, 128) float32 tensor (157 -> 66 us)."""
    return grad.mul(mask.view(torch.uint8)).mul_(scale)


def _fast_dropout_backward_applies(node: torch.fx.Node) -> bool:
    if node.target is not torch.ops.aten.native_dropout_backward.default or len(node.args) != 3 or node.kwargs:
        return False
    grad, mask = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
    return (grad is not None and mask is not None and mask.dtype == torch.bool
            and grad.dtype in (torch.float32, torch.float64) and tuple(grad.shape) == tuple(mask.shape))


def _rng_key(gid: int | str) -> str:
    return f"rng_state_{gid}"


def _key_name(key) -> str:
    return key if isinstance(key, str) else key.name


def _group_device(ms: list[torch.fx.Node]) -> str:
    for m in ms:
        for t in tree_leaves(m.meta.get("val")):
            if isinstance(t, torch.Tensor):
                return str(t.device)
    return "cpu"


def fixed_view_roots(node: torch.fx.Node, fixed_views: frozenset[str] | set[str]) -> frozenset[torch.fx.Node] | None:
    """The placeholders from which `node`, a view of fixed memory, is made again wherever it is read; None if it
    is not one.

    A view of fixed memory is a node of `TraceResult.fixed_views` (the trace's storage analysis: it allocates
    nothing and aliases only parameters, buffers, inputs or tangents) or a chain of view ops down to a placeholder
    (`capture.fx_nodes.free_view_root`). The trace lists no inputs for such a node, so the contraction may put it
    in a group after a group that reads it, or fold it into its reader apart from the view it is made of (a view
    of `getitem(split(input))` where the getitem sits in a later group): the executor makes it, and every fixed
    view it is made of, where it is needed. The whole chain down to the placeholders (and the joint module's
    constants) must be such views, none of them mutating."""
    if node.op != "call_function":
        return None
    roots: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            roots.add(n)
            continue
        if n.op == "get_attr":
            continue
        if n.op != "call_function" or (n.name not in fixed_views and free_view_root(n) is None):
            return None
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return None
        stack.extend(n.all_input_nodes)
    return frozenset(roots)


def _lookup(env: dict, a: torch.fx.Node, reader: torch.fx.Node | None, graph: torch.fx.Graph | None = None,
            fixed: frozenset[str] = frozenset()):
    try:
        return env[a]
    except KeyError:
        pass
    if graph is not None and a.op == "get_attr":
        # a constant of the joint module (a tensor the forward made from Python values): the planned modules
        # share the joint module's attributes, so it is read where it is needed
        env[a] = graph.node_copy(a)
        return env[a]
    if graph is not None and fixed_view_roots(a, fixed) is not None:
        # a view of fixed memory that the trace grouped with a later node (or whose own view is there): make it
        # here, with what it is a view of (a view costs nothing)
        env[a] = graph.node_copy(a, lambda b: _lookup(env, b, a, graph, fixed))
        return env[a]
    who = f"'{reader.name}'" if reader is not None else "an output"
    raise ExecutorError(f"{who} reads fx value '{a.name}' before the schedule computes it")


def _check_forward_part(traced, seq, split, members, outs, kinds, fx_index) -> None:
    """Forward outputs and random ops must run before the split; random ops in eager order."""
    first: dict[int, int] = {}
    for p, v in enumerate(seq):
        first.setdefault(v, p)
    group_of = {m: gid for gid, ms in members.items() for m in ms}
    for o, (kind, what) in zip(outs, kinds):
        if kind in ("output", "buffer_update") and o is not None and o in group_of:
            gid = group_of[o]
            if first.get(gid, len(seq)) >= split:
                raise ExecutorError(
                    f"the schedule computes {kind} '{o.name}' (graph node {gid}) after the backward has begun; "
                    "a forward output must be computed in the forward part")
    random_groups = [gid for gid, ms in members.items() if any(node_draws_random(m) for m in ms)]
    for gid in random_groups:
        if gid not in first:
            raise ExecutorError(f"random graph node {gid} is never computed")
        if first[gid] >= split:
            raise ExecutorError(f"random graph node {gid} runs after the backward has begun: eager draws it in the "
                                "forward, so the random numbers would differ")
    by_position = sorted(random_groups, key=lambda g: first[g])
    by_eager = sorted(random_groups, key=lambda g: min(fx_index[m] for m in members[g] if node_draws_random(m)))
    if by_position != by_eager:
        raise ExecutorError(f"the schedule runs the random ops in the order {by_position}, eager draws them in the "
                            f"order {by_eager}: the random numbers would differ")
