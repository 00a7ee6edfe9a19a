"""An exact CP-SAT solver over retention intervals, in the spirit of Moccasin (Bartan et al., ICML 2023).

Family (see solvers/exact/cpsat_family.py): stage k ends with the first computation of node k (reference order) and
may first recompute earlier nodes in ascending id order; each node is computed at most C = `max_computations`
times; values are freed at their last use. The optimum is exact for that family; `lower_bound_cost` is CP-SAT's
bound for the family (not for schedules outside it).

Model. Every computation of node u is an optional interval on the event timeline (`event_time(n, k, u) =
k * n + u` for stage k). Computation 0 of u is fixed at stage u; computation j >= 1 has a stage variable
k_uj in (u, last useful stage] and a presence literal. The interval runs from the computation to one past the
last use it serves; consecutive computations of a node do not overlap. Every input u of a computation of v is
served by exactly one computation of u that starts earlier and ends later. A cumulative constraint with each
interval's bytes keeps every event within budget - fixed_bytes: memory while computing v is every live interval
at v's time, v's own included, exactly the simulator's figure. A retained node's last computation lives to the
end. The objective counts the recomputations' costs.

Integers: bytes are divided by their gcd (exact). Costs are divided by their gcd when they are integers of
moderate size (exact); otherwise they are scaled and rounded down, so the reported bound stays a valid lower
bound on the true cost, and the solution's true cost comes from the simulator.

Warm starts (the cost phase always gets a complete hint when one exists): a given `hint_sequence`, else the
cheapest baseline that fits and lies in the family, else the greedy member of solvers/exact/cpsat_greedy.py. When none
fits, a feasibility phase minimises the peak (capacity as a variable floored at the budget) from the greedy
member at the nearest larger budget where the greedy works; reaching the budget ends it at once, and proving
that the budget cannot be reached proves the family's minimum peak (the InfeasibleBudgetError names it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import reduce

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal, check_budget_floor
from solvers.deadline import check, deadline_after, seconds_left
from solvers.exact.cpsat_family import (
    FamilyForm,
    computation_limits,
    event_time,
    family_form,
    sequence_from_stages,
    stage_normal_form,
)
from solvers.exact.cpsat_greedy import best_greedy_sequence
from solvers.heuristics import baselines

SOLVER_NAME = "cpsat"
# Largest objective coefficient sum we hand CP-SAT unscaled; above it costs are scaled and floored.
_MAX_EXACT_OBJECTIVE = 2 ** 40
_SCALED_OBJECTIVE = 2 ** 30


@dataclass
class _Model:
    model: object
    n: int
    horizon: int
    present: list[list[object]]  # per node, per computation: literal (None for computation 0)
    stage: list[list[object]]  # per node, per computation: stage variable or int
    end: list[list[object]]
    size: list[list[object]]
    serve: dict = field(default_factory=dict)  # (u, v, j) -> list of (i, literal)
    cost_units: list[int] = field(default_factory=list)
    cost_unit: float = 1.0  # true cost per objective unit (a lower bound on it when `cost_exact` is false)
    cost_exact: bool = True
    capacity: object = None  # the capacity variable of the feasibility phase
    capacity_hi: int = 0


def _cost_scaling(graph: Graph, limits: list[int]) -> tuple[list[int], float, bool]:
    """Integer objective coefficients and the true cost of one unit; exact when possible."""
    costs = [float(c) for c in graph.costs]
    ints = all(c == math.floor(c) for c in costs)
    if ints:
        ic = [int(c) for c in costs]
        g = reduce(math.gcd, [c for c in ic if c > 0], 0) or 1
        units = [c // g for c in ic]
        if sum(u * (k - 1) for u, k in zip(units, limits)) <= _MAX_EXACT_OBJECTIVE:
            return units, float(g), True
    top = max(costs) if costs else 0.0
    if top <= 0:
        return [0] * len(costs), 1.0, True
    total = sum(c * max(k - 1, 1) for c, k in zip(costs, limits))
    unit = total / _SCALED_OBJECTIVE  # one unit of objective is worth `unit` of true cost
    return [int(math.floor(c / unit)) for c in costs], unit, False


def last_useful_stages(graph: Graph) -> list[int]:
    """For each node u, the last stage where a computation of u can serve anything.

    A computation of u serves computations of its users, which happen no later than their own last useful
    stages; a retained node's last computation serves the end of the schedule (stage n-1).
    """
    n = graph.n
    last = list(range(n))
    for u in reversed(range(n)):
        if graph.nodes[u].retain:
            last[u] = n - 1
        for w in graph.users[u]:
            last[u] = max(last[u], last[w])
    return last


def build_model(graph: Graph, budget_bytes: int, max_computations: int = 2, *,
                peak_objective_upto: int | None = None, deadline: float | None = None) -> _Model:
    """The CP-SAT model of the family under `budget_bytes` (see the module docstring).

    peak_objective_upto: build the feasibility phase instead: the capacity is a variable between the budget and
    this many bytes, and the objective is that capacity (so reaching the budget ends the phase at once).
    deadline (time.perf_counter()): NoSolutionInTimeError once it passes during the build.
    """
    from ortools.sat.python import cp_model

    n = graph.n
    H = n * n  # event times are 0..n*n-1; an interval ending at H lives to the end
    m = cp_model.CpModel()
    limits = computation_limits(graph, max_computations)
    last_stage = last_useful_stages(graph)
    for u in range(n):
        if last_stage[u] <= u:
            limits[u] = 1  # a recomputation would serve nothing
    present, stage, end, size, intervals, demands = [], [], [], [], [], []
    sizes = [int(b) for b in graph.sizes]
    g_bytes = reduce(math.gcd, [b for b in sizes if b > 0], 0) or 1
    for u in range(n):
        check(deadline, f"CP-SAT: building the model ({u} of {n} nodes)", budget_bytes=budget_bytes)
        pu, ku, eu, zu = [None], [u], [], []
        t0 = event_time(n, u, u)
        last = last_stage[u]
        no_use = not graph.users[u]
        retain = graph.nodes[u].retain
        for j in range(limits[u]):
            if j == 0:
                start = t0
                lit = None
            else:
                lit = m.NewBoolVar(f"p_{u}_{j}")
                k = m.NewIntVar(u + 1, last, f"k_{u}_{j}")
                start = k * n + u
                pu.append(lit)
                ku.append(k)
            if no_use and not retain:
                e = t0 + 1
                sz = 1
            else:
                e = m.NewIntVar(t0 + 1, H, f"e_{u}_{j}")
                sz = m.NewIntVar(1, H - t0, f"d_{u}_{j}")
            if lit is None:
                iv = m.NewIntervalVar(start, sz, e, f"i_{u}_{j}")
            else:
                iv = m.NewOptionalIntervalVar(start, sz, e, lit, f"i_{u}_{j}")
            eu.append(e)
            zu.append(sz)
            if sizes[u] > 0:
                intervals.append(iv)
                demands.append(sizes[u] // g_bytes)
        for j in range(1, limits[u]):
            if j >= 2:
                m.AddImplication(pu[j], pu[j - 1])
            # computation j starts after computation j-1 has ended (a resident value is not recomputed)
            m.Add(eu[j - 1] <= ku[j] * n + u).OnlyEnforceIf(pu[j])
        if retain:
            for j in range(limits[u]):
                cond = [] if j == 0 else [pu[j]]
                if j + 1 < limits[u]:
                    cond.append(pu[j + 1].Not())
                m.Add(eu[j] == H).OnlyEnforceIf(cond)
        present.append(pu)
        stage.append(ku)
        end.append(eu)
        size.append(zu)
    mdl = _Model(m, n, H, present, stage, end, size)
    # every input of every computation is resident: served by one computation of the input
    for v in range(n):
        check(deadline, f"CP-SAT: building the model's input rows ({v} of {n} nodes)", budget_bytes=budget_bytes)
        for j in range(limits[v]):
            tv = event_time(n, v, v) if j == 0 else stage[v][j] * n + v
            for u in graph.inputs[v]:
                cands = [0] + [i for i in range(1, limits[u]) if u + 1 <= (v if j == 0 else last_stage[v])]
                if len(cands) == 1:
                    if j == 0:
                        m.Add(end[u][0] >= tv + 1)
                    else:
                        m.Add(end[u][0] >= tv + 1).OnlyEnforceIf(present[v][j])
                    continue
                lits = []
                for i in cands:
                    z = m.NewBoolVar(f"z_{u}_{i}_{v}_{j}")
                    lits.append((i, z))
                    m.Add(end[u][i] >= tv + 1).OnlyEnforceIf(z)
                    if i >= 1:
                        m.AddImplication(z, present[u][i])
                        m.Add(stage[u][i] * n + u <= tv - 1).OnlyEnforceIf(z)
                if j == 0:
                    m.AddExactlyOne([z for _, z in lits])
                else:
                    m.Add(sum(z for _, z in lits) == present[v][j])
                mdl.serve[(u, v, j)] = lits
    cap = int(budget_bytes) - int(graph.fixed_bytes)
    units, unit, exact = _cost_scaling(graph, limits)
    mdl.cost_units, mdl.cost_unit, mdl.cost_exact = units, unit, exact
    if peak_objective_upto is not None:
        hi = -(-(int(peak_objective_upto) - int(graph.fixed_bytes)) // g_bytes)
        capv = m.NewIntVar(cap // g_bytes, max(cap // g_bytes, hi), "capacity")
        m.AddCumulative(intervals, demands, capv)
        m.Minimize(capv)
        mdl.capacity, mdl.capacity_hi = capv, max(cap // g_bytes, hi)
        return mdl
    m.AddCumulative(intervals, demands, cap // g_bytes)
    m.Minimize(sum(units[u] * present[u][j] for u in range(n) for j in range(1, limits[u]) if units[u]))
    return mdl


def _add_hint(mdl: _Model, graph: Graph, form: FamilyForm) -> bool:
    """Hint every variable from a family member; False when the form does not fit the model's limits."""
    m, n, H = mdl.model, mdl.n, mdl.horizon
    for u in range(n):
        if len(form.stages[u]) > len(mdl.present[u]):
            return False
    for u in range(n):
        st = form.stages[u]
        for j in range(len(mdl.present[u])):
            here = j < len(st)
            if j >= 1:
                m.AddHint(mdl.present[u][j], here)
                m.AddHint(mdl.stage[u][j], st[j] if here else u + 1)
            t = event_time(n, st[j] if here else u + 1, u)
            if here:
                uses = form.serves[u][j]
                e = H if (graph.nodes[u].retain and j == len(st) - 1) else (uses[-1] + 1 if uses else t + 1)
            else:
                e = t + 1
            if not isinstance(mdl.end[u][j], int):
                m.AddHint(mdl.end[u][j], e)
                m.AddHint(mdl.size[u][j], max(1, e - t))
    if mdl.capacity is not None:
        m.AddHint(mdl.capacity, mdl.capacity_hi)
    for (u, v, j), lits in mdl.serve.items():
        if j < len(form.stages[v]):
            tv = event_time(n, form.stages[v][j], v)
            who = next(i for i, uses in enumerate(form.serves[u]) if tv in uses)
        else:
            who = -1
        for i, z in lits:
            m.AddHint(z, i == who)
    return True


def _baseline_hint(graph: Graph, budget_bytes: int, max_computations: int, deadline: float | None = None
                   ) -> tuple[list[int] | None, str | None, int | None]:
    """The cheapest baseline schedule that fits the budget and lies in the family, and the lowest baseline peak
    (baselines not finished by `deadline` are left out)."""

    best, best_name, best_cost, min_peak = None, None, math.inf, None
    for name in ("checkpoint_all", "chen_greedy", "chen_greedy_linear", "chen_sqrtn", "chen_sqrtn_linear"):
        fn = getattr(baselines, name)
        try:
            prop = fn(graph, budget_bytes, time_limit_s=seconds_left(deadline))
        except NoSolutionInTimeError:
            continue
        except InfeasibleBudgetError as e:
            if e.min_budget_bytes is not None:
                min_peak = e.min_budget_bytes if min_peak is None else min(min_peak, e.min_budget_bytes)
            continue
        sim = simulate(graph, prop.schedule)
        min_peak = sim.peak_bytes if min_peak is None else min(min_peak, sim.peak_bytes)
        seq = prop.schedule.computes
        if sim.total_cost < best_cost and family_form(graph, seq, max_computations) is not None:
            best, best_name, best_cost = seq, name, sim.total_cost
        if name == "checkpoint_all":
            break  # no recomputation: nothing cheaper exists
    return best, best_name, min_peak


def default_parameters(workers: int) -> dict:
    """CP-SAT parameters used unless overridden (chosen on the benchmark graphs: scripts/measure_cpsat.py)."""
    return {"num_workers": int(workers), "symmetry_level": 0}


def feasibility_parameters(workers: int) -> dict:
    """Parameters of the feasibility phase: no LP and no probing, which the peak objective does not need and
    without which it finds a schedule within budget sooner on rl250 and rl500 at 0.8 (scripts/measure_cpsat.py)."""
    return {"num_workers": int(workers), "symmetry_level": 0, "linearization_level": 0,
            "cp_model_probing_level": 0}


def _solve(mdl: _Model, params: dict, seconds: float | None, log: bool):
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    for k, v in params.items():
        setattr(solver.parameters, k, v)
    if seconds is not None:
        solver.parameters.max_time_in_seconds = max(0.01, seconds)
    solver.parameters.log_search_progress = bool(log)
    code = solver.Solve(mdl.model)
    return solver, code


def _stages_of(mdl: _Model, solver) -> list[list[int]]:
    return [[u] + [int(solver.Value(mdl.stage[u][j])) for j in range(1, len(mdl.present[u]))
                   if solver.BooleanValue(mdl.present[u][j])] for u in range(mdl.n)]


def cpsat(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, workers: int = 2,
          max_computations: int = 2, hint: bool = True, hint_sequence=None, rel_gap: float = 0.0,
          feasibility_share: float = 0.8, parameters: dict | None = None, log: bool = False,
          known_lower_bound_cost: float | None = None) -> Proposal:
    """Minimum-cost schedule of the family under `budget_bytes` (bytes), by CP-SAT.

    max_computations: C, the most computations of one node (Moccasin's C). hint: warm-start from the cheapest
    baseline in the family; hint_sequence: a compute sequence to try as the hint first (used when it, or its stage
    normal form (solvers.exact.cpsat_family.stage_normal_form), is in the family and fits). When no hint fits, a
    feasibility phase first minimises the peak (capacity as a variable, floored at the budget) from the
    no-recomputation schedule, for at most `feasibility_share` of the time left; its first schedule within budget
    warm-starts the cost phase. rel_gap: CP-SAT's relative gap limit (0: prove
    the exact optimum). parameters: extra SatParameters fields.
    known_lower_bound_cost: a bound on the total cost that holds for every schedule (the forced-recomputation
    bound); with exact cost units it becomes a row on the objective, so CP-SAT stops as soon as a schedule meets
    it instead of proving it (mobilenet and resnet50 at 0.5-0.8).
    Raises InfeasibleBudgetError (below the single-operation bound, or CP-SAT proved that no member of the family
    fits) and NoSolutionInTimeError (no schedule within the time limit).
    """
    from ortools.sat.python import cp_model

    check_budget_floor(graph, budget_bytes, SOLVER_NAME)
    if max_computations < 1:
        raise ValueError("max_computations must be >= 1")
    budget_bytes = int(budget_bytes)
    C = int(max_computations)

    # one deadline for everything below (hints, builds, both phases), with a margin for reading the solution back
    deadline = deadline_after(None if time_limit_s is None else 0.97 * time_limit_s)

    def left() -> float | None:
        return seconds_left(deadline)

    params = default_parameters(workers)
    params.update(parameters or {})
    info: dict = {"family": f"stages in reference order, ascending ids within a stage, at most {C} computations "
                            "per node", "max_computations": C,
                  "bound_scope": "lower bound over the solver's family only"}
    # hint: a given sequence first, then the baselines
    hint_seq, hint_name, min_known = None, None, None
    if hint_sequence is not None:
        # the given sequence, or its stage normal form when only that lies in the family (and still fits)
        normal = stage_normal_form(hint_sequence)
        for name, seq in (("given", list(hint_sequence)), ("given, stage normal form", normal)):
            if family_form(graph, seq, C) is not None:
                peak = simulate(graph, Schedule.from_sequence(graph, seq)).peak_bytes
                if peak <= budget_bytes:
                    hint_seq, hint_name, min_known = seq, name, peak
                    break
    if hint and hint_seq is None:
        hint_seq, hint_name, min_known = _baseline_hint(graph, budget_bytes, C, deadline)
    if hint and hint_seq is None:
        seq = best_greedy_sequence(graph, budget_bytes, C, deadline=deadline)
        if seq is not None:
            hint_seq, hint_name = seq, "greedy"
    if hint_seq is None:
        # feasibility phase: lower the peak until it meets the budget, from the greedy member at the nearest
        # budget above where the greedy works (else the no-recomputation schedule)
        ref = list(range(graph.n))
        ref_peak = simulate(graph, Schedule.from_sequence(graph, ref)).peak_bytes
        start, start_name = ref, "no recomputation"
        if hint:
            for step in range(1, 20):
                above = budget_bytes + (ref_peak - budget_bytes) * step // 20
                if left() is not None and left() < 0.8 * time_limit_s:
                    break
                seq = best_greedy_sequence(graph, above, C, variants=(1.0, 0.5), deadline=deadline)
                if seq is not None:
                    start, start_name = seq, f"greedy at {above} bytes"
                    break
        start_peak = simulate(graph, Schedule.from_sequence(graph, start)).peak_bytes
    if hint_seq is None and start_peak <= budget_bytes:
        hint_seq, hint_name = start, start_name
    if hint_seq is None:
        fmdl = build_model(graph, budget_bytes, C, peak_objective_upto=start_peak, deadline=deadline)
        _add_hint(fmdl, graph, family_form(graph, start, C))
        share = None if left() is None else left() * feasibility_share
        fparams = feasibility_parameters(workers)
        fparams.update(parameters or {})
        fsolver, fcode = _solve(fmdl, fparams, share, log)
        info["feasibility_phase"] = {"status": fsolver.StatusName(fcode), "seconds": fsolver.WallTime(),
                                     "start": start_name}
        if fcode in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stages = _stages_of(fmdl, fsolver)
            seq = sequence_from_stages(graph, stages)
            peak = simulate(graph, Schedule.from_sequence(graph, seq)).peak_bytes
            info["feasibility_phase"]["peak_bytes"] = peak
            if peak <= budget_bytes:
                hint_seq, hint_name = seq, "feasibility phase"
            elif fcode == cp_model.OPTIMAL:
                raise InfeasibleBudgetError(budget_bytes, peak, SOLVER_NAME,
                                            "CP-SAT proved no schedule of its family fits; the budget named is the "
                                            "family's proven minimum peak")
            else:
                raise NoSolutionInTimeError(
                    f"CP-SAT found no schedule within {time_limit_s} s for {graph.name} at {budget_bytes} bytes "
                    f"(its lowest peak was {peak} bytes)")
        elif fcode == cp_model.INFEASIBLE:  # cannot happen: the no-recomputation schedule is a member
            raise SolverError("CP-SAT found the feasibility phase infeasible: a model bug")
        else:
            raise NoSolutionInTimeError(f"CP-SAT found no schedule within {time_limit_s} s "
                                        f"(feasibility phase {fsolver.StatusName(fcode)}) for {graph.name} at "
                                        f"{budget_bytes} bytes")
    t_build = time.perf_counter()
    try:
        mdl = build_model(graph, budget_bytes, C, deadline=deadline)
    except NoSolutionInTimeError:
        if hint_seq is None:
            raise
        info["returned"] = "the hint (the time limit ran out while building the cost model)"
        return Proposal(Schedule.from_sequence(graph, hint_seq),
                        Status.HEURISTIC if hint_name != "feasibility phase" else Status.FEASIBLE,
                        lower_bound_cost=None, info=info)
    if known_lower_bound_cost is not None and mdl.cost_exact:
        need = (float(known_lower_bound_cost) - graph.total_cost) / mdl.cost_unit
        floor_units = math.ceil(need - 1e-6 * max(1.0, abs(need)))  # the objective is an integer >= need
        if floor_units > 0:
            # the objective as a variable whose domain starts at the bound: CP-SAT's own bound then starts there
            # and it ends (OPTIMAL) once a schedule reaches it (a side constraint alone does not lift its bound)
            expr = sum(mdl.cost_units[u] * lit for u in range(graph.n) for lit in mdl.present[u][1:]
                       if mdl.cost_units[u])
            top = sum(mdl.cost_units[u] * (len(mdl.present[u]) - 1) for u in range(graph.n))
            obj = mdl.model.NewIntVar(floor_units, max(floor_units, top), "recomputation_cost")
            mdl.model.Add(obj == expr)
            mdl.model.Minimize(obj)
            info["known_lower_bound_units"] = floor_units
    info["build_seconds"] = time.perf_counter() - t_build
    info["cost_scaling"] = "exact" if mdl.cost_exact else "floored (the bound stays valid)"
    info["hint"] = hint_name if hint_seq is not None and _add_hint(mdl, graph, family_form(graph, hint_seq, C)) \
        else None
    solver, code = _solve(mdl, dict(params, relative_gap_limit=float(rel_gap)), left(), log)
    info.update(cpsat_status=solver.StatusName(code), cpsat_seconds=solver.WallTime(),
                num_conflicts=solver.NumConflicts())
    if code == cp_model.INFEASIBLE:
        raise InfeasibleBudgetError(budget_bytes, min_known, SOLVER_NAME,
                                    "CP-SAT proved no schedule of its family fits; the budget named is the lowest "
                                    "peak of the baselines" if min_known is not None else
                                    "CP-SAT proved no schedule of its family fits")
    if code == cp_model.MODEL_INVALID:
        raise SolverError(f"CP-SAT rejected the model: {mdl.model.Validate()}")
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint_seq is not None:  # the hint is a member within budget: return it, saying where it came from
            sched = Schedule.from_sequence(graph, hint_seq)
            info["returned"] = "the hint (CP-SAT returned no schedule in time)"
            return Proposal(sched, Status.HEURISTIC if hint_name != "feasibility phase" else Status.FEASIBLE,
                            lower_bound_cost=None, info=info)
        raise NoSolutionInTimeError(f"CP-SAT found no schedule within {time_limit_s} s "
                                    f"(status {solver.StatusName(code)}) for {graph.name} at {budget_bytes} bytes")
    seq = sequence_from_stages(graph, _stages_of(mdl, solver))
    sched = Schedule.from_sequence(graph, seq)
    sim = simulate(graph, sched)
    if sim.peak_bytes > budget_bytes:
        raise SolverError(f"CP-SAT's schedule peaks at {sim.peak_bytes} bytes, over {budget_bytes}: a model bug")
    bound_units = math.ceil(solver.BestObjectiveBound() - 1e-6)
    lower = graph.total_cost + max(0, bound_units) * mdl.cost_unit
    gap = (sim.total_cost - lower) / sim.total_cost if sim.total_cost > 0 else 0.0
    info.update(gap=gap, objective_units=solver.ObjectiveValue(), bound_units=solver.BestObjectiveBound(),
                recomputations=len(seq) - graph.n)
    if code == cp_model.OPTIMAL and gap <= max(rel_gap, 1e-9 if mdl.cost_exact else 1e-6):
        status = Status.OPTIMAL
    else:
        status = Status.FEASIBLE
    return Proposal(sched, status, lower_bound_cost=lower, info=info)
