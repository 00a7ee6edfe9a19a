"""Tests of solvers.exact.chain_dp: exact over its family, checked against two exhaustive searches.

- tests/solvers/exhaustive.py searches every schedule: chain_dp can only be >= it. On unit-size chains
  (any costs) they agree on every case tried.
- `family_optimal_cost` below searches exactly chain_dp's family by brute force: chain_dp must equal it
  on every chain, whatever the sizes. The family: each backward node (and the loss) computed once; a
  forward value that served as the input of two sweeps (a checkpoint) stays resident until its backward
  node; a forward value is only computed when no forward value at or above it is resident (sweeps start
  from the highest resident value: the stack order of the recursion).
- Two named chains show the schedules outside the family that beat it with heterogeneous sizes.
"""
import heapq
import itertools
import random
import time

import pytest

from graphs.errors import GraphError, InfeasibleBudgetError, NoSolutionInTimeError
from graphs.generate import chain, linear_training_graph, random_dag, random_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import OpKind, Status
from graphs.simulate import reference_peak_bytes
from solvers.base import solve
from solvers.exact.chain_dp import chain_dp, is_training_chain
from tests.solvers.exhaustive import min_feasible_budget, optimal_cost

# ---- the family oracle ---------------------------------------------------------------------------------

def family_optimal_cost(graph, budget):
    """Least cost over chain_dp's family (module docstring) by Dijkstra; None if nothing fits."""
    n = graph.n
    L = (n - 1) // 2
    sizes = [int(s) for s in graph.sizes]
    costs = [float(c) for c in graph.costs]
    if graph.fixed_bytes > budget:
        return None
    in_mask = [sum(1 << i for i in ins) for ins in graph.inputs]
    once = sum(1 << v for v in range(n) if v >= L or not graph.nodes[v].recomputable)
    retained = sum(1 << r for r in graph.retained)
    fwd = (1 << L) - 1  # x_0 .. x_{L-1}; the loss acts as the first gradient
    start = (0, 0, 0, 0)  # resident, computed (of `once`), used >= 1, used >= 2 (as x_{v+1}'s input)
    dist = {start: 0.0}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    done = set()
    while heap:
        d, _, st = heapq.heappop(heap)
        if st in done:
            continue
        done.add(st)
        res, comp, u1, u2 = st
        if comp >> (2 * L) & 1 and res & retained == retained:
            return d
        used = graph.fixed_bytes + sum(sizes[i] for i in range(n) if res >> i & 1)
        for v in range(n):
            bit = 1 << v
            if res & bit:
                if v < L and u2 & bit and not comp >> (2 * L - v) & 1:
                    continue  # a checkpoint stays until its backward node
                nxt, c = (res & ~bit, comp, u1 & ~bit, u2 & ~bit), 0.0
            else:
                if in_mask[v] & ~res or used + sizes[v] > budget or (once & bit and comp & bit):
                    continue
                if v < L and res & fwd & ~(bit - 1):
                    continue  # stack order
                nu1, nu2 = u1 & ~bit, u2 & ~bit
                if 1 <= v <= L:
                    pb = 1 << (v - 1)
                    nu2 |= pb if nu1 & pb else 0
                    nu1 |= pb
                nxt, c = (res | bit, comp | (bit & once), nu1, nu2), costs[v]
            if nxt not in done and d + c < dist.get(nxt, float("inf")):
                dist[nxt] = d + c
                heapq.heappush(heap, (d + c, next(tie), nxt))
    return None


def dp_cost(graph, budget):
    """chain_dp's cost through solve() (which replays the schedule in the simulator), or None."""
    try:
        res = solve(graph, budget, "chain_dp")
    except InfeasibleBudgetError as e:
        assert e.min_budget_bytes is not None and e.min_budget_bytes > budget
        return None
    assert res.status is Status.OPTIMAL
    assert res.total_cost == pytest.approx(res.info["cost"])
    return res.total_cost


def random_chain(seed, L, *, unit_sizes=False, extras=False):
    rng = random.Random(seed)
    n = 2 * L + 1
    costs = [rng.randint(0, 5) for _ in range(n)]
    sizes = [1] * n if unit_sizes else [rng.randint(1, 6) for _ in range(n)]
    g = linear_training_graph(L, costs=costs, sizes=sizes, name=f"chain{L}_{seed}")
    if not extras:
        return g
    nodes = tuple(Node(nd.id, nd.name, nd.cost, nd.bytes, nd.inputs, nd.backward,
                       retain=nd.id >= L and rng.random() < 0.25,
                       recomputable=nd.id >= L or rng.random() > 0.2) for nd in g.nodes)
    return Graph(nodes, fixed_bytes=rng.randint(0, 3), name=g.name + "x")


def budgets(g):
    return range(g.single_op_bound_bytes() - 1, reference_peak_bytes(g) + 2)


# ---- shape ----------------------------------------------------------------------------------------------

def test_is_training_chain():
    for L in range(1, 6):
        assert is_training_chain(linear_training_graph(L))
        assert is_training_chain(random_chain(L, L, extras=True))
    assert not is_training_chain(chain([1.0] * 5, [1] * 5))
    assert not is_training_chain(random_training_graph(3, 0, skip_prob=0.0))  # backward reads x_{i-1} too
    assert not is_training_chain(random_dag(7, 1))
    nodes = list(linear_training_graph(3).nodes)
    nodes[5] = Node(5, "bwd5", 1.0, 1, (4,), backward=True)  # drops its forward input
    assert not is_training_chain(Graph(tuple(nodes)))


def test_rejects_other_graphs():
    with pytest.raises(GraphError, match="training chain"):
        chain_dp(random_dag(7, 1), 100)
    with pytest.raises(GraphError, match="training chain"):
        solve(chain([1.0] * 5, [1] * 5), 100, "chain_dp")
    nodes = list(linear_training_graph(2).nodes)
    nodes[1] = Node(1, "fwd1", 1.0, 1, (0,), retain=True)
    with pytest.raises(GraphError, match="retained forward"):
        chain_dp(Graph(tuple(nodes)), 100)


# ---- known values -----------------------------------------------------------------------------------------

def test_checkmate_linear_graph_l8():
    g = linear_training_graph(8)
    res = solve(g, 4, "chain_dp")
    assert res.total_cost == 26.0  # the Checkmate MILP optimum; exhaustive search agrees (test_exhaustive)
    assert res.peak_bytes <= 4 and res.status is Status.OPTIMAL
    assert res.lower_bound_cost is None  # optimal within its family only
    assert "persistent" in res.info["family"]
    assert dp_cost(g, 5) == 22.0
    assert dp_cost(g, 3) == 45.0
    assert dp_cost(g, 2) is None
    top = solve(g, reference_peak_bytes(g), "chain_dp")
    assert top.total_cost == g.total_cost and top.lower_bound_cost == g.total_cost


# ---- against the exhaustive searches ------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_unit_size_chains_equal_exhaustive(L):
    for seed in range(3):
        g = random_chain(100 * L + seed, L, unit_sizes=True)
        if seed == 2:
            g = Graph(g.nodes, fixed_bytes=2, name=g.name)
        for b in budgets(g):
            ex = optimal_cost(g, b)
            assert dp_cost(g, b) == (None if ex is None else pytest.approx(ex[0])), (g.name, b)


@pytest.mark.parametrize("seed", range(10))
def test_any_sizes_equal_family_oracle_and_never_below_exhaustive(seed):
    g = random_chain(seed, 1 + seed % 4, extras=seed % 2 == 1)
    for b in budgets(g):
        dp = dp_cost(g, b)
        fam = family_optimal_cost(g, b)
        assert dp == (None if fam is None else pytest.approx(fam)), (g.name, b)
        ex = optimal_cost(g, b)
        if dp is not None:
            assert ex is not None and ex[0] <= dp + 1e-9


def test_non_persistent_schedule_beats_the_family():
    # With sizes that differ, keeping x_0 from the first sweep, using it once more and then dropping it
    # (it is recomputed from nothing before its backward node) beats every persistent schedule.
    g = linear_training_graph(3, costs=[1, 1, 0, 2, 0, 0, 2], sizes=[3, 6, 2, 4, 5, 3, 2])
    ex_cost, ex_sched = optimal_cost(g, 14)
    assert ex_cost == 8.0 and dp_cost(g, 14) == 9.0 == family_optimal_cost(g, 14)
    x0 = [k for k, op in enumerate(ex_sched.ops) if op.node == 0]
    kinds = [ex_sched.ops[k].kind for k in x0]
    # x_0 is computed, serves two computations of x_1, is freed before backward node 6 reads it, recomputed
    assert kinds[:3] == [OpKind.COMPUTE, OpKind.FREE, OpKind.COMPUTE]
    assert ex_sched.computes.count(1) == 2


def test_early_left_sweep_beats_the_family():
    # Stack order: chain_dp solves the right part (down to B_2) before any sweep for the left part. Here
    # recomputing x_0, x_1 while the 1-byte gradient of B_3 is held, before B_2, saves a recomputation.
    g = linear_training_graph(4, costs=[2, 4, 5, 1, 3, 3, 5, 0, 4], sizes=[4, 6, 2, 4, 5, 1, 4, 3, 4])
    ex_cost, ex_sched = optimal_cost(g, 13)
    assert ex_cost == 35.0 and dp_cost(g, 13) == 40.0 == family_optimal_cost(g, 13)
    seq = ex_sched.computes
    assert seq.index(6) > seq.index(1, 2)  # x_1 is recomputed before backward node 6 (B_2) runs


# ---- the least budget -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_min_budget_is_exact_for_the_family(seed):
    g = random_chain(seed + 50, 2 + seed % 3, unit_sizes=seed < 2, extras=seed == 5)
    with pytest.raises(InfeasibleBudgetError) as info:
        chain_dp(g, g.single_op_bound_bytes() - 1)
    need = info.value.min_budget_bytes
    assert dp_cost(g, need) is not None
    assert dp_cost(g, need - 1) is None
    assert need >= min_feasible_budget(g)
    if seed < 2:
        assert need == min_feasible_budget(g)


def test_non_recomputable_first_layer_is_kept():
    nodes = list(linear_training_graph(3).nodes)
    nodes[0] = Node(0, "dropout", 1.0, 1, (), recomputable=False)
    g = Graph(tuple(nodes))
    with pytest.raises(InfeasibleBudgetError) as info:
        chain_dp(g, 3)  # at 3 units x_0 cannot stay resident through the backward pass
    assert info.value.min_budget_bytes == 4
    res = solve(g, 4, "chain_dp")
    assert res.sim.compute_counts[0] == 1
    assert res.total_cost == optimal_cost(g, 4)[0]


# ---- properties and speed ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_never_rises_with_the_budget(seed):
    g = random_chain(seed + 7, 12, unit_sizes=seed == 0, extras=seed == 2)
    prev = None
    for b in range(g.single_op_bound_bytes(), reference_peak_bytes(g) + 1):
        cost = dp_cost(g, b)
        if cost is None:
            assert prev is None
            continue
        assert prev is None or cost <= prev + 1e-9
        prev = cost
    assert prev == pytest.approx(g.total_cost)


def test_unit_chain_l200_is_fast():
    g = linear_training_graph(200)
    for b in [3, 4, 10, 40, 101, reference_peak_bytes(g)]:
        t0 = time.perf_counter()
        res = solve(g, b, "chain_dp")
        seconds = time.perf_counter() - t0
        assert res.peak_bytes <= b
        assert seconds < 3.0, f"budget {b}: {seconds:.2f} s"  # 0.05-1.3 s measured on the shared 2-core machine
    assert solve(g, 3, "chain_dp").total_cost == 401 + 200 * 199 // 2  # recompute from x_0 every time


def test_time_limit_is_honoured():
    rng = random.Random(3)
    L = 150
    g = linear_training_graph(L, costs=[rng.randint(1, 9) for _ in range(2 * L + 1)],
                              sizes=[rng.randint(1, 9) for _ in range(2 * L + 1)])
    with pytest.raises(NoSolutionInTimeError):
        chain_dp(g, reference_peak_bytes(g) // 3, time_limit_s=0.0)


def test_matches_milp_on_unit_size_chains():
    pytest.importorskip("solvers.exact.milp", reason="solvers/milp.py (the Checkmate MILP) is not there yet")
    from solvers.base import solver_names

    if "milp" not in solver_names():
        pytest.skip("the MILP solver is not registered")
    for L, seed in [(2, 0), (3, 1), (4, 2)]:
        g = random_chain(seed, L, unit_sizes=True)
        for b in range(g.single_op_bound_bytes(), reference_peak_bytes(g) + 1):
            try:
                milp = solve(g, b, "milp", mip_gap=0.0, time_limit_s=30)
            except InfeasibleBudgetError:
                milp = None
            dp = dp_cost(g, b)
            if milp is None:
                assert dp is None
            else:
                assert milp.status is Status.OPTIMAL
                assert dp == pytest.approx(milp.total_cost), (g.name, b)
