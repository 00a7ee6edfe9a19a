"""Greedy eviction in the style of Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021).

The nodes run in the reference order. Before a node runs, its evicted inputs are recomputed on
demand (with their evicted ancestors, oldest first). Whenever the next output would push memory
over the budget, the resident value with the smallest score is evicted, where for DTR

    score(u) = recompute_cost(u) / (bytes(u) x staleness(u)),

recompute_cost(u) is the cost of u plus the cost of every non-resident ancestor that recomputing
u would need (DTR's h_DTR with the evicted neighbourhood taken exactly over ancestors; `dtr_local`
uses u's own cost only, DTR's h_DTR-local), and
staleness is the number of computations since u was last computed or read. Values are freed at
their last use in the reference order.

With `zombies` (the default), a value past its last use that an evicted value still needs stays
resident as an eviction candidate, as DTR frees a tensor for good only when nothing evicted
depends on it; without it, such chains of dead ancestors make recomputation cascade.

Never evicted: a value the current computation (or the recomputation in progress) reads, a
retained value, a non-recomputable value, or a value that could not be recomputed at its next
use because it needs a non-recomputable value that is gone by then.

`Rollout` is the shared engine; `solvers.heuristics.evict` drives it with an offline (Belady-style) score.
"""
from __future__ import annotations

import bisect
import math
import time
from typing import Callable

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import reference_peak_bytes
from solvers.base import Proposal, bisect_smallest
from solvers.deadline import deadline_after, passed

INF = math.inf


class Rollout:
    """Executes a graph in the reference order under a budget, evicting by a score.

    A score function gets (engine, u, step, recompute_cost) and returns a number; the resident
    value with the smallest score is evicted. `run` returns the compute sequence, or None when
    at some point nothing can be evicted and the next value does not fit.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        n = graph.n
        self.n = n
        self.inputs = graph.inputs
        self.users = graph.users
        self.cost = [float(c) for c in graph.costs]
        self.size = [int(b) for b in graph.sizes]
        self.retained = [nd.retain for nd in graph.nodes]
        self.recomputable = [nd.recomputable for nd in graph.nodes]
        # last reference step that reads each value (-1: none)
        self.last_use = [u[-1] if u else -1 for u in self.users]
        # deadline[u]: the last reference step at which u can still be recomputed (a
        # non-recomputable value among its ancestors is freed after its own last use).
        dl = [INF] * n
        for v in range(n):
            d = INF
            for i in self.inputs[v]:
                d = min(d, self.last_use[i] if not self.recomputable[i] else dl[i])
            dl[v] = d if self.recomputable[v] else -INF
        self.deadline = dl
        self.stuck: dict | None = None  # why the last run gave up (None: it did not)

    # ---- helpers available to score functions ------------------------------------------------
    def next_use(self, u: int, step: int) -> int:
        """First reference step after `step` that reads u (the graph's n if none)."""
        us = self.users[u]
        k = bisect.bisect_right(us, step)
        return us[k] if k < len(us) else self.n

    @property
    def cut_by_deadline(self) -> bool:
        """Whether the last `run` gave up because its deadline passed (not because it got stuck)."""
        return (self.stuck or {}).get("reason") == "deadline"

    # ---- the rollout -------------------------------------------------------------------------
    def run(self, budget_bytes: int, den: Callable, bias: list[float] | None = None, *,
            lookahead: bool = False, zombies: bool = True, max_computes: int | None = None,
            deadline_s: float | None = None, neighbourhood: bool = True) -> list[int] | None:
        """The compute sequence of the greedy under `budget_bytes`, or None if it gets stuck.

        den(engine, u, step, next_use, clock) -> float: the evicted value minimises
        recompute_cost(u) / den(...), optionally times bias[u] (used by the improvement search).
        lookahead: recompute_cost counts the ancestors that will be missing at u's next use (freed
        at their last use before it), not only those missing now (offline knowledge).
        zombies: a value past its last use that an evicted value with later uses reads stays
        resident as an eviction candidate instead of being freed (DTR frees a tensor for good
        only when no evicted tensor depends on it).
        max_computes: give up (None) after this many computations (default 20 n + 100): a
        rollout that recomputes that much is of no use, and it could take very long.
        deadline_s: give up (None) once time.perf_counter() passes it (checked before every computation).
        neighbourhood: recompute_cost counts the missing ancestors (h_DTR); False counts u's own cost only
        (DTR's h_DTR-local).
        """
        n, inputs, size, cost = self.n, self.inputs, self.size, self.cost
        budget = int(budget_bytes) - int(self.graph.fixed_bytes)
        resident = [False] * n
        pins = [0] * n
        self.last_access = last_access = [0] * n
        res_set: set[int] = set()
        seq: list[int] = []
        evictable = [self.recomputable[u] and not self.retained[u] for u in range(n)]
        deadline, last_use, users = self.deadline, self.last_use, self.users
        state = {"mem": 0, "clock": 0}
        self.stuck = None
        max_seq = 20 * n + 100 if max_computes is None else int(max_computes)

        def rcost(u: int, cap: float, t: int, when: int) -> float:
            # cost of u plus every ancestor its recomputation at step `when` needs that is missing
            # (each once); stops early once the total reaches cap (u then cannot be the minimum)
            total = cost[u]
            if not neighbourhood:
                return total
            seen = {u}
            if lookahead:
                def missing(j: int) -> bool:
                    if resident[j]:
                        return last_use[j] < when
                    return not (self.next_use(j, t) <= when <= last_use[j])
            else:
                def missing(j: int) -> bool:
                    return not resident[j]
            stack = [i for i in inputs[u] if missing(i)]
            while stack and total < cap:
                i = stack.pop()
                if i in seen:
                    continue
                seen.add(i)
                total += cost[i]
                for j in inputs[i]:
                    if j not in seen and missing(j):
                        stack.append(j)
            return total

        def make_room(t: int, x: int) -> bool:
            sx = size[x]
            while state["mem"] + sx > budget:
                best, best_s = -1, INF
                for u in res_set:
                    if pins[u] or not evictable[u]:
                        continue
                    nu = self.next_use(u, t)
                    if nu > deadline[u]:
                        continue
                    d = den(self, u, t, nu, state["clock"])
                    if bias is not None:
                        d /= bias[u]
                    s = rcost(u, best_s * d, t, nu) / d
                    if s < best_s or best < 0:
                        best, best_s = u, s
                if best < 0:
                    self.stuck = dict(step=t, node=x, mem=state["mem"], need=sx, resident=len(res_set))
                    return False
                resident[best] = False
                res_set.discard(best)
                zombie.discard(best)
                state["mem"] -= size[best]
            return True

        def compute(t: int, x: int, touched: list[int]) -> bool:
            # make x's inputs resident (recomputing the missing ones depth first), then compute x
            if x != t and (not self.recomputable[x] or deadline[x] < t):
                self.stuck = dict(step=t, node=x, reason="not recomputable")
                return False
            held = []
            ok = True
            for i in inputs[x]:
                if resident[i]:
                    pins[i] += 1
                    held.append(i)
            for i in inputs[x]:
                if not resident[i]:
                    if not compute(t, i, touched):
                        ok = False
                        break
                    pins[i] += 1
                    held.append(i)
            if ok and len(seq) >= max_seq:
                self.stuck = dict(step=t, node=x, reason=f"over {max_seq} computations")
                ok = False
            if ok and deadline_s is not None and time.perf_counter() > deadline_s:
                self.stuck = dict(step=t, node=x, reason="deadline")
                ok = False
            if ok and make_room(t, x):
                state["clock"] += 1
                resident[x] = True
                res_set.add(x)
                state["mem"] += size[x]
                seq.append(x)
                touched.append(x)
                last_access[x] = state["clock"]
                for i in inputs[x]:
                    last_access[i] = state["clock"]
            else:
                ok = False
            for i in held:
                pins[i] -= 1
            return ok

        import sys
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * n + 1000))
        zombie: set[int] = set()
        try:
            for t in range(n):
                if deadline_s is not None and time.perf_counter() > deadline_s:
                    self.stuck = dict(step=t, reason="deadline")
                    return None
                touched: list[int] = []
                if not compute(t, t, touched):
                    return None
                # free what no later reference step reads (recomputed helpers included)
                dead = {i for x in touched for i in (*inputs[x], x)
                        if resident[i] and last_use[i] <= t and not self.retained[i]}
                if zombies:
                    dead |= zombie
                    zombie = {i for i in dead if any(not resident[w] and last_use[w] > t for w in users[i])}
                    dead -= zombie
                for i in dead:
                    resident[i] = False
                    res_set.discard(i)
                    state["mem"] -= size[i]
        finally:
            sys.setrecursionlimit(limit)
        return seq


def dtr_den(eng: Rollout, u: int, step: int, next_use: int, clock: int) -> float:
    """h_DTR's denominator: bytes x staleness (computations since u was last computed or read)."""
    return max(eng.size[u], 1) * (clock - eng.last_access[u] + 1)


def smallest_budget(graph: Graph, feasible: Callable[[int], bool | None], failed_at: int,
                    deadline: float | None = None) -> tuple[int, bool]:
    """Bisection for the smallest budget above `failed_at` where `feasible` holds: (that budget, complete).

    The search runs between max(failed_at, single-op bound - 1) (taken as failing) and the
    reference peak, where every rollout succeeds (it never evicts there). The greedy is not
    monotone in the budget, so the result is a budget that works, not a proven minimum. Once
    `deadline` passes (or `feasible` answers None), the least budget found to work so far is
    returned with complete=False.
    """
    lo = max(int(failed_at), graph.single_op_bound_bytes() - 1)
    _, hi = bisect_smallest(lo, max(reference_peak_bytes(graph), lo + 1), feasible, deadline)
    return hi, not passed(deadline)


def infeasible(graph: Graph, budget_bytes: int, name: str, feasible: Callable[[int], bool | None],
               what: str, deadline: float | None = None) -> InfeasibleBudgetError:
    """The error for a budget the heuristic's own deterministic part cannot meet (a fact about its schedule, not a
    proof for all schedules), naming the smallest budget it meets (bisection, cut at `deadline`)."""
    floor = graph.single_op_bound_bytes()
    low, complete = smallest_budget(graph, feasible, max(int(budget_bytes), floor - 1), deadline)
    if low == floor:
        reason = "single-operation bound: some node needs its inputs and output resident together; it meets that"
    elif complete:
        reason = (f"the smallest budget above the requested one at which {what}, found by bisection "
                  f"(not a proof: the single-operation bound is {floor} bytes)")
    else:
        reason = (f"a budget at which {what}; the bisection for the smallest was cut at the time limit "
                  f"(the single-operation bound is {floor} bytes)")
    return InfeasibleBudgetError(budget_bytes, low, name, f"{name}'s schedule does not fit; {reason}")


def rollout_or_none(eng: Rollout, budget_bytes: int, den: Callable, deadline: float | None, **run_options
                    ) -> bool | None:
    """Whether a rollout fits `budget_bytes`: True, False, or None when `deadline` cut it short."""
    seq = eng.run(budget_bytes, den, deadline_s=deadline, **run_options)
    if seq is not None:
        return True
    return None if eng.cut_by_deadline else False


def greedy_sequence(graph: Graph, budget_bytes: int, den: Callable, name: str, deadline: float | None = None,
                    **run_options) -> list[int]:
    """Run the rollout; raise InfeasibleBudgetError naming the smallest budget it meets, or NoSolutionInTimeError
    when `deadline` passes first."""
    eng = Rollout(graph)
    seq = None
    if budget_bytes >= graph.single_op_bound_bytes():
        seq = eng.run(budget_bytes, den, deadline_s=deadline, **run_options)
        if seq is None and eng.cut_by_deadline:
            raise NoSolutionInTimeError(f"{name}: its rollout did not finish within the time limit",
                                        budget_bytes=budget_bytes, solver=name)
    if seq is None:
        # a rollout that succeeds under a smaller computation cap succeeds the same way without it
        small = dict(run_options, max_computes=4 * graph.n + 100)
        raise infeasible(graph, budget_bytes, name, lambda b: rollout_or_none(eng, b, den, deadline, **small),
                         "its greedy eviction does not get stuck", deadline)
    return seq


def dtr(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
        zombies: bool = True, neighbourhood: bool = True) -> Proposal:
    """DTR-style greedy eviction (see the module docstring); status HEURISTIC.

    zombies=False frees every value at its last use even when an evicted value still needs it
    (eager freeing); recomputation then cascades through dead ancestors on wide fan-in graphs.
    neighbourhood=False scores by u's own cost only (`dtr_local`).
    """
    name = "dtr" if neighbourhood else "dtr_local"
    seq = greedy_sequence(graph, budget_bytes, dtr_den, name, deadline_after(time_limit_s), zombies=zombies,
                          neighbourhood=neighbourhood)
    sched = Schedule.from_sequence(graph, seq)
    return Proposal(sched, Status.HEURISTIC, info={"recomputations": len(seq) - graph.n, "zombies": zombies,
                                                   "neighbourhood": neighbourhood})


def dtr_local(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
              zombies: bool = True) -> Proposal:
    """DTR with h_DTR-local: score(u) = cost(u) / (bytes(u) x staleness(u)), u's own cost only.

    The simplest reading of DTR's score. It is cheaper to evaluate, and it gives the figures quoted for a
    DTR-style heuristic on the Checkmate graphs (resnet50 0.11 % / 0.31 % at 0.9 / 0.8, segnet 42 % at 0.5); on
    wide fan-in graphs (rl100, rl250 at 0.9) it evicts values whose recomputation needs many evicted ancestors
    and gets stuck.
    """
    return dtr(graph, budget_bytes, time_limit_s=time_limit_s, zombies=zombies, neighbourhood=False)
