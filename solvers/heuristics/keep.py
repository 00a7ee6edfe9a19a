"""The cheapest recomputation for a kept set: the shared back end of every keep-policy baseline.

A policy names the values to keep (checkpoint). The forward pass runs in the reference order; a
forward value that is not kept is dropped once its last forward user has run, and any later user
that needs it recomputes it from the nearest resident ancestors (each missing ancestor once, in
topological order). A recomputed value then stays until its last use, so a segment is recomputed
once for the whole backward pass through it, as in Chen et al. Backward values, retained values,
random (non-recomputable) values and forward values with no forward user are always kept.
The frees are then placed at last use, which is optimal for the resulting compute sequence.
"""
from __future__ import annotations

from typing import Iterable

from graphs.ir import Graph
from graphs.schedule import Schedule


def always_kept(graph: Graph) -> set[int]:
    """Values that any keep-policy keeps: see the module docstring."""
    out = set()
    for nd in graph.nodes:
        fwd_users = [u for u in graph.users[nd.id] if not graph.nodes[u].backward]
        if nd.backward or nd.retain or not nd.recomputable or not fwd_users:
            out.add(nd.id)
    return out


def sequence_from_kept(graph: Graph, kept: Iterable[int]) -> list[int]:
    """The compute sequence (with recomputations) that a kept set implies."""
    n = graph.n
    keep = set(kept) | always_kept(graph)
    inputs, users = graph.inputs, graph.users
    last_use = _last_needed(graph)
    last_fwd_use = [max((x for x in u if not graph.nodes[x].backward), default=-1) for u in users]
    retained = set(graph.retained)
    resident: set[int] = set()
    recomputed: set[int] = set()
    seq: list[int] = []
    for t in range(n):
        missing: set[int] = set()
        stack = [i for i in inputs[t] if i not in resident]
        while stack:
            i = stack.pop()
            if i in missing or i in resident:
                continue
            missing.add(i)
            stack.extend(j for j in inputs[i] if j not in resident and j not in missing)
        for i in sorted(missing):
            seq.append(i)
            resident.add(i)
            recomputed.add(i)
        seq.append(t)
        resident.add(t)
        recomputed.discard(t)
        drop = []
        for v in resident:
            if v in retained:
                continue
            if last_use[v] <= t:
                drop.append(v)
            elif v not in keep and v not in recomputed and last_fwd_use[v] <= t:
                drop.append(v)
        for v in drop:
            resident.discard(v)
            recomputed.discard(v)
    return seq


def _last_needed(graph: Graph) -> list[int]:
    """For each node, the last stage at which its value may be needed.

    A recomputable value is needed up to its last use. A value that cannot be recomputed must also outlive every
    recomputation that may read it: a recomputable forward user may be recomputed as late as its own last use, and
    so on down that user's recomputable forward descendants. Backward values are never recomputed here (each is
    resident until its last use, and only backward nodes read them), so the chain stops at the backward pass.
    """
    n = graph.n
    last_use = [max(u) if u else i for i, u in enumerate(graph.users)]
    cone = list(last_use)
    for u in reversed(range(n)):
        for w in graph.users[u]:
            nd = graph.nodes[w]
            if nd.recomputable and not nd.backward:
                cone[u] = max(cone[u], cone[w])
    return [cone[v] if not graph.nodes[v].recomputable else last_use[v] for v in range(n)]


def schedule_from_kept(graph: Graph, kept: Iterable[int]) -> Schedule:
    """The schedule for a kept set: `sequence_from_kept` with frees at last use."""
    return Schedule.from_sequence(graph, sequence_from_kept(graph, kept))
