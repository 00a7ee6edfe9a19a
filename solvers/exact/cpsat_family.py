"""The schedule family of the CP-SAT solver (solvers/exact/cpsat.py): stages with at most C computations per node.

Family (C = `max_computations`):
- stage k (k = 0..n-1, the reference order) ends with the first computation of node k;
- before it, stage k may recompute earlier nodes (ids < k), each at most once per stage, in ascending id order;
- every node is computed at most C times in all (a non-recomputable node once);
- values are freed right after their last use (`Schedule.from_sequence`), which is optimal for the sequence.

This is Checkmate's stage family (ordered computations within a stage) cut to at most C computations per node, so
its optimum is >= the Checkmate MILP optimum, and equal to it once C is large enough (C = n always is).
An event is the pair (stage k, node u), placed on the timeline at `event_time(n, k, u) = k * n + u`; distinct
events have distinct times and the timeline order is the execution order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphs.ir import Graph


def event_time(n: int, stage: int, node: int) -> int:
    return stage * n + node


def computation_limits(graph: Graph, max_computations: int) -> list[int]:
    """How many computations of each node the family allows (1 for non-recomputable nodes)."""
    return [max_computations if nd.recomputable else 1 for nd in graph.nodes]


@dataclass(frozen=True)
class FamilyForm:
    """A compute sequence written in the family's terms.

    stages[v]: the stage of each computation of v, ascending (stages[v][0] == v).
    serves[v]: for each computation of v, the times of the uses it serves (ascending), where a use is the
    computation of a user at `event_time`.
    """

    stages: tuple[tuple[int, ...], ...]
    serves: tuple[tuple[tuple[int, ...], ...], ...]


def family_form(graph: Graph, sequence: Sequence[int], max_computations: int) -> FamilyForm | None:
    """The family form of `sequence`, or None when the sequence is not in the family.

    The sequence must be valid in the sense of the simulator (inputs computed before use); only the
    family conditions are checked here.
    """
    n = graph.n
    limits = computation_limits(graph, max_computations)
    stages: list[list[int]] = [[] for _ in range(n)]
    nxt = 0  # the node whose first computation closes the current stage
    last_recomputed = -1  # id of the last recomputation in the current stage
    served: list[list[list[int]]] = [[] for _ in range(n)]
    for v in sequence:
        v = int(v)
        if not 0 <= v < n:
            return None
        if not stages[v]:
            if v != nxt:
                return None  # first computations must follow the reference order
            stage = nxt
            nxt += 1
            last_recomputed = -1
        else:
            if v <= last_recomputed or len(stages[v]) >= limits[v]:
                return None
            stage = nxt
            last_recomputed = v
            if stage >= n:
                return None  # recomputation after the last stage
        t = event_time(n, stage, v)
        for u in graph.inputs[v]:
            if not stages[u]:
                return None  # not a valid sequence
            served[u][-1].append(t)
        stages[v].append(stage)
        served[v].append([])
    if nxt != n:
        return None
    return FamilyForm(tuple(tuple(s) for s in stages), tuple(tuple(tuple(x) for x in s) for s in served))


def sequence_from_stages(graph: Graph, stages: Sequence[Sequence[int]]) -> list[int]:
    """The compute sequence of a family member given the stages of each node's computations."""
    n = graph.n
    events = sorted(event_time(n, k, v) for v in range(n) for k in stages[v])
    return [t % n for t in events]


def stage_normal_form(sequence: Sequence[int]) -> list[int]:
    """`sequence` with the recomputations of each stage (those between two first computations) put in ascending id
    order, each once: a member of the family when the first computations follow the reference order and no node
    then runs more often than the family allows (check with `family_form`).

    A recomputation moved earlier within its stage is still served (its inputs are earlier nodes, recomputed in the
    same stage in ascending order or resident), but it may stay resident longer, so the peak can change: replay the
    result (the eviction rollouts' schedules, which recompute a value twice before one backward node or out of id
    order, mostly keep their peak: measured on the transformers zoo at 40-60 % of the peak, within the budget)."""
    out: list[int] = []
    pending: set[int] = set()
    first: set[int] = set()
    for v in sequence:
        v = int(v)
        if v in first:
            pending.add(v)
            continue
        out.extend(sorted(pending))
        pending.clear()
        out.append(v)
        first.add(v)
    out.extend(sorted(pending))
    return out
