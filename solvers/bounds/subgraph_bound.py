"""A floor on the budget of every schedule, from an exact search on a small part of the graph.

Take a set S of nodes and one of them, the sink. Project any valid schedule onto S: keep the computations and frees
of S's values and forget the rest. What remains obeys looser rules, the *relaxation*: a state is the set of S's
values resident; any of them may be freed; a value x of S not resident may be computed when its inputs in S are
resident and

    bytes(resident S values) + bytes(x) + bytes(x's inputs outside S) <= budget - fixed bytes,

because in the real schedule those outside inputs are resident too when x is computed, besides the S values. So if
the relaxation cannot compute the sink within a budget, no schedule of any kind (any order, any recomputation,
gradients included) can: every schedule computes every node at least once. The smallest budget at which the
relaxation computes the sink is a bottleneck shortest path over the states (Dijkstra on the largest memory met
along the way), exact for S; it is a floor for the whole graph.

Candidates: a sink y with two or more inputs, and S = a source z, y, and every node on a path from z to y. On
resnet50 this proves its smallest budget: pool1_pool_backward needs the gradients of both branches of the first
block, and with S = conv2_block2_out_backward .. pool1_pool_backward (23 nodes) no order of any recomputation fits
below 0.108 x the reference peak, which the lowest-memory rebuild meets; the single-operation bound is 0.097.
The search is exponential in |S|, so S is capped in size and in states visited; the floor is the best any
candidate proves within the time given.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from graphs.ir import Graph
from solvers.bounds.forced_bound import ancestor_masks, bits

MAX_NODES = 24
MAX_STATES = 100_000


class _TooLarge(Exception):
    pass


@dataclass(frozen=True)
class SubgraphFloor:
    budget_bytes: int  # no schedule of any kind fits a smaller budget
    source: int
    sink: int
    nodes: tuple[int, ...]  # S
    capped: bool  # True: the relaxation fails at every budget up to the cap it was given (so the floor is cap + 1)

    def describe(self, graph: Graph) -> str:
        return (f"the {len(self.nodes)} nodes on paths from {graph.describe(self.source)} to "
                f"{graph.describe(self.sink)}, with every other value counted only while it is read, cannot reach "
                f"the latter below {self.budget_bytes} bytes (exhaustive search)")


def relaxed_min_budget(graph: Graph, nodes, sink: int, cap_bytes: int, *, max_states: int = MAX_STATES) -> int | None:
    """The least budget (bytes, at most `cap_bytes`) at which the relaxation over `nodes` computes `sink`; None if
    none up to `cap_bytes` does (every schedule then needs more than `cap_bytes`).

    Raises _TooLarge after `max_states` states."""
    order = sorted(set(int(v) for v in nodes) | {int(sink)})
    idx = {v: k for k, v in enumerate(order)}
    size = [int(graph.sizes[v]) for v in order]
    need, extra = [], []
    for v in order:
        ins = set(graph.inputs[v])
        need.append(sum(1 << idx[i] for i in ins if i in idx))
        extra.append(int(graph.sizes[v]) + sum(int(graph.sizes[i]) for i in ins if i not in idx))
    ks = idx[int(sink)]
    fixed = int(graph.fixed_bytes)
    cap = int(cap_bytes) - fixed
    goal = -1
    best = {0: 0}
    heap = [(0, 0, 0)]  # (largest memory met on the way, state bit mask, memory of the state)
    while heap:
        peak, state, mem = heapq.heappop(heap)
        if state == goal:
            return peak + fixed
        if best.get(state, peak + 1) < peak:
            continue
        for k in range(len(order)):
            bit = 1 << k
            if state & bit:
                nxt, nmem, npeak = state ^ bit, mem - size[k], peak
            elif need[k] & state == need[k]:
                top = mem + extra[k]
                if top > cap:
                    continue
                npeak = max(peak, top)
                if k == ks:
                    heapq.heappush(heap, (npeak, goal, 0))
                    continue
                nxt, nmem = state | bit, mem + size[k]
            else:
                continue
            if npeak < best.get(nxt, npeak + 1):
                best[nxt] = npeak
                heapq.heappush(heap, (npeak, nxt, nmem))
        if len(best) > max_states:
            raise _TooLarge
    return None


def subgraph_floor_bytes(graph: Graph, cap_bytes: int, *, max_nodes: int = MAX_NODES, max_states: int = MAX_STATES,
                         deadline: float | None = None) -> SubgraphFloor | None:
    """The highest floor the candidates prove, searching budgets up to `cap_bytes` (the relaxation is run with that
    cap: a candidate that fails at every budget up to it proves cap_bytes + 1, and the search stops there).

    deadline: time.perf_counter() after which no further candidate starts. None when no candidate ran."""
    anc, desc = ancestor_masks(graph)
    found: SubgraphFloor | None = None
    sinks = [y for y in range(graph.n) if len(set(graph.inputs[y])) >= 2]
    for y in reversed(sinks):  # training graphs: the backward pass, where the tight joins are, first
        if deadline is not None and time.perf_counter() > deadline:
            return found
        sources = []
        for z in bits(anc[y]):
            between = desc[z] & anc[y]
            count = bin(between).count("1") + 2
            if count <= max_nodes:
                sources.append((count, z, between))
        # a larger S gives a relaxation at least as tight as any S inside it: largest first, subsets skipped
        done: list[int] = []
        for count, z, between in sorted(sources, reverse=True):
            if deadline is not None and time.perf_counter() > deadline:
                return found
            mask = between | (1 << z) | (1 << y)
            if any(mask & ~m == 0 for m in done):
                continue
            nodes = list(bits(mask))
            try:
                b = relaxed_min_budget(graph, nodes, y, cap_bytes, max_states=max_states)
            except _TooLarge:
                continue
            done.append(mask)
            capped = b is None
            b = int(cap_bytes) + 1 if capped else b
            if found is None or b > found.budget_bytes:
                found = SubgraphFloor(b, z, y, tuple(nodes), capped)
                if capped:
                    return found
    return found
