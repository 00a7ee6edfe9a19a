"""A lower bound on the cost of every schedule, of any order and any recomputation: forced recomputations.

The argument. Take any node x and its first computation. Let v be a strict ancestor of x, not an input of x,
that is computed exactly once and has a reader w that strictly descends from x (or is retained: its reader is
the end of the schedule). v's single computation comes before x's first computation (x needs v's value,
transitively), and x's first computation comes before every computation of w (w needs x's value, transitively),
so v is resident during x's first computation: all such v at once. Memory then is at least

    fixed bytes + bytes(inputs of x, and x) + sum of bytes(v) over such v that are computed once.

So for every node x, the values of the conflict set V(x) (such v, not inputs of x) that are computed only once
must fit in room(x) = budget - fixed - bytes(inputs of x, and x). Choosing which values are computed at least
twice, at least cost, is a covering knapsack over the conflict sets: a small integer program (one binary per
value) whose optimum, added to one computation of every node, bounds the cost of every schedule. A
non-recomputable value of V(x) always counts; if those alone overflow room(x), no schedule fits the budget.

Windows (`windows=True`) add what a value absent at two tight points costs: if an input u of x2 is absent at
the first computation of x1, an ancestor of x2, u is rebuilt between the two, and so are its inputs unless they
were resident at x1; such a value that is also absent at x2's first computation and read after it runs three
times. This lifts the bound where large values must be rebuilt between tight points (segnet and unet at their
smallest budgets). See `_window_program`.

Closures (`closures=True`) add what an absent value needs when it is computed again after x: its inputs, resident
at x or computed again too (solvers.bounds.row_program). This lifts the bound most on traced transformers, whose
backward reads the softmax's output but not the scores before it: dropping the output costs the scores too.

Unlike the MILP's and CP-SAT's bounds, which hold for their schedule families only, this bound holds for all
schedules. It is weak where memory is spread thin (many small values), and tight where one large value must
be recomputed (segnet at half its reference peak: its first convolution, 40 % of the cost, has to run twice).
`conflict_rows` also hands these rows to the stage MILP as cuts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.simulate import reference_peak_bytes
from solvers.base import bisect_smallest, check_budget_floor
from solvers.bounds.row_program import ConflictRow, RowProgram, undominated
from solvers.highs import HighsWithStart  # PuLP's HiGHS, with highspy's start-up banner kept off stdout
from solvers.pulp_import import pulp


@dataclass(frozen=True)
class ForcedBound:
    lower_bound_cost: float  # every schedule within the budget costs at least this (total cost)
    recomputed: tuple[int, ...]  # a cheapest set of values that must run twice (the windows may add more)
    proven: bool  # the covering program was solved to optimality (else its dual bound is used)
    rows: int  # conflict rows that bind (their members do not all fit)


def bits(mask: int):
    """The positions of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@lru_cache(maxsize=4)
def ancestor_masks(graph: Graph) -> tuple[list[int], list[int]]:
    """Strict ancestors and strict descendants of every node, as bit masks (cached: a Graph is immutable, and
    memory_floor_bytes's bisection, the window program and the subgraph relaxation ask again for the same
    graph)."""
    n = graph.n
    anc = [0] * n
    for v in range(n):
        m = 0
        for i in graph.inputs[v]:
            m |= anc[i] | (1 << i)
        anc[v] = m
    desc = [0] * n
    for v in range(n - 1, -1, -1):
        m = 0
        for w in graph.users[v]:
            m |= desc[w] | (1 << w)
        desc[v] = m
    return anc, desc


def conflict_rows(graph: Graph, budget_bytes: int, deadline: float | None = None) -> list[ConflictRow]:
    """The binding rows of the covering program (see the module docstring).

    Raises InfeasibleBudgetError when some node's inputs, output and non-recomputable conflict values alone
    exceed the budget: no schedule of any kind fits then; NoSolutionInTimeError once time.perf_counter()
    passes `deadline` (the scan is quadratic in the number of nodes: ~1 s for 1000).
    """
    n = graph.n
    sizes = [int(b) for b in graph.sizes]
    budget = int(budget_bytes) - int(graph.fixed_bytes)
    anc, desc = ancestor_masks(graph)
    users_mask = [0] * n
    for v in range(n):
        for w in graph.users[v]:
            users_mask[v] |= 1 << w
    retained = [nd.retain for nd in graph.nodes]
    recomputable = [nd.recomputable for nd in graph.nodes]
    rows: list[ConflictRow] = []
    for x in range(n):
        if deadline is not None and time.perf_counter() > deadline:
            raise NoSolutionInTimeError(f"forced_bound: conflict sets not built in time ({x} of {n} nodes)")
        local = set(graph.inputs[x]) | {x}
        room = budget - sum(sizes[i] for i in local)
        members: list[int] = []
        pinned: list[int] = []
        for v in bits(anc[x]):
            if v in local or sizes[v] == 0:
                continue
            if retained[v] or users_mask[v] & desc[x]:
                (members if recomputable[v] else pinned).append(v)
        fixed = sum(sizes[v] for v in pinned)
        room -= fixed
        if room < 0:
            need = int(budget_bytes) - room
            raise InfeasibleBudgetError(
                budget_bytes, None, "forced_bound",
                f"node {graph.describe(x)} needs its inputs and output resident together with {fixed} bytes of "
                f"non-recomputable values that later nodes read: at least {need} bytes, in any schedule")
        if sum(sizes[v] for v in members) > room:
            rows.append(ConflictRow(x, tuple(members), room, tuple(pinned)))
    return rows


MAX_WINDOW_VARIABLES = 20000  # window rows beyond this many variables are left out (the bound stays valid)


def _solve_program(prob, time_limit_s: float | None) -> tuple[bool, float | None]:
    """(proven optimal, its objective or else HiGHS's dual bound) of a PuLP minimisation; the value is None if
    HiGHS knows nothing within the limit."""
    import highspy


    prob.solve(HighsWithStart(start=None, msg=False, timeLimit=time_limit_s, gapRel=0.0))
    h = prob.solverModel
    if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
        return True, float(pulp.value(prob.objective) or 0.0)
    dual = h.getInfo().mip_dual_bound
    if dual is None or not (dual == dual) or dual in (float("inf"), float("-inf")):
        return False, None
    return False, max(0.0, float(dual))


def _window_program(graph: Graph, rows: list[ConflictRow]) -> pulp.LpProblem | None:
    """The covering program with windows: it also counts values that must be computed three times.

    Per row x, r[v, x] says v is resident at x's first computation (T_x); e[v] counts v's extra computations.
    Rows: memory at each T_x; e[v] >= 1 - r[v, x]. Windows, for a row x1 and a row x2 that descends from x1 (so
    T_x1 < T_x2): an input u of x2 in V(x1) that is absent at T_x1 is computed between T_x1 and T_x2 (w[u] = 1),
    and so is each input z of such a value unless z is resident at T_x1 (w[z] >= w[u] - r[z, x1], up the
    ancestors). A value computed in that window, absent at T_x2 and read after x2, is computed three times:
    before T_x1, in the window, after T_x2 (e[z] >= w[z] + 1 - r[z, x2]). None when no window applies.
    """
    recomputable = [nd.recomputable for nd in graph.nodes]
    by_node = {row.node: row for row in rows}
    program = RowProgram(graph, "forced_recomputation_windows")
    for row in rows:
        program.add_row(row, closure=False)
    prob = program.prob
    windows = 0
    _, desc = ancestor_masks(graph)
    row_nodes = sorted(by_node)
    for row1 in rows:
        x1 = row1.node
        local1 = set(graph.inputs[x1]) | {x1}
        members1 = set(row1.members)
        for x2 in (x for x in row_nodes if desc[x1] >> x & 1):  # every tight node after x1, nearest first
            row2 = by_node[x2]
            members2 = set(row2.members)
            starts = [u for u in dict.fromkeys(graph.inputs[x2]) if u in members1]
            if not starts:
                continue
            # the closure: values whose window computation the starts may need, up to values resident at T_x1
            closure, stack, ok = set(starts), list(starts), True
            while stack and ok:
                u = stack.pop()
                for z in graph.inputs[u]:
                    if z in local1 or z in closure:
                        continue
                    if not recomputable[z]:
                        ok = False  # left out: such a value cannot be recomputed in the window
                        break
                    closure.add(z)
                    stack.append(z)
            if not ok or windows + len(closure) > MAX_WINDOW_VARIABLES:
                continue
            w = {z: prob.add_variable(f"w_{z}_{x1}_{x2}", 0, 1, pulp.LpBinary) for z in closure}
            windows += len(closure)
            for u in starts:
                prob += w[u] + program.resident(u, x1) >= 1
            for u in closure:
                for z in graph.inputs[u]:
                    if z in closure:
                        prob += w[z] + program.resident(z, x1) >= w[u]
            for z in closure:
                if z in members2:
                    prob += program.extra(z, x2) >= w[z] + 1 - program.resident(z, x2)
                else:
                    prob += program.extra(z, x2) >= w[z]
    if not windows:
        return None
    return program.finish()


def closure_program(graph: Graph, rows: list[ConflictRow]) -> pulp.LpProblem:
    """The covering program with every row's recomputation closure (solvers.bounds.row_program), on the rows no
    other row implies."""
    program = RowProgram(graph, "forced_recomputation_closures")
    for row in undominated(rows):
        program.add_row(row)
    return program.finish()


def forced_recompute_bound(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = 10.0,
                           windows: bool = True, closures: bool = True) -> ForcedBound:
    """The covering program's bound (see the module docstring); total cost, valid for every schedule.

    Raises InfeasibleBudgetError when even the rows' fixed parts overflow (no schedule fits), and
    NoSolutionInTimeError if the program is not solved at all within the limit.
    """
    t0 = time.perf_counter()
    check_budget_floor(graph, budget_bytes, "forced_bound")
    rows = conflict_rows(graph, budget_bytes, None if time_limit_s is None else t0 + time_limit_s)
    base = float(graph.total_cost)
    if not rows:
        return ForcedBound(base, (), True, 0)
    costs = graph.costs
    sizes = graph.sizes
    prob = pulp.LpProblem("forced_recomputation", pulp.LpMinimize)
    y = {}
    for row in rows:
        for v in row.members:
            if v not in y:
                y[v] = prob.add_variable(f"y_{v}", 0, 1, pulp.LpBinary)
    prob += pulp.lpSum(float(costs[v]) * y[v] for v in y)
    for k, row in enumerate(rows):
        if k % 32 == 0 and time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            # building the program is itself quadratic in large graphs' rows
            raise NoSolutionInTimeError(f"forced_bound: covering program not built within {time_limit_s} s "
                                        f"({k} of {len(rows)} rows)")
        total = sum(int(sizes[v]) for v in row.members)
        # sum over members of size (1 - y) <= room  <=>  sum size * y >= total - room
        prob += pulp.lpSum(int(sizes[v]) * y[v] for v in row.members) >= total - row.room_bytes

    def left() -> float | None:
        return None if time_limit_s is None else max(0.5, time_limit_s - (time.perf_counter() - t0))

    proven, value = _solve_program(prob, left())
    if value is None:
        raise NoSolutionInTimeError(f"forced_bound: covering program not solved within {time_limit_s} s")
    chosen = tuple(sorted(v for v, var in y.items() if (var.varValue or 0.0) > 0.5)) if proven else ()
    bound = float(sum(costs[v] for v in chosen)) if proven else value
    larger = []
    if windows:
        larger.append(lambda: _window_program(graph, rows))
    if closures:
        # a program apart from the windows': one program with both costs seconds more on the Checkmate graphs and
        # lifts no bound there
        larger.append(lambda: closure_program(graph, rows))
    for build in larger:
        if time_limit_s is not None and time.perf_counter() - t0 >= 0.5 * time_limit_s:
            break
        wprob = build()
        if wprob is not None:
            wproven, wvalue = _solve_program(wprob, left())
            if wprob.status == pulp.LpStatusInfeasible:
                raise InfeasibleBudgetError(
                    budget_bytes, None, "forced_bound",
                    "some value read later cannot be resident at a tight node, nor be computed again there (an "
                    "input it needs cannot be recomputed and does not fit): no schedule of any kind fits")
            if wvalue is not None and wvalue > bound:
                # the larger program's optimum (or its dual bound) is a bound for every schedule too, whatever
                # set of values the plain program chose
                bound, proven = wvalue, wproven and proven
    return ForcedBound(base + bound, chosen, proven, len(rows))


def memory_floor_bytes(graph: Graph, deadline: float | None = None) -> int:
    """The smallest budget at which the conflict rows' fixed parts fit: a floor for every schedule.

    It is the single-operation bound, raised where non-recomputable values (dropout masks, say) that later
    nodes read must stay resident beside some node's inputs and output. Bisection: feasibility of the rows only
    grows with the budget. Once `deadline` (time.perf_counter()) passes, the bisection stops and the floor proven
    so far is returned (still a floor for every schedule, possibly below the exact one)."""

    lo = graph.single_op_bound_bytes()
    if all(nd.recomputable for nd in graph.nodes):
        return lo
    hi = max(lo, reference_peak_bytes(graph))

    def fits(b: int) -> bool | None:
        try:
            conflict_rows(graph, b, deadline)
            return True
        except InfeasibleBudgetError:
            return False
        except NoSolutionInTimeError:
            return None

    if fits(lo) is not False:
        return lo
    failing, _ = bisect_smallest(lo, hi, fits, deadline)  # fits(hi): the reference order meets it
    return failing + 1  # every budget up to `failing` is proven too small
