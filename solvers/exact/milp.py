"""The Checkmate MILP (Jain et al., MLSys 2020) with frontier-advancing stages, built with PuLP.

Schedule family: the stage family of `solvers.exact.stage_model` (stage t recomputes some nodes < t in ascending
order, then computes t for the first time; frees at last use). "Optimal" and the lower bound refer to that
family: first computations in the reference order, each node at most once per stage.

Variables (only the lower triangle is created): R[t, i] (i < t, recomputable i; R[t, t] = 1 is a constant),
S[t, i] (i < t; the end state S[n] is the retained set, a constant), FREE[t, i, k] (free i after computing k
in stage t; created only where it can be 1), U[t, k] (memory while computing k in stage t, continuous, in
units of the budget left after fixed bytes). Memory is exactly the simulator's: fixed bytes, plus everything
resident, plus the output of the node being computed; a value is freed after its last reader in the stage
unless the next stage keeps it.

On top of Checkmate's constraints the model adds two dominance cuts (`tighten=True`), each satisfied by some
optimal schedule so they keep the optimum and tighten the relaxation: recompute i in stage t only if a later
node of the stage reads it or stage t+1 keeps it; keep i into stage t only if stage t reads it or keeps it
further. FREE is only bounded from above (freeing more only lowers memory, so the solver frees what it may).

The objective's constant (every node computed once) is not handed to the backends, so their relative gap
(`mip_gap`) is measured on the recomputation cost alone: a stricter test than the same gap on the total cost.

Backends (`backend=`): "highs" (default; highspy through PuLP's HiGHS API) and "cbc" (PuLP's bundled CBC).
Warm start (the cheapest schedule of the baselines and of a cost-per-byte keep policy that the model accepts)
works with both: HiGHS gets it through `Highs.setSolution` before the run, CBC through PuLP's `warmStart` (a
MIP-start file).
"""
from __future__ import annotations

import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal, check_budget_floor
from solvers.bounds.forced_bound import conflict_rows
from solvers.deadline import check, deadline_after, earlier, passed, seconds_left
from solvers.exact.stage_model import (
    free_matrix,
    modeled_memory,
    project_to_stage_family,
    ratio_kept_sequences,
    sequence_from_stages,
    stage_cost,
    stages_from_sequence,
)
from solvers.heuristics import baselines
from solvers.highs import HighsWithStart
from solvers.pulp_import import pulp

BACKENDS = ("highs", "cbc")
FAMILY = "frontier-advancing stages (first computations in the reference order, each node at most once per stage)"


@dataclass
class StageMILP:
    """A built model: the PuLP problem and its variables, keyed by (t, i) / (t, i, k)."""

    graph: Graph
    budget_bytes: int
    unit_bytes: float  # memory unit of U and of the budget row (so the budget is 1.0)
    prob: pulp.LpProblem
    R: dict = field(default_factory=dict)
    S: dict = field(default_factory=dict)
    FREE: dict = field(default_factory=dict)
    U: dict = field(default_factory=dict)
    Y: dict = field(default_factory=dict)  # Y[i] = 1: i is computed at least twice (forced-recomputation cuts)
    build_seconds: float = 0.0

    def r(self, t: int, i: int):
        """R[t, i] as a variable or a constant 0/1."""
        if i == t:
            return 1
        return self.R.get((t, i), 0)

    def s(self, t: int, i: int):
        if t == self.graph.n:
            return 1 if self.graph.nodes[i].retain else 0
        return self.S.get((t, i), 0)

    def values(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """Rounded (R, S, FREE) of the current solution."""
        n = self.graph.n
        R = np.zeros((n, n), dtype=bool)
        S = np.zeros((n + 1, n), dtype=bool)
        for t in range(n):
            R[t, t] = True
        for (t, i), v in self.R.items():
            R[t, i] = (v.varValue or 0.0) > 0.5
        for (t, i), v in self.S.items():
            S[t, i] = (v.varValue or 0.0) > 0.5
        for i in self.graph.retained:
            S[n, i] = True
        F = {key: (v.varValue or 0.0) > 0.5 for key, v in self.FREE.items()}
        return R, S, F


def _add(prob: pulp.LpProblem, terms: list, sense: int, rhs: float) -> None:
    """Add sum(coef * var) (sense) rhs, where terms mixes (var, coef) pairs and constants (coef * 1)."""
    expr = pulp.LpAffineExpression()
    const = 0.0
    for x, c in terms:
        if isinstance(x, (int, float)):
            const += c * x
        else:
            expr.addterm(x, c)
    if not expr:  # a constant constraint: the builder only emits satisfiable ones
        return
    prob.addConstraint(pulp.LpConstraint(expr, sense, rhs=rhs - const))


def build_model(graph: Graph, budget_bytes: int, *, relax: bool = False, tighten: bool = True,
                aggregated_free: bool = True, forced_cuts: bool = False, deadline: float | None = None) -> StageMILP:
    """Build the stage MILP (or its LP relaxation with `relax=True`).

    aggregated_free: bound each FREE variable with Checkmate's single aggregated hazard row (the default: a
    smaller model that HiGHS solves faster on the benchmarks, and Checkmate's published LP bound) instead of
    one row per hazard (a slightly tighter relaxation, used by `lp_bound`).
    forced_cuts: add the forced-recomputation rows of `solvers.bounds.forced_bound` (valid for every schedule). They
    lift the relaxation (segnet at 0.5: proven optimal in 20 s with them), but the larger model can slow HiGHS's
    search for schedules (unet at its smallest budget: a worse schedule in 60 s); `auto` takes that bound
    separately.
    deadline (time.perf_counter()): NoSolutionInTimeError once it passes (the model has O(n^2) variables: a
    1000-node graph takes minutes to build).
    """
    t0 = time.perf_counter()

    def tick(t: int) -> None:
        check(deadline, f"building the stage MILP ({t} of {n} stages)", budget_bytes=budget_bytes)

    n = graph.n
    m = [int(x) for x in graph.sizes]
    unit = float(max(budget_bytes - graph.fixed_bytes, 1))
    prob = pulp.LpProblem(f"checkmate_{graph.name}", pulp.LpMinimize)
    model = StageMILP(graph, int(budget_bytes), unit, prob)
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    recomputable = [nd.recomputable for nd in graph.nodes]
    users, inputs = graph.users, graph.inputs
    for t in range(n):
        tick(t)
        for i in range(t):
            if recomputable[i]:
                model.R[t, i] = prob.add_variable(f"R_{t}_{i}", 0, 1, cat)
            model.S[t, i] = prob.add_variable(f"S_{t}_{i}", 0, 1, cat)
    r, s = model.r, model.s
    LE, EQ = pulp.LpConstraintLE, pulp.LpConstraintEQ
    # A value kept into stage t+1 was kept into stage t or computed in stage t.
    for t in range(n):
        tick(t)
        for i in range(t):
            if isinstance(s(t + 1, i), int) and s(t + 1, i) == 0:
                continue
            _add(prob, [(s(t + 1, i), 1), (s(t, i), -1), (r(t, i), -1)], LE, 0)
    # Computing j needs each input resident: computed earlier in the stage or kept.
    for t in range(n):
        tick(t)
        for j in range(t + 1):
            if isinstance(r(t, j), int) and r(t, j) == 0:
                continue
            for i in inputs[j]:
                _add(prob, [(r(t, j), 1), (r(t, i), -1), (s(t, i), -1)], LE, 0)
    if tighten:
        for t in range(n):
            tick(t)
            for i in range(t):
                later_readers = [j for j in users[i] if j <= t]
                if t in later_readers:
                    continue  # stage t always reads i: both cuts are void
                rd = [(r(t, j), -1) for j in later_readers]
                if (t, i) in model.R:
                    _add(prob, [(r(t, i), 1), (s(t + 1, i), -1), *[(r(t, j), -1) for j in users[i] if i < j <= t]],
                         LE, 0)
                _add(prob, [(s(t, i), 1), (s(t + 1, i), -1), *rd], LE, 0)
    if forced_cuts:
        _add_forced_recomputation_cuts(model, cat)
    # FREE[t, i, k] <= R[t, k], <= 1 - S[t+1, i], <= 1 - R[t, j] for every later reader j of i in the stage.
    for t in range(n):
        tick(t)
        for k in range(t + 1):
            rk = r(t, k)
            if isinstance(rk, int) and rk == 0:
                continue
            for i in dict.fromkeys((*inputs[k], k)):
                keep = s(t + 1, i)
                if isinstance(keep, int) and keep == 1:
                    continue
                hazards = [r(t, j) for j in users[i] if k < j <= t]
                if any(isinstance(h, int) and h == 1 for h in hazards):
                    continue  # node t reads i later in the stage: never freed here
                hazards = [h for h in hazards if not isinstance(h, int)]
                f = prob.add_variable(f"F_{t}_{i}_{k}", 0, 1, cat)
                model.FREE[t, i, k] = f
                if aggregated_free:
                    # (1 - FREE) * (number of hazards) >= (1 - R[t,k]) + S[t+1,i] + sum R[t,j]
                    nh = 1 + len(hazards) + (0 if isinstance(keep, int) else 1)
                    _add(prob, [(f, nh), (rk, -1), (keep, 1), *[(h, 1) for h in hazards]], LE, nh - 1)
                else:
                    if not isinstance(rk, int):
                        _add(prob, [(f, 1), (rk, -1)], LE, 0)
                    if not isinstance(keep, int):
                        _add(prob, [(f, 1), (keep, 1)], LE, 1)
                    for h in hazards:
                        _add(prob, [(f, 1), (h, 1)], LE, 1)
    # Memory: U[t, 0] = kept + R[t,0] m_0; U[t, k] = U[t, k-1] - freed after k-1 + R[t,k] m_k; U <= budget.
    for t in range(n):
        tick(t)
        prev = None
        for k in range(t + 1):
            u = prob.add_variable(f"U_{t}_{k}", None, None, pulp.LpContinuous)
            model.U[t, k] = u
            terms = [(u, 1), (r(t, k), -m[k] / unit)]
            if k == 0:
                terms += [(s(t, i), -m[i] / unit) for i in range(t)]
            else:
                terms.append((prev, -1))
                terms += [(model.FREE[t, i, k - 1], m[i] / unit) for i in dict.fromkeys((*inputs[k - 1], k - 1))
                          if (t, i, k - 1) in model.FREE]
            _add(prob, terms, EQ, 0)
            if not (isinstance(r(t, k), int) and r(t, k) == 0):
                _add(prob, [(u, 1)], LE, (budget_bytes - graph.fixed_bytes) / unit)
            prev = u
    costs = graph.costs
    obj = pulp.LpAffineExpression([(v, float(costs[i])) for (t, i), v in model.R.items() if costs[i] != 0])
    obj.constant = float(costs.sum())
    prob.setObjective(obj)
    model.build_seconds = time.perf_counter() - t0
    return model


def _add_forced_recomputation_cuts(model: StageMILP, cat) -> None:
    """The covering rows of `solvers.bounds.forced_bound` (valid for every schedule, so the optimum is unchanged):
    Y[i] <= sum over stages t > i of R[t, i], and at every node x the values of its conflict set that are computed
    once fit in the room left by x's inputs and output. They lift the relaxation where one large value must be
    recomputed (segnet at half its reference peak), which the stage rows alone bound weakly."""

    g, prob, unit = model.graph, model.prob, model.unit_bytes
    m = [int(x) for x in g.sizes]
    try:
        rows = conflict_rows(g, model.budget_bytes)
    except InfeasibleBudgetError:
        return  # no schedule fits: the memory rows say so on their own (models are also built for such budgets)
    for row in rows:
        for i in row.members:
            if i not in model.Y:
                y = prob.add_variable(f"Y_{i}", 0, 1, cat)
                model.Y[i] = y
                _add(prob, [(y, 1), *[(model.r(t, i), -1) for t in range(i + 1, g.n)]], pulp.LpConstraintLE, 0)
        total = sum(m[i] for i in row.members)
        _add(prob, [(model.Y[i], -m[i] / unit) for i in row.members], pulp.LpConstraintLE,
             (row.room_bytes - total) / unit)


# ---- warm start -------------------------------------------------------------------------------------------
BASELINES = ("checkpoint_all", "chen_greedy", "chen_greedy_linear", "chen_sqrtn", "chen_sqrtn_linear")


def baseline_schedules(graph: Graph, budget_bytes: int, deadline: float | None = None
                       ) -> tuple[list[tuple[float, str, list[int]]], int | None, str]:
    """Every baseline schedule within budget as (cost, name, sequence), cheapest first, and the smallest budget
    a baseline is known to meet (with its name). Baselines not finished by `deadline` are left out."""

    found, best_min, best_name = [], None, ""
    for name in BASELINES:
        try:
            prop = getattr(baselines, name)(graph, budget_bytes, time_limit_s=seconds_left(deadline))
        except NoSolutionInTimeError:
            continue
        except InfeasibleBudgetError as e:
            if e.min_budget_bytes is not None and (best_min is None or e.min_budget_bytes < best_min):
                best_min, best_name = e.min_budget_bytes, name
            continue
        sim = simulate(graph, prop.schedule)
        found.append((sim.total_cost, name, prop.schedule.computes))
        if best_min is None or sim.peak_bytes < best_min:
            best_min, best_name = sim.peak_bytes, name
    found.sort(key=lambda x: x[0])
    return found, best_min, best_name


def start_values(model: StageMILP, sequence: list[int]) -> dict[str, float] | None:
    """Variable values (by name) that put `sequence` into the model, or None if it is not a feasible point."""
    g = model.graph
    st = stages_from_sequence(g, sequence)
    if st is None:
        return None
    R, S = st
    F = free_matrix(g, R, S)
    U = modeled_memory(g, R, S, F)
    out: dict[str, float] = {}
    for t in range(g.n):
        for i in range(t):
            if R[t, i] and (t, i) not in model.R:
                return None
    for k in range(g.n):
        for t in range(k, g.n):
            if R[t, k] and U[t, k] > model.budget_bytes:
                return None
    for (t, i), v in model.R.items():
        out[v.name] = float(R[t, i])
    for (t, i), v in model.S.items():
        out[v.name] = float(S[t, i])
    for key, v in model.FREE.items():
        out[v.name] = float(F.get(key, False))
    for (t, k), v in model.U.items():
        out[v.name] = float(U[t, k] - g.fixed_bytes) / model.unit_bytes
    for i, v in model.Y.items():
        out[v.name] = float(R[i + 1:, i].any())
    return out


# ---- backends ----------------------------------------------------------------------------------------------
@dataclass
class BackendResult:
    outcome: str  # "optimal" | "feasible" | "infeasible" | "no_solution" | "error" | "crashed"
    objective: float | None
    bound: float | None
    detail: str


def _run_highs(model: StageMILP, time_limit_s, mip_gap, threads, start, relax=False) -> BackendResult:
    import highspy

    # HiGHS's default tolerances on purpose: with mip_feasibility_tolerance 1e-9, HiGHS 1.16 declared a
    # MIP start optimal on segnet at 0.8 (overhead 1.38 %, the optimum being 0.21 %). Memory overshoots from
    # the primal tolerance are caught by the simulator and solved again (see `milp`).
    solver = HighsWithStart(start=start, msg=False, timeLimit=time_limit_s, gapRel=mip_gap, threads=threads,
                             mip=not relax)
    model.prob.solve(solver)
    h = model.prob.solverModel
    ms = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    offset = float(model.prob.objective.constant)  # PuLP does not hand the objective constant to HiGHS
    obj = info.objective_function_value + offset if has_sol else None
    bound = None
    if not relax:
        b = info.mip_dual_bound
        bound = float(b) + offset if b is not None and math.isfinite(b) else None
    elif ms == S.kOptimal:
        bound = obj
    detail = f"HiGHS {h.modelStatusToString(ms)}"
    if ms == S.kOptimal:
        return BackendResult("optimal", obj, bound if bound is not None else obj, detail)
    if ms in (S.kInfeasible, S.kUnboundedOrInfeasible):  # the model is bounded (costs >= 0): infeasible
        return BackendResult("infeasible", None, None, detail)
    limits = {S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit, S.kInterrupt, S.kObjectiveBound,
              S.kObjectiveTarget, S.kMemoryLimit}
    if hasattr(S, "kHighsInterrupt"):
        limits.add(S.kHighsInterrupt)
    if ms in limits:
        return BackendResult("feasible" if has_sol else "no_solution", obj, bound, detail)
    return BackendResult("error", obj, bound, detail)


def _run_cbc(model: StageMILP, time_limit_s, mip_gap, threads, start) -> BackendResult:
    if start:
        for v in model.prob.variables():
            if v.name in start:
                v.setInitialValue(start[v.name])
    fd, log = tempfile.mkstemp(suffix=".log", prefix="cbc_")
    os.close(fd)
    try:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=None if time_limit_s is None else max(1, int(time_limit_s)),
                                   gapRel=mip_gap, threads=threads, warmStart=bool(start), logPath=log)
        try:
            model.prob.solve(solver)
        except pulp.PulpSolverError as e:
            # CBC 2.10.3 (PuLP's bundled binary) can crash when its time limit expires right after reading a
            # MIP start; the caller falls back on the start itself.
            return BackendResult("crashed", None, None, f"CBC failed: {e}")
        text = open(log).read()
    finally:
        os.unlink(log)
    status, sol = model.prob.status, model.prob.sol_status
    obj = pulp.value(model.prob.objective) if sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) else None
    # CBC's summary prints "Lower bound:" when it stops early (not when it proves optimality).
    m = re.search(r"^Lower bound:\s*([-+0-9.eE]+)", text, re.M)
    # CBC's log leaves out the objective constant (the cost of the first computations)
    bound = float(m.group(1)) + float(model.prob.objective.constant) if m else None
    detail = f"CBC status={pulp.LpStatus[status]} sol_status={sol}"
    # PuLP reports status Optimal for a time-limited CBC run; only sol_status tells proven from merely feasible.
    if sol == pulp.LpSolutionOptimal:
        if bound is None and obj is not None:
            # CBC stopped by its relative gap on the objective it sees (without the constant)
            const = float(model.prob.objective.constant)
            bound = const + (obj - const) * (1 - (mip_gap or 0.0))
        return BackendResult("optimal", obj, bound, detail)
    if sol == pulp.LpSolutionIntegerFeasible:
        return BackendResult("feasible", obj, bound, detail)
    if status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return BackendResult("infeasible", None, None, detail)
    if sol == pulp.LpSolutionNoSolutionFound and time_limit_s is not None:
        return BackendResult("no_solution", None, bound, detail)
    return BackendResult("error", obj, bound, detail)


def run_backend(model: StageMILP, backend: str, time_limit_s: float | None, mip_gap: float | None,
                threads: int | None, start: dict[str, float] | None) -> BackendResult:
    """Solve a built model with "highs" or "cbc"; the variables then hold the solution (if any)."""
    if backend == "highs":
        return _run_highs(model, time_limit_s, mip_gap, threads, start)
    if backend == "cbc":
        return _run_cbc(model, time_limit_s, mip_gap, threads, start)
    raise SolverError(f"unknown MILP backend '{backend}'; known: {', '.join(BACKENDS)}")


# ---- the solver --------------------------------------------------------------------------------------------
def milp(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, backend: str = "highs",
         mip_gap: float = 0.01, threads: int | None = None, warm_start: bool = True,
         tighten: bool = True, forced_cuts: bool = False, start_sequences: list | None = None) -> Proposal:
    """Minimum-cost schedule of the stage family within `budget_bytes` (bytes), by the Checkmate MILP.

    time_limit_s covers building and solving. mip_gap: relative gap on the recomputation cost at which the
    backend stops (OPTIMAL then means optimal within that gap; lower_bound_cost is the backend's best bound,
    over the stage family). threads: the backend's thread count (None: its default).
    start_sequences: more warm-start candidates (compute sequences from any solver, e.g. the schedules of
    other heuristics); each is projected onto the stage family and used if it still fits the budget.
    Raises InfeasibleBudgetError (below the single-operation bound, or when the model is proven infeasible:
    min_budget_bytes is then the smallest peak a baseline schedule reaches), NoSolutionInTimeError (limit
    reached without any schedule), SolverError (a backend failure).
    """
    if backend not in BACKENDS:
        raise SolverError(f"unknown MILP backend '{backend}'; known: {', '.join(BACKENDS)}")
    t0 = time.perf_counter()
    name = "milp" if backend == "highs" else f"milp_{backend}"
    check_budget_floor(graph, budget_bytes, name)
    deadline = deadline_after(time_limit_s)
    found, baseline_min, baseline_name = baseline_schedules(graph, budget_bytes, deadline)
    if found and found[0][1] == "checkpoint_all":  # no recomputation fits: nothing can cost less
        sched = Schedule.from_sequence(graph, found[0][2])
        return Proposal(sched, Status.OPTIMAL, graph.total_cost, {"backend": backend, "family": FAMILY,
                                                                   "note": "checkpoint_all fits"})
    model_budget = int(budget_bytes)
    skip_start = False  # set when the backend's values disagreed with its objective after a MIP start
    if warm_start:
        # the keep-policy starts may take a fifth of the time (seconds each on 1000 nodes); the build needs the rest
        ratio_deadline = earlier(deadline, None if time_limit_s is None else 0.2 * time_limit_s)
        extra = _ratio_starts(graph, budget_bytes, ratio_deadline) + _given_starts(graph, budget_bytes, start_sequences)
        found = sorted([*found, *extra], key=lambda x: x[0])
    for attempt in range(3):
        try:
            model = build_model(graph, model_budget, tighten=tighten, forced_cuts=forced_cuts, deadline=deadline)
        except NoSolutionInTimeError as e:
            if not found:
                raise NoSolutionInTimeError(f"{name}: {e} (limit {time_limit_s} s), and no baseline fits",
                                            budget_bytes=budget_bytes, solver=name, seconds=time_limit_s) from e
            cost, bname, seq = found[0]  # every candidate fits the budget; the cheapest is the incumbent
            return Proposal(Schedule.from_sequence(graph, seq), Status.FEASIBLE, None,
                            {"backend": backend, "family": FAMILY, "warm_start": bname,
                             "fallback": f"the time limit ran out while building the model ({e})"})
        start, start_name = None, None
        if warm_start and not skip_start:
            for cost, bname, seq in found:
                start = start_values(model, seq)
                if start is not None:
                    start_name = bname
                    break
        # keep a margin for reading the solution back and simulating it (about 3 s on mobilenet at 60 s).
        # HiGHS itself may overrun its limit on very large models (resnet50: 63 s run for a ~45 s limit).
        margin = 0.0 if time_limit_s is None else min(3.0, 0.05 * time_limit_s)
        if time_limit_s is not None and (time.perf_counter() - t0) + 2 * model.build_seconds + margin > time_limit_s:
            # PuLP's copy into the backend takes about as long as the build and cannot be interrupted: no
            # time is left to solve (resnet50 at 60 s), so the best start is the answer
            best = next(((b, q) for _, b, q in found if start_values(model, q) is not None), None)
            if best is None:
                raise NoSolutionInTimeError(f"{name}: building the model left no time to solve it "
                                            f"({model.build_seconds:.1f} s to build, limit {time_limit_s} s)")
            return Proposal(Schedule.from_sequence(graph, best[1]), Status.FEASIBLE, None,
                            {"backend": backend, "family": FAMILY, "warm_start": best[0],
                             "fallback": f"no time left to solve after building the model "
                                         f"({model.build_seconds:.1f} s)"})
        left = None if time_limit_s is None else max(0.5, time_limit_s - margin - (time.perf_counter() - t0))
        res = run_backend(model, backend, left, mip_gap, threads, start)
        info = {"backend": backend, "family": FAMILY, "detail": res.detail, "warm_start": start_name,
                "variables": len(model.prob.variables()), "constraints": model.prob.numConstraints(),
                "build_seconds": round(model.build_seconds, 3), "objective": res.objective}
        if res.outcome == "infeasible":
            raise InfeasibleBudgetError(
                budget_bytes, baseline_min, name,
                f"the MILP proved that no frontier-advancing stage schedule fits; baseline '{baseline_name}' "
                f"meets {baseline_min} bytes" if baseline_min is not None else
                "the MILP proved that no frontier-advancing stage schedule fits")
        if res.outcome in ("no_solution", "crashed") and start is not None:
            # the limit came (or the backend died at it) before the start was even taken up: the start is
            # still a valid schedule of the family, so it is the incumbent
            seq = next(q for _, b, q in found if b == start_name)
            info["fallback"] = f"warm start ({res.outcome} from the backend)"
            return Proposal(Schedule.from_sequence(graph, seq), Status.FEASIBLE, None, info)
        if res.outcome == "no_solution":
            raise NoSolutionInTimeError(f"{name}: no schedule within {time_limit_s} s ({res.detail})")
        if res.outcome in ("error", "crashed"):
            raise SolverError(f"{name}: backend failed ({res.detail})")
        R, S, _ = model.values()
        values_cost = stage_cost(graph, R)
        if res.objective is not None and values_cost > res.objective * (1 + 1e-7) + 1e-6:
            # HiGHS has reported the optimum's objective while handing back the MIP start's values (a 6-node
            # graph: objective 42, values of the start's 50): solve once more without the start, and claim
            # nothing if the values still disagree with the objective
            info["values_disagree"] = f"objective {res.objective}, values read back cost {values_cost}"
            if start is not None and not skip_start:
                skip_start = True
                continue
        seq = sequence_from_stages(graph, R, S)
        sched = Schedule.from_sequence(graph, seq)
        sim = simulate(graph, sched)
        if sim.peak_bytes > budget_bytes:
            # Only a backend tolerance can cause this (the model's memory is an upper bound of the simulated
            # one); solve again with the budget lowered by the overshoot.
            model_budget -= sim.peak_bytes - budget_bytes
            info["retried_for_tolerance"] = attempt + 1
            continue
        status = Status.OPTIMAL if res.outcome == "optimal" and "values_disagree" not in info else Status.FEASIBLE
        bound = res.bound
        known = min((c for c, _, _ in found), default=math.inf)
        if bound is not None and bound > min(known, sim.total_cost) * (1 + 1e-7) + 1e-9:
            # a schedule we hold costs less than the backend's "bound" (beyond rounding): the backend is wrong
            info["warning"] = f"backend bound {bound} above a known schedule's cost {known}: no claim made"
            status, bound = Status.FEASIBLE, None
        if sim.total_cost > known * (1 + 1e-9) + 1e-9:
            seq = next(q for c, _, q in found if c == known)
            sched = Schedule.from_sequence(graph, seq)
            sim = simulate(graph, sched)
            info["fallback"] = "a warm-start candidate was cheaper than the backend's solution"
        if model_budget != budget_bytes:
            # the model solved was for a smaller budget: its optimum and bound say nothing about this one
            status, bound = Status.FEASIBLE, None
        if bound is not None:
            # every schedule computes each node once; a bound above the found cost is tolerance noise
            bound = min(max(bound, graph.total_cost), sim.total_cost)
        info["model_cost"] = stage_cost(graph, R)
        return Proposal(sched, status, bound, info)
    raise SolverError(f"{name}: solutions kept exceeding the budget after tolerance retries")


def _given_starts(graph: Graph, budget_bytes: int, sequences) -> list[tuple[float, str, list[int]]]:
    """Caller-supplied sequences projected onto the stage family, those that fit, as (cost, name, sequence)."""
    out = []
    for k, seq in enumerate(sequences or ()):
        proj = project_to_stage_family(graph, seq)
        if proj is None:
            continue
        sim = simulate(graph, Schedule.from_sequence(graph, proj))
        if sim.peak_bytes <= budget_bytes:
            out.append((sim.total_cost, f"given_{k}", proj))
    return out


def _ratio_starts(graph: Graph, budget_bytes: int, deadline: float | None) -> list[tuple[float, str, list[int]]]:
    """The cheapest schedule within budget of the cost-per-byte keep policy, as a warm-start candidate (it
    helps where the baselines have nothing to offer, e.g. graphs without a backward pass)."""
    best = None
    for seq in ratio_kept_sequences(graph, deadline=deadline):
        if passed(deadline) or len(seq) > 20 * graph.n:
            break  # a longer sequence takes seconds to replay on large graphs, and makes a poor start
        sim = simulate(graph, Schedule.from_sequence(graph, seq))
        if sim.peak_bytes <= budget_bytes and (best is None or sim.total_cost < best[0]):
            best = (sim.total_cost, "cost_per_byte_keep", seq)
    return [] if best is None else [best]


def milp_cbc(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, **options) -> Proposal:
    """`milp` with the CBC backend."""
    return milp(graph, budget_bytes, time_limit_s=time_limit_s, backend="cbc", **options)


def lp_solution(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, tighten: bool = True,
                aggregated_free: bool = False, threads: int | None = None) -> tuple[float, StageMILP]:
    """Solve the LP relaxation; returns (optimal LP value, model with the fractional values).

    Raises InfeasibleBudgetError when the relaxation is infeasible (then so is the MILP), NoSolutionInTimeError
    when the LP is not solved within the limit.
    """
    check_budget_floor(graph, budget_bytes, "lp_bound")
    deadline = deadline_after(time_limit_s)
    model = build_model(graph, budget_bytes, relax=True, tighten=tighten, aggregated_free=aggregated_free,
                        deadline=deadline)
    res = _run_highs(model, seconds_left(deadline), None, threads, None, relax=True)
    if res.outcome == "infeasible":
        raise InfeasibleBudgetError(budget_bytes, None, "lp_bound",
                                    "the LP relaxation of the stage MILP is infeasible")
    if res.outcome != "optimal" or res.objective is None:
        raise NoSolutionInTimeError(f"lp_bound: LP not solved ({res.detail})")
    return float(res.objective), model


def lp_bound(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, tighten: bool = True,
             aggregated_free: bool = False, threads: int | None = None) -> float:
    """Lower bound on the cost of any stage-family schedule within budget: the LP relaxation's value.

    tighten / aggregated_free as in `build_model`; `tighten=False, aggregated_free=True` is Checkmate's own LP.
    """
    value, _ = lp_solution(graph, budget_bytes, time_limit_s=time_limit_s, tighten=tighten,
                           aggregated_free=aggregated_free, threads=threads)
    return value
