"""A lower bound for every schedule that computes the nodes for the first time in the program's order.

The family (FAMILY): the first computation of each node comes in ascending id order, the order of the traced
program; recomputations and frees may go anywhere. The executor runs the program in that order, the Checkmate
MILP's stages advance along it, and every solver here returns such schedules (`in_program_order` checks one).

The argument is forced_bound's, with the order known: at the first computation of x (time T) every node before x
has been computed and none after it, so a value v < x that is computed once and read by a node after x (or
retained) is resident at T, whether or not that reader descends from x. In a transformer's backward, the weight
gradients and the other branches are not descendants of the node at hand but still run after it; this is what
the bound for every schedule cannot count. The rows and their recomputation closures then form the program of
solvers.bounds.row_program. The order also splits each value's life into intervals between its readers' first
computations (`life_intervals`): a value absent at a row's time is computed again before its next reader's first
computation, so within the interval that time falls in, and a value absent in two intervals is computed twice
more. The program pays per interval, a tighter bound than one extra computation per value in all (on traced
transformers, many values are absent at rows of several intervals). Within one interval, a value can still be
computed twice more: absent at a row x1, computed again for the recomputation of an absent member that a reader
before row x2 needs, and absent again at x2 (RowProgram.add_second_computations; the MLP's first matmul of a ViT,
read by the GELU recomputed for its backward and by the GELU's backward).

Graphs of many hundreds of nodes have hundreds of rows, each with a closure over most of the forward pass, too
large to solve at once. The program is solved on a few rows, the most overfull first; the rows its solution
violates (checked by a greedy assignment, which proves a row satisfied when it succeeds, with the values it would
have to keep for want of a second computation kept) are added, and again
until none is violated or the time is up: first its linear relaxation (rounded to check the rows), then the
integer program. Each round's optimum, or its dual bound when the time runs out, is a bound: its rows are a
subset of all of them, and a relaxation only lowers an optimum.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from graphs.ir import Graph
from graphs.schedule import OpKind, Schedule
from solvers.bounds.forced_bound import _solve_program
from solvers.bounds.row_program import ConflictRow, RowProgram, undominated
from solvers.pulp_import import pulp

FAMILY = ("program-order schedules: every node computed for the first time in the program's order (ascending ids), "
          "recomputations and frees anywhere (the Checkmate MILP's family, and every solver's here)")
FIRST_ROWS = 8  # rows of the first round
ROWS_PER_ROUND = 8  # violated rows added per round, the most violated first


@dataclass(frozen=True)
class OrderBound:
    lower_bound_cost: float  # every program-order schedule within the budget costs at least this (total cost)
    proven: bool  # the program over every row was solved to optimality
    rows: int  # rows kept (binding, and not left out as implied by another)
    rows_used: int  # rows in the last program solved
    fits: bool = True  # False: no program-order schedule fits the budget (pinned values alone overflow a row)
    # the values the last program solved to optimality computes more than once (its rows only; rounded where it
    # was the linear relaxation): a hint of what a schedule near the bound recomputes, not a schedule
    recomputed: tuple[int, ...] = ()


def in_program_order(schedule: Schedule) -> bool:
    """Whether the schedule's first computations come in ascending id order (the family of FAMILY)."""
    seen: set[int] = set()
    last = -1
    for op in schedule.ops:
        if op.kind is OpKind.COMPUTE and op.node not in seen:
            if op.node < last:
                return False
            seen.add(op.node)
            last = op.node
    return True


def order_rows(graph: Graph, budget_bytes: int, deadline: float | None = None) -> list[ConflictRow] | None:
    """The binding rows in program order, or None when no program-order schedule fits (some row's inputs, output
    and pinned values overflow the budget). Stops at `deadline` with the rows found so far (a subset is valid)."""
    n = graph.n
    sizes = graph.sizes.astype(np.int64)
    budget = int(budget_bytes) - int(graph.fixed_bytes)
    last = np.array([max(u) if u else -1 for u in graph.users], dtype=np.int64)
    retained = np.array([nd.retain for nd in graph.nodes], dtype=bool)
    recomputable = np.array([nd.recomputable for nd in graph.nodes], dtype=bool)
    ids = np.arange(n)
    rows = []
    for x in range(n):
        if deadline is not None and x % 64 == 0 and time.perf_counter() > deadline:
            break
        local = list({x, *graph.inputs[x]})
        live = (ids < x) & ((last > x) | retained) & (sizes > 0)
        live[local] = False
        room = budget - int(sizes[local].sum())
        pinned = np.nonzero(live & ~recomputable)[0]
        room -= int(sizes[pinned].sum())
        if room < 0:
            return None
        members = np.nonzero(live & recomputable)[0]
        if int(sizes[members].sum()) > room:
            rows.append(ConflictRow(x, tuple(int(v) for v in members), room, tuple(int(v) for v in pinned)))
    return rows


def undominated_in_order(rows: list[ConflictRow], graph: Graph, deadline: float | None = None) -> list[ConflictRow]:
    """row_program.undominated, where a row implies another only if each of the other's members falls in the same
    interval of its life at both (no reader of a member comes between the two rows), so that an absence at one is
    paid by the same variable as at the other. Their closures may still differ (an input resident at one row's
    node only): leaving such a row out keeps the bound valid, and may lower it. Past `deadline`, the rows not yet
    examined are kept."""
    readers = [np.array(sorted({u for v in row.members for u in graph.users[v]}), dtype=np.int64) for row in rows]

    def no_reader_between(i: int, j: int) -> bool:
        lo, hi = sorted((rows[i].node, rows[j].node))
        return np.searchsorted(readers[i], hi, "right") == np.searchsorted(readers[i], lo, "right")

    return undominated(rows, no_reader_between, deadline)


def life_intervals(graph: Graph, users: list[list[int]] | None = None) -> Callable[[int, int], int]:
    """gap_of(v, x) for RowProgram: the number of v's readers that come before x in program order, which numbers
    the interval of v's life between two of its readers' first computations that x's first computation falls in
    (the last one runs to the end). A value absent at x's first computation is computed again before its next
    reader's first computation (or before the end, if it is retained), so within that interval: absences in two
    intervals are two computations."""
    users = [sorted(u) for u in graph.users] if users is None else users  # (each node's readers, ascending)
    return lambda v, x: bisect.bisect_right(users[v], x)


class _AbsentAt:
    """The values a solution of the program computes again after x's first computation (a set, for _excess)."""

    def __init__(self, program: RowProgram, chosen_keys: set, x: int, kept: set[int] = frozenset()):
        self.program, self.chosen, self.x = program, chosen_keys, x
        self.kept = kept  # resident at x all the same (else a second computation, not paid)

    def __contains__(self, v: int) -> bool:
        return v not in self.kept and self.program.key(v, self.x) in self.chosen


def _excess(graph: Graph, row: ConflictRow, again: set[int] | _AbsentAt, free: set[int]) -> int:
    """Bytes by which row overflows when every value in `again` (computed again) is absent where it can be: the
    members in it are absent, and so is each input an absent value needs that is in it too; the other inputs it
    needs are resident. A result <= 0 is a feasible assignment of the row's variables: the row holds."""
    size = graph.sizes
    members = set(row.members)
    used = sum(int(size[v]) for v in row.members if v not in again)
    resident: set[int] = set()
    absent = [v for v in row.members if v in again]
    seen = set(absent)
    while absent:
        u = absent.pop()
        for z in graph.inputs[u]:
            if z in free or size[z] == 0 or z in seen or z in resident:
                continue
            if z in again and graph.nodes[z].recomputable:
                seen.add(z)
                absent.append(z)
            elif z not in members:
                resident.add(z)
                used += int(size[z])
    return used - row.room_bytes


def order_bound(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = 10.0,
                prune_rows: bool = True, second_computations: bool = True) -> OrderBound | None:
    """The bound of the module docstring (total cost), or None if not even the first round is solved in time.

    prune_rows: leave out rows another row implies, up to their closures (`undominated_in_order`): fewer rows,
    faster rounds (traced BERT at 60 %: 4 s gives 15.08 % with them left out, 14.60 % with every row), and a bound
    that may miss what a left-out row's closure adds.
    second_computations: with RowProgram.add_second_computations on each round's rows (a higher bound on traced
    transformers: GPT-2, Llama, ViT)."""
    t0 = time.perf_counter()
    deadline = None if time_limit_s is None else t0 + time_limit_s
    all_rows = order_rows(graph, budget_bytes, deadline)
    base = float(graph.total_cost)
    if all_rows is None:
        return OrderBound(float("inf"), True, 0, 0, fits=False)
    users = [sorted(u) for u in graph.users]
    gap_of = life_intervals(graph, users)
    rows = undominated_in_order(all_rows, graph, deadline) if prune_rows else all_rows
    if not rows:
        return OrderBound(base, True, 0, 0)
    overflow = {row.node: sum(int(graph.sizes[v]) for v in row.members) - row.room_bytes for row in rows}
    active = sorted(rows, key=lambda row: -overflow[row.node])[:FIRST_ROWS]
    outcome = _rounds(graph, rows, active, gap_of, users if second_computations else None, deadline)
    if outcome is None:
        return OrderBound(float("inf"), True, len(rows), len(active), fits=False)
    best, proven, active, recomputed = outcome
    return None if best is None else OrderBound(base + best, proven, len(rows), len(active),
                                                  recomputed=tuple(sorted(recomputed)))


def _rounds(graph: Graph, rows: list[ConflictRow], active: list[ConflictRow], gap_of, users: list[list[int]] | None,
            deadline: float | None) -> tuple[float | None, bool, list[ConflictRow], set[int]] | None:
    """The rounds of the module docstring from `active`: (the best bound, whether the last integer program was
    solved with no row violated, the rows it had, the values the last program solved to optimality computes more
    than once), or None when the rows admit no assignment. users: add second computations
    (RowProgram.add_second_computations)."""

    best: float | None = None
    recomputed: set[int] = set()
    # Rounds of the linear relaxation first (a tenth of the time on 2000-node graphs, within 0.1 % of the
    # graph's cost there), its solution rounded to choose rows; then rounds of the integer program from there.
    for relaxed in (True, False):
        while True:
            program = RowProgram(graph, "program_order_bound", relaxed=relaxed, gap_of=gap_of)
            for row in active:
                program.add_row(row)
            if users is not None:
                program.add_second_computations(users, deadline)
            if best is not None and deadline is not None and time.perf_counter() >= deadline:
                # a later round, built past the deadline: the earlier rounds' bound
                return best, False, active, recomputed
            prob = program.finish()
            # the first round gets at least 0.2 s (without it there is no bound at all), a later one what is left
            left = None if deadline is None else max(0.2 if best is None else 0.0, deadline - time.perf_counter())
            proven, value = _solve_program(prob, left)
            if prob.status == pulp.LpStatusInfeasible:
                # even these rows admit no assignment: no program-order schedule fits (closures included: an
                # absent value whose inputs can be neither resident nor recomputed)
                return None
            if value is not None:
                best = value if best is None else max(best, value)
            if not proven:
                return best, False, active, recomputed
            chosen_keys = {k for k, var in program.e.items() if (var.varValue or 0.0) > 0.5}
            recomputed = {k[0] for k in chosen_keys}
            if deadline is not None and time.perf_counter() > deadline:
                return best, False, active, recomputed
            chosen = {row.node for row in active}
            unpaid = program.unpaid_second_computations(chosen_keys) if users is not None else {}
            violated = []
            for k, row in enumerate(rows):
                if k % 64 == 0 and deadline is not None and time.perf_counter() > deadline:
                    return best, False, active, recomputed
                if row.node not in chosen:
                    kept = program.kept_for_a_second_computation(row, unpaid) if unpaid else frozenset()
                    again = _AbsentAt(program, chosen_keys, row.node, kept)
                    excess = _excess(graph, row, again, program.free_at(row))
                    if excess > 0:
                        violated.append((excess, row))
            if not violated:
                if not relaxed:
                    return best, True, active, recomputed
                break
            violated.sort(key=lambda t: -t[0])
            active = active + [row for _, row in violated[:ROWS_PER_ROUND]]
    raise AssertionError("unreachable: the integer program's rounds end in a return")
