"""Drop-gap search: which values to drop between two of their uses, as an interval cover.

The reference order runs every node once; a *drop* of value u over the gap between two
consecutive uses a < b of u (or between its computation and its first use) frees u after step
a and recomputes it before step r, a < r <= b: right before its use b, or earlier, right before
the last use of one of its inputs. Its inputs must be resident then: an input whose last use
comes before r is kept until r (an *extension*), and a drop of an input that keeps it absent at
r conflicts with the drop (as do two drops of the same gap). With S the chosen drops, the memory
at reference step s is modelled as

    mem0(s) - sum of bytes(u) over drops with a < s < r
            + sum of bytes(i) over extensions that cover s (each up to r inclusive),

which bounds the memory of every op up to step s from above (a recomputation placed before step
r is counted as live at r). The greedy search counts an extension once per drop that needs it
(more conservative); the MILP (`drop_gap_milp`) counts a kept input once. Either way a set S
whose model peak is within budget gives a schedule within budget; the simulator is still the
judge. Cost = sum of cost(u) over S.

`GapSearch.solve` finds a cheap feasible S: a lazy greedy cover of the excess (excess bytes
removed per unit cost), reverse-delete pruning, then ruin-and-recreate with simulated-annealing
acceptance (drop the drops in a random window, re-cover) until its deadline. `drop_gap_milp`
solves the family exactly with HiGHS within a time limit, warm-started from the search.
"""
from __future__ import annotations

import heapq
import math
import random
import time

import numpy as np

from graphs.ir import Graph
from solvers.highs import quiet_highs


class GapSearch:
    def __init__(self, graph: Graph):
        self.graph = graph
        n = graph.n
        self.n = n
        size = [int(b) for b in graph.sizes]
        users = graph.users
        end = [n - 1 if graph.nodes[v].retain else (users[v][-1] if users[v] else v) for v in range(n)]
        self.last_use = end
        diff = np.zeros(n + 1, dtype=np.int64)
        for v in range(n):
            diff[v] += size[v]
            diff[end[v] + 1] -= size[v]
        self.mem0 = np.cumsum(diff[:n]) + int(graph.fixed_bytes)
        # candidates
        self.c_u: list[int] = []
        self.c_lo: list[int] = []  # span start (first step the delta touches)
        self.c_p: list[int] = []  # the use b that the recomputation serves; span ends at p
        self.c_delta: list[np.ndarray] = []
        self.c_cost: list[float] = []
        gap_opts: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (u, gap) -> [(r, candidate)]
        self.uses = []
        self.c_r: list[int] = []  # the step before which the recomputation runs
        self.c_ext: list[tuple[int, ...]] = []  # inputs kept past their last use until r
        self.c_drop: list[tuple[int, int]] = []  # steps [first, last] where u is absent
        for u in range(n):
            a = [u, *users[u]]
            self.uses.append(a)
            nd = graph.nodes[u]
            if not nd.recomputable:
                continue
            for k in range(len(a) - 1):
                L, p = a[k] + 1, a[k + 1]
                if L > p - 1:
                    continue
                # recompute right before the use p, or earlier, right before the last use of an
                # input (that input then needs no extension); u is resident from r to p
                points = sorted({p} | {end[i] for i in nd.inputs if L < end[i] < p})
                for r in points:
                    ext = [(end[i] + 1, size[i]) for i in nd.inputs if end[i] < r]
                    lo = min([L] + [s0 for s0, _ in ext])
                    d = np.zeros(p - lo + 1, dtype=np.int64)
                    d[L - lo:r - lo] -= size[u]
                    for s0, b in ext:
                        d[s0 - lo:r - lo + 1] += b
                    gap_opts.setdefault((u, k), []).append((r, len(self.c_u)))
                    self.c_ext.append(tuple(i for i in nd.inputs if end[i] < r))
                    self.c_drop.append((L, r - 1))
                    self.c_u.append(u)
                    self.c_lo.append(lo)
                    self.c_p.append(p)
                    self.c_r.append(r)
                    self.c_delta.append(d)
                    self.c_cost.append(float(nd.cost))
        m = len(self.c_u)
        self.m = m
        conf: list[set[int]] = [set() for _ in range(m)]
        self.absent: list[tuple[int, int, int, int]] = []  # (c, j, i, r): drop j keeps input i of c absent at r
        for opts in gap_opts.values():  # one option per gap at most
            for _, c in opts:
                conf[c].update(j for _, j in opts if j != c)
        # a recomputation of u before step r needs every input i resident then: no drop of i may
        # keep i absent at r (absent from after a[k] up to its own recomputation point)
        for c in range(m):
            u, r = self.c_u[c], self.c_r[c]
            for i in graph.inputs[u]:
                a = self.uses[i]
                k = int(np.searchsorted(a, r)) - 1  # the gap (a[k], a[k+1]) with a[k] < r
                if 0 <= k < len(a) - 1 and a[k] < r < a[k + 1]:
                    for r2, j in gap_opts.get((i, k), ()):
                        if r2 > r:
                            conf[c].add(j)
                            conf[j].add(c)
                            self.absent.append((c, j, i, r))
        self.conf = conf
        self.gap_groups = [[c for _, c in opts] for opts in gap_opts.values() if len(opts) > 1]
        self.gap_opts = gap_opts
        self.helpers: set[tuple[int, int]] = set()  # chosen by drop_gap_milp
        # for each step, the candidates whose span touches it (to re-cover a window quickly)
        touch: list[list[int]] = [[] for _ in range(n)]
        for c in range(m):
            for s in range(self.c_lo[c], self.c_p[c] + 1):
                touch[s].append(c)
        self.touch = touch
        self.eps = 1e-6 * max(float(np.mean(graph.costs)) if n else 1.0, 1e-12)

    # ---- evaluation ---------------------------------------------------------------------------
    def excess(self, chosen: set[int], budget_bytes: int) -> np.ndarray:
        e = self.mem0 - int(budget_bytes)
        for c in chosen:
            e[self.c_lo[c]:self.c_p[c] + 1] += self.c_delta[c]
        return e

    def benefit(self, c: int, e: np.ndarray) -> float:
        seg = e[self.c_lo[c]:self.c_p[c] + 1]
        return float(np.maximum(seg, 0).sum() - np.maximum(seg + self.c_delta[c], 0).sum())

    def cost(self, chosen: set[int]) -> float:
        return float(sum(self.c_cost[c] for c in chosen))

    # ---- construction -------------------------------------------------------------------------
    def cover(self, chosen: set[int], e: np.ndarray, pool, rng: random.Random | None = None,
              noise: float = 0.0) -> bool:
        """Greedily add drops from `pool` until no step is over budget; updates chosen and e."""
        blocked = set()
        for c in chosen:
            blocked |= self.conf[c]
        heap = []
        for c in pool:
            if c in chosen or c in blocked:
                continue
            b = self.benefit(c, e)
            if b > 0:
                r = b / (self.c_cost[c] + self.eps)
                if noise and rng is not None:
                    r *= 1.0 + noise * rng.random()
                heap.append((-r, c))
        heapq.heapify(heap)
        while heap and e.max() > 0:
            negr, c = heapq.heappop(heap)
            if c in chosen or c in blocked:
                continue
            b = self.benefit(c, e)
            if b <= 0:
                continue
            r = b / (self.c_cost[c] + self.eps)
            if noise and rng is not None:
                r *= 1.0 + noise * rng.random()
            if heap and r < -heap[0][0] * (1 - 1e-12):
                heapq.heappush(heap, (-r, c))
                continue
            chosen.add(c)
            blocked |= self.conf[c]
            e[self.c_lo[c]:self.c_p[c] + 1] += self.c_delta[c]
        return bool(e.max() <= 0)

    def prune(self, chosen: set[int], e: np.ndarray) -> None:
        """Remove drops (most expensive first) whose removal keeps every step within budget."""
        for c in sorted(chosen, key=lambda c: -self.c_cost[c]):
            seg = e[self.c_lo[c]:self.c_p[c] + 1]
            if (seg - self.c_delta[c]).max() <= 0:
                seg -= self.c_delta[c]
                chosen.discard(c)

    def solve(self, budget_bytes: int, deadline: float, seed: int = 0, temperature: float = 0.3
              ) -> set[int] | None:
        """A cheap feasible drop set for the budget, improved until `deadline` (perf_counter)."""
        rng = random.Random(seed)
        chosen: set[int] = set()
        e = self.excess(chosen, budget_bytes)
        if not self.cover(chosen, e, range(self.m)):
            return None
        self.prune(chosen, e)
        best, best_cost = set(chosen), self.cost(chosen)
        cur, cur_cost = set(chosen), best_cost
        n = self.n
        it = 0
        t_start = time.perf_counter()
        span = max(deadline - t_start, 1e-9)
        # simulated annealing on the cost: the temperature starts at `temperature` x the mean
        # cost of a drop and falls linearly to zero at the deadline
        t0 = temperature * best_cost / max(len(best), 1)
        while cur:
            now = time.perf_counter()
            if now >= deadline:
                break
            temp = t0 * (1.0 - (now - t_start) / span)
            it += 1
            # ruin: the drops whose span meets a random window around a random chosen drop
            c0 = rng.choice(tuple(cur))
            w = rng.randint(1, max(2, n // 20))
            lo = max(0, self.c_lo[c0] - rng.randint(0, w))
            hi = min(n - 1, self.c_p[c0] + rng.randint(0, w))
            trial = set(cur)
            te = e.copy()
            removed = [c for c in trial if self.c_p[c] >= lo and self.c_lo[c] <= hi and rng.random() < 0.7]
            if not removed:
                removed = [c0]
            for c in removed:
                trial.discard(c)
                te[self.c_lo[c]:self.c_p[c] + 1] -= self.c_delta[c]
            over = np.nonzero(te > 0)[0]
            pool = set()
            for s in over:
                pool.update(self.touch[s])
            pool -= set(removed) if rng.random() < 0.5 else set()
            if not self.cover(trial, te, pool, rng, noise=0.3):
                continue
            self.prune(trial, te)
            tc = self.cost(trial)
            if tc <= cur_cost or (temp > 0 and rng.random() < math.exp(-(tc - cur_cost) / temp)):
                cur, cur_cost, e = trial, tc, te
                if tc < best_cost - 1e-12:
                    best, best_cost = set(trial), tc
        self.iterations = it
        return best

    # ---- output -------------------------------------------------------------------------------
    def absent_at(self, chosen: set[int], i: int, r: int) -> bool:
        """Whether a chosen drop keeps value i absent at step r."""
        return any(self.c_u[c] == i and self.c_drop[c][0] <= r <= self.c_drop[c][1] for c in chosen)

    def sequence(self, chosen: set[int], helpers: set[tuple[int, int]] = frozenset()) -> list[int]:
        """The reference order with each chosen drop's recomputation placed before its point r.

        helpers: (i, r) pairs: value i is also recomputed before step r for a recomputation there
        that reads it, when a chosen drop keeps it absent at r or it is past its last use (else
        it is resident already).
        """
        before: dict[int, list[int]] = {}
        for c in chosen:
            before.setdefault(self.c_r[c], []).append(self.c_u[c])
        for i, r in helpers:
            if self.last_use[i] < r or self.absent_at(chosen, i, r):
                before.setdefault(r, []).append(i)
        seq: list[int] = []
        for t in range(self.n):
            seq.extend(sorted(before.get(t, ())))
            seq.append(t)
        return seq


def drop_gap_milp(gs: GapSearch, budget_bytes: int, time_limit_s: float, warm: set[int] | None = None,
                  threads: int = 1, deadline: float | None = None, heuristic_effort: float = 0.05,
                  helpers: bool = False, chain: int = 0) -> tuple[set[int] | None, float | None, str]:
    """The cheapest drop set of the family by HiGHS; a kept input counts once, whatever needs it.

    The extensions of an input are merged: z[i, k] says that input i is kept past its last use
    through the k-th distinct recomputation point that needs it (z non-increasing in k, and at
    least every chosen drop that needs it that far). This model is exact for the union of the
    extensions, so its peak bounds the simulated one from above like the greedy's model.
    deadline: a time.perf_counter() value; the solver's own limit is cut to end by then, so the
    model building counts against the time.
    helpers: a drop may also read an input that another drop keeps absent at its point r, if that
    input is recomputed once more before r (a *helper*, whose own inputs must then be resident);
    the helpers chosen are left in gs.helpers for `gs.sequence(chosen, gs.helpers)`.
    chain: an input past its last use may also be recomputed by a helper before r instead of
    being kept until r, and so may a helper's own inputs, up to `chain` levels deep (0: never).
    Returns (drop set or None, the solver's lower bound on the family's cost or None, status text);
    None when highspy is not installed or no solution was found within the time limit.
    """
    try:
        import highspy
    except ImportError:  # pragma: no cover - highspy is a project dependency
        return None, None, "highspy not installed"
    n, m = gs.n, gs.m
    size = gs.graph.sizes
    gs.helpers = set()
    if (gs.mem0 - int(budget_bytes)).max(initial=0) <= 0:
        return set(), 0.0, "Optimal"  # nothing to drop: costs are >= 0
    points: dict[int, list[int]] = {}
    for c in range(m):
        for i in gs.c_ext[c]:
            points.setdefault(i, []).append(gs.c_r[c])
    # helpers: (i, r) -> column of "recompute i again before r", for a recomputation there that
    # reads i while a drop keeps i absent (`helpers`), or, up to `chain` levels deep, while i is
    # past its last use (instead of keeping i until r); a helper's inputs must be resident at r
    # in turn: kept, or (within the depth) recomputed by a helper themselves
    end = gs.last_use
    rec = [nd.recomputable for nd in gs.graph.nodes]
    chain = int(chain)
    depth: dict[tuple[int, int], int] = {}
    if helpers:
        for _, _, i, r in gs.absent:
            depth[(i, r)] = 1
    if chain > 0:
        for c in range(m):
            for i in gs.c_ext[c]:
                if rec[i]:
                    depth[(i, gs.c_r[c])] = 1
    helper_ext: dict[tuple[int, int], list[int]] = {}
    helper_conf: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # [(drop, input, r)]
    todo = sorted(depth)
    while todo:
        key = todo.pop()
        i, r = key
        ext = [j for j in gs.graph.inputs[i] if end[j] < r]
        helper_ext[key] = ext
        for j in ext:
            points.setdefault(j, []).append(r)
            if rec[j] and depth[key] < chain and (j, r) not in depth:
                depth[(j, r)] = depth[key] + 1
                todo.append((j, r))
        confl = []
        for j in gs.graph.inputs[i]:
            a = gs.uses[j]
            k = int(np.searchsorted(a, r)) - 1
            if 0 <= k < len(a) - 1 and a[k] < r < a[k + 1]:
                confl.extend((c2, j, r) for r2, c2 in gs.gap_opts.get((j, k), ()) if r2 > r)
                if helpers and depth[key] < max(chain, 1) and (j, r) not in depth:
                    depth[(j, r)] = depth[key] + 1
                    todo.append((j, r))
        helper_conf[key] = confl
    helper_keys = sorted(depth)
    zcol: dict[tuple[int, int], int] = {}  # (input, point) -> column
    col = m
    seg_rows: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    chain_pairs = []
    for i, rs in points.items():
        rs = sorted(set(rs))
        prev = gs.last_use[i]
        for k, r in enumerate(rs):
            zcol[(i, r)] = col
            for s in range(prev + 1, r + 1):
                seg_rows[s].append((col, float(size[i])))
            if k:
                chain_pairs.append((col - 1, col))
            prev = r
            col += 1
    hcol = {key: col + k for k, key in enumerate(helper_keys)}
    for (i, r), hc in hcol.items():
        seg_rows[r].append((hc, float(size[i])))
    col += len(helper_keys)
    ncol = col
    excess = gs.mem0 - int(budget_bytes)
    for c in range(m):
        lo, hi = gs.c_drop[c]
        b = -float(size[gs.c_u[c]])
        for s in range(lo, hi + 1):
            seg_rows[s].append((c, b))
    inf = highspy.kHighsInf
    h = quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    if deadline is not None:
        time_limit_s = min(float(time_limit_s), deadline - time.perf_counter())
    if time_limit_s <= 0.05:
        return None, None, "no time left after building the model"
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_heuristic_effort", float(heuristic_effort))
    cost = np.zeros(ncol)
    cost[:m] = gs.c_cost
    h.addVars(ncol, np.zeros(ncol), np.ones(ncol))
    for (i, r), hc in hcol.items():
        cost[hc] = gs.graph.nodes[i].cost
    h.changeColsCost(ncol, np.arange(ncol, dtype=np.int32), cost)
    integer = np.array(list(range(m)) + sorted(hcol.values()), dtype=np.int32)
    h.changeColsIntegrality(len(integer), integer, np.array([highspy.HighsVarType.kInteger] * len(integer)))
    lower, upper, starts, index, value = [], [], [], [], []

    def row(lo: float, up: float, entries) -> None:
        lower.append(lo)
        upper.append(up)
        starts.append(len(index))
        for j, v in entries:
            index.append(j)
            value.append(v)

    for s in range(n):
        if seg_rows[s]:
            row(-inf, float(-excess[s]), seg_rows[s])
        elif excess[s] > 0:
            return None, None, "a step is over budget and no drop covers it"
    for c in range(m):  # a dead input is kept until r, or recomputed by a helper
        for i in gs.c_ext[c]:
            hc = hcol.get((i, gs.c_r[c])) if chain > 0 else None
            row(-inf, 0.0, [(c, 1.0), (zcol[(i, gs.c_r[c])], -1.0)] + ([(hc, -1.0)] if hc is not None else []))
    for a, b in chain_pairs:
        row(0.0, inf, [(a, 1.0), (b, -1.0)])
    for group in gs.gap_groups:
        row(-inf, 1.0, [(c, 1.0) for c in group])
    for c, j, i, r in gs.absent:  # c reads i at r while j keeps i absent: only with a helper
        row(-inf, 1.0, [(c, 1.0), (j, 1.0)] + ([(hcol[(i, r)], -1.0)] if helpers else []))
    for key, hc in hcol.items():
        r = key[1]
        for j in helper_ext[key]:
            hj = hcol.get((j, r))
            row(-inf, 0.0, [(hc, 1.0), (zcol[(j, r)], -1.0)] + ([(hj, -1.0)] if hj is not None else []))
        for c2, j, _ in helper_conf[key]:
            hj = hcol.get((j, r))
            row(-inf, 1.0, [(hc, 1.0), (c2, 1.0)] + ([(hj, -1.0)] if hj is not None else []))
    h.addRows(len(lower), np.array(lower), np.array(upper), len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value))
    if warm:
        x = np.zeros(ncol)
        for c in warm:
            x[c] = 1.0
            for i in gs.c_ext[c]:
                for r in points[i]:
                    if r <= gs.c_r[c]:
                        x[zcol[(i, r)]] = 1.0
        try:
            sol = highspy.HighsSolution()
            sol.col_value = x.tolist()
            sol.value_valid = True
            h.setSolution(sol)
        except Exception:  # noqa: BLE001 - a warm start is optional; some versions lack it
            pass
    # HiGHS keeps one global thread scheduler per process, sized by the first run; a later run asking for another
    # thread count (this one asks for `threads`, the Checkmate MILP for HiGHS's default) then fails with no
    # solution ("Not Set"). Start a scheduler of our own size.
    highspy.Highs.resetGlobalScheduler(True)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else None
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return None, bound, status
    xs = h.getSolution().col_value
    # a helper of a dead input is not needed where the input is kept until r anyway
    gs.helpers = {key for key, hc in hcol.items() if xs[hc] > 0.5
                  and not (key in zcol and xs[zcol[key]] > 0.5)}
    return {c for c in range(m) if xs[c] > 0.5}, bound, status
