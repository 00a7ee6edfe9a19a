"""Optimal dynamic programming for training chains (revolve / Rotor style), exact in bytes.

The graphs: the shape of `graphs.generate.linear_training_graph` with any costs and sizes. For
L forward layers, x_0 .. x_{L-1} are forward nodes 0 .. L-1 (node i reads i-1), x_L is the loss
(node L), and the backward node B_i = node 2L-i (i < L) reads its predecessor (the gradient
delta_{i+1}; delta_L is the loss) and x_i, and writes delta_i.

The family searched (persistent, stack-ordered schedules, as in revolve and Rotor):
- a forward value that serves as a checkpoint (the start of more than one sweep) stays resident
  until its backward node has run;
- sweeps start from the highest resident forward value: a subproblem holds a checkpoint x_s (and,
  once the loss exists, the incoming gradient delta_{t+1}); it either runs B_s directly (t = s),
  or sweeps forward from x_s to some x_j, keeps x_j, solves the right part (j .. t) completely and
  then the left part (s .. j-1) with delta_j. Before the loss exists the sweep may run on to the loss;
- every backward node and the loss run once; frees are at last use;
- a virtual zero-byte checkpoint x_{-1} precedes x_0 (which has no inputs), so x_0 itself may be
  dropped and recomputed from nothing;
- a non-recomputable forward value is computed once (so it is kept as a checkpoint).
Memory is the simulator's: while computing v, fixed bytes + resident values + v's output; retained
gradients stay resident to the end. The DP works on exact byte values (memoised on the distinct
budgets that occur, each clamped to the peak that needs no recomputation), so within this family it
is exact: status OPTIMAL means "optimal among these schedules" (tests/solvers/test_chain_dp.py checks
it against a brute-force search of exactly this family).

Outside the family, with sizes that differ from layer to layer, two kinds of schedule can cost less
(the tests name one chain for each): a checkpoint used for a sweep and then dropped before its
backward node (recomputed later from a lower one), and a sweep for the left part run early, while
a smaller gradient is held. Exhaustive search over every schedule (tests/solvers/exhaustive.py) on
random chains with L <= 4 found a cheaper schedule at 17 of 1084 budgets with random sizes and 26 of
1039 with gradients as large as their activations, and none at 679 budgets with unit sizes (any
costs). No proof covers every chain, so `lower_bound_cost` is given only when nothing is recomputed,
and an InfeasibleBudgetError's minimum is the least peak of the family (another schedule may need less).

Subproblems with the same costs and sizes (a chain of identical blocks) share one memo entry.
"""
from __future__ import annotations

import math
import sys
import time
from bisect import bisect_left, bisect_right

from graphs.errors import GraphError, InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from solvers.base import Proposal

INF = math.inf
FAMILY = ("persistent stack-ordered checkpoint schedules (revolve/Rotor): a checkpoint stays until its backward "
          "node; sweeps start from the highest resident value, right part first; each backward node once; "
          "x_0 may be recomputed from nothing")


def is_training_chain(graph: Graph) -> bool:
    """True when `graph` has the shape of `linear_training_graph(L)` (any costs and sizes), L >= 1."""
    n = graph.n
    if n < 3 or n % 2 == 0:
        return False
    L = (n - 1) // 2
    for i, ins in enumerate(graph.inputs):
        if i == 0:
            want: tuple[int, ...] = ()
        elif i <= L:
            want = (i - 1,)
        else:
            want = tuple(sorted({i - 1, 2 * L - i}))
        if tuple(sorted(ins)) != want:
            return False
    return True


class _Chain:
    """The chain's arrays, indexed by layer + 1 so that the virtual checkpoint x_{-1} sits at 0."""

    def __init__(self, graph: Graph):
        n = graph.n
        self.L = L = (n - 1) // 2
        nd = graph.nodes
        for i in range(L):
            if nd[i].retain:
                raise GraphError(f"chain_dp does not support retained forward values ({graph.describe(i)})")
        # position p = i + 1 for layer i in -1 .. L
        self.w = [0] + [int(nd[i].bytes) for i in range(L + 1)]  # bytes of x_i
        self.f = [0.0] + [float(nd[i].cost) for i in range(L + 1)]  # cost of x_i
        self.g = [0] + [int(nd[2 * L - i].bytes) for i in range(L)] + [int(nd[L].bytes)]  # bytes of delta_i
        self.b = [0.0] + [float(nd[2 * L - i].cost) for i in range(L)] + [0.0]  # cost of B_i
        self.rec = [True] + [bool(nd[i].recomputable) for i in range(L)] + [True]
        self.ret = [False] + [bool(nd[2 * L - i].retain) for i in range(L)] + [bool(nd[L].retain)]
        # R[p]: bytes of retained gradients delta_k, k >= i + 2, resident while B_i's subproblem runs
        self.R = [0] * (L + 3)
        for p in range(L, -1, -1):
            k = p + 1  # position of layer i + 2 is p + 2; accumulate from the right
            self.R[p] = self.R[p + 1] + (self.g[k + 1] if k + 1 <= L + 1 and self.ret[k + 1] else 0)
        self.F = [0.0]  # prefix sums of forward costs over positions
        for c in self.f:
            self.F.append(self.F[-1] + c)
        self.Bs = [0.0]
        for c in self.b:
            self.Bs.append(self.Bs[-1] + c)
        # first non-recomputable position at or after p (L + 2 if none)
        self.next_fixed = [L + 2] * (L + 3)
        for p in range(L + 1, -1, -1):
            self.next_fixed[p] = p if not self.rec[p] else self.next_fixed[p + 1]
        self.pair = [0] + [self.w[p - 1] + self.w[p] for p in range(1, L + 2)]  # x_{p-1} and x_p together
        self._intern_segments()
        self.sigT = [list(col) for col in zip(*self.sig)]

    def fwd_cost(self, p: int, q: int) -> float:
        """Cost of computing positions p+1 .. q."""
        return self.F[q + 1] - self.F[p + 1]

    def min_cost(self, p: int, q: int) -> float:
        """Least cost of a subproblem over positions p .. q: each forward p+1..q and each B once."""
        return self.fwd_cost(p, q) + self.Bs[q + 1] - self.Bs[p]

    def _intern_segments(self) -> None:
        """sig[p][q]: one id per distinct subproblem content (positions p .. q+1 and R[q])."""
        L = self.L
        table: dict = {}
        cls: list = [(self.w[p], self.f[p], self.b[p], self.g[p], self.rec[p], self.ret[p]) for p in range(L + 2)]
        cls[0] = "virtual"  # the virtual checkpoint has no backward node: never shared with a layer
        self.sig = [[-1] * (L + 2) for _ in range(L + 2)]
        for p in range(L + 1):
            seg = table.setdefault(("leaf", cls[p]), len(table))
            for q in range(p, L + 1):
                seg_next = table.setdefault((seg, cls[q + 1]), len(table))
                self.sig[p][q] = table.setdefault(("sub", seg_next, self.R[q]), len(table))
                seg = seg_next


_NONE = (INF, -1, INF)  # (cost, choice, peak used) of an impossible subproblem


class _Memo:
    """Results (cost, choice, peak used) of one kind of subproblem, by content id and available bytes m.

    An optimum found at m whose schedule peaks at `used` bytes is also optimal at every m' in [used, m]:
    less memory never lowers the least cost, and that schedule still fits. So results are also kept as
    disjoint intervals of m per content id (merged when their costs are equal: the least cost is
    monotone in m), which answers the many nearby budgets that chains with irregular sizes produce.
    """

    def __init__(self, K: int):
        self.K = K
        self.exact: dict[int, tuple[float, int, float]] = {}  # id * K + m -> result
        self.ivals: dict[int, tuple[list, list, list]] = {}  # id -> (used, hi, result) sorted by used
        self.infeasible: dict[int, int] = {}  # id -> the largest m known to be infeasible

    def find(self, sid: int, m: int):
        key = sid * self.K + m
        got = self.exact.get(key)
        if got is not None:
            return got
        if m <= self.infeasible.get(sid, -1):
            got = _NONE
        else:
            iv = self.ivals.get(sid)
            if iv is None:
                return None
            i = bisect_right(iv[0], m) - 1
            if i < 0 or m > iv[1][i]:
                return None
            got = iv[2][i]
        self.exact[key] = got
        return got

    def store(self, sid: int, m: int, res: tuple[float, int, float]) -> None:
        self.exact[sid * self.K + m] = res
        cost, _, used = res
        if cost == INF:
            if m > self.infeasible.get(sid, -1):
                self.infeasible[sid] = m
            return
        useds, his, results = self.ivals.setdefault(sid, ([], [], []))
        lo, hi = int(used), m
        i = bisect_left(useds, lo)
        if i > 0 and results[i - 1][0] == cost:  # same cost just below: one interval
            lo, res, hi = useds[i - 1], results[i - 1], max(hi, his[i - 1])
            i -= 1
            del useds[i], his[i], results[i]
        if i < len(useds) and results[i][0] == cost:  # same cost just above
            hi = max(hi, his[i])
            del useds[i], his[i], results[i]
        useds.insert(i, lo)
        his.insert(i, hi)
        results.insert(i, res)


class _DP:
    """Memoised cost DP for one chain: `sub` and `top` return (cost, choice, peak used)."""

    def __init__(self, ch: _Chain, deadline: float | None, m_max: int):
        self.ch = ch
        self.deadline = deadline
        self.K = max(int(m_max), 0) + 1  # memo keys are id * K + m, with 0 <= m <= m_max
        self.memo_sub = _Memo(self.K)
        self.memo_top = _Memo(self.K)
        self.capm = self._caps()
        self.capT = [list(col) for col in zip(*self.capm)]
        self.cap_top_list = self._cap_tops()
        self.memo_min_sub: dict[int, float] = {}
        self.memo_min_top: dict[int, float] = {}
        self.calls = 0

    def _tick(self) -> None:
        self.calls += 1
        if self.deadline is not None and self.calls % 1024 == 0 and time.perf_counter() > self.deadline:
            raise NoSolutionInTimeError("chain_dp ran out of time before finishing its dynamic program")

    def _caps(self) -> list[list[int]]:
        """capm[p][q]: peak of the subproblem (p, q) when it keeps every forward value (least cost)."""
        ch = self.ch
        n = ch.L + 2
        capm = [[0] * n for _ in range(n)]
        for p in range(n - 1):
            capm[p][p] = 0 if p == 0 else ch.w[p] + ch.g[p + 1] + ch.R[p] + ch.g[p]
        for length in range(1, n - 1):
            for p in range(0, n - 1 - length):
                q = p + length
                sweep = ch.w[p] + ch.g[q + 1] + ch.R[q] + ch.w[p + 1]
                capm[p][q] = max(sweep, ch.w[p] + capm[p + 1][q], capm[p][p])
        return capm

    def _cap_tops(self) -> list[int]:
        """The same for `top(p)`."""
        ch = self.ch
        last = ch.L + 1
        out = [0] * (last + 1)
        for p in range(last - 1, -1, -1):
            out[p] = max(ch.w[p] + ch.w[p + 1], self.capm[p][p])
            if p + 1 < last:
                out[p] = max(out[p], ch.w[p] + out[p + 1])
        return out

    def leaf(self, p: int, m: int) -> tuple[float, int, float]:
        """Run B at position p with x_p and its incoming gradient resident (the subproblem p, p)."""
        ch = self.ch
        if p == 0:
            return (0.0, 0, 0)
        need = ch.w[p] + ch.g[p + 1] + ch.R[p] + ch.g[p]
        return (ch.b[p], 0, need) if need <= m else _NONE

    def sub(self, p: int, q: int, m: int) -> tuple[float, int, float]:
        """The subproblem (p, q): x at position p and delta at q+1 resident, m bytes for everything in
        it (x_p and delta_{q+1} included); produce delta at p. Least cost, choice, peak used."""
        ch = self.ch
        if p == q:
            return self.leaf(p, m)
        if m < 0 or ch.next_fixed[p + 1] <= q:
            return _NONE  # no room, or a non-recomputable forward value would be computed again
        capm, sig, K, memo = self.capm, ch.sig, self.K, self.memo_sub
        if m > capm[p][q]:
            m = capm[p][q]
        sid = sig[p][q]
        got = memo.find(sid, m)
        if got is not None:
            return got
        self._tick()
        exact = memo.exact
        w, F, pair = ch.w, ch.F, ch.pair
        base = w[p] + ch.g[q + 1] + ch.R[q]
        floor = ch.min_cost(p, q)
        leaf_p = self.leaf(p, m)
        mr = m - w[p]  # for the right part, x_p stays resident
        F0 = F[p + 1]
        sig_q, cap_q = ch.sigT[q], self.capT[q]  # right parts (r, q)
        sig_p, cap_p = sig[p], capm[p]  # left parts (p, r-1)
        best, arg, used = INF, -1, INF
        sweep = w[p + 1]  # the sweep's peak, beyond base, up to x_r: it only grows with r
        for r in range(p + 1, q + 1):
            if r > p + 1 and pair[r] > sweep:
                sweep = pair[r]
            if base + sweep > m:
                break
            if floor + F[r] - F0 >= best:
                break  # no candidate from here on can beat best, even without further recomputation
            if r == q:
                right = self.leaf(q, mr)
            else:
                mm = cap_q[r]
                if mr < mm:
                    mm = mr
                right = (exact.get(sig_q[r] * K + mm) if mm >= 0 else None) or self.sub(r, q, mr)
            if right[0] == INF:
                continue
            if r - 1 == p:
                left = leaf_p
            else:
                mm = cap_p[r - 1]
                if m < mm:
                    mm = m
                left = exact.get(sig_p[r - 1] * K + mm) or self.sub(p, r - 1, m)
            cost = F[r + 1] - F0 + right[0] + left[0]
            if cost < best:
                best, arg, used = cost, r - p, max(base + sweep, w[p] + right[2], left[2])
        res = (best, arg, used)
        memo.store(sid, m, res)
        return res

    def top(self, p: int, m: int) -> tuple[float, int, float]:
        """From x at position p resident (the loss not yet computed) to the end: cost, choice, peak used."""
        ch = self.ch
        if m < 0:
            return _NONE
        cap_top = self.cap_top_list
        if m > cap_top[p]:
            m = cap_top[p]
        memo, K = self.memo_top, self.K
        got = memo.find(p, m)
        if got is not None:
            return got
        self._tick()
        exact, exact_sub = memo.exact, self.memo_sub.exact
        w, F, capm, sig = ch.w, ch.F, self.capm, ch.sig
        last = ch.L + 1  # position of the loss
        F0 = F[p + 1]
        floor = F[last + 1] - F0 + ch.Bs[last] - ch.Bs[p]
        mr = m - w[p]
        leaf_p = self.leaf(p, m)
        best, arg, used = INF, -1, INF
        pair, sig_p, cap_p = ch.pair, sig[p], capm[p]
        sweep = w[p + 1]
        stop = min(last, ch.next_fixed[p + 1])  # x at p+1 .. r-1 is recomputed later: it must be recomputable
        for r in range(p + 1, stop + 1):
            if r > p + 1 and pair[r] > sweep:
                sweep = pair[r]
            if w[p] + sweep > m:
                break
            if floor + F[r] - F0 >= best:
                break
            # the left part: the subproblem (p, r-1), after everything to the right
            if r - 1 == p:
                left = leaf_p
            else:
                mm = cap_p[r - 1]
                if m < mm:
                    mm = m
                left = exact_sub.get(sig_p[r - 1] * K + mm) or self.sub(p, r - 1, m)
            if left[0] == INF:
                continue
            if r == last:
                right_cost, right_used = 0.0, 0
            else:
                mm = cap_top[r]
                if mr < mm:
                    mm = mr
                right = (exact.get(r * K + mm) if mm >= 0 else None) or self.top(r, mr)
                if right[0] == INF:
                    continue
                right_cost, right_used = right[0], w[p] + right[2]
            cost = F[r + 1] - F0 + right_cost + left[0]
            if cost < best:
                best, arg, used = cost, r - p, max(w[p] + sweep, right_used, left[2])
        res = (best, arg, used)
        memo.store(p, m, res)
        return res

    # ---- the least memory of the family ----------------------------------------------------------
    def min_sub(self, p: int, q: int) -> float:
        """Least m at which `sub(p, q, m)` is finite (inf if a non-recomputable value is in the way)."""
        ch = self.ch
        if p == q:
            return 0 if p == 0 else ch.w[p] + ch.g[p + 1] + ch.R[p] + ch.g[p]
        if ch.next_fixed[p + 1] <= q:
            return INF
        key = ch.sig[p][q]
        got = self.memo_min_sub.get(key)
        if got is not None:
            return got
        self._tick()
        base = ch.w[p] + ch.g[q + 1] + ch.R[q]
        best = INF
        sweep = 0
        for r in range(p + 1, q + 1):
            sweep = max(sweep, (ch.w[r - 1] if r - 1 > p else 0) + ch.w[r])
            if base + sweep >= best:
                break
            best = min(best, max(base + sweep, ch.w[p] + self.min_sub(r, q), self.min_sub(p, r - 1)))
        self.memo_min_sub[key] = best
        return best

    def min_top(self, p: int) -> float:
        """Least m at which `top(p, m)` is finite."""
        got = self.memo_min_top.get(p)
        if got is not None:
            return got
        ch = self.ch
        last = ch.L + 1
        best = INF
        sweep = 0
        for r in range(p + 1, last + 1):
            sweep = max(sweep, (ch.w[r - 1] if r - 1 > p else 0) + ch.w[r])
            if ch.w[p] + sweep >= best or ch.next_fixed[p + 1] < r:
                break
            if r == last:
                need = max(ch.w[p] + sweep, self.min_sub(p, last - 1))
            else:
                need = max(ch.w[p] + sweep, ch.w[p] + self.min_top(r), self.min_sub(p, r - 1))
            best = min(best, need)
        self.memo_min_top[p] = best
        return best



def _solve_chain(dp: _DP, m: int) -> tuple[float, list[int], list[int]]:
    """Cost, compute sequence and kept layers of the optimum at m available bytes."""
    cost = dp.top(0, m)[0]
    if cost == INF:
        return cost, [], []
    ch = dp.ch
    L = ch.L
    seq: list[int] = []
    kept: list[int] = []

    def emit_sub(p: int, q: int, mm: int) -> None:
        if p == q:
            if p > 0:
                seq.append(2 * L - (p - 1))
            return
        r = p + dp.sub(p, q, mm)[1]
        seq.extend(range(p, r))  # positions p+1 .. r are nodes p .. r-1
        kept.append(r - 1)
        emit_sub(r, q, mm - ch.w[p])
        emit_sub(p, r - 1, mm)

    def emit_top(p: int, mm: int) -> None:
        r = p + dp.top(p, mm)[1]
        seq.extend(range(p, r))
        if r == L + 1:
            emit_sub(p, L, mm)
            return
        kept.append(r - 1)
        emit_top(r, mm - ch.w[p])
        emit_sub(p, r - 1, mm)

    emit_top(0, m)
    return cost, seq, kept


def chain_dp(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None) -> Proposal:
    """The least-cost persistent schedule of a training chain within `budget_bytes` (see the module doc).

    Raises GraphError if `graph` is not a training chain (`is_training_chain`) or retains a forward
    value; InfeasibleBudgetError with the least peak of any persistent schedule when none fits;
    NoSolutionInTimeError when `time_limit_s` runs out first.
    """
    if not is_training_chain(graph):
        raise GraphError(f"chain_dp needs a training chain (the shape of linear_training_graph: forward chain, "
                         f"loss, backward node 2L-i reading 2L-i-1 and forward i); '{graph.name}' is not one")
    t0 = time.perf_counter()
    deadline = None if time_limit_s is None else t0 + float(time_limit_s)
    ch = _Chain(graph)
    dp = _DP(ch, deadline, budget_bytes - graph.fixed_bytes)
    budget_bytes = int(budget_bytes)
    m = budget_bytes - graph.fixed_bytes
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 20 * ch.L + 1000))  # the memoised recursion nests ~2 frames a layer
    try:
        cost = dp.top(0, m)[0] if m >= 0 else INF
        if cost == INF:
            need = dp.min_top(0)
            raise InfeasibleBudgetError(
                budget_bytes, None if need == INF else graph.fixed_bytes + int(need), "chain_dp",
                "least peak over persistent schedules (the family chain_dp searches); "
                "a schedule outside that family might fit a smaller budget",
            )
        cost, seq, kept = _solve_chain(dp, m)
    finally:
        sys.setrecursionlimit(old_limit)
    schedule = Schedule.from_sequence(graph, seq)
    # Every node is computed at least once by any schedule: with no recomputation the cost is optimal.
    no_recompute = cost <= graph.total_cost * (1 + 1e-12) + 1e-12
    info = {
        "family": FAMILY,
        "optimal_within": "family",
        "cost": cost,
        "kept": sorted(set(kept)),
        "dp_states": len(dp.memo_sub.exact) + len(dp.memo_top.exact),
        "seconds": time.perf_counter() - t0,
    }
    return Proposal(schedule, Status.OPTIMAL, lower_bound_cost=graph.total_cost if no_recompute else None, info=info)
