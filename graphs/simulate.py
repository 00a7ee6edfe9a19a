"""The one memory simulator: replays a schedule, validates it, and measures peak and cost.

Memory model (../shared/benchmarks/README.md, plus fixed bytes and retained values):
computing v needs every input of v resident; memory while computing v is fixed_bytes plus the
bytes of every resident value plus v's output. Freeing only lowers memory. Peak is the maximum
over the schedule; cost is the sum of the costs of every computation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphs.errors import ScheduleError
from graphs.ir import Graph
from graphs.schedule import OpKind, Schedule


@dataclass(frozen=True)
class SimResult:
    peak_bytes: int
    total_cost: float
    overhead: float  # total_cost / graph.total_cost - 1 (0 when the graph costs nothing)
    timeline_bytes: np.ndarray  # memory during each op: compute = resident + output, free = after the free
    compute_counts: np.ndarray  # how many times each node is computed
    peak_op_index: int  # the op where the peak is first reached (-1 for an empty schedule)

    @property
    def recomputed(self) -> list[int]:
        return [int(i) for i in np.nonzero(self.compute_counts > 1)[0]]


def simulate(graph: Graph, schedule: Schedule, co_outputs=None) -> SimResult:
    """Replay `schedule` on `graph`. Raises ScheduleError (naming the op) if it is invalid.

    co_outputs (optional): node -> the nodes its operation allocates along with its own output (a multi-output
    op's other outputs, each a node of its own). Computing the node then also holds all of them for the length
    of the op: those the schedule does not compute next are dropped at once, those it does are the same storage
    (counted again at their own compute, when the peak at the op already covered them). This is exact for the
    executor; solvers instead count them in the node's size (see planner.core.solver_graph), which over-counts.

    Invalid: an unknown node id; computing v while an input is not resident; computing a value
    that is already resident; recomputing a non-recomputable node; freeing a value that is not
    resident; a sink never computed; a retained node not resident at the end.
    """
    n = graph.n
    sizes = graph.sizes
    costs = graph.costs
    inputs = graph.inputs
    resident = np.zeros(n, dtype=bool)
    counts = np.zeros(n, dtype=np.int64)
    mem = int(graph.fixed_bytes)
    peak = mem
    peak_at = -1
    total = 0.0
    timeline = np.zeros(len(schedule.ops), dtype=np.int64)
    for k, op in enumerate(schedule.ops):
        v = op.node
        if not (0 <= v < n):
            raise ScheduleError(f"op {k} ({op.kind.value} {v}): unknown node id (graph has {n} nodes)", k)
        if op.kind is OpKind.COMPUTE:
            for i in inputs[v]:
                if not resident[i]:
                    raise ScheduleError(
                        f"op {k} (compute {graph.describe(v)}): input {graph.describe(i)} is not resident", k
                    )
            if resident[v]:
                raise ScheduleError(f"op {k} (compute {graph.describe(v)}): the value is already resident", k)
            if counts[v] >= 1 and not graph.nodes[v].recomputable:
                raise ScheduleError(f"op {k} (compute {graph.describe(v)}): the node is not recomputable", k)
            mem += int(sizes[v])
            resident[v] = True
            counts[v] += 1
            total += float(costs[v])
            at_op = mem
            if co_outputs is not None and v in co_outputs:
                at_op += sum(int(sizes[s]) for s in co_outputs[v])
            if at_op > peak:
                peak, peak_at = at_op, k
        elif op.kind is OpKind.FREE:
            if not resident[v]:
                raise ScheduleError(f"op {k} (free {graph.describe(v)}): the value is not resident", k)
            resident[v] = False
            mem -= int(sizes[v])
        else:  # pragma: no cover - OpKind is closed
            raise ScheduleError(f"op {k}: unknown kind {op.kind!r}", k)
        timeline[k] = mem
    for s in graph.sinks:
        if counts[s] == 0:
            raise ScheduleError(f"the schedule never computes sink {graph.describe(s)}")
    for r in graph.retained:
        if not resident[r]:
            raise ScheduleError(f"retained {graph.describe(r)} is not resident at the end of the schedule")
    base = graph.total_cost
    overhead = total / base - 1.0 if base > 0 else 0.0
    return SimResult(int(peak), float(total), float(overhead), timeline, counts, int(peak_at))


def reference_peak_bytes(graph: Graph) -> int:
    """Peak of the reference order (ascending ids) with no recomputation, freeing at last use."""
    return simulate(graph, Schedule.from_sequence(graph, range(graph.n))).peak_bytes


def budget_from_multiplier(graph: Graph, multiplier: float) -> int:
    """ceil(multiplier x reference peak), in bytes (the benchmarks' budget rule)."""
    import math
    from fractions import Fraction

    # Fraction(str(m)) reads 0.9 as 9/10 exactly, so the product is not blurred by binary floats.
    return int(math.ceil(Fraction(str(multiplier)) * reference_peak_bytes(graph)))
