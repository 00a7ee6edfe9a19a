"""The project's graph type: a frozen DAG of integer node ids in a topological order.

Node `i` of a graph has id `i`; its inputs all have smaller ids, so ascending ids are a valid
execution order (the *reference order*). `labels` keeps the ids a node had in the file or tool
it came from (a benchmark's node ids, say), so that exports can speak the source's language.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from graphs.errors import GraphError


@dataclass(frozen=True)
class Node:
    """One operation of the graph.

    cost: compute cost of one computation (any unit: FLOPs, seconds, ...; >= 0).
    bytes: bytes the output occupies while resident (>= 0).
    inputs: ids of the nodes whose outputs this node reads.
    backward: part of the backward pass.
    retain: must be resident at the end of the schedule (e.g. a parameter gradient).
    recomputable: may be computed more than once (false for random ops such as dropout).
    """

    id: int
    name: str
    cost: float
    bytes: int
    inputs: tuple[int, ...] = ()
    backward: bool = False
    retain: bool = False
    recomputable: bool = True


@dataclass(frozen=True, eq=False)
class Graph:
    """A validated computation graph. Construct with `Graph(nodes, fixed_bytes=..., name=...)`.

    fixed_bytes: memory resident throughout (parameters, buffers, inputs), added to every figure.
    labels: the node ids of the source (defaults to 0..n-1); unique ints.
    """

    nodes: tuple[Node, ...]
    fixed_bytes: int = 0
    name: str = "graph"
    labels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "fixed_bytes", int(self.fixed_bytes))
        if self.labels is None:
            object.__setattr__(self, "labels", tuple(range(len(self.nodes))))
        else:
            object.__setattr__(self, "labels", tuple(int(x) for x in self.labels))
        _validate(self)

    # ---- sizes and arrays -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def n(self) -> int:
        return len(self.nodes)

    @cached_property
    def costs(self) -> np.ndarray:
        return np.array([nd.cost for nd in self.nodes], dtype=float)

    @cached_property
    def sizes(self) -> np.ndarray:
        """Output bytes per node (int64)."""
        return np.array([nd.bytes for nd in self.nodes], dtype=np.int64)

    @cached_property
    def inputs(self) -> tuple[tuple[int, ...], ...]:
        return tuple(nd.inputs for nd in self.nodes)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the ids of the nodes that read it, ascending."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for nd in self.nodes:
            for i in nd.inputs:
                out[i].append(nd.id)
        return tuple(tuple(u) for u in out)

    @cached_property
    def sinks(self) -> tuple[int, ...]:
        return tuple(i for i, u in enumerate(self.users) if not u)

    @cached_property
    def retained(self) -> tuple[int, ...]:
        return tuple(nd.id for nd in self.nodes if nd.retain)

    @property
    def total_cost(self) -> float:
        """Cost of computing every node once (the denominator of overhead)."""
        return float(self.costs.sum())

    @cached_property
    def label_to_id(self) -> dict[int, int]:
        return {lab: i for i, lab in enumerate(self.labels)}

    def single_op_bound_bytes(self) -> int:
        """max over nodes of fixed + inputs + output bytes: no schedule can peak below it."""
        best = 0
        for nd in self.nodes:
            need = nd.bytes + sum(int(self.nodes[i].bytes) for i in set(nd.inputs))
            best = max(best, need)
        return self.fixed_bytes + best

    def describe(self, i: int) -> str:
        return f"node {self.labels[i]} '{self.nodes[i].name}'"

    # ---- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_unordered(
        cls,
        nodes: Iterable[dict],
        *,
        fixed_bytes: int = 0,
        name: str = "graph",
        order: Sequence[int] | None = None,
    ) -> "Graph":
        """Build from dicts with arbitrary integer `id`s and `inputs` given as ids.

        `order` (a permutation of the ids, topological) becomes the reference order; without
        it the ids are sorted ascending. A cycle or an unknown input id raises GraphError.
        """
        import networkx as nx

        recs = list(nodes)
        by_id: dict[int, dict] = {}
        for r in recs:
            if "id" not in r:
                raise GraphError(f"a node has no 'id': {r!r}")
            if r["id"] in by_id:
                raise GraphError(f"duplicate node id {r['id']}")
            by_id[r["id"]] = r
        for r in recs:
            for i in r.get("inputs", ()):
                if i not in by_id:
                    raise GraphError(f"node {r['id']} '{r.get('name', '')}' reads unknown node id {i}")
        order = sorted(by_id) if order is None else list(order)
        if sorted(order) != sorted(by_id):
            raise GraphError("the order must list every node id exactly once")
        pos = {lab: k for k, lab in enumerate(order)}
        if any(pos[i] >= pos[r["id"]] for r in recs for i in r.get("inputs", ())):
            # not a topological order: name a cycle if there is one (else validation below names the order's fault)
            g = nx.DiGraph()
            g.add_nodes_from(by_id)
            g.add_edges_from((i, r["id"]) for r in recs for i in r.get("inputs", ()))
            try:
                cyc = nx.find_cycle(g)
                raise GraphError(f"the graph has a cycle: {' -> '.join(str(e[0]) for e in cyc)} -> {cyc[0][0]}")
            except nx.NetworkXNoCycle:
                pass
        out = []
        for k, lab in enumerate(order):
            r = by_id[lab]
            out.append(
                Node(
                    id=k,
                    name=str(r.get("name", lab)),
                    cost=r.get("cost", 0.0),
                    bytes=r.get("bytes", 0),
                    inputs=tuple(pos[i] for i in r.get("inputs", ())),
                    backward=bool(r.get("backward", False)),
                    retain=bool(r.get("retain", False)),
                    recomputable=bool(r.get("recomputable", True)),
                )
            )
        return cls(tuple(out), fixed_bytes=fixed_bytes, name=name, labels=tuple(order))


def _validate(g: Graph) -> None:
    if g.fixed_bytes < 0:
        raise GraphError(f"fixed_bytes must be >= 0, got {g.fixed_bytes}")
    n = len(g.nodes)
    if len(g.labels) != n:
        raise GraphError(f"{len(g.labels)} labels for {n} nodes")
    if len(set(g.labels)) != n:
        raise GraphError("node labels must be unique")
    for k, nd in enumerate(g.nodes):
        if not isinstance(nd, Node):
            raise GraphError(f"position {k} holds {type(nd).__name__}, not a Node")
        where = f"node {nd.id} '{nd.name}'"
        if nd.id != k:
            raise GraphError(f"{where} is at position {k}: node ids must be 0..n-1 in order")
        cost = nd.cost
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or math.isnan(cost) or math.isinf(cost):
            raise GraphError(f"{where} has cost {cost!r}: it must be a finite number")
        if cost < 0:
            raise GraphError(f"{where} has negative cost {cost}")
        if not isinstance(nd.bytes, (int, np.integer)) or isinstance(nd.bytes, bool):
            raise GraphError(f"{where} has bytes {nd.bytes!r}: it must be an int")
        if nd.bytes < 0:
            raise GraphError(f"{where} has negative bytes {nd.bytes}")
        if len(set(nd.inputs)) != len(nd.inputs):
            raise GraphError(f"{where} lists an input twice: {nd.inputs}")
        for i in nd.inputs:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise GraphError(f"{where} has input {i!r}: inputs must be int ids")
            if i < 0 or i >= n:
                raise GraphError(f"{where} reads unknown node id {i} (ids are 0..{n - 1})")
            if i == k:
                raise GraphError(f"{where} reads itself: a cycle")
            if i > k:
                raise GraphError(
                    f"{where} reads node {i}, which comes later: ids must be in a topological order"
                    + (" (and the graph has a cycle)" if _has_cycle(g) else "")
                )


def _has_cycle(g: Graph) -> bool:
    import networkx as nx

    dg = nx.DiGraph()
    for nd in g.nodes:
        for i in nd.inputs:
            if 0 <= i < len(g.nodes):
                dg.add_edge(i, nd.id)
    return not nx.is_directed_acyclic_graph(dg)
