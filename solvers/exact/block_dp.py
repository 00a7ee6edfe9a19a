"""`block_dp`: the optimal schedule of a family built on a graph's chain of blocks (solvers.exact.blocks).

The family (FAMILY): the forward pass runs once, in the reference order; glue values are kept; each block keeps
some of its local values read by the backward pass (its *option*) and drops the rest after their last forward use;
before each backward node, the local values it needs that are not resident are recomputed, once, in ascending
order, from the block's kept values and glue, and stay until their last use (Chen et al.'s segments, with the
kept set chosen per block). Glue values that a block's recomputation may read stay until that block's backward
window ends. Every free is at a fixed place, so the memory of a schedule is exact:

    memory at an event = outside(event) + kept bytes of the blocks before this one + this block's own values

where `outside` (everything but the blocks' local values) does not depend on the options. For each block shape
every option (2**choices kept sets) is evaluated at once with numpy: its recomputed set, recompute cost, kept
bytes and its own peak term (the largest outside + own memory over its forward and backward windows). A dynamic
program over the blocks in order, on the kept bytes so far counted in units of budget / GRID, picks one option per
block under the budget: rounded up, its schedule fits; rounded down, its cost is a lower bound for the family. The
result is OPTIMAL within the family when the two are within FAMILY_GAP, FEASIBLE otherwise (the bound is reported
either way, `info["family"]` says which family); the schedule is replayed by the simulator like any other, and its
peak equals the program's figure.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from graphs.errors import GraphError, InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.schedule import Op, OpKind, Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal, check_budget_floor
from solvers.deadline import check, deadline_after
from solvers.exact.blocks import MAX_CHOICES, Blocks, split_blocks

FAMILY = ("block kept-set schedules: the graph split into a chain of blocks at narrow cuts (boundaries kept); "
          "forward once; each block keeps a subset of its values read by the backward pass and recomputes the "
          "rest once, from its kept values, for its own backward")
FAMILY_GAP = 1e-4  # within this share of the family's bound, the schedule counts as optimal for the family
GRID = 1 << 15  # units of kept bytes the dynamic program counts in (budget / GRID bytes each)
BIG = np.int64(1) << 40


@dataclass
class _BlockData:
    """One block's static arrays, indexed by local position j (ascending node id)."""

    local: np.ndarray  # node ids
    size: np.ndarray  # bytes (int64)
    fin: list[list[int]]  # local inputs (positions)
    fuse: list[list[int]]  # local forward users (positions)
    has_b: np.ndarray  # read by a backward node
    first_b: np.ndarray  # first backward reader (node id; BIG if none)
    last_b: np.ndarray  # last backward reader
    last_f: np.ndarray  # last forward reader (node id; the node itself if none)
    choices: list[int]  # positions free to choose
    forced: list[int]  # positions always kept
    first: int
    last: int
    window: tuple[int, int] | None


def _block_data(graph: Graph, bl) -> _BlockData:
    nodes, users = graph.nodes, graph.users
    local = list(bl.local)
    pos = {v: j for j, v in enumerate(local)}
    fin, fuse = [], []
    has_b, first_b, last_b, last_f = [], [], [], []
    for v in local:
        fin.append([pos[i] for i in nodes[v].inputs if i in pos])
        fuse.append([pos[u] for u in users[v] if u in pos])
        b = [u for u in users[v] if nodes[u].backward]
        f = [u for u in users[v] if not nodes[u].backward]
        has_b.append(bool(b))
        first_b.append(min(b) if b else int(BIG))
        last_b.append(max(b) if b else -1)
        last_f.append(max(f) if f else v)
    return _BlockData(np.array(local, dtype=np.int64), np.array([nodes[v].bytes for v in local], dtype=np.int64),
                      fin, fuse, np.array(has_b, dtype=bool), np.array(first_b, dtype=np.int64),
                      np.array(last_b, dtype=np.int64),
                      np.array(last_f, dtype=np.int64), [pos[v] for v in bl.choices], [pos[v] for v in bl.forced],
                      bl.first, bl.last, bl.bwd_window)


def _kept_matrix(d: _BlockData, options: np.ndarray | None = None) -> np.ndarray:
    """Kept flags per option (rows) and local value (columns): every subset of the choices, or the given bit rows."""
    c = len(d.choices)
    bits = np.arange(1 << c, dtype=np.int64) if options is None else np.asarray(options, dtype=np.int64)
    K = np.zeros((len(bits), len(d.local)), dtype=bool)
    for k, j in enumerate(d.choices):
        K[:, j] = (bits >> k) & 1
    K[:, d.forced] = True
    return K


def _recompute(d: _BlockData, K: np.ndarray):
    """(rec, tau): which local values each option recomputes, and before which backward node (BIG: never)."""
    m = len(d.local)
    rec = np.zeros_like(K)
    tau = np.full(K.shape, BIG, dtype=np.int64)
    for j in reversed(range(m)):
        need = np.full(K.shape[0], bool(d.has_b[j]))
        t = np.full(K.shape[0], d.first_b[j] if d.has_b[j] else BIG, dtype=np.int64)
        for w in d.fuse[j]:
            need |= rec[:, w]
            t = np.minimum(t, np.where(rec[:, w], tau[:, w], BIG))
        rec[:, j] = need & ~K[:, j]
        tau[:, j] = np.where(rec[:, j], t, BIG)
    return rec, tau


def _intervals(d: _BlockData, K: np.ndarray, rec: np.ndarray, tau: np.ndarray):
    """Backward-window slot intervals [start, end] per option and local value (start > end: not resident).

    A slot key orders the ops of the backward window: (y - w0) * (m + 1) + j for the recomputation of local j
    before backward node y, (y - w0) * (m + 1) + m for the computation of y itself."""
    m = len(d.local)
    w0 = d.window[0]
    M1 = m + 1

    def key(y, j):
        return (y - w0) * M1 + j

    start = np.full(K.shape, BIG, dtype=np.int64)
    end = np.full(K.shape, -1, dtype=np.int64)
    for j in range(m):
        last_read = key(d.last_b[j], m) if d.has_b[j] else np.int64(-1)
        rend = np.full(K.shape[0], last_read, dtype=np.int64)
        for w in d.fuse[j]:
            rend = np.maximum(rend, np.where(rec[:, w], key(tau[:, w], w), -1))
        kept_here = K[:, j] & bool(d.has_b[j])
        start[:, j] = np.where(rec[:, j], key(tau[:, j], j), np.where(kept_here, 0, BIG))
        # a kept value also stays for the recomputations that read it
        end[:, j] = np.where(rec[:, j] | kept_here, rend, -1)
    return start, end


class _Shape:
    """The options of one block shape, evaluated for every subset of its choices."""

    def __init__(self, d: _BlockData, K: np.ndarray | None = None):
        self.K = _kept_matrix(d) if K is None else K
        self.rec, tau = _recompute(d, self.K)
        m = len(d.local)
        self.kept_bytes = (self.K & d.has_b[None, :]).astype(np.int64) @ d.size
        rel = d.local - d.first
        span = d.last - d.first
        # forward window: local j resident at event x (relative) while rel_j <= x <= its last forward read, or to the
        # end of the window when kept
        endf = np.where(self.K, span, (d.last_f - d.first)[None, :])
        xs = np.arange(span + 1, dtype=np.int64)
        self.fwd_alive = np.zeros((self.K.shape[0], span + 1), dtype=np.int64)
        for j in range(m):
            self.fwd_alive += d.size[j] * ((rel[j] <= xs)[None, :] & (xs[None, :] <= endf[:, j:j + 1]))
        if d.window is None:
            self.slot_keys = np.zeros(0, dtype=np.int64)
            self.bwd_alive = np.zeros((self.K.shape[0], 0), dtype=np.int64)
            return
        start, end = _intervals(d, self.K, self.rec, tau)
        w0, w1 = d.window
        M1 = m + 1
        compute_keys = np.arange(w1 - w0 + 1, dtype=np.int64) * M1 + m
        recompute_keys = np.unique(start[self.rec])
        self.slot_keys = np.union1d(compute_keys, recompute_keys)
        ks = self.slot_keys
        self.bwd_alive = np.zeros((self.K.shape[0], len(ks)), dtype=np.int64)
        for j in range(m):
            self.bwd_alive += d.size[j] * ((start[:, j:j + 1] <= ks[None, :]) & (ks[None, :] <= end[:, j:j + 1]))

    def peak_terms(self, d: _BlockData, at: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """Per option: the largest outside + own memory over the block's windows (without earlier blocks' bytes)."""
        w = (self.fwd_alive + at[d.first:d.last + 1][None, :]).max(axis=1)
        if len(self.slot_keys):
            m = len(d.local)
            y = d.window[0] + self.slot_keys // (m + 1)
            is_compute = (self.slot_keys % (m + 1)) == m
            base = np.where(is_compute, at[y], pre[y])
            w = np.maximum(w, (self.bwd_alive + base[None, :]).max(axis=1))
        return w


def _pareto3(kb: np.ndarray, w: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the options no other option beats in kept bytes, peak term and cost together."""
    order = np.lexsort((cost, w, kb))
    keep: list[int] = []
    stair_w: list[int] = []  # among kept options so far (all with kb <= current): increasing w, decreasing cost
    stair_c: list[float] = []
    for i in order:
        wi, ci = int(w[i]), float(cost[i])
        k = bisect.bisect_right(stair_w, wi)
        if k and stair_c[k - 1] <= ci:
            continue  # something with kb <= and w <= costs no more
        keep.append(int(i))
        # insert (wi, ci) and drop the entries it dominates (w >= wi and cost >= ci)
        j = k
        while j < len(stair_w) and stair_c[j] >= ci:
            j += 1
        stair_w[k:j] = [wi]
        stair_c[k:j] = [ci]
    return np.array(keep, dtype=np.int64)


class _Plan:
    """The block chain of a graph with its outside memory, ready for the dynamic program at any budget."""

    def __init__(self, graph: Graph, blocks: Blocks, deadline: float | None):
        self.graph = graph
        self.blocks = blocks
        self.data = [_block_data(graph, b) for b in blocks.blocks]
        self.free_event = self._free_events()
        ref_kept = [d_kept_all(d) for d in self.data]
        ops = self.ops(ref_kept)
        sim = simulate(graph, Schedule(tuple(ops)))
        at, pre = _event_memory(graph, ops, sim.timeline_bytes)
        # subtract every block's own values (all kept) to leave the outside memory
        n = graph.n
        diff_at = np.zeros(n + 1, dtype=np.int64)
        diff_pre = np.zeros(n + 1, dtype=np.int64)
        for d in self.data:
            end = np.where(d.has_b, d.last_b, d.last_f)
            for v, e, s in zip(d.local, end, d.size):
                diff_at[v] += s
                diff_at[e + 1] -= s
                diff_pre[v + 1] += s
                diff_pre[e + 1] -= s
        self.at = at - np.cumsum(diff_at)[:n]
        self.pre = pre - np.cumsum(diff_pre)[:n]
        # backward events outside every window: the blocks whose window has not started keep their bytes
        self.level_max = np.full(len(self.data) + 1, -1, dtype=np.int64)
        in_window = np.zeros(n, dtype=bool)
        for d in self.data:
            in_window[d.first:d.last + 1] = True
            if d.window:
                in_window[d.window[0]:d.window[1] + 1] = True
        starts = [d.window[0] if d.window else int(BIG) for d in self.data]
        for y in np.nonzero(~in_window)[0]:
            level = next((s for s, st in enumerate(starts) if st <= y), len(self.data))
            self.level_max[level] = max(self.level_max[level], self.at[y])
        self.shapes: dict[tuple, _Shape] = {}
        self.options = []  # per block: (kept_bytes, peak_term, recompute cost, kept-matrix rows) after pruning
        for b, d in zip(blocks.blocks, self.data):
            check(deadline, "block_dp: enumerating block options")
            shape = self.shapes.get(b.signature)
            if shape is None:
                shape = self.shapes[b.signature] = _Shape(d)
            w = shape.peak_terms(d, self.at, self.pre)
            cost = shape.rec.astype(float) @ graph.costs[d.local]
            keep = _pareto3(shape.kept_bytes, w, cost)
            self.options.append((shape.kept_bytes[keep], w[keep], cost[keep], shape.K[keep]))

    def peak_bytes(self, kept: list[np.ndarray]) -> int:
        """The peak the program counts for one kept flag row per block (the simulator replays the same figure)."""
        P = 0
        peak = int(self.level_max[0])
        for s, (d, K) in enumerate(zip(self.data, kept)):
            shape = _Shape(d, K[None, :])
            peak = max(peak, P + int(shape.peak_terms(d, self.at, self.pre)[0]))
            P += int(shape.kept_bytes[0])
            peak = max(peak, P + int(self.level_max[s + 1]))
        return peak

    def _free_events(self) -> np.ndarray:
        """For each node that is not a block's local value: the event after which it is freed (-1: never)."""
        g = self.graph
        ev = np.array([max(u) if u else i for i, u in enumerate(g.users)], dtype=np.int64)
        for d in self.data:
            if not d.choices or d.window is None:
                continue
            local = set(d.local.tolist())
            for v in d.local:
                for i in g.inputs[v]:
                    if i not in local:
                        ev[i] = max(ev[i], d.window[1])  # a recomputation may read it until the window ends
        for r in g.retained:
            ev[r] = -1
        return ev

    def ops(self, kept: list[np.ndarray]) -> list[Op]:
        """The schedule for one kept flag row per block (local positions)."""
        g = self.graph
        n = g.n
        free_after: dict[int, list[int]] = {}
        local_ids = set()
        recompute_before: dict[int, list[int]] = {}
        free_after_recompute: dict[int, list[int]] = {}
        for d, K in zip(self.data, kept):
            K2 = K[None, :]
            rec, tau = _recompute(d, K2)
            rec, tau = rec[0], tau[0]
            local_ids.update(d.local.tolist())
            m = len(d.local)
            for j, v in enumerate(d.local.tolist()):
                last_read = (int(d.last_b[j]), m) if d.has_b[j] else (-1, -1)
                by_user = max(((int(tau[w]), w) for w in d.fuse[j] if rec[w]), default=(-1, -1))
                if not K[j]:
                    free_after.setdefault(int(d.last_f[j]), []).append(v)  # the forward computation
                    if not rec[j]:
                        continue
                    recompute_before.setdefault(int(tau[j]), []).append(v)
                # a kept or recomputed value is freed after its last read: a backward node or a recomputation
                if by_user > last_read:
                    free_after_recompute.setdefault(int(d.local[by_user[1]]), []).append(v)
                else:
                    free_after.setdefault(last_read[0], []).append(v)
        ev = self.free_event
        for v in range(n):
            if v not in local_ids and ev[v] >= 0:
                free_after.setdefault(int(ev[v]), []).append(v)
        ops: list[Op] = []
        for x in range(n):
            for v in sorted(recompute_before.get(x, ())):
                ops.append(Op(OpKind.COMPUTE, v))
                for u in free_after_recompute.get(v, ()):
                    ops.append(Op(OpKind.FREE, u))
            ops.append(Op(OpKind.COMPUTE, x))
            for v in free_after.get(x, ()):
                ops.append(Op(OpKind.FREE, v))
        return ops

    def solve(self, budget_bytes: int, deadline: float | None, grid: int = GRID, round_up: bool = True):
        """The cheapest option per block on a grid of kept bytes: (recompute cost, kept rows per block) or None.

        The kept bytes so far are counted in units of q = ceil(budget / grid) bytes. Rounded up (each block's kept
        bytes to whole units), every constraint is checked on at least the true bytes: the schedule found fits.
        Rounded down, on at most the true bytes: the cost found is a lower bound for the whole family."""
        B = int(budget_bytes)
        if self.level_max[0] > B:
            return None
        q = max(1, -(-B // grid))
        G = B // q + 1  # states 0 .. G-1 units; more can never fit
        f = np.full(G, np.inf)
        f[0] = 0.0
        back = []
        for s, (kb, w, cost, _) in enumerate(self.options):
            check(deadline, "block_dp: dynamic program")
            units = -(-kb // q) if round_up else kb // q
            room = B - w  # P + w <= B
            limit = np.where(room >= 0, room // q, -1)
            # rounded up: P <= units * q, so units * q <= room suffices; rounded down: P >= units * q, relax to it
            new = np.full(G, np.inf)
            arg = np.full(G, -1, dtype=np.int32)
            for o in range(len(kb)):
                hi = min(int(limit[o]), G - 1 - int(units[o]))
                if hi < 0:
                    continue
                k = int(units[o])
                cand = f[:hi + 1] + cost[o]
                dst = new[k:k + hi + 1]
                better = cand < dst
                dst[better] = cand[better]
                arg[k:k + hi + 1][better] = o
            lm = self.level_max[s + 1]
            if lm >= 0:
                cut = max(0, (B - int(lm)) // q + 1)
                new[cut:] = np.inf
            if not np.isfinite(new).any():
                return None
            back.append(arg)
            f = new
        g = int(np.argmin(f))
        best = float(f[g])
        rows = []
        for s in reversed(range(len(self.options))):
            o = int(back[s][g])
            kb = self.options[s][0]
            rows.append(self.options[s][3][o])
            g -= int(-(-kb[o] // q) if round_up else kb[o] // q)
        rows.reverse()
        return best, rows


def d_kept_all(d: _BlockData) -> np.ndarray:
    """Every value the backward pass reads kept: no recomputation (the reference the outside memory comes from)."""
    return d.has_b.copy()


def _event_memory(graph: Graph, ops: list[Op], timeline: np.ndarray):
    """Memory at each node's (first) computation in `ops`, and just before it (after the previous frees)."""
    n = graph.n
    at = np.zeros(n, dtype=np.int64)
    pre = np.zeros(n, dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    prev = int(graph.fixed_bytes)
    for k, op in enumerate(ops):
        if op.kind is OpKind.COMPUTE and not seen[op.node]:
            seen[op.node] = True
            at[op.node] = timeline[k]
            pre[op.node] = prev
        prev = int(timeline[k])
    return at, pre


def block_dp(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
             max_choices: int = MAX_CHOICES) -> Proposal:
    """The cheapest schedule of FAMILY within `budget_bytes` (see the module doc). `max_choices`: at most this many
    values per block to choose about (the smallest others are kept), 2**max_choices options per block shape.

    Raises GraphError when the graph has no block chain to plan on (solvers.exact.blocks.split_blocks),
    InfeasibleBudgetError when no schedule of the family fits (another schedule may), NoSolutionInTimeError when
    `time_limit_s` runs out first, SolverError if the replayed peak differs from the program's (a bug)."""
    t0 = time.perf_counter()
    deadline = deadline_after(time_limit_s)
    check_budget_floor(graph, budget_bytes, "block_dp")
    blocks = split_blocks(graph, max_choices)
    if blocks is None:
        raise GraphError(f"block_dp: '{graph.name}' has no chain of blocks to plan on (it needs forward nodes "
                         "before backward ones and values the backward pass reads)")
    plan = _Plan(graph, blocks, deadline)
    t_options = time.perf_counter() - t0
    lower = plan.solve(budget_bytes, deadline, round_up=False)
    if lower is None:
        raise InfeasibleBudgetError(int(budget_bytes), None, "block_dp",
                                    "no schedule of block_dp's family fits (a schedule outside it may)")
    upper = plan.solve(budget_bytes, deadline, round_up=True)
    if upper is None:
        raise NoSolutionInTimeError(
            f"block_dp: counted in whole units of {-(-int(budget_bytes) // GRID)} bytes, no schedule of its family "
            "fits, though counted exactly one may", budget_bytes=int(budget_bytes), solver="block_dp")
    schedule = Schedule(tuple(plan.ops(upper[1])))
    sim = simulate(graph, schedule)
    if sim.peak_bytes > budget_bytes:
        raise SolverError(f"block_dp: the replayed peak {sim.peak_bytes} exceeds the budget {budget_bytes}: "
                          "the program's memory accounting is wrong for this graph")
    bound = min(sim.total_cost, graph.total_cost + lower[0])
    gap = (sim.total_cost - bound) / sim.total_cost if sim.total_cost > 0 else 0.0
    info = {"family": FAMILY, "blocks": len(blocks.blocks), "block_shapes": len(plan.shapes),
            "choices": blocks.n_choices, "forced_choices": blocks.forced_choices,
            "family_gap": gap, "options_seconds": round(t_options, 3),
            "seconds": round(time.perf_counter() - t0, 3)}
    status = Status.OPTIMAL if gap <= FAMILY_GAP else Status.FEASIBLE
    return Proposal(schedule, status, lower_bound_cost=bound, info=info)
