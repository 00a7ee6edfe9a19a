"""`rollout_search`: many eviction rollouts with randomly perturbed scores; the cheapest schedule wins.

The greedy eviction engine of `solvers.heuristics.dtr` makes one choice per eviction, by a score; a single bad choice
early on can cost a large recomputation later (segnet at its smallest budget: DTR recomputes a convolution of
182085 cost units where one of 105400 and a few small ones would do). Perturbing the scores explores nearby choices
cheaply: each rollout multiplies every value's score by its own random factor exp(sigma * N(0, 1)) (sigma drawn
from SIGMAS per rollout), cycling over three scores: DTR's (bytes x staleness), Belady's (bytes x steps until the
next use) and Belady's with the recompute cost taken at the next use. The unperturbed rollouts run first, so the result
is never worse than theirs.

A rollout costs milliseconds on graphs of a hundred nodes, so a few seconds try thousands. Every candidate is
replayed by the simulator; status HEURISTIC. Results depend on the time given (how many rollouts run); `rollouts`
caps their number instead, for reproducible runs.
"""
from __future__ import annotations

import math
import random
import time
from typing import Sequence

from graphs.errors import NoSolutionInTimeError
from graphs.ir import Graph
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.base import Proposal
from solvers.deadline import passed
from solvers.heuristics.dtr import Rollout, dtr_den, infeasible, rollout_or_none
from solvers.heuristics.evict import ROLLOUTS

DEFAULT_TIME_LIMIT_S = 5.0
SIGMAS = (0.3, 1.0, 2.0)
# evict's three (name, denominator, rollout options), cycled over with DTR's first: dtr, belady, belady_lookahead
SCORES = tuple(next(r for r in ROLLOUTS if r[0] == name) for name in ("dtr", "belady", "belady_lookahead"))


def rollout_search(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, seed: int = 0,
                   rollouts: int | None = None, stop_at_cost: float | None = None,
                   prior: Sequence[float] | None = None) -> Proposal:
    """The cheapest schedule within `budget_bytes` over perturbed rollouts (see the module docstring).

    time_limit_s: how long to keep trying (default DEFAULT_TIME_LIMIT_S); rollouts: stop after this many instead
    (whichever comes first when both are given); stop_at_cost: stop once a schedule costs no more (a known lower
    bound); prior: a factor per value on every rollout's score, the unperturbed ones included (below 1: evicted
    sooner), e.g. from what a lower bound's solution recomputes. Raises InfeasibleBudgetError, naming the smallest
    budget the unperturbed DTR rollout meets, when no rollout fits.
    """
    t0 = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
    deadline = t0 + limit
    budget_bytes = int(budget_bytes)
    rng = random.Random(seed)
    eng = Rollout(graph)
    cap = 4 * graph.n + 100  # a rollout that recomputes more than this is of no use
    best: tuple[float, Schedule, str, int] | None = None
    done = 0
    unperturbed = len(SCORES)
    complete = True  # every unperturbed rollout ran to its end
    if budget_bytes >= graph.single_op_bound_bytes():
        while rollouts is None or done < rollouts:
            if passed(deadline):
                complete = complete and done >= unperturbed
                break
            name, den, opts = SCORES[done % len(SCORES)]
            bias = None if prior is None else list(prior)
            if done >= unperturbed:
                sigma = rng.choice(SIGMAS)
                noise = [math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(graph.n)]
                bias = noise if prior is None else [p * z for p, z in zip(prior, noise)]
            seq = eng.run(budget_bytes, den, bias=bias, max_computes=cap, deadline_s=deadline, **opts)
            done += 1
            if seq is None:
                if done <= unperturbed and eng.cut_by_deadline:
                    complete = False  # an unperturbed rollout was cut: its failure says nothing
                continue
            sched = Schedule.from_sequence(graph, seq)
            sim = simulate(graph, sched)
            if sim.peak_bytes <= budget_bytes and (best is None or sim.total_cost < best[0]):
                best = (sim.total_cost, sched, name, done)
                if stop_at_cost is not None and sim.total_cost <= stop_at_cost * (1 + 1e-9) + 1e-9:
                    break
    if best is None:
        if not complete:
            raise NoSolutionInTimeError(f"rollout_search: its unperturbed rollouts did not finish within {limit:g} s",
                                        budget_bytes=budget_bytes, solver="rollout_search", seconds=limit)
        raise infeasible(graph, budget_bytes, "rollout_search",
                         lambda b: rollout_or_none(eng, b, dtr_den, deadline, max_computes=cap),
                         "its unperturbed DTR rollout does not get stuck", deadline)
    cost, sched, name, at = best
    info = {"rollouts": done, "best_score": name, "best_at_rollout": at, "perturbed": at > unperturbed,
            "seconds": round(time.perf_counter() - t0, 3)}
    return Proposal(sched, Status.HEURISTIC, info=info)
