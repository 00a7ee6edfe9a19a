"""Graph generators for tests and examples: chains, Checkmate's linear graph, random DAGs and training graphs."""
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
    nodes = [Node(i, f"f{i}", float(rng.randint(1, max_cost)), rng.randint(1, max_bytes), fwd_inputs[i])
             for i in range(n_forward)]
    return _with_backward(nodes, lambda i: (float(rng.randint(1, max_cost)), rng.randint(1, max_bytes)),
                          name or f"train{n_forward}_{seed}")


def _with_backward(forward: list[Node], grad_cost_bytes, name: str, grad_name=lambda i: f"g{i}") -> Graph:
    """`forward` (nodes 0..n-1) plus a loss reading the last node and a mirrored backward pass: the gradient of
    forward node i reads the gradient of every forward user of i (or the loss), the forward inputs of i and i
    itself, as an autodiff graph does. `grad_cost_bytes(i)` gives the (cost, bytes) of i's gradient; it is called
    for i = n-1 down to 0."""
    n_forward = len(forward)
    users: list[list[int]] = [[] for _ in range(n_forward)]
    for nd in forward:
        for j in nd.inputs:
            users[j].append(nd.id)
    loss = n_forward
    grad_id = {i: loss + (n_forward - i) for i in range(n_forward)}  # gradient of forward i
    nodes = list(forward)
    nodes.append(Node(loss, "loss", 1.0, 1, (n_forward - 1,), backward=True))
    for i in reversed(range(n_forward)):
        ins = {grad_id[u] for u in users[i]} or {loss}
        ins |= set(forward[i].inputs) | {i}
        cost, size = grad_cost_bytes(i)
        nodes.append(Node(grad_id[i], grad_name(i), float(cost), int(size), tuple(sorted(ins)),
                          backward=True))
    nodes.sort(key=lambda nd: nd.id)
    return Graph(tuple(nodes), name=name)


def decoder_training_graph(n_layers: int, seed: int = 0, *, seq: int = 512, width: int = 768, heads: int = 12,
                           jitter: float = 0.1, name: str | None = None) -> Graph:
    """A training graph shaped like a decoder-only transformer: an embedding, `n_layers` blocks (layer norm, QKV
    projection, attention scores and softmax and dropout as wide as heads x seq x seq, attention output,
    projection, residual sum, layer norm, MLP of 4 x width with GELU, residual sum), a final norm and the loss, then
    the mirrored backward pass (`_with_backward`). Bytes are float32 elements; costs are FLOPs, each scaled by a
    random factor in [1 - jitter, 1 + jitter] (as measured op times vary); gradients cost twice their op. About 27
    nodes a layer (48 layers: 1253 nodes)."""
    rng = random.Random(seed)
    S, w = int(seq), int(width)
    hidden, scores = 4 * S * w, 4 * heads * S * S
    fwd: list[Node] = []
    grad_cost: list[float] = []

    def op(kind: str, flops: float, size: int, *inputs: int) -> int:
        i = len(fwd)
        c = float(flops) * (1 + jitter * (2 * rng.random() - 1))
        fwd.append(Node(i, f"{kind}_{i}", c, int(size), tuple(sorted(set(inputs)))))
        grad_cost.append(2 * c)
        return i

    h = op("embedding", S * w, hidden)
    for _ in range(int(n_layers)):
        ln1 = op("layer_norm", 5 * S * w, hidden, h)
        qkv = op("addmm", 2 * S * w * 3 * w, 3 * hidden, ln1)
        sc = op("bmm", 2 * S * S * w, scores, qkv)
        sm = op("softmax", 5 * heads * S * S, scores, sc)
        dr = op("dropout", 2 * heads * S * S, scores + scores // 4, sm)
        at = op("bmm", 2 * S * S * w, hidden, dr, qkv)
        pr = op("addmm", 2 * S * w * w, hidden, at)
        h1 = op("add", S * w, hidden, h, pr)
        ln2 = op("layer_norm", 5 * S * w, hidden, h1)
        fc = op("addmm", 2 * S * w * 4 * w, 4 * hidden, ln2)
        ge = op("gelu", 8 * S * 4 * w, 4 * hidden, fc)
        f2 = op("addmm", 2 * S * 4 * w * w, hidden, ge)
        h = op("add", S * w, hidden, h1, f2)
    op("layer_norm", 5 * S * w, hidden, h)
    return _with_backward(fwd, lambda i: (grad_cost[i], fwd[i].bytes), name or f"decoder{n_layers}_{seed}",
                          grad_name=lambda i: f"grad_{fwd[i].name}")
