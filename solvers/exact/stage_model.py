"""Checkmate's frontier-advancing stage representation, shared by the MILP, its LP relaxation and LP rounding.

The schedule family ("stage family"): stage t (t = 0..n-1) first recomputes some nodes with ids < t, in
ascending id order, and then computes node t for the first time. So first computations follow the reference
order, and a node is computed at most once per stage. Values are freed right after their last use
(`Schedule.from_sequence`). Checkmate (Jain et al., MLSys 2020) calls this the frontier-advancing restriction.

Matrices (numpy bool, n x n or (n+1) x n), indexed [stage, node]:
- R[t, i]: node i is computed in stage t (R[t, t] is always true; only i <= t may be true).
- S[t, i]: the value of node i is resident when stage t begins (only i < t); row n is the end of the schedule
  (exactly the retained nodes).
- FREE[t, i, k]: the value of i is freed right after computing k in stage t (i is k or an input of k).
Memory while computing k in stage t is fixed + sum_i S[t, i] bytes_i + (bytes of what stage t computed up to k
and has not freed yet), which is the simulator's "resident values plus the output of k".
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from graphs.ir import Graph
from graphs.schedule import Op, OpKind, Schedule
from solvers.deadline import passed


def sequence_from_stages(graph: Graph, R: np.ndarray, S: np.ndarray | None = None) -> list[int]:
    """The compute sequence of stage matrices: stage by stage, the recomputed ids ascending, then t.

    With S given, a recomputation of a value that is already resident at the stage start is dropped (it could
    only cost more and use more memory; `from_sequence` would otherwise keep the older copy until its last use).
    """
    seq: list[int] = []
    for t in range(graph.n):
        for i in range(t):
            if R[t, i] and not (S is not None and S[t, i]):
                seq.append(i)
        seq.append(t)
    return seq


def stages_from_sequence(graph: Graph, sequence: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """(R, S) of a sequence in the stage family, with S the residency of `Schedule.from_sequence` at each stage
    start (row n: what is resident at the end). None when the sequence is not in the family."""
    n = graph.n
    R = np.zeros((n, n), dtype=bool)
    t = 0
    pending: list[int] = []
    for v in sequence:
        if t >= n:
            return None
        if v == t:
            if any(a >= b for a, b in zip(pending, pending[1:])) or any(i >= t for i in pending):
                return None
            for i in pending:
                R[t, i] = True
            R[t, t] = True
            pending = []
            t += 1
        else:
            pending.append(int(v))
    if t != n or pending:
        return None
    sched = Schedule.from_sequence(graph, sequence)
    S = np.zeros((n + 1, n), dtype=bool)
    resident = np.zeros(n, dtype=bool)
    stage, started = 0, False
    for op in sched.ops:
        if op.kind is OpKind.COMPUTE:
            if not started:  # the first computation of a stage: what is resident now was kept for it
                S[stage] = resident
                started = True
            resident[op.node] = True
            if op.node == stage:
                stage, started = stage + 1, False
        else:
            resident[op.node] = False
    S[n] = resident
    return R, S


def free_matrix(graph: Graph, R: np.ndarray, S: np.ndarray) -> dict[tuple[int, int, int], bool]:
    """FREE[t, i, k] implied by (R, S): free i after computing k in stage t when k is the last node of the
    stage that reads i (or i itself when no later node of the stage reads it) and i is not kept for stage t+1."""
    n = graph.n
    out: dict[tuple[int, int, int], bool] = {}
    users = graph.users
    for t in range(n):
        for k in range(t + 1):
            for i in (*graph.inputs[k], k):
                later = any(R[t, j] for j in users[i] if k < j <= t)
                out[(t, i, k)] = bool(R[t, k] and not S[t + 1, i] and not later)
    return out


def modeled_memory(graph: Graph, R: np.ndarray, S: np.ndarray,
                   FREE: dict[tuple[int, int, int], bool] | None = None) -> np.ndarray:
    """U[t, k]: the MILP's memory (bytes) while computing k in stage t (k <= t; defined for every k <= t, and
    only meaningful where R[t, k]). The recurrence the MILP uses, evaluated exactly in integers."""
    n = graph.n
    if FREE is None:
        FREE = free_matrix(graph, R, S)
    m = [int(x) for x in graph.sizes]
    U = np.zeros((n, n), dtype=object)
    for t in range(n):
        cur = graph.fixed_bytes + sum(m[i] for i in range(t) if S[t, i])
        for k in range(t + 1):
            if k > 0:
                cur -= sum(m[i] for i in (*graph.inputs[k - 1], k - 1) if FREE.get((t, i, k - 1), False))
            cur += m[k] if R[t, k] else 0
            U[t, k] = cur
    return U


def literal_schedule(graph: Graph, R: np.ndarray, S: np.ndarray,
                     FREE: dict[tuple[int, int, int], bool]) -> Schedule:
    """The schedule the stage variables describe, frees included: compute per R; after computing k free each
    value with FREE[t, i, k]; at the end of stage t free every resident value not in S[t+1].

    Used to check that the MILP's memory model is the simulator's: simulating this schedule gives a peak
    equal to the largest U[t, k] over computed (t, k)."""
    n = graph.n
    ops: list[Op] = []
    resident = np.zeros(n, dtype=bool)
    for t in range(n):
        for k in range(t + 1):
            if not R[t, k]:
                continue
            ops.append(Op(OpKind.COMPUTE, k))
            resident[k] = True
            for i in dict.fromkeys((*graph.inputs[k], k)):
                if FREE.get((t, i, k), False) and resident[i]:
                    ops.append(Op(OpKind.FREE, i))
                    resident[i] = False
        for i in range(n):
            if resident[i] and not S[t + 1, i]:
                ops.append(Op(OpKind.FREE, i))
                resident[i] = False
    return Schedule(tuple(ops))


def recompute_for_kept(graph: Graph, S: np.ndarray, deadline: float | None = None) -> np.ndarray | None:
    """The cheapest recomputation R for a kept pattern S (Checkmate's rule for rounding).

    Within stage t, node i < t is recomputed exactly when it is needed and not resident: some node computed
    later in the stage reads it, or S[t+1] wants it and S[t] lacks it. Decided from t-1 down to 0.
    Non-recomputable nodes are never recomputed: their one computation stays resident until its last use
    (as `Schedule.from_sequence` keeps it), whatever S says. None once `deadline` (time.perf_counter()) passes
    (quadratic in the nodes: about a second for 1000).
    """
    n = graph.n
    R = np.zeros((n, n), dtype=bool)
    users = graph.users
    fixed = [not nd.recomputable for nd in graph.nodes]
    for t in range(n):
        if deadline is not None and t % 64 == 0 and passed(deadline):
            return None
        R[t, t] = True
        for i in range(t - 1, -1, -1):
            if S[t, i] or fixed[i]:
                continue
            needed = bool(S[t + 1, i]) or any(R[t, j] for j in users[i] if j <= t)
            R[t, i] = needed
    return R


def stage_cost(graph: Graph, R: np.ndarray) -> float:
    return float((R.sum(axis=0) * graph.costs).sum())


def ratio_kept_sequences(graph: Graph, max_thresholds: int = 32, deadline: float | None = None):
    """Stage-family sequences from a simple keep policy, for warm starts (a generator): keep the values whose cost
    per byte is at least a threshold (expensive, small values are worth their memory), for up to `max_thresholds`
    thresholds spread over the distinct scores; the rest is recomputed where needed (`recompute_for_kept`).
    Thresholds not finished by `deadline` (time.perf_counter()) are left out (a 1000-node graph: seconds each)."""
    n = graph.n
    sizes = graph.sizes.astype(float)
    score = graph.costs / np.maximum(sizes, 1.0)
    distinct = np.unique(score)
    if len(distinct) > max_thresholds:
        distinct = distinct[np.unique(np.linspace(0, len(distinct) - 1, max_thresholds).round().astype(int))]
    for theta in [*distinct.tolist(), np.inf]:
        if passed(deadline):
            return
        keep = score >= theta
        S = np.zeros((n + 1, n), dtype=bool)
        for i in np.nonzero(keep)[0]:
            S[i + 1:n, i] = True
        S[n, list(graph.retained)] = True
        R = recompute_for_kept(graph, S, deadline)
        if R is None:
            return
        yield sequence_from_stages(graph, R, S)


def project_to_stage_family(graph: Graph, sequence: Sequence[int]) -> list[int] | None:
    """The stage-family sequence closest to `sequence`: between the first computations of t-1 and t, the
    nodes it (re)computes are kept once each, in ascending order. None when its first computations are not in
    ascending id order (then no stage of the family matches them). Memory may differ: simulate the result."""
    seen = 0  # next node expected to be computed for the first time
    out: list[int] = []
    pending: set[int] = set()
    for v in sequence:
        v = int(v)
        if v == seen:
            out.extend(sorted(pending))
            out.append(v)
            pending.clear()
            seen += 1
        elif v < seen:
            pending.add(v)
        else:
            return None
    if seen != graph.n:
        return None
    return out
