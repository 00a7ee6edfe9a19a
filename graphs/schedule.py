"""Schedules (sequences of compute / free operations) and statuses."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from graphs.ir import Graph


class OpKind(str, Enum):
    COMPUTE = "compute"
    FREE = "free"


@dataclass(frozen=True)
class Op:
    kind: OpKind
    node: int

    def __iter__(self):  # so that `kind, node = op` works
        yield self.kind
        yield self.node


class Status(str, Enum):
    """How good a returned schedule is known to be."""

    OPTIMAL = "optimal"  # proven minimum cost (within the solver's stated gap)
    # proven minimum over a family of schedules only (a portfolio's answer whose bound covers that family alone; the
    # result's info names the family under "bound_scope")
    OPTIMAL_IN_FAMILY = "optimal in its family"
    FEASIBLE = "feasible"  # an exact solver's incumbent when its limit was reached
    HEURISTIC = "heuristic"  # a heuristic's schedule: valid, no optimality claim


@dataclass(frozen=True)
class Schedule:
    """A sequence of operations over a graph's node ids."""

    ops: tuple[Op, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def computes(self) -> list[int]:
        """The node ids computed, in order (a node appears again when it is recomputed)."""
        return [op.node for op in self.ops if op.kind is OpKind.COMPUTE]

    @classmethod
    def from_pairs(cls, pairs: Iterable[Sequence]) -> "Schedule":
        return cls(tuple(Op(OpKind(k), int(v)) for k, v in pairs))

    def to_pairs(self) -> list[list]:
        return [[op.kind.value, op.node] for op in self.ops]

    @classmethod
    def from_sequence(cls, graph: "Graph", sequence: Sequence[int]) -> "Schedule":
        """The schedule that computes `sequence` in order and frees every value right after its last use.

        A computation of v serves the uses of v up to the next computation of v. A value whose
        computation serves no use is freed right after it is computed, unless it is retained and
        this is its last computation. Freeing at last use is optimal for a fixed sequence.
        """
        seq = [int(v) for v in sequence]
        n = graph.n
        # For each position k, the position of the last use it serves (or -1: none).
        last_use = [-1] * len(seq)
        current: dict[int, int] = {}  # node -> position of its latest computation
        for k, v in enumerate(seq):
            for i in graph.inputs[v] if 0 <= v < n else ():
                if i in current:
                    last_use[current[i]] = k
            current[v] = k
        is_last_computation = [False] * len(seq)
        for v, k in current.items():
            is_last_computation[k] = True
        retain = {i for i in graph.retained}
        free_after: dict[int, list[int]] = {}
        keep_forever = set()
        for k, v in enumerate(seq):
            if is_last_computation[k] and v in retain:
                keep_forever.add(k)
                continue
            free_after.setdefault(max(last_use[k], k), []).append(v)
        ops: list[Op] = []
        for k, v in enumerate(seq):
            ops.append(Op(OpKind.COMPUTE, v))
            for dead in free_after.get(k, ()):  # inputs first, then v itself if it is unused
                ops.append(Op(OpKind.FREE, dead))
        return cls(tuple(ops))
