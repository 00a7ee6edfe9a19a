"""A greedy member of the CP-SAT family within a budget, to warm-start CP-SAT where no baseline fits.

Runs the stages in the reference order. Before stage k computes node k, every missing input (and, recursively,
its missing ancestors) is recomputed in ascending id order. Before each computation, while memory (fixed bytes,
resident values, the new output) would exceed the budget, one resident value is evicted: the one with the largest
score (steps until its next use) x bytes / (1 + cost of recomputing it with its missing ancestors), among values
that the stage still needs, retained values, and values that could not be recomputed within the family's limit
(C computations per node) excluded. Evicting is freeing after the value's last use so far, so it never raises
memory at earlier events. A value is dropped once no later first computation reads it.
Returns the compute sequence, or None when the greedy gets stuck; the simulator has the last word.
"""
from __future__ import annotations

from graphs.ir import Graph
from graphs.schedule import Schedule
from graphs.simulate import simulate
from solvers.deadline import passed
from solvers.exact.cpsat_family import computation_limits, family_form


def _missing_closure(graph: Graph, roots, resident: set[int]) -> set[int]:
    out: set[int] = set()
    stack = [r for r in roots if r not in resident]
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.add(x)
        stack.extend(i for i in graph.inputs[x] if i not in resident and i not in out)
    return out


def _gone_closure(graph: Graph, v: int, resident: set[int], when: int) -> set[int]:
    """Ancestors that recomputing v at stage `when` needs recomputed too: those not resident by then."""
    out: set[int] = set()
    stack = list(graph.inputs[v])
    while stack:
        a = stack.pop()
        if a in out:
            continue
        users = graph.users[a]
        gone = a not in resident or (not graph.nodes[a].retain and max(users) < when)
        if gone:
            out.add(a)
            stack.extend(graph.inputs[a])
    return out


def _needed_back(graph: Graph, pending: set[int], resident: set[int], next_use, k: int) -> set[int]:
    """Resident values that bringing back the evicted (pending) values will read."""
    out: set[int] = set()
    for p in pending:
        when = next_use(p, k) or k
        for a in _gone_closure(graph, p, resident, when) | {p}:
            out.update(i for i in graph.inputs[a] if i in resident)
    return out


def greedy_family_sequence(graph: Graph, budget_bytes: int, max_computations: int = 2,
                           size_power: float = 1.0, deadline: float | None = None) -> list[int] | None:
    """A family member's compute sequence that the greedy keeps within `budget_bytes`, or None (also when
    `deadline`, a time.perf_counter() value, passes first)."""
    n = graph.n
    sizes = [int(b) for b in graph.sizes]
    costs = [float(c) for c in graph.costs]
    limits = computation_limits(graph, max_computations)
    users = graph.users
    retained = set(graph.retained)
    count = [0] * n
    resident: set[int] = set()
    mem = int(graph.fixed_bytes)
    seq: list[int] = []
    pending: set[int] = set()  # evicted values that a later computation reads

    def next_use(v: int, k: int) -> int | None:
        for w in users[v]:  # ascending
            if w > k:
                return w
        return None

    for k in range(n):
        if passed(deadline):
            return None
        pending = {p for p in pending if next_use(p, k - 1) is not None}
        todo = sorted(_missing_closure(graph, graph.inputs[k], resident)) + [k]
        for x in todo[:-1]:
            if count[x] >= limits[x]:
                return None
        for x in todo:
            pending.discard(x)
        for pos, x in enumerate(todo):
            # inputs of this stage's remaining computations, and what evicted values will need to come back
            pinned = {i for y in todo[pos:] for i in graph.inputs[y]}
            pinned |= _needed_back(graph, pending, resident, next_use, k)
            while mem + sizes[x] > budget_bytes:
                best, best_score = None, -1.0
                for v in resident:
                    if v in pinned or v in retained or count[v] >= limits[v]:
                        continue
                    nu = next_use(v, k)
                    if nu is None:
                        continue
                    need = _gone_closure(graph, v, resident, nu)
                    if any(count[a] >= limits[a] for a in need):
                        continue
                    rcost = costs[v] + sum(costs[a] for a in need)
                    score = (nu - k) * (sizes[v] ** size_power) / (1.0 + rcost)
                    if score > best_score:
                        best, best_score = v, score
                if best is None:
                    return None
                resident.discard(best)
                pending.add(best)
                mem -= sizes[best]
            seq.append(x)
            count[x] += 1
            resident.add(x)
            mem += sizes[x]
            # drop what nothing later in this stage nor any later first computation reads
            later = {i for y in todo[pos + 1:] for i in graph.inputs[y]}
            later |= _needed_back(graph, pending, resident, next_use, k)
            for v in list(resident):
                if v not in later and v not in retained and next_use(v, k) is None:
                    resident.discard(v)
                    mem -= sizes[v]
    if family_form(graph, seq, max_computations) is None:
        return None
    return seq


def best_greedy_sequence(graph: Graph, budget_bytes: int, max_computations: int = 2,
                         variants: tuple[float, ...] = (1.0, 0.5, 2.0, 0.0), deadline: float | None = None
                         ) -> list[int] | None:
    """The cheapest of a few greedy variants that fits the budget in the simulator, or None. Variants not
    finished by `deadline` (time.perf_counter()) are left out."""
    best, best_cost = None, None
    for p in variants:
        seq = greedy_family_sequence(graph, budget_bytes, max_computations, size_power=p, deadline=deadline)
        if seq is None:
            continue
        sim = simulate(graph, Schedule.from_sequence(graph, seq))
        if sim.peak_bytes <= budget_bytes and (best_cost is None or sim.total_cost < best_cost):
            best, best_cost = seq, sim.total_cost
    return best
