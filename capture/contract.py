"""Contraction: grouping the ops of a traced aten graph into the nodes the solvers see.

Works on `OpRecord`s (one per fx call_function node, in fx order) and knows nothing of fx.

Groups are formed in three steps:
1. Alias groups (always): an op whose output shares a storage with an earlier op's output (a view,
   `_unsafe_view`, `getitem` of a multi-output op, `alias`, `detach`, ...) joins that op's group.
   The group owns the storage, so it stays alive while any member is still to be read: this is how
   "a view keeps its base alive" is expressed in the graph.
2. Free views of fixed memory (always): a group that allocates nothing, costs nothing and reads only
   fixed memory (e.g. `t` of a weight) folds into its only user group.
3. Cheap chains (`merge_chains=True`): a group of ops without a FLOP formula (elementwise ops,
   reductions, copies) whose only user is another such group in the same phase, neither random nor
   retained, folds into that user, provided the folded value is no larger than the user's own output
   and what the user group already holds (so the group's bytes still bound what the chain keeps).

`contract(..., alias_only_edges=True)` skips grouping entirely (one node per op) and instead adds,
to every op that reads an alias, the ops that own the aliased storage as extra inputs.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class OpRecord:
    """One aten op of the joint graph, as the tracer measured it.

    inputs: indices (into the record list) of the ops whose outputs it reads, ascending.
    shares_with: indices of earlier ops whose output storage its outputs share.
    bytes: bytes of the storages this op newly allocates (0 for a view).
    cost: compute cost in the chosen unit. flops: registry FLOPs (0 when unregistered).
    cheap: no FLOP formula applies (elementwise, reduction, copy, view...).
    """

    name: str
    inputs: tuple[int, ...]
    shares_with: tuple[int, ...]
    bytes: int
    cost: float
    backward: bool
    random: bool
    retain: bool
    cheap: bool
    flops: int = 0
    recomputable: bool = True  # False also for random ops and for secondary outputs of multi-output ops


@dataclass
class Group:
    """A node of the contracted graph: some ops computed together."""

    members: list[int]  # record indices, in fx order
    inputs: tuple[int, ...] = ()  # group ids (after ordering)
    bytes: int = 0
    cost: float = 0.0
    backward: bool = False
    recomputable: bool = True
    retain: bool = False
    anchor: int = 0  # the record whose fx position places the group in the reference order


@dataclass
class Contraction:
    groups: list[Group]  # in a topological reference order
    group_of: list[int] = field(default_factory=list)  # record index -> group id


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i


def contract(records: list[OpRecord], *, merge_chains: bool = False, alias_only_edges: bool = False) -> Contraction:
    """Group `records` (see the module docstring) and order the groups topologically.

    Raises ValueError if the alias groups would form a cycle (an op that aliases one input while
    reading a value computed from that same input); no aten op seen so far does this.
    """
    n = len(records)
    if alias_only_edges:
        return _one_node_per_op(records)
    uf = _UnionFind(n)
    anchor = list(range(n))  # per root

    def union(a: int, b: int, anchor_from: int | None = None) -> int:
        ra, rb = uf.find(a), uf.find(b)
        if ra == rb:
            return ra
        new_anchor = min(anchor[ra], anchor[rb]) if anchor_from is None else anchor[uf.find(anchor_from)]
        uf.parent[rb] = ra
        anchor[ra] = new_anchor
        return ra

    # 1. alias groups
    for i, r in enumerate(records):
        for j in r.shares_with:
            union(j, i)

    def group_users() -> dict[int, set[int]]:
        users: dict[int, set[int]] = {}
        for i, r in enumerate(records):
            gi = uf.find(i)
            for j in r.inputs:
                gj = uf.find(j)
                if gj != gi:
                    users.setdefault(gj, set()).add(gi)
        return users

    def members_by_root() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i in range(n):
            out.setdefault(uf.find(i), []).append(i)
        return out

    # 2. free views of fixed memory fold into their only user
    mem = members_by_root()
    users = group_users()
    for root, ms in mem.items():
        reads_ops = any(uf.find(j) != root for i in ms for j in records[i].inputs)
        free = all(records[i].bytes == 0 and records[i].cost == 0 for i in ms)
        retained = any(records[i].retain for i in ms)
        us = users.get(root, set())
        if free and not reads_ops and not retained and len(us) == 1:
            (user,) = us
            union(user, root, anchor_from=user)

    # 2b. secondary outputs of one multi-output op with the same readers and the same fate (e.g. a
    # layer norm's mean and rstd, a backward op's weight and bias gradients) live and die together
    sibling: dict[tuple, int] = {}
    mem = members_by_root()
    users = group_users()
    for root, ms in mem.items():
        if len(ms) != 1 or records[ms[0]].recomputable:
            continue
        r = records[ms[0]]
        key = (r.inputs, frozenset(users.get(root, ())), r.retain, r.backward, r.random)
        if key in sibling:
            union(sibling[key], root)
        else:
            sibling[key] = root

    # 3. cheap chains, in fx order: a group folds into its only user
    if merge_chains:
        changed = True
        while changed:
            changed = False
            mem = members_by_root()
            users = group_users()
            held = {root: sum(records[i].bytes for i in ms) for root, ms in mem.items()}
            for root in sorted(mem, key=lambda g: anchor[g]):
                if uf.find(root) != root:
                    continue
                us = users.get(root, set())
                if len(us) != 1:
                    continue
                (user,) = us
                user = uf.find(user)
                if user == root:
                    continue
                if not _chain_ok(records, mem[root], mem.get(user, []), held.get(root, 0), held.get(user, 0)):
                    continue
                new_root = union(user, root, anchor_from=user)
                mem[new_root] = mem.get(user, []) + mem[root]
                held[new_root] = held.get(user, 0) + held[root]
                changed = True
            # users changed: recompute and sweep again until nothing folds
    return _order_groups(records, [uf.find(i) for i in range(n)], anchor)


def _chain_ok(records: list[OpRecord], ms: list[int], us: list[int], held: int, user_held: int) -> bool:
    if not ms or not us:
        return False
    if any(_pinned(records[i]) or records[i].retain or not records[i].cheap for i in ms):
        return False
    if any(_pinned(records[i]) or not records[i].cheap for i in us):
        return False
    phase = {records[i].backward for i in ms} | {records[i].backward for i in us}
    if len(phase) != 1:
        return False
    return held <= user_held


def _pinned(r: OpRecord) -> bool:
    return r.random or not r.recomputable


def _order_groups(records: list[OpRecord], root_of: list[int], anchor: list[int]) -> Contraction:
    roots = sorted(set(root_of), key=lambda g: anchor[g])
    members: dict[int, list[int]] = {g: [] for g in roots}
    for i, g in enumerate(root_of):
        members[g].append(i)
    ext_inputs: dict[int, set[int]] = {g: set() for g in roots}
    for i, r in enumerate(records):
        for j in r.inputs:
            if root_of[j] != root_of[i]:
                ext_inputs[root_of[i]].add(root_of[j])
    users: dict[int, list[int]] = {g: [] for g in roots}
    indeg = {g: len(ext_inputs[g]) for g in roots}
    for g in roots:
        for h in ext_inputs[g]:
            users[h].append(g)
    heap = [(anchor[g], g) for g in roots if indeg[g] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, g = heapq.heappop(heap)
        order.append(g)
        for u in users[g]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (anchor[u], u))
    if len(order) != len(roots):
        stuck = [records[members[g][0]].name for g in roots if indeg[g] > 0][:5]
        raise ValueError(f"alias grouping made a cycle among the ops {stuck}")
    gid = {g: k for k, g in enumerate(order)}
    read_outside: set[int] = set()
    for i, r in enumerate(records):
        for j in r.inputs:
            if root_of[j] != root_of[i]:
                read_outside.add(j)
    groups = []
    for g in order:
        ms = members[g]
        a = anchor[g]
        groups.append(
            Group(
                members=ms,
                inputs=tuple(sorted(gid[h] for h in ext_inputs[g])),
                bytes=_high_water_bytes(records, ms, read_outside),
                cost=float(sum(records[i].cost for i in ms)),
                backward=records[a].backward,
                recomputable=not any(_pinned(records[i]) for i in ms),
                retain=any(records[i].retain for i in ms),
                anchor=a,
            )
        )
    return Contraction(groups, [gid[root_of[i]] for i in range(len(records))])


def _high_water_bytes(records: list[OpRecord], ms: list[int], read_outside: set[int]) -> int:
    """Most bytes a group's members hold at once when it runs its ops in fx order.

    A member's value lives until its last reader inside the group, or to the end when it is read
    outside the group or retained; an alias member extends the life of the storage it shares. For a
    group of aliases this is the sum of their new bytes; for a merged chain it is the chain's
    transient peak, which is what the group adds to memory while it runs (an overestimate of what it
    holds afterwards, never an underestimate).
    """
    if len(ms) == 1:
        return int(records[ms[0]].bytes)
    inside = set(ms)
    end = len(records)
    last = {i: (end if (i in read_outside or records[i].retain) else i) for i in ms}
    for i in ms:
        for j in records[i].inputs:
            if j in inside:
                last[j] = max(last[j], i)
    for i in reversed(ms):  # aliases keep the storages they share alive
        for j in records[i].shares_with:
            if j in inside:
                last[j] = max(last[j], last[i])
    live = peak = 0
    frees: dict[int, int] = {}
    for i in ms:
        live += records[i].bytes
        peak = max(peak, live)
        frees.setdefault(last[i], 0)
        frees[last[i]] += records[i].bytes
        live -= frees.pop(i, 0)
    return int(peak)


def _one_node_per_op(records: list[OpRecord]) -> Contraction:
    """No grouping: readers of an alias also read the ops that own its storage (transitively)."""
    owners: list[set[int]] = []
    for i, r in enumerate(records):
        s = set(r.shares_with)
        for j in r.shares_with:
            s |= owners[j]
        owners.append(s)
    # an alias that must survive to the end keeps the storage's owners alive to the end too
    retained_readers: list[list[OpRecord]] = [[] for _ in records]
    for i, r in enumerate(records):
        for j in owners[i]:
            retained_readers[j].append(r)
    groups = []
    for i, r in enumerate(records):
        ins = set(r.inputs)
        for j in r.inputs:
            ins |= owners[j]
        ins.discard(i)
        groups.append(
            Group(
                members=[i],
                inputs=tuple(sorted(ins)),
                bytes=r.bytes,
                cost=float(r.cost),
                backward=r.backward,
                recomputable=not _pinned(r),
                retain=r.retain or any(r2.retain for r2 in retained_readers[i]),
                anchor=i,
            )
        )
    return Contraction(groups, list(range(len(records))))
