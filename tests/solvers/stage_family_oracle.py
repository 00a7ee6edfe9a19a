"""Exhaustive oracles over Checkmate's stage family, to check the MILP on tiny graphs.

The family: stage t = 0..n-1 first recomputes a subset of the nodes with ids < t, in ascending id order, and
then computes node t (its first computation); so first computations follow ascending ids and each node is
computed at most once per stage. A compute sequence becomes a schedule by `Schedule.from_sequence` (frees at
last use) and the simulator judges it.

Two searches over that family, written independently of the MILP:
- `enumerate_optimum`: every sequence of the family (one subset per stage), each simulated; for n <= 5.
- `stage_family_optimum`: exhaustive dynamic programming over the stage boundaries. The state is the set of
  values resident when a stage starts; a move picks the stage's recomputed subset and the values kept for
  the next stage, and every other value is freed after its last read in the stage. Every (subset, kept set)
  pair is tried, so the search covers the family; the result's sequence is replayed by the simulator.
"""
from __future__ import annotations

from itertools import combinations

from graphs.ir import Graph
from graphs.schedule import Schedule
from graphs.simulate import simulate


def _subsets(pool: list[int]):
    for r in range(len(pool) + 1):
        yield from combinations(pool, r)


def enumerate_optimum(graph: Graph, budget_bytes: int) -> tuple[float, list[int]] | None:
    """(minimum cost, sequence) by simulating every sequence of the family; None if none fits."""
    n = graph.n
    best = None

    def rec(t: int, seq: list[int]) -> None:
        nonlocal best
        if t == n:
            sim = simulate(graph, Schedule.from_sequence(graph, seq))
            if sim.peak_bytes <= budget_bytes and (best is None or sim.total_cost < best[0]):
                best = (sim.total_cost, list(seq))
            return
        pool = [i for i in range(t) if graph.nodes[i].recomputable]
        for sub in _subsets(pool):
            rec(t + 1, seq + list(sub) + [t])

    rec(0, [])
    return best


def stage_family_optimum(graph: Graph, budget_bytes: int) -> tuple[float, list[int]] | None:
    """(minimum cost, sequence) over the family within budget by dynamic programming; None if none fits."""
    n = graph.n
    size = [int(x) for x in graph.sizes]
    cost = [float(c) for c in graph.costs]
    inputs = graph.inputs
    retained = 0
    for i in graph.retained:
        retained |= 1 << i
    # frontier: kept-set bitmask -> (cost so far, parent key, stage sequence)
    frontier: dict[int, tuple[float, tuple | None, list[int]]] = {0: (0.0, None, [])}
    history: list[dict] = []
    for t in range(n):
        nxt: dict[int, tuple[float, tuple | None, list[int]]] = {}
        for kept, (c0, _, _) in frontier.items():
            pool = [i for i in range(t) if graph.nodes[i].recomputable and not kept >> i & 1]
            for sub in _subsets(pool):
                stage = [*sub, t]
                avail = kept
                ok = True
                for v in stage:
                    if any(not avail >> i & 1 for i in inputs[v]):
                        ok = False
                        break
                    avail |= 1 << v
                if not ok:
                    continue
                # last position in the stage that reads each value (-1: not read in this stage)
                last = {}
                for p, v in enumerate(stage):
                    for i in inputs[v]:
                        last[i] = p
                c1 = c0 + sum(cost[v] for v in stage)
                cand = [i for i in range(t + 1) if avail >> i & 1]
                for keep_next in _subsets(cand):
                    kmask = 0
                    for i in keep_next:
                        kmask |= 1 << i
                    if t == n - 1 and (retained & ~kmask):
                        continue
                    if kmask in nxt and nxt[kmask][0] <= c1:
                        continue
                    if _stage_peak(graph, size, inputs, kept, stage, kmask, last) > budget_bytes:
                        continue
                    nxt[kmask] = (c1, (t, kept), stage)
        history.append(nxt)
        frontier = nxt
        if not frontier:
            return None
    best_mask = min(frontier, key=lambda k: frontier[k][0])
    best_cost = frontier[best_mask][0]
    stages: list[list[int]] = []
    mask = best_mask
    for t in range(n - 1, -1, -1):
        c, parent, stage = history[t][mask]
        stages.append(stage)
        mask = parent[1]
    seq = [v for stage in reversed(stages) for v in stage]
    return best_cost, seq


def _stage_peak(graph, size, inputs, kept: int, stage: list[int], keep_next: int, last: dict) -> int:
    """Peak memory of one stage: values kept for the next stage stay; others go after their last read here
    (a kept-in value never read here and not kept on is dropped before the stage starts)."""
    resident = {i for i in range(graph.n) if kept >> i & 1 and (keep_next >> i & 1 or i in last)}
    mem = graph.fixed_bytes + sum(size[i] for i in resident)
    peak = mem
    for p, v in enumerate(stage):
        mem += size[v]
        peak = max(peak, mem)
        resident.add(v)
        for i in list(resident):
            if keep_next >> i & 1:
                continue
            if last.get(i, -1) <= p and (i in last or i == v):
                resident.discard(i)
                mem -= size[i]
    return peak
