"""The covering program over conflict rows, with what an absent value costs later (its recomputation closure).

A conflict row (`ConflictRow`) is a point in every schedule of some family, the first computation of a node x
(time T), with the values `members` that are certainly resident at T if each is computed only once, and the
room they share there. The plain program lets any member be absent at T at the price of one more computation
of it. That is too cheap where a member's inputs are gone by T: the second computation of an absent member v
happens after T and reads v's inputs, so each input is resident at T (taking room there) or is computed again
after T itself, and so on up v's ancestors. Every such ancestor was computed before T (x descends from it), so
computing it again after T is a second computation; a non-recomputable one must be resident. Attention is the
case in point: the backward reads the softmax's output, not the scores it came from; dropping the output and
rerunning the cheap softmax needs the scores, which are then kept at T (as large as the output) or rebuilt by
the query-key matmul.

Per row x: r[z, x] (z resident at T) for the members and for the closure values met on the way up, a[z, x]
(z computed again after T, continuous: its least value is 0 or 1 once the r are binary; for a member it is
1 - r[v]); rows a[z] + r[z] >= a[u] for an input z of u (r[z] >= a[u] if z cannot be recomputed), e[v] >= 1 - r[v]
for members and e[z] >= a[z] for the rest, e[z] being the extra computations of z (integer), and the memory row:
the sizes of the resident values within the row's room. Inputs of x and x are resident at T anyway (they are in
the room already), as are the row's pinned values (non-recomputable members, counted in the room), and values of
no size cost nothing: the closure stops there, which only loosens the program. Minimise sum cost[z] * e[z]. Any
subset of the rows gives a valid bound; `undominated` drops rows whose members are a subset of another row's with
no less room.

Where the order of first computations is known (`gap_of`, from solvers.bounds.order_bound), e is kept per value and
interval of its life between two readers (e[z, gap], 0 or 1), and `add_second_computations` adds a second one,
e[z, gap, 2], where a recomputation needs z between two rows at which z is absent within one interval.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from graphs.ir import Graph
from solvers.pulp_import import pulp


@dataclass(frozen=True)
class ConflictRow:
    """At node x, the recomputable values `members` that are computed only once must fit in `room_bytes`.

    pinned: the non-recomputable values resident at x in every schedule of the family (already taken from the
    room)."""

    node: int
    members: tuple[int, ...]
    room_bytes: int  # budget - fixed - bytes(inputs and output of x) - bytes(pinned values)
    pinned: tuple[int, ...] = ()


def undominated(rows: list[ConflictRow], may_imply: Callable[[int, int], bool] | None = None,
                deadline: float | None = None) -> list[ConflictRow]:
    """The rows that no other row implies: a row whose members are a subset of another's, with at least its room,
    holds whenever that one does (for the plain program exactly; with closures the dropped row may have added a
    little, and leaving a row out keeps the bound valid). Ties keep the first.

    may_imply(i, j): a further condition for row j to imply row i (indices into `rows`); deadline: past it, the
    rows not yet examined are kept."""
    masks = [sum(1 << v for v in row.members) for row in rows]
    keep = []
    for i, (m, row) in enumerate(zip(masks, rows)):
        if deadline is not None and i % 32 == 0 and time.perf_counter() > deadline:
            return keep + rows[i:]
        dominated = False
        for j, (m2, row2) in enumerate(zip(masks, rows)):
            if j == i or m & ~m2 or row.room_bytes < row2.room_bytes:
                continue
            if may_imply is not None and not may_imply(i, j):
                continue
            if m != m2 or row.room_bytes != row2.room_bytes or j < i:
                dominated = True
                break
        if not dominated:
            keep.append(row)
    return keep


CHAIN_DEPTH = 4  # values on a chain of RowProgram.second_computation_chains, its two ends included


class RowProgram:
    """The program of the module docstring, built row by row (the window rows of forced_bound add to it)."""

    def __init__(self, graph: Graph, name: str, relaxed: bool = False,
                 gap_of: Callable[[int, int], int] | None = None):
        """relaxed: the linear relaxation (every variable continuous), a weaker bound that solves much faster.
        gap_of(v, x): where the order of computations is known (solvers.bounds.order_bound), the interval of v's
        life that x's first computation falls in; a value absent in two intervals is computed in each, so it pays
        once per interval (e[v, gap], 0 or 1) instead of once in all (e[v])."""
        self.graph = graph
        self.gap_of = gap_of
        self.kinds = (pulp.LpContinuous,) * 2 if relaxed else (pulp.LpInteger, pulp.LpBinary)
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.e: dict = {}  # extra computations of a value (key v), or of a value in one interval (key (v, gap))
        self.r: dict[tuple[int, int], object] = {}  # (value, row node) -> resident at the row's time
        self.rows: dict[int, ConflictRow] = {}
        self.size = [int(b) for b in graph.sizes]
        self.recomputable = [nd.recomputable for nd in graph.nodes]
        self._chains = None  # second_computation_chains, once every row is in

    def key(self, v: int, x: int):
        """The key in `e` of v's extra computations that its absence at x's first computation pays for."""
        return v if self.gap_of is None else (v, self.gap_of(v, x))

    def extra(self, v: int, x: int):
        k = self.key(v, x)
        if k not in self.e:
            if self.gap_of is None:
                self.e[k] = self.prob.add_variable(f"e_{v}", 0, 2, self.kinds[0])
            else:
                self.e[k] = self.prob.add_variable(f"e_{v}_{k[1]}", 0, 1, self.kinds[0])
        return self.e[k]

    def resident(self, v: int, x: int):
        if (v, x) not in self.r:
            self.r[v, x] = self.prob.add_variable(f"r_{v}_{x}", 0, 1, self.kinds[1])
        return self.r[v, x]

    def free_at(self, row: ConflictRow) -> set[int]:
        """Values resident at the row's time in every case (its node, that node's inputs, the pinned values): the
        closure does not go through them, nor through values of no size."""
        x = row.node
        return {x, *self.graph.inputs[x], *row.pinned}

    def add_row(self, row: ConflictRow, closure: bool = True) -> None:
        x = row.node
        self.rows[x] = row
        members = set(row.members)
        for v in row.members:
            self.prob += self.extra(v, x) + self.resident(v, x) >= 1
        if not closure:
            return
        free = self.free_at(row)
        a = {}

        def again(z: int):
            if z not in a:
                a[z] = self.prob.add_variable(f"a_{z}_{x}", 0, 1)
                self.prob += self.extra(z, x) >= a[z]
            return a[z]

        def needed(u: int):
            # a member is computed again after T exactly when it is absent there
            return 1 - self.resident(u, x) if u in members else again(u)

        stack, seen = list(row.members), set(row.members)
        while stack:
            u = stack.pop()
            for z in dict.fromkeys(self.graph.inputs[u]):
                if z in free or self.size[z] == 0:
                    continue
                if z not in members:
                    if self.recomputable[z]:
                        self.prob += again(z) + self.resident(z, x) >= needed(u)
                    else:
                        self.prob += self.resident(z, x) >= needed(u)
                if z not in seen and self.recomputable[z]:
                    seen.add(z)
                    stack.append(z)

    def second_computation_chains(self, users: list[list[int]], deadline: float | None = None
                                  ) -> list[tuple[int, int, int, tuple[int, ...], int]]:
        """(x1, z, y, chain, gap) for add_second_computations: chain = (u, ..., z) is a path up the inputs from a
        member u of row x1 whose next reader is y, through values not resident at x1 anyway (recomputable, of some
        size), to a member z of x1 (z included; up to CHAIN_DEPTH values, one path per (u, z)); gap: the interval
        of z's life x1 falls in. If every value on the chain is absent at x1, u is computed again before y, and
        with it each value on the chain, z last: z is computed between x1 and y. Cached; stops at `deadline` with
        the chains found so far (fewer chains only weaken the bound)."""
        assert self.gap_of is not None
        if self._chains is not None:
            return self._chains
        out: list[tuple[int, int, int, tuple[int, ...], int]] = []
        for x1, row1 in self.rows.items():
            if deadline is not None and time.perf_counter() > deadline:
                break
            free1 = self.free_at(row1)
            members1 = set(row1.members)
            for u in row1.members:
                gu = self.gap_of(u, x1)
                if gu >= len(users[u]):
                    continue
                y = users[u][gu]  # u's next reader: u is computed again before it
                parent = {u: None}
                frontier = [u]
                for _ in range(CHAIN_DEPTH - 1):
                    nxt = []
                    for w in frontier:
                        for z in self.graph.inputs[w]:
                            if z in parent or z in free1 or not self.size[z] or not self.recomputable[z]:
                                continue
                            parent[z] = w
                            nxt.append(z)
                            if z in members1:
                                chain, c = [], z
                                while c is not None:
                                    chain.append(c)
                                    c = parent[c]
                                out.append((x1, z, y, tuple(reversed(chain)), self.gap_of(z, x1)))
                    frontier = nxt
        self._chains = out
        return out

    def _applies(self, x1: int, z: int, y: int, g: int, x2: int) -> bool:
        return x2 > x1 and x2 >= y and self.gap_of(z, x2) == g

    def add_second_computations(self, users: list[list[int]], deadline: float | None = None) -> int:
        """Where the order is known (gap_of): a value z absent at row x1 and needed by the recomputation of an
        absent member u of x1 (directly, or through other values absent there: a chain of
        second_computation_chains), which comes before u's next reader y, so before any row x2 >= y; and absent
        again at a row x2 in the same interval of z's life: z is computed twice in that interval, once between x1
        and u's recomputation, once after x2. Adds those rows (a second variable per value and interval, key
        (z, gap, 2) in `e`) until `deadline` (fewer rows only weaken the bound); returns how many."""
        rows_with: dict[int, list[int]] = {}
        for x, row in self.rows.items():
            for v in row.members:
                rows_with.setdefault(v, []).append(x)
        added = 0
        for k, (x1, z, y, chain, g) in enumerate(self.second_computation_chains(users, deadline)):
            if k % 256 == 0 and deadline is not None and time.perf_counter() > deadline:
                break
            for x2 in rows_with.get(z, ()):
                if self._applies(x1, z, y, g, x2):
                    if (z, g, 2) not in self.e:
                        self.e[z, g, 2] = self.prob.add_variable(f"e2_{z}_{g}", 0, 1, self.kinds[0])
                    self.prob += (self.e[z, g, 2] >= 1 - pulp.lpSum(self.resident(w, x1) for w in chain)
                                  - self.resident(z, x2))
                    added += 1
        return added

    def unpaid_second_computations(self, chosen: set) -> dict[int, list[tuple[int, int, int]]]:
        """After solving: per value z, the (x1, y, gap) of the chains whose values the solution leaves all absent
        at x1 while it pays no second computation of z in that interval (`chosen`: the keys of `e` it sets)."""
        def resident(v, x):
            var = self.r.get((v, x))
            return var is not None and (var.varValue or 0.0) > 0.5

        out: dict[int, list[tuple[int, int, int]]] = {}
        for x1, z, y, chain, g in self._chains or ():
            if (z, g, 2) not in chosen and not any(resident(w, x1) for w in chain):
                out.setdefault(z, []).append((x1, y, g))
        return out

    def kept_for_a_second_computation(self, row: ConflictRow, unpaid: dict[int, list[tuple[int, int, int]]]
                                      ) -> set[int]:
        """The members the solved program would have to keep resident at `row` (not one of its rows) or pay a
        second computation for, were the row added (`unpaid`: unpaid_second_computations)."""
        x2 = row.node
        return {z for z in row.members if any(self._applies(x1, z, y, g, x2) for x1, y, g in unpaid.get(z, ()))}

    def finish(self) -> pulp.LpProblem:
        """Adds the memory rows and the objective; returns the problem."""
        by_row: dict[int, list[int]] = {}
        for v, x in self.r:
            by_row.setdefault(x, []).append(v)
        for x, values in by_row.items():
            terms = [(self.r[v, x], self.size[v]) for v in values if self.size[v]]
            if terms:
                self.prob += pulp.lpSum(c * var for var, c in terms) <= self.rows[x].room_bytes
        costs = self.graph.costs
        self.prob += pulp.lpSum(float(costs[k if self.gap_of is None else k[0]]) * var for k, var in self.e.items())
        return self.prob
