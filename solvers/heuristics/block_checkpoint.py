"""Checkpointing by blocks, as people write it by hand: per-block and selective checkpointing as schedules of a graph.

The caller names the graph's blocks (node sets: the forward and backward nodes of each repeated layer; the planner
finds them from the model's modules) and, for selective checkpointing (SAC: torchtitan's and Megatron's policy,
Korthikanti et al. 2022), the nodes whose values are saved (matmul and attention outputs). The schedule:

- runs every forward node once, in the reference order;
- before the first backward node of a block, recomputes the block's forward values that the backward reads, with
  what they need from inside the block, except saved values and values that cannot be recomputed (those stay from
  the forward);
- runs the backward nodes in the reference order.

Every value is freed at its last use (`Schedule.from_sequence`), so a block's inner values die in the forward once
the block no longer reads them, and its inputs (the previous block's output) live until its recomputation: what
torch.utils.checkpoint around each block holds, with at most its recomputation (it runs the whole block again; this
recomputes only what the backward reads). These schedules join auto's portfolio, so the planner never returns a
costlier schedule where they fit.
"""
from __future__ import annotations

from typing import Collection, Sequence

from graphs.errors import GraphError, InfeasibleBudgetError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal
from solvers.exact.blocks import split_blocks


def block_checkpoint_sequence(graph: Graph, blocks: Sequence[Collection[int]],
                              saved: Collection[int] = ()) -> list[int]:
    """The compute sequence of checkpointing `blocks` (see the module docstring); `saved`: values kept from the
    forward inside the blocks (empty: per-block checkpointing)."""
    block_of: dict[int, int] = {}
    for k, nodes in enumerate(blocks):
        for v in nodes:
            block_of.setdefault(int(v), k)
    keep = set(int(v) for v in saved)
    nodes = graph.nodes
    inputs = graph.inputs

    def redone(v: int, k: int) -> bool:
        return block_of.get(v) == k and not nodes[v].backward and nodes[v].recomputable and v not in keep

    again: dict[int, set[int]] = {k: set() for k in range(len(blocks))}
    for nd in nodes:
        if nd.backward:
            for u in nd.inputs:
                k = block_of.get(u)
                if k is not None and redone(u, k):
                    again[k].add(u)
    for k, vs in again.items():  # what the recomputed values read from inside the block is recomputed too
        stack = list(vs)
        while stack:
            v = stack.pop()
            for u in inputs[v]:
                if u not in vs and redone(u, k):
                    vs.add(u)
                    stack.append(u)
    seq = [nd.id for nd in nodes if not nd.backward]
    done: set[int] = set()
    for nd in nodes:
        if not nd.backward:
            continue
        k = block_of.get(nd.id)
        if k is not None and k not in done:
            done.add(k)
            seq.extend(sorted(again[k]))
        seq.append(nd.id)
    return seq


def graph_blocks(graph: Graph) -> list[list[int]]:
    """The blocks of `graph` found from the graph alone (block_dp's split at narrow cuts), as node sets."""

    split = split_blocks(graph)
    if split is None or not split.blocks:
        raise GraphError(f"{graph.name} splits into no chain of blocks: pass block_checkpoint its blocks")
    out = []
    for b in split.blocks:
        nodes = [v for v in range(b.first, b.last + 1) if not graph.nodes[v].backward]
        if b.bwd_window is not None:
            nodes += [v for v in range(b.bwd_window[0], b.bwd_window[1] + 1) if graph.nodes[v].backward]
        out.append(nodes)
    return out


def block_checkpoint(graph: Graph, budget_bytes: int, *, blocks: Sequence[Collection[int]] | None = None,
                     saved: Collection[int] = (), time_limit_s: float | None = None) -> Proposal:
    """The block-checkpointing schedule (a heuristic: one schedule), or InfeasibleBudgetError naming its peak.
    Without `blocks`, the graph's own chain of blocks (`solvers.exact.blocks.split_blocks`: its forward nodes and the
    backward nodes of its backward window); GraphError where it has none."""
    if blocks is None:
        blocks = graph_blocks(graph)
    sched = Schedule.from_sequence(graph, block_checkpoint_sequence(graph, blocks, saved))
    peak = simulate(graph, sched).peak_bytes
    if peak > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, peak, "block_checkpoint", "its only schedule peaks there")
    return Proposal(sched, Status.HEURISTIC, info={"blocks": len(blocks), "saved": len(saved)})
