"""Two-phase LP rounding (Checkmate's approximation): solve the stage LP, round the kept set, recompute.

Phase 1 solves the LP relaxation of the stage MILP (`solvers.exact.milp.lp_solution`). Phase 2 rounds the
fractional kept pattern S (a sweep of thresholds, then randomized rounding with S as probabilities), derives
the cheapest recomputation for each rounded S (`stage_model.recompute_for_kept`: within each stage
recompute exactly what is needed and not kept), turns it into a schedule that frees at last use, and lets the
simulator judge it. The cheapest schedule within budget wins. When no rounding fits, the LP is solved again
for smaller budgets (its rounding then errs on the low-memory side), as Checkmate does.

Status: HEURISTIC, or OPTIMAL when the schedule's cost meets the LP bound. lower_bound_cost is the LP value at
the requested budget: a lower bound over the stage family (see `solvers.exact.stage_model`).
"""
from __future__ import annotations

import random
import time

import numpy as np

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal, check_budget_floor
from solvers.deadline import seconds_left
from solvers.exact.milp import baseline_schedules, lp_solution
from solvers.exact.stage_model import recompute_for_kept, sequence_from_stages

DEFAULT_TIME_LIMIT_S = 60.0
# Budgets (fractions of the requested one) the LP is re-solved at when no rounding fits.
BUDGET_SHRINK = (1.0, 0.97, 0.93, 0.88, 0.8, 0.7, 0.6)


def fractional_kept(graph: Graph, model) -> np.ndarray:
    """The LP's S as an (n+1) x n float array (row n: the retained set)."""
    n = graph.n
    S = np.zeros((n + 1, n))
    for (t, i), v in model.S.items():
        S[t, i] = min(1.0, max(0.0, v.varValue or 0.0))
    for i in graph.retained:
        S[n, i] = 1.0
    return S


def schedule_for_kept(graph: Graph, S: np.ndarray) -> Schedule:
    R = recompute_for_kept(graph, S)
    return Schedule.from_sequence(graph, sequence_from_stages(graph, R, S))


def roundings(S_frac: np.ndarray, rng: random.Random, samples: int, max_thresholds: int = 64):
    """Rounded kept patterns: deterministic thresholds first, then `samples` randomized ones (alternately
    one coin per stage and node, and one threshold per node shared by all stages)."""
    n = S_frac.shape[1]
    tri = np.tril(np.ones((n + 1, n), dtype=bool), -1)
    tri[n] = False  # the end row is fixed (retained)
    frac = np.unique(np.round(S_frac[tri], 6))
    frac = frac[(frac > 0) & (frac <= 1)]
    if len(frac) > max_thresholds:
        frac = np.quantile(frac, np.linspace(0, 1, max_thresholds))
    for thr in sorted(set(frac.tolist()) | {0.5, 1.0}, reverse=True):
        S = S_frac >= thr - 1e-9
        S[n] = S_frac[n] > 0.5
        yield S & (tri | _end_row(n))
    for k in range(samples):
        if k % 2:  # independent coins per (stage, node)
            draw = np.array([[rng.random() for _ in range(n)] for _ in range(n + 1)])
        else:  # one threshold per node for all stages: keeps a value over a coherent run of stages
            draw = np.tile(np.array([rng.random() for _ in range(n)]), (n + 1, 1))
        S = draw < S_frac
        S[n] = S_frac[n] > 0.5
        yield S & (tri | _end_row(n))


def _end_row(n: int) -> np.ndarray:
    m = np.zeros((n + 1, n), dtype=bool)
    m[n] = True
    return m


def lp_round(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, samples: int = 200,
             seed: int = 0, tighten: bool = True) -> Proposal:
    """The cheapest simulated schedule within `budget_bytes` over LP roundings (see the module docstring).

    Raises InfeasibleBudgetError below the single-operation bound, when the LP relaxation is infeasible (no
    stage schedule fits; min_budget_bytes from the baselines), or when no rounding fits (min_budget_bytes: the
    lowest peak a rounding or a baseline reached). NoSolutionInTimeError when the first LP is not solved in time.
    """
    t0 = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
    deadline = t0 + limit
    check_budget_floor(graph, budget_bytes, "lp_round")
    found, baseline_min, baseline_name = baseline_schedules(graph, budget_bytes, deadline)
    if found and found[0][1] == "checkpoint_all":
        return Proposal(Schedule.from_sequence(graph, found[0][2]), Status.OPTIMAL, graph.total_cost,
                        {"note": "checkpoint_all fits"})
    try:
        bound, model = lp_solution(graph, budget_bytes, time_limit_s=seconds_left(deadline), tighten=tighten)
    except InfeasibleBudgetError as e:
        raise InfeasibleBudgetError(budget_bytes, baseline_min, "lp_round",
                                    f"{e.reason}; baseline '{baseline_name}' meets {baseline_min} bytes") from e
    except NoSolutionInTimeError as e:
        if not found:
            raise NoSolutionInTimeError(f"lp_round: {e}", budget_bytes=budget_bytes, min_budget_bytes=baseline_min,
                                        solver="lp_round", seconds=limit) from e
        cost, b_name, b_seq = found[0]
        return Proposal(Schedule.from_sequence(graph, b_seq), Status.HEURISTIC, None,
                        {"note": f"the LP was not solved in time ({e}); baseline {b_name}"})
    rng = random.Random(seed)
    best = None  # (cost, peak, schedule, how)
    lowest_peak = None
    tried = 0
    seen: set[bytes] = set()
    for frac in BUDGET_SHRINK:
        if frac != 1.0:
            if best is not None or time.perf_counter() - t0 > limit:
                break
            try:
                _, model = lp_solution(graph, int(budget_bytes * frac), tighten=tighten,
                                       time_limit_s=seconds_left(deadline))
            except (InfeasibleBudgetError, NoSolutionInTimeError):
                break
        S_frac = fractional_kept(graph, model)
        for S in roundings(S_frac, rng, samples):
            if time.perf_counter() - t0 > limit:
                break
            key = np.packbits(S).tobytes()
            if key in seen:
                continue
            seen.add(key)
            tried += 1
            sched = schedule_for_kept(graph, S)
            sim = simulate(graph, sched)
            lowest_peak = sim.peak_bytes if lowest_peak is None else min(lowest_peak, sim.peak_bytes)
            if sim.peak_bytes <= budget_bytes and (best is None or (sim.total_cost, sim.peak_bytes) < best[:2]):
                best = (sim.total_cost, sim.peak_bytes, sched, frac)
    for b_cost, b_name, b_seq in found:  # baselines that fit stay candidates: never return worse than them
        if best is None or b_cost < best[0]:
            b_sched = Schedule.from_sequence(graph, b_seq)
            best = (b_cost, simulate(graph, b_sched).peak_bytes, b_sched, f"baseline {b_name}")
    if best is None:
        known = [x for x in (lowest_peak, baseline_min) if x is not None]
        raise InfeasibleBudgetError(budget_bytes, min(known) if known else None, "lp_round",
                                    f"no rounding of {tried} fits; the lowest peak among roundings and baselines")
    cost, _, sched, frac = best
    status = Status.OPTIMAL if cost <= bound * (1 + 1e-9) + 1e-9 else Status.HEURISTIC
    info = {"lp_value": bound, "roundings_tried": tried, "lp_budget_fraction": frac}
    return Proposal(sched, status, min(max(bound, graph.total_cost), cost), info)
