"""`lowest_memory`: a schedule for the tightest budgets, at any cost: recompute forward values from scratch.

Every backward value is computed once, in the reference order, and kept until its last reader. Every forward
value a backward node reads is recomputed just before it, from the graph's sources, in a depth-first order (the
input with the larger ancestor cone first, Sethi-Ullman style), and freed after its last reader. So while a
backward node's inputs are rebuilt, only the gradients still waiting for readers are resident: the
classic minimum-memory strategy of recomputation (its cost grows with the square of the depth: 3-15x the
graph's cost on the Checkmate graphs), used where nothing cheaper fits and by the smallest-budget search.

One choice is searched greedily, node by node: a backward node may share one rebuild with the next one or two
backward nodes that read it (a batch-norm backward and the convolution backward after it read the same
activations), which avoids holding the first one's output during the second rebuild but holds the shared
activations longer. Each candidate is scored by the peak of its own stretch of the schedule (an estimate: it
counts the waiting gradients as held throughout), so the variant without sharing is also built, and the one
whose simulated peak is lower is returned.

Forward values that cannot be recomputed (dropout) are computed once and kept until read, like gradients. Graphs
without backward nodes get the reference order (nothing is a gradient to wait for). Status HEURISTIC.

With `improve_s`, a greedy pass then keeps forward values from the forward pass instead of rebuilding them, as
long as the schedule fits the budget (`keep_greedily`): at resnet50's smallest budget found (0.108 of the
reference peak) it cuts the cost from 15.8x to 2.4x the graph's in 5 s; `auto` uses it when nothing else fits.
"""
from __future__ import annotations

import time
from collections import Counter

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import SimResult, simulate
from solvers.base import Proposal
from solvers.deadline import check, deadline_after, seconds_left

MAX_GROUP = 3


def _rebuild_order(graph: Graph, needed: list[int], kept: list[bool], cone: list[int], reverse: bool
                   ) -> list[int]:
    """`needed` and their ancestors up to kept values, in a depth-first post-order."""
    order: list[int] = []
    seen: set[int] = set()
    key = (lambda i: -cone[i]) if not reverse else (lambda i: cone[i])
    for root in sorted(dict.fromkeys(needed), key=key):
        if root in seen:
            continue
        stack = [(root, iter(sorted((i for i in graph.inputs[root] if not kept[i]), key=key)))]
        seen.add(root)
        while stack:
            v, it = stack[-1]
            nxt = next((i for i in it if i not in seen), None)
            if nxt is None:
                stack.pop()
                order.append(v)
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted((i for i in graph.inputs[nxt] if not kept[i]), key=key))))
    return order


def _segment_peak(graph: Graph, segment: list[int], held_bytes: int, later: set[int]) -> int:
    """Peak of `segment` run on top of `held_bytes`, freeing each of its values after its last reader in it
    (values in `later` are read after the segment and stay)."""
    last: dict[int, int] = {}
    for k, v in enumerate(segment):
        for i in graph.inputs[v]:
            last[i] = k
    sizes = graph.sizes
    mem, peak = held_bytes, 0
    live: set[int] = set()
    for k, v in enumerate(segment):
        peak = max(peak, mem + int(sizes[v]))
        mem += int(sizes[v])
        live.add(v)
        for i in (*graph.inputs[v], v):
            if i in live and last.get(i, -1) <= k and i not in later:
                live.discard(i)
                mem -= int(sizes[i])
    return peak


def lowest_memory_sequence(graph: Graph, keep: frozenset[int] = frozenset(), max_groups=(1, MAX_GROUP)
                           ) -> list[int]:
    """The lower-peak sequence of the variants (single rebuilds only, or rebuilds shared greedily); the
    cheaper one when the peaks are equal. `keep`: forward values kept from the forward pass instead of rebuilt."""
    return _best_variant(graph, keep, max_groups)[0]


def _best_variant(graph: Graph, keep: frozenset[int], max_groups, deadline: float | None = None
                  ) -> tuple[list[int], SimResult]:
    """`lowest_memory_sequence` with the simulation that chose it (so callers need not replay it again).
    NoSolutionInTimeError once `deadline` (time.perf_counter()) passes."""
    best = None
    for max_group in max_groups:
        seq = _sequence(graph, max_group, keep, deadline)
        sim = simulate(graph, Schedule.from_sequence(graph, seq))
        if best is None or (sim.peak_bytes, sim.total_cost) < (best[1].peak_bytes, best[1].total_cost):
            best = (seq, sim)
    return best


def _sequence(graph: Graph, max_group: int, keep: frozenset[int] = frozenset(), deadline: float | None = None
              ) -> list[int]:
    n = graph.n
    backward = [nd.backward for nd in graph.nodes]
    if not any(backward):
        return list(range(n))
    # kept: computed once and kept until read (backward values, forward values that cannot be recomputed, such
    # as dropout, and those in `keep`); every other forward value is rebuilt before each backward node reading it
    kept = [nd.backward or not nd.recomputable or nd.id in keep for nd in graph.nodes]
    cone = [0] * n  # number of rebuilt ancestors (the depth-first order's key)
    anc: list[set[int]] = [set() for _ in range(n)]
    for v in range(n):
        for i in graph.inputs[v]:
            if not kept[i]:
                anc[v] |= anc[i] | {i}
        cone[v] = len(anc[v])
    last_reader = [max(us) if us else -1 for us in graph.users]
    seq: list[int] = []
    done_kept: list[int] = []
    x = 0
    while x < n:
        check(deadline, f"lowest_memory: rebuilding for node {x} of {n}")
        if not backward[x]:
            seq.append(x)
            if kept[x]:
                done_kept.append(x)
            x += 1
            continue
        held = sum(int(graph.sizes[v]) for v in done_kept if last_reader[v] >= x or graph.nodes[v].retain)
        chain = [x]
        while (len(chain) < max_group and chain[-1] + 1 < n and backward[chain[-1] + 1]
               and chain[-1] in graph.inputs[chain[-1] + 1]):
            chain.append(chain[-1] + 1)
        best = None
        for size in range(1, len(chain) + 1):
            # the first `size` nodes share one rebuild; the rest of the chain is scored as single rebuilds, so
            # that every candidate is scored over the same stretch
            groups = [chain[:size]] + [[y] for y in chain[size:]]
            peak, first = 0, None
            for group in groups:
                # chain members computed in earlier groups of this candidate that are still to be read
                extra = sum(int(graph.sizes[y]) for y in chain if y < group[0]
                            and (last_reader[y] >= group[0] or graph.nodes[y].retain))
                needed = [f for y in group for f in graph.inputs[y] if not kept[f]]
                later = {y for y in group if last_reader[y] > group[-1] or graph.nodes[y].retain}
                options = [_rebuild_order(graph, needed, kept, cone, rev) + group for rev in (False, True)]
                scored = [(_segment_peak(graph, seg, held + extra, later), seg) for seg in options]
                p, seg = min(scored, key=lambda z: z[0])
                peak = max(peak, p)
                if first is None:
                    first = seg
            if best is None or peak < best[0]:
                best = (peak, first, chain[:size])
        _, segment, chosen = best
        seq += segment
        done_kept += chosen
        x = chosen[-1] + 1
    return seq


def lowest_memory(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
                  improve_s: float | None = None) -> Proposal:
    """The schedule of the module docstring if it fits `budget_bytes`; else InfeasibleBudgetError naming its
    peak (the smallest budget this strategy meets).

    improve_s: then spend up to this many seconds keeping forward values instead of rebuilding them, one at a
    time (the largest rebuild cost first), wherever the schedule still fits the budget (`keep_greedily`).
    """
    deadline = deadline_after(time_limit_s)
    seq, sim = _best_variant(graph, frozenset(), (1, MAX_GROUP), deadline)
    if sim.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, sim.peak_bytes, "lowest_memory",
                                    "recomputing every forward value from scratch for each backward node peaks there")
    info = {"recomputations": len(seq) - graph.n}
    if improve_s:
        left = seconds_left(deadline)
        seq, kept = keep_greedily(graph, budget_bytes, seq, improve_s if left is None else min(improve_s, left),
                                  cost=sim.total_cost)
        info.update(recomputations=len(seq) - graph.n, kept=len(kept))
    return Proposal(Schedule.from_sequence(graph, seq), Status.HEURISTIC, info=info)


def keep_greedily(graph: Graph, budget_bytes: int, seq: list[int], seconds: float, *, cost: float | None = None
                  ) -> tuple[list[int], set[int]]:
    """Keep forward values from the forward pass instead of rebuilding them, while the schedule fits.

    Candidates are the rebuilt forward values, by the cost of their rebuilds in `seq` (largest first); each is
    kept if the rebuilt schedule stays within `budget_bytes` and costs less. Stops after `seconds`.
    cost: `seq`'s simulated cost, when the caller has it."""
    deadline = time.perf_counter() + seconds
    counts = Counter(seq)
    costs = graph.costs
    candidates = sorted((v for v in range(graph.n) if counts[v] > 1 and not graph.nodes[v].backward
                         and graph.nodes[v].recomputable), key=lambda v: -(counts[v] - 1) * float(costs[v]))
    best_cost = simulate(graph, Schedule.from_sequence(graph, seq)).total_cost if cost is None else cost
    kept: set[int] = set()
    for v in candidates:
        if time.perf_counter() > deadline:
            break
        try:
            trial, sim = _best_variant(graph, frozenset(kept | {v}), (1,), deadline)
        except NoSolutionInTimeError:
            break
        if sim.peak_bytes <= budget_bytes and sim.total_cost < best_cost:
            kept.add(v)
            seq, best_cost = trial, sim.total_cost
    return seq, kept
