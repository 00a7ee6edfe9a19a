"""Graph generators for tests and examples: chains, Checkmate's linear graph, random DAGs."""
from __future__ import annotations

import random
from typing import Sequence

from graphs.ir import Graph, Node


def chain(costs: Sequence[float], sizes: Sequence[int], name: str = "chain") -> Graph:
    """A plain chain 0 -> 1 -> ... -> n-1 (no backward pass)."""
    if len(costs) != len(sizes):
        raise ValueError("costs and sizes must have the same length")
    nodes = [Node(i, f"n{i}", float(c), int(b), (i - 1,) if i else ()) for i, (c, b) in enumerate(zip(costs, sizes))]
    return Graph(tuple(nodes), name=name)


def linear_training_graph(
    n_layers: int,
    costs: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
) -> Graph:
    """Checkmate's linear graph: forward chain 0..L-1, loss L, backward L+1..2L.

    Node i (0 < i <= 2L) reads i-1; backward node 2L-i also reads forward node i for i < L.
    2L+1 nodes; unit cost and unit bytes unless `costs` / `sizes` (length 2L+1) are given.
    """
    L = int(n_layers)
    if L < 1:
        raise ValueError("n_layers must be >= 1")
    n = 2 * L + 1
    costs = [1.0] * n if costs is None else list(costs)
    sizes = [1] * n if sizes is None else list(sizes)
    if len(costs) != n or len(sizes) != n:
        raise ValueError(f"costs and sizes need {n} entries")
    nodes = []
    for i in range(n):
        ins = [i - 1] if i > 0 else []
        if i > L:
            j = 2 * L - i  # forward partner of backward node i
            if j not in ins:
                ins.append(j)
        nodes.append(Node(i, f"{'fwd' if i < L else 'loss' if i == L else 'bwd'}{i}", float(costs[i]), int(sizes[i]),
                          tuple(sorted(ins)), backward=i >= L))
    return Graph(tuple(nodes), name=name or f"linear{L}")


def random_dag(
    n: int,
    seed: int,
    *,
    edge_prob: float = 0.3,
    max_fan_in: int = 3,
    max_cost: int = 10,
    max_bytes: int = 10,
    retain_prob: float = 0.0,
    name: str | None = None,
) -> Graph:
    """A random connected DAG in topological order with integer costs and sizes (>= 1 byte).

    Every node after the first reads its predecessor with probability 1/2 or another earlier
    node, so the graph is connected; extra edges up to `max_fan_in` inputs.
    """
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        ins: set[int] = set()
        if i > 0:
            ins.add(i - 1 if rng.random() < 0.5 else rng.randrange(i))
            for j in range(i):
                if len(ins) >= max_fan_in:
                    break
                if rng.random() < edge_prob / max(1, i) * 2:
                    ins.add(j)
        nodes.append(Node(i, f"v{i}", float(rng.randint(0, max_cost)), rng.randint(1, max_bytes), tuple(sorted(ins)),
                          retain=rng.random() < retain_prob))
    return Graph(tuple(nodes), name=name or f"random{n}_{seed}")


def random_training_graph(n_forward: int, seed: int, *, max_cost: int = 10, max_bytes: int = 10,
                          skip_prob: float = 0.3, name: str | None = None) -> Graph:
    """A random forward DAG plus its mirrored backward pass (a small training graph).

    Forward node i reads i-1 and, with probability skip_prob, one earlier node (a skip). The loss
    reads the last forward node. Backward node for forward i reads the gradient of every forward
    user of i (or the loss) plus the forward inputs of i and i itself, as an autodiff graph does.
    """
    rng = random.Random(seed)
    fwd_inputs: list[tuple[int, ...]] = []
    for i in range(n_forward):
        ins = {i - 1} if i > 0 else set()
        if i > 1 and rng.random() < skip_prob:
            ins.add(rng.randrange(i - 1))
        fwd_inputs.append(tuple(sorted(ins)))
    users: list[list[int]] = [[] for _ in range(n_forward)]
    for i, ins in enumerate(fwd_inputs):
        for j in ins:
            users[j].append(i)
    loss = n_forward
    grad_id = {i: loss + (n_forward - i) for i in range(n_forward)}  # gradient of forward i
    nodes = [Node(i, f"f{i}", float(rng.randint(1, max_cost)), rng.randint(1, max_bytes), fwd_inputs[i])
             for i in range(n_forward)]
    nodes.append(Node(loss, "loss", 1.0, 1, (n_forward - 1,), backward=True))
    for i in reversed(range(n_forward)):
        ins = {grad_id[u] for u in users[i]} or {loss}
        ins |= set(fwd_inputs[i]) | {i}
        nodes.append(Node(grad_id[i], f"g{i}", float(rng.randint(1, max_cost)), rng.randint(1, max_bytes),
                          tuple(sorted(ins)), backward=True))
    nodes.sort(key=lambda nd: nd.id)
    return Graph(tuple(nodes), name=name or f"train{n_forward}_{seed}")
