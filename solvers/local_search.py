"""Drop-gap search: which values to drop between two of their uses, as an interval cover.

The reference order runs every node once; a *drop* of value u over the gap between two
consecutive uses a < b of u (or between its computation and its first use) frees u after step
a and recomputes it right before step b. Its inputs must be resident then: an input whose last
use comes before b is kept until b (an *extension*), and an input dropped over a gap that
strictly contains b conflicts with the drop. With S the chosen drops, the memory at reference
step s is modelled as

    mem0(s) - sum of bytes(u) over drops whose gap strictly contains s
            + sum of bytes(i) over extensions that cover s (counted once per drop),

which bounds the memory of every op up to step s from above (recomputations placed before step
b are live at b, and extensions are counted until b inclusive, once per drop that needs them).
So a set S with model peak <= budget always gives a schedule within budget; the simulator is
still the judge. Cost = sum of cost(u) over S.

`GapSearch` finds a cheap feasible S: a lazy greedy cover of the excess (excess bytes removed
per unit cost), reverse-delete pruning, then ruin-and-recreate (drop the drops in a random
window, re-cover, keep if not worse) until the time limit.
"""
from __future__ import annotations

import heapq
import random
import time

import numpy as np

from graphs.ir import Graph


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
        self.c_p: list[int] = []  # recompute point (the use b); span ends at p
        self.c_delta: list[np.ndarray] = []
        self.c_cost: list[float] = []
        gap_of: dict[tuple[int, int], int] = {}  # (u, gap index) -> candidate id
        self.uses = []
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
                ext = [(end[i] + 1, size[i]) for i in nd.inputs if end[i] < p]
                lo = min([L] + [s for s, _ in ext])
                d = np.zeros(p - lo + 1, dtype=np.int64)
                d[L - lo:p - lo] -= size[u]
                for s, b in ext:
                    d[s - lo:] += b
                gap_of[(u, k)] = len(self.c_u)
                self.c_u.append(u)
                self.c_lo.append(lo)
                self.c_p.append(p)
                self.c_delta.append(d)
                self.c_cost.append(float(nd.cost))
        m = len(self.c_u)
        self.m = m
        # conflicts: a drop of u recomputed at p needs every input i resident at p
        conf: list[set[int]] = [set() for _ in range(m)]
        for c in range(m):
            u, p = self.c_u[c], self.c_p[c]
            for i in graph.inputs[u]:
                a = self.uses[i]
                k = int(np.searchsorted(a, p)) - 1  # gap (a[k], a[k+1]) with a[k] < p
                if 0 <= k < len(a) - 1 and a[k] < p < a[k + 1] and (i, k) in gap_of:
                    j = gap_of[(i, k)]
                    conf[c].add(j)
                    conf[j].add(c)
        self.conf = conf
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

    def solve(self, budget_bytes: int, deadline: float, seed: int = 0) -> set[int] | None:
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
        while time.perf_counter() < deadline and cur:
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
            if tc <= cur_cost:
                cur, cur_cost, e = trial, tc, te
                if tc < best_cost - 1e-12:
                    best, best_cost = set(trial), tc
        self.iterations = it
        return best

    # ---- output -------------------------------------------------------------------------------
    def sequence(self, chosen: set[int]) -> list[int]:
        """The reference order with each chosen drop's recomputation placed right before its use."""
        before: dict[int, list[int]] = {}
        for c in chosen:
            before.setdefault(self.c_p[c], []).append(self.c_u[c])
        seq: list[int] = []
        for t in range(self.n):
            seq.extend(sorted(before.get(t, ())))
            seq.append(t)
        return seq
