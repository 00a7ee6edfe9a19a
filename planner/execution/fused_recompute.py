"""Stashed values that inductor can rebuild inside the backward's kernels: moved from the stash into the backward.

After decomposition, some values a planned forward stashes for the backward are pointwise functions of other
stashed values and of the model's parameters: a ReLU's output of a BatchNorm's input, its two statistics, its
weight and bias. Eager needs such a value stashed (an eager backward op reads the tensor). In the compiled backward
the pointwise chain is fused into the kernels that read it, so rebuilding it there costs a few reads of values held
anyway and, where no kernel needs it as a whole tensor, no memory at all. torch.compile's own partitioner makes the
same trade. `rebuild_pointwise_stash` makes it on the plan's decomposed halves:

- a stashed value qualifies when no other stashed value shares its storage, and every op between it and its
  sources is pointwise or a view, draws no random numbers, and there are at most MAX_CHAIN of them; its sources
  are other stashed values (which stay stashed), views of them (rebuilt by a reshape), and forward inputs that the
  forward does not write (parameters: alive through the whole step, passed to the backward as extra stash entries
  that cost no memory);
- the rebuild is placed just before the value's first reader in the backward, and only where every stashed value
  it reads is read there or later anyway, so no stashed value lives longer than the plan says;
- the forward returns None in its place and the backward loses that input, as for an unread stash value.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

aten = torch.ops.aten
MAX_CHAIN = 16
_VIEWS = {aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
          aten.reshape.default, aten._unsafe_view.default, aten.permute.default, aten.t.default,
          aten.alias.default, aten.slice.Tensor, aten.select.int}
# views whose source is a reshape of the view (same elements, same order): a source reached only as such a
# view of a stashed value is rebuilt by reshaping the stashed value back
_RESHAPES = {aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.reshape.default,
             aten._unsafe_view.default, aten.alias.default}


@dataclasses.dataclass
class Rebuilt:
    """What `rebuild_pointwise_stash` changed. The backward's inputs are now: the stash inputs it kept (indices
    into its former inputs, in order), then one input per extra forward output, then its former inputs after the
    stash (the tangents). The forward returns `extra_primals` (forward input indices) after its stash."""

    kept_stash: list[int]
    extra_primals: list[int]
    moved: list[str]  # the forward nodes whose values the backward now rebuilds

    @property
    def changed(self) -> bool:
        return bool(self.moved)


def _is_fusible(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target in _VIEWS:
        return True
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `node` views (itself if it is no view)."""
    while node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _shape(node: torch.fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _sources(value: torch.fx.Node, stashed: set[torch.fx.Node], reshaped: dict[torch.fx.Node, torch.fx.Node],
             params: set[torch.fx.Node]):
    """The ops that rebuild `value` (in forward order) and the sources they read, or None if it needs more than
    pointwise ops and views of stashed values and parameters."""
    ops: list[torch.fx.Node] = []
    sources: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()

    def visit(n: torch.fx.Node, top: bool) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if not top and (n in stashed or n in params or n in reshaped):
            sources.add(n)
            return True
        if not _is_fusible(n) or len(ops) >= MAX_CHAIN:
            return False
        for a in n.all_input_nodes:
            if not visit(a, False):
                return False
        ops.append(n)
        return True

    if not visit(value, True):
        return None
    return ops, sources


def rebuild_pointwise_stash(f_gm: torch.fx.GraphModule, b_gm: torch.fx.GraphModule, first_stash: int,
                            stash_positions: list[int], written_primals: set[int]) -> Rebuilt:
    """Move each qualifying stashed value's pointwise chain into the backward (module docstring). `stash_positions`
    lists, per leading backward input that is a stash value, its index among the forward's stash outputs;
    `written_primals` are the forward inputs the forward writes (BatchNorm's running statistics)."""
    out = next(n for n in f_gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    f_phs = [n for n in f_gm.graph.nodes if n.op == "placeholder"]
    b_phs = [n for n in b_gm.graph.nodes if n.op == "placeholder"]
    n_stash = len(stash_positions)
    ph_of: dict[torch.fx.Node, torch.fx.Node] = {}  # stashed forward node -> its backward input
    for k, pos in enumerate(stash_positions):
        v = values[first_stash + pos]
        if isinstance(v, torch.fx.Node) and v not in ph_of:
            ph_of[v] = b_phs[k]
    params = {ph for i, ph in enumerate(f_phs) if i not in written_primals}
    removed: set[int] = set()  # backward inputs no longer read (their values are rebuilt)
    extra: dict[torch.fx.Node, torch.fx.Node] = {}  # forward input -> the backward's new input for it
    moved: list[str] = []
    for k in range(n_stash):
        v = values[first_stash + stash_positions[k]]
        ph = b_phs[k]
        if not isinstance(v, torch.fx.Node) or not ph.users or ph_of.get(v) is not ph or v in params:
            continue
        stashed = set(ph_of) - {v}
        root = _root(v)
        if any(_root(n) is root for n in stashed):
            continue  # another stashed value holds its storage: rebuilding it frees nothing
        # a node that a stashed value is a reshape of is rebuilt from that value
        reshaped: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in stashed:
            src = n
            while src.op == "call_function" and src.target in _RESHAPES and isinstance(src.args[0], torch.fx.Node):
                src = src.args[0]
                if src not in stashed and src is not root:
                    reshaped.setdefault(src, n)
        found = _sources(v, stashed, reshaped, params)
        if found is None:
            continue
        ops, sources = found
        b_order = {n: i for i, n in enumerate(b_gm.graph.nodes)}
        first_read = min(b_order[u] for u in ph.users)
        # sources are stashed values, reshapes of them (never stashed themselves) or parameters
        held = [ph_of[s] for s in sources if s in stashed] + [ph_of[reshaped[s]] for s in sources if s in reshaped]
        if any(not p.users or max(b_order[u] for u in p.users) < first_read for p in held):
            continue  # the rebuild would hold a stashed value past its last reader
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for s in sources:
            if s in stashed:
                env[s] = ph_of[s]
            elif s in params:
                if s not in extra:
                    with b_gm.graph.inserting_after(b_phs[n_stash - 1]):
                        new = b_gm.graph.placeholder(f"primal_{f_phs.index(s)}")
                    new.meta = dict(s.meta)
                    extra[s] = new
                env[s] = extra[s]
        anchor = min(ph.users, key=lambda u: b_order[u])
        with b_gm.graph.inserting_before(anchor):
            for s in sources:
                if s not in env:
                    env[s] = b_gm.graph.call_function(aten.reshape.default, (ph_of[reshaped[s]], list(_shape(s))))
                    env[s].meta = dict(s.meta)
            for op in ops:
                env[op] = b_gm.graph.node_copy(op, lambda a: env[a])
        ph.replace_all_uses_with(env[v])
        removed.add(k)
        del ph_of[v]
        values[first_stash + stash_positions[k]] = None
        moved.append(v.name)
    if not removed:
        return Rebuilt(list(range(n_stash)), [], [])
    for k in sorted(removed, reverse=True):
        b_gm.graph.erase_node(b_phs[k])
    extra_primals = [f_phs.index(s) for s in extra]
    values.extend(extra)
    out.args = (type(out.args[0])(values),)
    f_gm.graph.eliminate_dead_code()
    f_gm.recompile()
    # the extra inputs were each inserted right after the last stash input (so in reverse order of creation):
    # put them in creation order, before the tangents
    _order_placeholders(b_gm, [extra[s] for s in extra], b_phs[n_stash:])
    b_gm.graph.lint()
    b_gm.recompile()
    return Rebuilt([k for k in range(n_stash) if k not in removed], extra_primals, moved)


def _order_placeholders(gm: torch.fx.GraphModule, extras: list[torch.fx.Node], after: list[torch.fx.Node]) -> None:
    """Put the placeholders `extras` then `after` last among the graph's placeholders, in that order."""
    for ph in [*extras, *after]:
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        if last is not ph:
            last.append(ph)
