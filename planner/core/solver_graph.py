"""The graph the solver plans for a traced model: the traced graph adjusted to what the executor holds.

`solver_graph` builds the solver's graph from the trace (tangents as nodes, the loss's workspace, the secondary
outputs of multi-output ops); `secondary_outputs` finds those ops, `executor_sequence` turns a schedule into what the
executor holds, and the last helpers map a solver schedule back to traced node ids for the step builder.
"""
from __future__ import annotations

import operator

from capture.fx_nodes import strided_bytes
from graphs.ir import Graph
from planner.execution.step_builder import fixed_view_roots

# A scalar loss and the gradient autograd seeds it with: two 512-byte blocks of CUDA's caching allocator.
LOSS_RESERVE_BYTES = 1024


def solver_graph(traced, loss_bytes: int = 0, *, pin_secondaries: bool = False,
                 secondaries: dict[int, list[int]] | None = None, loss_held_bytes: int = 0) -> Graph:
    """The graph the solver plans: the traced graph, adjusted to what the executor really holds.

    - Recomputable unless a node produces one of the model's outputs (the caller holds the output from
      the forward to the end of the backward, so a second copy would cost its memory twice). Random
      ops (dropout) ARE recomputable here, although the trace marks them not: the executor saves the
      generator state before their first computation and replays it for every recomputation, so a
      recomputed mask is bitwise the first one (tests/planner check gradients against eager).
    - Retained (resident to the end) only the model's outputs and the gradients; new buffer values
      are copied into the buffers during the forward and are not held.
    - The tangents (incoming gradients of the outputs) are one node `tangents` instead of fixed memory:
      autograd hands them over together at the start of the backward (the executor makes a zero one for an
      output the loss does not reach, and one of the traced strides for another), and they live to its end.
      Every op that reads a tangent reads this node, so none can start before all of them exist. It has no
      inputs, costs nothing, cannot be recomputed, and reads as the label `traced.graph.n`.
    - A forward multi-output op's node also counts the bytes of its secondary outputs (their own nodes
      keep theirs): each computation allocates them all, and this keeps every recomputation within the
      peak at the price of counting them twice while both nodes are resident (`planner.core.problem` derives the
      executor's exact view, which counts each output once, from this graph).
      A backward multi-output op is not recomputable. A secondary output's own node is, but the executor
      recomputes it by indexing the newest result of its op, which keeps all that op's outputs alive from that
      computation on. A forward op's node counts them for that long anyway (the secondary output reads it, so it
      is resident until then); for a backward op's, `executor_sequence` turns a schedule into what the executor
      really holds, and with `pin_secondaries` such nodes are not recomputable at all (plan() falls back to that
      graph when the first does not fit).
    - With `loss_bytes` (`capture.loss_workspace.LossMemory.workspace_bytes`), a node `loss` of that size reads the
      model's outputs and is read by the tangents: the loss function's temporaries at the forward/backward boundary.
      With `loss_held_bytes` (part of `loss_bytes`), a node `loss held` of that size, retained to the end, before it:
      what the loss tensor keeps alive through the backward (`LossMemory.held_bytes`).
    - Fixed memory gains the bytes of the buffers the forward updates (`updated_buffer_bytes`: the executor may stash
      their old values), and LOSS_RESERVE_BYTES for the scalar loss and its seed gradient, which live
      outside the model during the step, unless the model computes its loss itself (every tangent is a
      scalar: the loss is then an output node and its seed the tangent).
    Labels: a traced node keeps its traced id as its label, so `graph.labels` maps back to `node_map`.
    """
    from torch.utils._pytree import tree_leaves

    g = traced.graph
    gm = traced.joint_module
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))
    keep_names = {o.name for o, (kind, _) in zip(outs, traced.output_kinds)
                  if kind in ("output", "grad") and o is not None}
    user_out_names = {o.name for o, (kind, _) in zip(outs, traced.output_kinds) if kind == "output" and o is not None}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = phs[traced.num_primals:]
    readers: dict[int, list[int]] = {j: [] for j in range(len(tangents))}
    by_name = traced.fx_nodes
    fixed = frozenset(traced.fixed_views)
    for gid, names in traced.node_map.items():
        mine = {by_name[nm] for nm in names}
        read = {a for m in mine for a in m.all_input_nodes if a not in mine}
        # a view of a tangent grouped elsewhere is made where it is read (see the executor's fixed_view_roots)
        read |= {r for a in read for r in (fixed_view_roots(a, fixed) or ())}
        for j, t in enumerate(tangents):
            if t in read:
                readers[j].append(gid)
    secondary = secondary_outputs(traced) if secondaries is None else secondaries
    secondary_ids = {i for ids in secondary.values() for i in ids}
    recs = []
    read_tangents = [j for j, rs in readers.items() if rs]
    tangent_label = g.n  # all tangents as one node: autograd hands them over together
    for nd in g.nodes:
        names = traced.node_map[nd.id]
        extra_inputs = [tangent_label] if any(nd.id in readers[j] for j in read_tangents) else []
        # A recomputation of a multi-output op allocates its secondary outputs again: a forward op's node
        # counts them; a backward one (whose secondary outputs are weight gradients) is not recomputed.
        multi = nd.id in secondary
        counts = multi and not nd.backward
        extra_bytes = sum(int(g.nodes[i].bytes) for i in secondary[nd.id]) if counts else 0
        recs.append({
            "id": nd.id, "name": nd.name, "cost": nd.cost, "bytes": int(nd.bytes) + extra_bytes,
            "inputs": list(nd.inputs) + extra_inputs, "backward": nd.backward,
            "retain": any(nm in keep_names for nm in names),
            "recomputable": (not any(nm in user_out_names for nm in names) and not (multi and nd.backward)
                             and not (pin_secondaries and nd.id in secondary_ids)),
        })
    order = list(range(g.n))
    loss_label = g.n + len(tangents)
    out_groups = sorted({gid for gid, names in traced.node_map.items() if any(nm in user_out_names for nm in names)})
    tangent_bytes = sum(strided_bytes(tangents[j].meta["val"]) for j in read_tangents)
    if read_tangents:
        recs.append({"id": tangent_label, "name": "tangents", "cost": 0.0, "bytes": tangent_bytes,
                     "inputs": [loss_label] if loss_bytes else [],
                     "backward": True, "retain": True, "recomputable": False})
        first = min(r for j in read_tangents for r in readers[j])
        order.insert(order.index(first), tangent_label)
    if loss_bytes:
        # the loss's own temporaries (e.g. cross-entropy's log-softmax) live from the end of the forward
        # until autograd hands the gradients over
        held = min(int(loss_held_bytes), int(loss_bytes))
        recs.append({"id": loss_label, "name": "loss", "cost": 0.0, "bytes": int(loss_bytes) - held,
                     "inputs": out_groups, "backward": False, "retain": False, "recomputable": False})
        first_tangent = next(k for k, lab in enumerate(order) if lab >= g.n)
        order.insert(first_tangent, loss_label)
        if held:
            held_label = loss_label + 1
            recs.append({"id": held_label, "name": "loss held", "cost": 0.0, "bytes": held, "inputs": out_groups,
                         "backward": False, "retain": True, "recomputable": False})
            order.insert(first_tangent, held_label)
    # the model's own loss is an output node and its seed gradient the tangent: nothing lives outside the graph
    own_loss = bool(read_tangents) and all(tangents[j].meta["val"].numel() == 1 for j in read_tangents)
    reserve = 0 if own_loss and not loss_bytes else LOSS_RESERVE_BYTES
    fixed = g.fixed_bytes - tangent_bytes + reserve + updated_buffer_bytes(traced)
    return Graph.from_unordered(recs, fixed_bytes=fixed, name=g.name, order=order)


def updated_buffer_bytes(traced) -> int:
    """Bytes of the buffers the forward updates (BatchNorm's running statistics, a step counter). Where a
    recomputation or the backward reads such a buffer, the executor stashes a copy of its value before the update
    (planner.execution.step_builder), alive from the forward into the backward: counted as fixed memory, whether or
    not the schedule needs it (a few hundred bytes on the models seen; the schedule is not known here)."""
    updated = {what for kind, what in traced.output_kinds if kind == "buffer_update"}
    phs = [n for n in traced.joint_module.graph.nodes if n.op == "placeholder"]
    first = len(traced.param_names)
    return sum(strided_bytes(phs[first + j].meta["val"]) for j, name in enumerate(traced.buffer_names)
               if name in updated)


def secondary_outputs(traced) -> dict[int, list[int]]:
    """Traced node id of a multi-output op -> the ids of the nodes the trace made of its other outputs.

    The trace makes each secondary output of a multi-output op (a pooling's indices, a layer norm's
    statistics, a dropout's mask: a getitem) a node of its own, computed once. But every computation of
    the op, a recomputation included, allocates all its outputs at once.
    """
    by_name = traced.fx_nodes
    group_of = {nm: gid for gid, names in traced.node_map.items() for nm in names}
    out: dict[int, list[int]] = {}
    for gid, names in traced.node_map.items():
        nodes = [by_name[nm] for nm in names]
        if nodes and all(n.target is operator.getitem for n in nodes):
            sources = {group_of.get(n.args[0].name) for n in nodes}
            if len(sources) == 1 and None not in sources and gid not in sources:
                out.setdefault(sources.pop(), []).append(gid)
    return out


def executor_sequence(graph: Graph, computes, co_outputs: dict[int, list[int]]) -> list[int]:
    """The computations (solver indices) as the executor holds them. A recomputed secondary output s of a multi-output
    op is indexed out of the op's newest result, which holds s's storage from that computation of the op on; so s
    is computed right after that computation of the op, or, where its earlier copy is still in use then, that copy
    is kept (its recomputation dropped). Every other computation is unchanged."""
    source_of = {s: v for v, ss in co_outputs.items() for s in ss}
    seq = list(computes)
    out: list[int] = []
    last_of: dict[int, int] = {}  # node -> position in `out` of its latest computation
    last_read: dict[int, int] = {}  # node -> position in `out` of its latest reader
    for v in seq:
        src = source_of.get(v)
        if src is not None and v in last_of and src in last_of:
            i = last_of[src]
            if last_read.get(v, last_of[v]) > i or last_of[v] > i:
                continue  # its earlier copy is alive when the op last ran: the executor keeps that one
            out.insert(i + 1, v)  # indexed out of that result: alive from there
            last_of = {u: (k + 1 if k > i else k) for u, k in last_of.items()}
            last_read = {u: (k + 1 if k > i else k) for u, k in last_read.items()}
            last_of[v] = i + 1
            continue
        out.append(v)
        last_of[v] = len(out) - 1
        for u in graph.inputs[v]:
            last_read[u] = len(out) - 1
    return out



def split_position(graph: Graph, computes, traced_nodes: int) -> int:
    """How many computations of the sequence run before its first node that is not one of the trace's (the loss's
    workspace or the tangents): the position where the backward half begins."""
    count = 0
    for v in computes:
        if graph.labels[v] >= traced_nodes:
            break
        count += 1
    return count


def traced_sequence(graph: Graph, computes, traced_nodes: int) -> list[int]:
    """A solver-graph compute sequence in traced node ids (the tangents and the loss's workspace dropped: solver
    labels from `traced_nodes` on)."""
    return [graph.labels[v] for v in computes if graph.labels[v] < traced_nodes]
