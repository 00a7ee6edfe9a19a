"""A compiled region's joint graph as the project's `Graph`, and what a forward/backward split of it holds.

torch.compile hands a partitioner each compiled region's joint forward+backward fx graph (AOTAutograd's: placeholders
`primals_*` then `tangents_*`, outputs `[*forward outputs, *one gradient or None per primal]`), possibly with symbolic
sizes (SymInt placeholders, shapes such as `[2, s27, 32]`) once a second input shape has arrived.
`region_graph(gm, num_fwd_outputs, sizes=...)` prices it the way `capture.trace` prices a traced step: a copy with
every symbolic size replaced by a concrete one (the value `sizes` gives its symbols, else its hint,
`torch.fx.experimental.symbolic_shapes.optimization_hint`: the size of the input that triggered this compilation; no
guard is added) runs once on fake tensors (`capture.trace._build_records`: storages, FLOPs), is contracted
(`capture.contract`) and becomes a `RegionGraph`: the groups as graph nodes plus one node
`tangents` (after a node `boundary` that reads the forward outputs) that is read by every backward group and every
group that reads an incoming gradient, so that no schedule starts the backward before the forward outputs exist; the
boundary node can be given bytes (`RegionGraph.with_boundary_probe`) to bound what the forward leaves.

What the region allocates is all that is counted (`fixed_bytes` = 0): its parameters are the step's resident memory,
its input is the output of whatever ran before it, its incoming gradient the input gradient of whatever runs after
it. Forward outputs and gradients are retained (held to the region's end); random ops (`capture.random_draws`: a
recomputation would draw again) and the secondary outputs of multi-output ops are not recomputable, nor is any
backward op (a partitioner's backward computes each of its ops once).

`held_bytes(fw, bw, region)` replays a forward and a backward module cut from that joint graph (their nodes keep the
joint's names) and returns what they hold at once, in the same accounting: each storage (a group) from the op that
makes it to its last reader, the saved values from the forward's end to their last reader in the backward, forward
outputs and gradients to the end. `saved_storage_bytes(fw, num_fwd_outputs)` sums the distinct storages a forward
module hands to its backward beyond its inputs (parameters and the region's input cost nothing more to save).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from capture import meta_overrides
from capture.contract import contract
from capture.fx_nodes import free_view_root
from capture.trace import _build_records
from graphs.errors import GraphError, TraceError
from graphs.ir import Graph

TANGENTS = "tangents"
BOUNDARY = "boundary"


@dataclass(frozen=True)
class RegionGraph:
    """A region's joint graph as the solvers see it (see the module docstring).

    graph: the contracted groups (`node_map`: graph node id -> fx node names of the joint, in fx order), a node
        `boundary` (`boundary_id`: it reads the forward outputs, 0 bytes; `with_boundary_probe` gives it bytes) and a
        node `tangents` (`tangents_id`: the incoming gradients, 0 bytes, read by every backward group; it reads the
        boundary node).
    group_of: fx node name -> group id, for every call_function node of the joint.
    symbolic: the joint graph had symbolic sizes (priced at `hints`: symbol -> the size it was priced at).
    """

    graph: Graph
    node_map: dict[int, list[str]]
    group_of: dict[str, int]
    tangents_id: int
    boundary_id: int
    symbolic: bool
    hints: dict[str, int] = field(default_factory=dict)
    aten_node_count: int = 0

    def group_bytes(self, gid: int) -> int:
        return int(self.graph.nodes[gid].bytes)

    def with_boundary_probe(self, probe_bytes: int) -> Graph:
        """The graph with the boundary node holding `probe_bytes` while it is computed (it is freed right after the
        tangents node): a schedule within a budget B then holds at most B - probe_bytes where the backward starts,
        which bounds what the forward leaves (saved values and outputs) on its own."""
        if probe_bytes <= 0:
            return self.graph
        nodes = list(self.graph.nodes)
        nodes[self.boundary_id] = dataclasses.replace(nodes[self.boundary_id], bytes=int(probe_bytes))
        return Graph(tuple(nodes), fixed_bytes=self.graph.fixed_bytes, name=self.graph.name, labels=self.graph.labels)


def _hint(value, sizes: dict | None = None) -> int:
    """The concrete size behind a SymInt: its expression with its symbols at `sizes` (sympy symbol -> int) where all
    of them are there, else its hint; or the int itself. TraceError for a size with no hint."""
    if isinstance(value, torch.SymInt):
        if sizes:
            expr = value.node.expr
            free = expr.free_symbols
            if free and all(s in sizes for s in free):
                try:
                    return int(expr.xreplace({s: sizes[s] for s in free}))
                except (TypeError, ValueError):
                    pass  # an expression sympy leaves symbolic: its hint
        try:
            return int(optimization_hint(value))
        except Exception as e:  # an unbacked size (a nonzero's length) without a hint
            raise TraceError(f"symbolic size {value} has no hint to plan with: {e}") from e
    return int(value)


def symbols_of(gm: torch.fx.GraphModule) -> list:
    """The sympy symbols in the sizes of `gm`'s placeholders, with a SymInt that holds each (symbol -> SymInt), in
    placeholder order: what a symbolic region's sizes depend on."""
    found: dict = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        dims = [val] if isinstance(val, torch.SymInt) else \
            [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else []
        for d in dims:
            if isinstance(d, torch.SymInt):
                for sym in d.node.expr.free_symbols:
                    found.setdefault(sym, d)
    return list(found.items())


def _is_symbolic(val) -> bool:
    if isinstance(val, torch.SymInt):
        return True
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return False


def static_copy(gm: torch.fx.GraphModule, sizes: dict | None = None) -> tuple[torch.fx.GraphModule, list[torch.Tensor],
                                                                          dict[str, int], bool]:
    """A copy of `gm` (same node names) whose size placeholders are replaced by concrete sizes (`sizes`: sympy symbol
    -> int; a size whose symbols are not all there: its hint), empty tensors of those shapes and strides for its
    remaining placeholders, the concrete sizes by symbol, and whether any size was symbolic.

    The tensors are real and uninitialised (`torch.empty_strided` on the placeholder's device): what it costs is one
    copy of the region's inputs while it is priced."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    hints: dict[str, int] = {}
    symbolic = False
    args: list[torch.Tensor] = []
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        symbolic |= _is_symbolic(val)
        if isinstance(val, torch.Tensor):
            shape = [_hint(s, sizes) for s in val.shape]
            stride = [_hint(s, sizes) for s in val.stride()]
            for s in val.shape:
                if isinstance(s, torch.SymInt):
                    hints[str(s)] = _hint(s, sizes)
            args.append(torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device))
        elif isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            concrete = _hint(val, sizes)
            if isinstance(val, torch.SymInt):
                hints[str(val)] = concrete
            for user in list(ph.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a, ph=ph, c=concrete: c if a is ph else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a, ph=ph, c=concrete: c if a is ph else a)
            graph.erase_node(ph)
        else:
            raise TraceError(f"placeholder {ph.name} holds a {type(val).__name__}, which the planner cannot price")
    return torch.fx.GraphModule(gm, graph), args, hints, symbolic


def _reads_tangent(node: torch.fx.Node, tangents: set[torch.fx.Node]) -> bool:
    for a in node.all_input_nodes:
        if a in tangents or (a.op == "call_function" and free_view_root(a) in tangents):
            return True
    return False


def region_graph(gm: torch.fx.GraphModule, num_fwd_outputs: int, *, cost_per_byte: float = 0.0,
                 sizes: dict | None = None) -> RegionGraph:
    """The region's graph (see the module docstring), its symbolic sizes at `sizes` (sympy symbol -> int; the others
    at their hints). A node's cost is its ops' FLOPs plus `cost_per_byte` for each byte it allocates (so that
    recomputing an elementwise op is not free). Raises TraceError where the graph cannot be priced (a size with no
    hint, a placeholder that is neither a tensor nor a size)."""
    static, args, hints, symbolic = static_copy(gm, sizes)
    with torch._C._DisableAutocast(), meta_overrides.overrides():
        records, _flops, _fixed_views = _build_records(static, args, "flops", None, False)
    del args
    con = contract(records)
    by_name = {n.name: n for n in gm.graph.nodes}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = {p for p in phs if p.name.startswith("tangents")}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))
    fwd_out_names = {o.name for o in outs[:num_fwd_outputs] if isinstance(o, torch.fx.Node)}

    node_map: dict[int, list[str]] = {}
    group_of: dict[str, int] = {}
    recs = []
    readers_of_tangents: list[int] = []
    fwd_out_groups: list[int] = []
    for gid, grp in enumerate(con.groups):
        names = [records[i].name for i in grp.members]
        node_map[gid] = names
        for nm in names:
            group_of[nm] = gid
        fx_members = [by_name[nm] for nm in names]
        inputs = list(grp.inputs)
        if any(_reads_tangent(m, tangents) for m in fx_members):
            readers_of_tangents.append(gid)
        if any(nm in fwd_out_names for nm in names):
            fwd_out_groups.append(gid)
        anchor = records[grp.anchor].name
        late = bool(grp.backward) or gid in readers_of_tangents
        recs.append({
            "id": gid, "name": anchor if len(names) == 1 else f"{anchor}+{len(names) - 1}",
            "cost": float(grp.cost) + cost_per_byte * int(grp.bytes), "bytes": int(grp.bytes), "inputs": inputs,
            "backward": late, "retain": bool(grp.retain), "recomputable": bool(grp.recomputable) and not late,
        })
    tangents_id, boundary_id = len(con.groups), len(con.groups) + 1
    # the forward groups, the boundary, the incoming gradients, then the backward groups: every backward group reads
    # the tangents node, which reads the boundary node, which reads the forward outputs, so a schedule computes every
    # backward op after the forward's outputs (a partitioner's backward module holds every backward op, even one
    # that reads no incoming gradient)
    backward = [r["id"] for r in recs if r["backward"]]
    forward = [r["id"] for r in recs if not r["backward"]]
    for r in recs:
        if r["backward"]:
            r["inputs"] = [*r["inputs"], tangents_id]
    recs.append({"id": boundary_id, "name": BOUNDARY, "cost": 0.0, "bytes": 0, "inputs": fwd_out_groups,
                 "backward": False, "retain": False, "recomputable": False})
    recs.append({"id": tangents_id, "name": TANGENTS, "cost": 0.0, "bytes": 0, "inputs": [boundary_id],
                 "backward": True, "retain": False, "recomputable": False})
    order = forward + [boundary_id, tangents_id] + backward
    try:
        graph = Graph.from_unordered(recs, fixed_bytes=0, name=f"region({len(records)} ops)", order=order)
    except GraphError as e:  # a forward group reading a backward one: the joint cannot be cut in two
        raise TraceError(f"the region's joint graph does not split into a forward and a backward: {e}") from e
    # the graph's node ids follow `order`; keep node_map and group_of in those ids
    pos = graph.label_to_id
    node_map = {pos[g]: names for g, names in node_map.items()}
    group_of = {nm: pos[g] for nm, g in group_of.items()}
    return RegionGraph(graph, node_map, group_of, pos[tangents_id], pos[boundary_id], symbolic, hints, len(records))


# ---------------------------------------------------------------------------------------------
# what a split holds
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldBytes:
    """What a region's forward and backward modules hold at once, in the region's accounting (bytes).

    forward_peak: during the forward; saved_bytes: the saved values' groups at the forward's end (forward outputs
    not counted); boundary: saved values and forward outputs together; backward_peak: during the backward, the
    forward outputs included (held to the region's end); grads: the gradients the backward leaves; peak: the
    largest of forward_peak, boundary and backward_peak."""

    forward_peak: int
    saved_bytes: int
    boundary: int
    backward_peak: int
    grads: int = 0

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.boundary, self.backward_peak)


def _walk(module: torch.fx.GraphModule, region: RegionGraph, live: set[int], start_bytes: int,
          keep: set[int]) -> int:
    """Peak bytes while `module` runs: groups in `live` (and `start_bytes` more) held at its start, each group's
    bytes from the first node that makes it to the last node that reads it, `keep` held to the end."""
    nodes = list(module.graph.nodes)
    last_read: dict[int, int] = {}
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            g = region.group_of.get(a.name)
            if g is not None:
                last_read[g] = k
    mem = start_bytes + sum(region.group_bytes(g) for g in live)
    peak = mem
    live = set(live)
    for k, n in enumerate(nodes):
        g = region.group_of.get(n.name) if n.op == "call_function" else None
        if g is not None and g not in live:
            live.add(g)
            mem += region.group_bytes(g)
            peak = max(peak, mem)
        for a in {*n.all_input_nodes, *([n] if g is not None else [])}:
            ga = region.group_of.get(a.name)
            if ga is not None and ga in live and ga not in keep and last_read.get(ga, -1) <= k:
                live.discard(ga)
                mem -= region.group_bytes(ga)
    return peak


def held_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, region: RegionGraph,
               num_fwd_outputs: int) -> HeldBytes:
    """What the split holds (see `HeldBytes`). Values the region did not make (parameters, its input, the incoming
    gradients) count nothing; gradients are kept to the end of the backward."""
    fw_out = next(n for n in fw.graph.nodes if n.op == "output")
    fw_outs = [o for o in tree_leaves(fw_out.args[0]) if isinstance(o, torch.fx.Node)]
    out_groups = {region.group_of[o.name] for o in fw_outs[:num_fwd_outputs] if o.name in region.group_of}
    saved_groups = {region.group_of[o.name] for o in fw_outs[num_fwd_outputs:] if o.name in region.group_of}
    forward_peak = _walk(fw, region, set(), 0, out_groups | saved_groups)
    out_bytes = sum(region.group_bytes(g) for g in out_groups)
    saved_only = saved_groups - out_groups
    saved_bytes = sum(region.group_bytes(g) for g in saved_only)
    bw_out = next(n for n in bw.graph.nodes if n.op == "output")
    grads = {region.group_of[o.name] for o in tree_leaves(bw_out.args[0])
             if isinstance(o, torch.fx.Node) and o.name in region.group_of}
    backward_peak = _walk(bw, region, saved_only, out_bytes, grads)
    grad_bytes = sum(region.group_bytes(g) for g in grads)
    return HeldBytes(forward_peak, saved_bytes, saved_bytes + out_bytes, backward_peak, grad_bytes)


def saved_storage_bytes(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes of the distinct storages the forward module hands to its backward beyond its inputs, its sizes at their
    hints (from the nodes' fake values): what a partition saves, whoever made it."""
    placeholders = set()
    for n in fw.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
            placeholders.add(StorageWeakRef(n.meta["val"].untyped_storage()))
    out = next(n for n in fw.graph.nodes if n.op == "output")
    seen: dict[StorageWeakRef, int] = {}
    for o in tree_leaves(out.args[0])[num_fwd_outputs:]:
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or is_sym_node(o):
            continue
        key = StorageWeakRef(val.untyped_storage())
        if key not in placeholders:
            seen[key] = _hint(val.untyped_storage().nbytes())
    return sum(seen.values())


def forward_ops_in(module: torch.fx.GraphModule, joint: torch.fx.GraphModule) -> list[str]:
    """Names of the joint's forward call_function nodes that `module` computes, getitems and free views of its inputs
    (a weight's transpose) left out: in a backward module, what it recomputes."""
    forward = {n.name for n in joint.graph.nodes if n.op == "call_function"
               and n.meta.get("partitioner_tag") != "is_backward" and not n.meta.get("autograd_backward")}
    return [n.name for n in module.graph.nodes
            if n.op == "call_function" and n.name in forward and n.target is not operator.getitem
            and free_view_root(n) is None]

