"""Exhaustive search: the exact minimum cost over every schedule, for tiny graphs (test oracle).

No schedule family is assumed: any order, any recomputation, frees anywhere. The rules are the
simulator's (graphs/simulate.py): computing v needs every input of v resident and v itself not
resident; memory while computing v is fixed bytes + resident bytes + v's output; every sink is
computed at least once; every retained value is resident at the end; a non-recomputable node is
computed at most once.

The search is Dijkstra over states (resident set, which tracked nodes have been computed), where
only sinks and non-recomputable nodes are tracked: nothing else about the past changes what can
still be done. Computing v costs v's cost; freeing costs nothing. Every other solver's optimum must
be >= this one, and equal when its schedule family contains an optimal schedule.
"""
from __future__ import annotations

import heapq
import itertools

from graphs.ir import Graph
from graphs.schedule import Op, OpKind, Schedule

DEFAULT_MAX_STATES = 2_000_000


class SearchTooLargeError(RuntimeError):
    """The search visited more states than allowed (the graph or the budget is too large for it)."""


def optimal_cost(graph: Graph, budget_bytes: int, *, max_states: int = DEFAULT_MAX_STATES,
                 program_order: bool = False) -> tuple[float, Schedule] | None:
    """(minimum cost, a schedule reaching it) over all schedules within `budget_bytes`, or None.

    None means that no schedule at all fits the budget. Raises SearchTooLargeError once more than
    `max_states` states have been settled. With `program_order`, only schedules whose first computations come in
    ascending id order count (solvers.bounds.order_bound's family): the state then tracks how many nodes have
    been computed, and a node may be computed only once every node before it has been.
    """
    n = graph.n
    budget = int(budget_bytes)
    fixed = int(graph.fixed_bytes)
    if fixed > budget:
        return None
    sizes = [int(s) for s in graph.sizes]
    costs = [float(c) for c in graph.costs]
    in_mask = [sum(1 << i for i in ins) for ins in graph.inputs]
    sink_mask = sum(1 << s for s in graph.sinks)
    retained_mask = sum(1 << r for r in graph.retained)
    once_mask = sum(1 << nd.id for nd in graph.nodes if not nd.recomputable)
    tracked = sink_mask | once_mask
    if program_order:
        tracked = (1 << n) - 1  # the computed set is then always a prefix of the ids

    def mem(resident: int) -> int:
        return sum(sizes[i] for i in range(n) if resident >> i & 1)

    start = (0, 0)
    dist: dict[tuple[int, int], float] = {start: 0.0}
    parent: dict[tuple[int, int], tuple[tuple[int, int], Op] | None] = {start: None}
    done: set[tuple[int, int]] = set()
    tie = itertools.count()  # keeps heap entries comparable without comparing states
    heap = [(0.0, next(tie), start)]
    while heap:
        d, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        if len(done) > max_states:
            raise SearchTooLargeError(f"more than {max_states} states on {graph.name} at budget {budget}")
        resident, computed = state
        if computed & sink_mask == sink_mask and resident & retained_mask == retained_mask:
            return d, _unwind(parent, state)
        used = fixed + mem(resident)
        moves = []
        for v in range(n):
            bit = 1 << v
            if resident & bit:
                moves.append(((resident & ~bit, computed), 0.0, Op(OpKind.FREE, v)))
                continue
            if in_mask[v] & ~resident or used + sizes[v] > budget or (once_mask & bit and computed & bit):
                continue
            if program_order and not computed & bit and computed != bit - 1:
                continue  # a first computation before an earlier node's
            moves.append(((resident | bit, computed | (bit & tracked)), costs[v], Op(OpKind.COMPUTE, v)))
        for nxt, c, op in moves:
            nd = d + c
            if nxt not in done and nd < dist.get(nxt, float("inf")):
                dist[nxt] = nd
                parent[nxt] = (state, op)
                heapq.heappush(heap, (nd, next(tie), nxt))
    return None


def _unwind(parent, state) -> Schedule:
    ops = []
    while parent[state] is not None:
        state, op = parent[state]
        ops.append(op)
    return Schedule(tuple(reversed(ops)))


def min_feasible_budget(graph: Graph, *, max_states: int = DEFAULT_MAX_STATES) -> int:
    """The smallest budget (bytes) at which some schedule exists, by bisection on `optimal_cost`.

    The peak of the no-recomputation schedule (ascending ids) is always feasible, and no budget
    below the single-operation bound is.
    """
    from graphs.simulate import reference_peak_bytes

    lo, hi = graph.single_op_bound_bytes(), reference_peak_bytes(graph)
    if optimal_cost(graph, lo, max_states=max_states) is not None:
        return lo
    while hi - lo > 1:  # invariant: lo infeasible, hi feasible
        mid = (lo + hi) // 2
        if optimal_cost(graph, mid, max_states=max_states) is None:
            lo = mid
        else:
            hi = mid
    return hi
