"""`auto`: pick among the registered solvers by the graph's size and shape, within one time limit.

Plan (every step replayed by the simulator through solvers.base.solve):
1. checkpoint_all: if it fits, no schedule can cost less (every node must run once): done.
2. the forced-recomputation bound (solvers.bounds.forced_bound), a lower bound valid for every schedule; then fast
   heuristics (Chen greedy, DTR in two scores, the lowest-memory rebuild) give an incumbent and a fallback, and
   a few seconds of randomly perturbed eviction rollouts (`rollout_search`) improve it where DTR's rollout fits,
   and find schedules where it gets stuck.
   When none of them fits, the subgraph relaxation (solvers.bounds.subgraph_bound) may prove that no schedule of any
   kind does: auto then raises at once (resnet50 at 0.1 x reference: 3 s instead of the whole limit).
   The block-chain program (`block_dp`, solvers.exact.block_dp), where the graph splits into blocks: first on graphs
   of more than CPSAT_MAX_NODES nodes, with the DTR rollouts and before the forced bound (it often is the answer
   there: where it is the cheapest schedule and within `mip_gap` of its family's bound, auto runs a few seconds of
   perturbed rollouts, whose schedules lie outside that family, and stops if none is cheaper, reporting that bound
   with status "optimal in its family"; otherwise it goes on, skipping Chen's greedies and the lowest-memory
   fallback, which cost seconds there and lose to it), after the fast heuristics on smaller ones (which often meet
   the forced bound at once).
3. where no schedule meets a bound yet, the program-order bound (solvers.bounds.order_bound); on training graphs too
   large for CP-SAT, rollouts that evict first the values its solution recomputes (`rollout_search` with a prior;
   again at the end, from another seed, with the time the later steps leave, while the gap is above `mip_gap`);
   then the eviction heuristic with local search (`evict`): a share of the time when an exact solver follows, nearly
   all of it on graphs too large for the exact solvers (the random layered graphs of 500+ nodes).
4. chain_dp, when the graph is a training chain.
5. an exact solver with the remaining time: CP-SAT (hinted with the best schedule so far) on training graphs (with
   backward nodes) up to CPSAT_MAX_NODES, over the wider family (three computations per value) first on graphs up to
   MILP_MAX_NODES, on larger ones over a family wide enough to hold its hint (up to HINT_MAX_COMPUTATIONS; the
   eviction rollouts, which get a larger share of the time on these graphs, recompute some values three times);
   the Checkmate MILP on graphs without a backward pass up to MILP_MAX_NODES nodes. CP-SAT, not the MILP, is the
   exact step on training graphs of every size it holds: it proves the same optima sooner on the benchmark graphs,
   and on traced models' graphs it proves in seconds where the MILP may find no schedule within the limit.
The cheapest schedule wins; its status is OPTIMAL when an exact solver proved it or when it costs no more than the
forced-recomputation bound (auto then stops at once, without the later steps). The reported lower bound is the
larger of the exact solver's (for its schedule family, dropped when a schedule outside the family beats it) and
the forced-recomputation bound (for every schedule); `info["bound_from"]` and `info["bound_scope"]` say which.
`info["chosen"]` names the solver whose schedule was returned and `info["tried"]` lists every attempt.

The time limit is a hard limit: each step gets at most its share (FAST_SHARE of it for each fast heuristic,
FORCED_BOUND_SHARE for the bound, ...) and the shared deadline of `solvers.deadline`; a solver that fails with a
SolverError (a backend failure, an invalid proposal) is recorded and skipped. When no step found a schedule, auto
raises InfeasibleBudgetError only where something proves it (the single-operation bound, the subgraph relaxation,
non-recomputable values that must stay resident, an exact solver's proof for its family), else
NoSolutionInTimeError with the least budget known to work.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, SolverError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Status
from solvers.base import Proposal, check_budget_floor, solve, solver_names
from solvers.progress import Progress, SearchState

MILP_MAX_NODES = 120  # graphs without a backward pass up to this size go to the Checkmate MILP; training graphs up
# to this size get CP-SAT over a wider family first (at most WIDER_COMPUTATIONS computations of a value)
WIDER_COMPUTATIONS = 3
WIDER_FAMILY_SHARE = 0.6  # of the remaining time, for that run; the default family's run gets the rest
# on larger training graphs CP-SAT's family widens to hold its hint, up to this many computations of a value
HINT_MAX_COMPUTATIONS = 4
CPSAT_MAX_NODES = 400  # beyond, the eviction heuristic's search gets the whole time limit
DEFAULT_TIME_LIMIT_S = 60.0
FAST_HEURISTICS = ("chen_greedy", "chen_greedy_linear", "dtr", "dtr_local", "lowest_memory")
# Share of the remaining time the improving eviction heuristic gets before an exact solver starts.
EVICT_SHARE_WITH_EXACT = 0.25
EVICT_SHARE_ALONE = 0.95
SAFETY_S, SAFETY_SHARE = 8.0, 0.12
LOWEST_MEMORY_IMPROVE_S = 20.0  # its keep-greedy pass, when nothing else fits
ROLLOUT_SEARCH_S, ROLLOUT_SEARCH_SHARE = 5.0, 0.1  # perturbed rollouts: at most this long, this share of the time
# where CP-SAT follows (graphs it holds), the rollouts' schedule is its hint, and a better hint is worth more than the
# seconds it takes from CP-SAT (on the transformers zoo at 40 % of the peak): hence a larger share there
ROLLOUT_SEARCH_SHARE_BEFORE_CPSAT = 0.2
FORCED_BOUND_S, FORCED_BOUND_SHARE = 5.0, 0.1  # the forced-recomputation bound (< 0.5 s on the benchmarks, up to
# ~4 s with its windows): at most this long, this share of the time
# rollouts guided by the program-order bound's solution (rollout_search with a prior) on training graphs too large
# for CP-SAT: a recomputed value's score times GUIDED_PRIOR (of 0.1, 0.2 and 0.3, 0.1 is the best or near it on
# traced T5 at 40 % and 60 % and on generated decoder and random-skip graphs), for at most GUIDED_S, this share of
# the remaining time
GUIDED_PRIOR, GUIDED_S, GUIDED_SHARE = 0.1, 5.0, 0.3
# they also get what is left at the end (at least GUIDED_MIN_LEFT_S, at most GUIDED_LEFT_S), where the best schedule
# is not within mip_gap of the bound
GUIDED_MIN_LEFT_S, GUIDED_LEFT_S = 0.5, 10.0
GUIDED_NOTE = "evicts first the values the program-order bound's solution recomputes"
ORDER_BOUND_S, ORDER_BOUND_SHARE = 4.0, 0.35  # the program-order bound, where no schedule meets the forced one yet
# (traced transformers of 145-770 nodes: 0.1-20 s to prove; a round cut short gives its dual bound). A third of
# short limits: on the tiny transformers with plan()'s 11 s, CP-SAT rarely proves and gains little from its last
# seconds, and the bound is what the gap is measured against.
SUBGRAPH_S = 5.0  # the subgraph relaxation, when no fast heuristic fits (resnet50 below its smallest budget: 1.4 s)
# Each fast heuristic gets at most this share of the time: they run in milliseconds to a second where they fit, but
# where they do not, naming the smallest budget they meet is a bisection of rollouts (dtr on rl1000 at 0.8: 70 s).
FAST_SHARE = 0.06
RETRY_SHARE = 0.2  # of the remaining time, for a DTR rollout that ran out of its share when nothing fits yet
BLOCK_DP_SHARE = 0.3  # the block-chain program: under a second on 1000-2000-node traced transformers
# Where no whole-graph exact solver runs (more than CPSAT_MAX_NODES nodes), auto stops once its best schedule is
# within this share of a bound that covers it (the block program's, for its family).
DEFAULT_MIP_GAP = 0.01


def computations_needed(sequence) -> int:
    """The most computations of one node in the stage normal form of `sequence` (solvers.exact.cpsat_family): the
    smallest C whose CP-SAT family can take it as a hint."""
    from collections import Counter

    from solvers.exact.cpsat_family import stage_normal_form

    return max(Counter(stage_normal_form(sequence)).values(), default=1)


def _hint_computations(graph: Graph, budget_bytes: int, sequence) -> int | None:
    """The computations per value a CP-SAT family needs to take `sequence` as its hint, in its stage normal form;
    None where that form does not fit the budget (CP-SAT would not use it)."""
    from graphs.schedule import Schedule
    from graphs.simulate import simulate
    from solvers.exact.cpsat_family import stage_normal_form

    normal = stage_normal_form(sequence)
    if simulate(graph, Schedule.from_sequence(graph, normal)).peak_bytes > budget_bytes:
        return None
    return computations_needed(normal)  # the normal form is its own normal form


def _is_chain(graph: Graph) -> bool:
    if "chain_dp" not in solver_names():
        return False
    from solvers.exact.chain_dp import is_training_chain

    return is_training_chain(graph)


def _has_blocks(graph: Graph) -> bool:
    if "block_dp" not in solver_names():
        return False
    from solvers.exact.blocks import split_blocks

    return split_blocks(graph) is not None


def auto(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
         mip_gap: float = DEFAULT_MIP_GAP, progress: Progress | None = None,
         candidates: Sequence[tuple[str, dict]] = ()) -> Proposal:
    """See the module docstring. `progress` (solvers.progress) is told each step as it starts, with the best cost
    and the largest bound known then. `candidates`: (label, block_checkpoint options) of the schedules the caller
    would otherwise run (the model's per-block and selective checkpointing): members of the portfolio, tried first,
    named by their label."""
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
    # Keep a margin for what follows the solvers (replay, export, process start-up) inside the caller's limit.
    limit -= min(SAFETY_S, SAFETY_SHARE * limit)
    t0 = time.perf_counter()
    check_budget_floor(graph, budget_bytes, "auto")
    tried: list[dict] = []
    results: list[SolveResult] = []
    infeasible: list[InfeasibleBudgetError] = []
    timed_out: list[NoSolutionInTimeError] = []
    bounds_known: list[float] = []

    def report(step: str) -> None:
        if progress is not None:
            progress(SearchState(step, min((r.total_cost for r in results), default=None),
                                 max(bounds_known, default=None), graph.total_cost))

    def attempt(name: str, seconds: float | None, label: str | None = None, **options) -> SolveResult | None:
        if name not in solver_names():
            return None
        label = label or name
        report(label)
        # what auto chose for it: the family CP-SAT ran over, the guided rollouts' prior
        noted: dict = {"max_computations": options["max_computations"]} if "max_computations" in options else {}
        if "prior" in options:
            noted["prior"] = GUIDED_NOTE
        try:
            r = solve(graph, budget_bytes, name, time_limit_s=seconds, **options)
        except InfeasibleBudgetError as e:
            tried.append({"solver": label, "outcome": "infeasible", "min_budget_bytes": e.min_budget_bytes,
                          "reason": e.reason})
            infeasible.append(e)
            return None
        except NoSolutionInTimeError as e:
            tried.append({"solver": label, "outcome": "no solution in time", "detail": str(e), **noted})
            timed_out.append(e)
            return None
        except SolverError as e:
            # a solver bug (an invalid or over-budget proposal) or a backend failure: the portfolio goes on
            # without it, and says so in `tried`
            tried.append({"solver": label, "outcome": "failed", "detail": f"{type(e).__name__}: {e}"})
            return None
        tried.append({"solver": label, "outcome": r.status.value, "total_cost": r.total_cost,
                      "lower_bound_cost": r.lower_bound_cost, "seconds": round(r.solve_seconds, 3), **noted})
        if label != name:
            r = dataclasses.replace(r, solver=label)
        results.append(r)
        return r

    def remaining() -> float:
        return max(0.0, limit - (time.perf_counter() - t0))

    first = attempt("checkpoint_all", None)
    if first is not None:
        return _pick(graph, results, tried, exact=first)  # no recomputation: optimal, bound = its cost
    for label, options in candidates:  # one schedule each: milliseconds
        attempt("block_checkpoint", None, label=label, **options)
    blocks = None
    big = graph.n > CPSAT_MAX_NODES
    has_blocks = _has_blocks(graph)
    if has_blocks and big:
        # first: on large graphs it is the best start there is, and often the answer (checked against the DTR-style
        # rollouts), before the forced-recomputation bound, which costs seconds there (2000 nodes: ~3 s)
        blocks = attempt("block_dp", min(remaining(), BLOCK_DP_SHARE * limit))
        for name in ("dtr", "dtr_local"):
            attempt(name, min(remaining(), FAST_SHARE * limit))
            if tried[-1]["solver"] == name and tried[-1]["outcome"] == "no solution in time":
                # cut by its share, it says nothing: once more, longer, before the block program's schedule is
                # taken as the cheapest (decoder75 at 0.1: DTR needs 1.2 s of its 1.1 s share, and beats it)
                attempt(name, RETRY_SHARE * remaining())
        if blocks is not None and _within_gap(blocks, results, mip_gap):
            # the best of the block program's family, but schedules outside it may cost less: a few seconds of
            # perturbed rollouts (seconds here) before the family's optimum is returned
            attempt("rollout_search", min(ROLLOUT_SEARCH_S, ROLLOUT_SEARCH_SHARE * remaining()))
            if _within_gap(blocks, results, mip_gap):
                return _pick(graph, results, tried, exact=blocks, forced=None)
    report("forced-recomputation bound")
    forced = _forced_bound(graph, budget_bytes, tried, min(FORCED_BOUND_S, FORCED_BOUND_SHARE * limit))
    if forced is not None:
        bounds_known.append(forced)

    order: float | None = None
    guided: list[float] | None = None  # the guided rollouts' prior, where they ran
    training = any(nd.backward for nd in graph.nodes)

    def known_bound() -> float | None:
        # the larger of the bound for every schedule and the one for every program-order schedule (the family
        # every solver here returns)
        return max((b for b in (forced, order) if b is not None), default=None)

    def proven() -> bool:
        # a schedule costs no more than a bound that covers it: nothing can do better
        known = known_bound()
        return known is not None and bool(results) and \
            min(r.total_cost for r in results) <= known * (1 + 1e-9) + 1e-9

    for name in FAST_HEURISTICS:
        if any(t["solver"] == name for t in tried):
            continue  # run above
        if name == "lowest_memory" and big and has_blocks and results:
            continue  # a fallback for budgets nothing else meets; on large training graphs it costs its whole share
        if name.startswith("chen") and big and blocks is not None:
            continue  # Chen's segments are a coarser family than the block program's (and cost seconds here)
        attempt(name, min(remaining(), FAST_SHARE * limit))
    if not results and any(nd.backward for nd in graph.nodes):
        # the DTR rollouts may need more than their share on large training graphs (2000 nodes: about a second)
        for name in ("dtr", "dtr_local"):
            if any(t["solver"] == name and t["outcome"] == "no solution in time" for t in tried):
                attempt(name, RETRY_SHARE * remaining())
    if not results:
        _raise_if_no_schedule_fits(graph, budget_bytes, infeasible, min(SUBGRAPH_S, 0.2 * remaining()))
    if results and all(r.solver == "lowest_memory" for r in results):
        # only the minimum-memory rebuild fits: let it keep what it can (at resnet50's smallest budget this cuts
        # the rebuild's recomputation by an order of magnitude)
        attempt("lowest_memory", remaining(), improve_s=min(LOWEST_MEMORY_IMPROVE_S, 0.3 * remaining()))
    if not proven() and remaining() > 0:
        # perturbing the rollouts' choices finds cheaper schedules where they fit, in a second or two, a better
        # start for the exact solvers; and it finds schedules where the unperturbed rollouts get stuck (traced
        # transformers with perturbed op costs), far cheaper than the eviction heuristic's there
        share = ROLLOUT_SEARCH_SHARE if big else ROLLOUT_SEARCH_SHARE_BEFORE_CPSAT
        attempt("rollout_search", min(ROLLOUT_SEARCH_S, share * remaining()), stop_at_cost=forced)
    if has_blocks and not big and not proven() and remaining() > 0:
        # after the fast heuristics, which often meet the forced bound on small graphs at once
        blocks = attempt("block_dp", min(remaining(), BLOCK_DP_SHARE * limit))
    if not proven() and remaining() > 0:
        report("program-order bound")
        order, recomputed = _order_bound(graph, budget_bytes, tried,
                                         min(ORDER_BOUND_S, ORDER_BOUND_SHARE * limit, remaining()))
        if order is not None:
            bounds_known.append(order)
        if recomputed and big and training and not proven() and remaining() > 0:
            # where no whole-graph exact solver follows: rollouts that evict first what the bound's solution
            # recomputes, which brings the best schedule close to the bound on large traced and generated
            # transformers. They are not run where CP-SAT follows: they give it no better start and take its time.
            guided = [GUIDED_PRIOR if v in recomputed else 1.0 for v in range(graph.n)]
            attempt("rollout_search", min(GUIDED_S, GUIDED_SHARE * remaining()), stop_at_cost=order, prior=guided)
    if proven():
        return _pick(graph, results, tried, exact=None, forced=forced, order=order)
    if graph.n <= CPSAT_MAX_NODES and training:
        exact_name = "cpsat"  # on every training graph it can hold (the module doc says why)
    elif graph.n <= MILP_MAX_NODES:
        exact_name = "milp"
    else:
        # Wide fan-in graphs without a backward pass (the random layered graphs): CP-SAT's stage family rarely
        # finds a schedule there in time, and the eviction search's drop-gap MILP does better with all of it.
        exact_name = None
    if exact_name not in solver_names():
        exact_name = None
    share = EVICT_SHARE_WITH_EXACT if exact_name else EVICT_SHARE_ALONE
    if remaining() > 0:
        attempt("evict", remaining() * share)
    if proven():
        return _pick(graph, results, tried, exact=None, forced=forced, order=order)
    exact: SolveResult | None = None
    if _is_chain(graph) and remaining() > 0:
        exact = attempt("chain_dp", remaining())
        if exact is not None and exact.lower_bound_cost is None:
            exact = None  # optimal only within its family: keep looking
    if exact is None and exact_name is not None and remaining() >= 1.0:
        options = {}
        if results:
            # The exact solvers start from the schedules found so far (where those lie in their family).
            ranked = sorted(results, key=lambda r: r.total_cost)
            if exact_name == "cpsat":
                options["hint_sequence"] = ranked[0].schedule.computes
                known = known_bound()
                if known is not None:
                    # CP-SAT stops once a schedule meets it (its family lies within the program-order one)
                    options["known_lower_bound_cost"] = known
            else:
                options["start_sequences"] = [r.schedule.computes for r in ranked[:3]]
        if exact_name == "cpsat" and graph.n <= MILP_MAX_NODES:
            # small graphs: the wider family first (a value computed up to three times; it reaches the MILP's
            # optimum where two computations fall short, as on vgg19 at 0.8); where it proves nothing in its share,
            # the default family, whose proof (for that family) comes sooner
            exact = attempt(exact_name, remaining() * WIDER_FAMILY_SHARE, max_computations=WIDER_COMPUTATIONS,
                            **options)
            if not proven() and (exact is None or exact.status is not Status.OPTIMAL) and remaining() >= 1.0:
                if results:  # the best schedule so far, which may now be the wider family's
                    options["hint_sequence"] = min(results, key=lambda r: r.total_cost).schedule.computes
                exact = _better_bound(exact, attempt(exact_name, remaining(), **options), results)
        else:
            if exact_name == "cpsat" and "hint_sequence" in options:
                # a family wide enough to hold the best schedule so far as its hint (the eviction rollouts' schedules
                # recompute some values three times, and a hint outside the family is lost to CP-SAT)
                need = _hint_computations(graph, budget_bytes, options["hint_sequence"])
                if need is not None and 2 < need <= HINT_MAX_COMPUTATIONS:
                    options["max_computations"] = need
            exact = attempt(exact_name, remaining(), **options)
    best_cost = min((r.total_cost for r in results), default=None)
    if guided is not None and best_cost is not None and order is not None and remaining() >= GUIDED_MIN_LEFT_S \
            and best_cost > order * (1 + mip_gap):
        # the time the steps above left (the eviction search ends once its local search settles), while the best
        # schedule is not within mip_gap of the bound: more guided rollouts, from another seed
        attempt("rollout_search", min(GUIDED_LEFT_S, remaining()), stop_at_cost=order * (1 + mip_gap), prior=guided,
                seed=1)
    exact = _better_bound(exact, blocks, results)
    seed = 1
    while not results and remaining() >= 0.1:
        # nothing found and nothing proven: the time left goes to more perturbed rollouts, from other seeds, until
        # one fits or the limit is reached (no schedule found proves nothing, so the whole limit is the user's)
        seed += 1
        attempt("rollout_search", remaining(), seed=seed)
    if not results:
        floor = graph.single_op_bound_bytes()
        least = _least_named(infeasible, timed_out)
        proofs = [f"{e.solver}: {e.reason}" for e in infeasible if e.solver in EXACT_SOLVERS]
        if proofs:
            raise InfeasibleBudgetError(budget_bytes, least, "auto",
                                        "no solver found a schedule, and an exact solver proved that none of its "
                                        "schedule family fits: " + "; ".join(proofs) +
                                        f"; single-operation bound {floor} bytes")
        known = "no budget is known to work" if least is None else f"the least budget known to work is {least} bytes"
        raise NoSolutionInTimeError(
            f"auto: no schedule found in {time.perf_counter() - t0:.1f} s for budget {budget_bytes} bytes, and nothing "
            f"proves that none exists; {known} (single-operation bound {floor} bytes)",
            budget_bytes=budget_bytes, min_budget_bytes=least, solver="auto", seconds=time_limit_s)
    return _pick(graph, results, tried, exact=exact, forced=forced, order=order)


EXACT_SOLVERS = ("milp", "milp_cbc", "cpsat", "chain_dp")
# bounds that hold for every schedule the planner can run: every schedule (the forced-recomputation bound, each node
# once), every program-order schedule (the family of every solver here)
BOUNDS_FOR_EVERY_SCHEDULE = ("forced_bound", "each_node_once", "order_bound")


def _better_bound(a: SolveResult | None, b: SolveResult | None, results: list[SolveResult]) -> SolveResult | None:
    """Of two exact solvers' results, the one whose family bound still holds for the cheapest schedule and is the
    larger (a bound that a cheaper schedule outside its family beat says nothing)."""
    best = min((r.total_cost for r in results), default=None)

    def valid(r):
        return r is not None and r.lower_bound_cost is not None and best is not None and \
            best >= r.lower_bound_cost * (1 - 1e-9) - 1e-9

    if valid(a) and valid(b):
        return a if a.lower_bound_cost >= b.lower_bound_cost else b
    if valid(b) and not valid(a):
        return b
    return a


def _within_gap(r: SolveResult, results: list[SolveResult], mip_gap: float) -> bool:
    """`r` is the cheapest result and costs at most (1 + mip_gap) x its own lower bound, over a family that left no
    choice out (a block with more values than block_dp enumerates keeps the rest: T5's cross-attention blocks, where
    the eviction search then finds schedules a third cheaper)."""
    best = min(x.total_cost for x in results)
    return (r.lower_bound_cost is not None and r.total_cost <= best * (1 + 1e-12) + 1e-12
            and not r.info.get("forced_choices")
            and r.total_cost <= r.lower_bound_cost * (1 + mip_gap) + 1e-12)


def _least_named(infeasible: list[InfeasibleBudgetError], timed_out: list[NoSolutionInTimeError] = ()) -> int | None:
    """The least budget the failing solvers named as one they meet (None if none did)."""
    return min((e.min_budget_bytes for e in (*infeasible, *timed_out) if e.min_budget_bytes is not None),
               default=None)


def _raise_if_no_schedule_fits(graph: Graph, budget_bytes: int, infeasible: list[InfeasibleBudgetError],
                               seconds: float) -> None:
    """Raise InfeasibleBudgetError when the subgraph relaxation proves that no schedule of any kind fits."""
    from solvers.bounds.subgraph_bound import subgraph_floor_bytes

    sub = subgraph_floor_bytes(graph, budget_bytes, deadline=time.perf_counter() + seconds)
    if sub is None or not sub.capped:
        return
    raise InfeasibleBudgetError(budget_bytes, _least_named(infeasible), "auto",
                                f"no schedule of any kind fits (subgraph relaxation: {sub.describe(graph)}); "
                                f"the budget named is the least a heuristic meets")


def _forced_bound(graph: Graph, budget_bytes: int, tried: list[dict], seconds: float) -> float | None:
    """The forced-recomputation bound (valid for every schedule), or None if it is not solved in a few seconds.

    Raises InfeasibleBudgetError when non-recomputable values make the budget infeasible for every schedule."""
    from solvers.bounds.forced_bound import forced_recompute_bound

    try:
        # windows on small graphs only: their rows cost 1-6 s on graphs of 185-1000 nodes and lift no bound there
        # at 0.5-0.9. Without closures: the program-order bound, run later where nothing meets this one, holds them
        # and more for every schedule a solver here returns (and the closures cost up to a second on resnet50,
        # lifting nothing there)
        fb = forced_recompute_bound(graph, budget_bytes, time_limit_s=seconds,
                                    windows=graph.n <= MILP_MAX_NODES, closures=False)
    except NoSolutionInTimeError:
        tried.append({"solver": "forced_bound", "outcome": "no solution in time"})
        return None
    tried.append({"solver": "forced_bound", "outcome": "optimal" if fb.proven else "bound",
                  "lower_bound_cost": fb.lower_bound_cost, "recomputed": list(fb.recomputed)})
    return fb.lower_bound_cost


def _order_bound(graph: Graph, budget_bytes: int, tried: list[dict], seconds: float
                 ) -> tuple[float | None, frozenset[int]]:
    """The bound for every program-order schedule (solvers.bounds.order_bound), or None if not solved in time or
    if no program-order schedule fits (then it bounds nothing a solver here returns); and the values its solution
    recomputes (OrderBound.recomputed)."""
    from solvers.bounds.order_bound import order_bound

    ob = order_bound(graph, budget_bytes, time_limit_s=seconds)
    if ob is None:
        tried.append({"solver": "order_bound", "outcome": "no solution in time"})
        return None, frozenset()
    if not ob.fits:
        tried.append({"solver": "order_bound", "outcome": "infeasible",
                      "reason": "no program-order schedule fits: a node's inputs, output and non-recomputable values "
                                "alive across it overflow the budget"})
        return None, frozenset()
    tried.append({"solver": "order_bound", "outcome": "optimal" if ob.proven else "bound",
                  "lower_bound_cost": ob.lower_bound_cost, "rows": ob.rows, "rows_used": ob.rows_used})
    return ob.lower_bound_cost, frozenset(ob.recomputed)


def _pick(graph: Graph, results: list[SolveResult], tried: list[dict], exact: SolveResult | None,
          forced: float | None = None, order: float | None = None) -> Proposal:
    best = min(results, key=lambda r: (r.total_cost, r.peak_bytes))
    bound = exact.lower_bound_cost if exact is not None else None
    bound_note = None
    if bound is not None and best.total_cost < bound * (1 - 1e-9) - 1e-9:
        # The exact solvers bound their own schedule family only; a schedule outside it beat the bound,
        # so the family's bound says nothing about the whole problem.
        bound_note = (f"{exact.solver}'s bound {bound:.6g} holds for its schedule family only; "
                      f"{best.solver}'s schedule lies outside it and costs less")
        bound = None
    bound_from = exact.solver if exact is not None and bound is not None else None
    scope = f"schedules of the family: {exact.info['family']}" if bound_from and exact.info.get("family") else None
    if order is not None and best.total_cost >= order * (1 - 1e-9) - 1e-9 and (bound is None or order > bound):
        # it holds for every program-order schedule: a wider family than any exact solver's here
        from solvers.bounds.order_bound import FAMILY as ORDER_FAMILY

        bound, bound_from, scope = order, "order_bound", f"schedules of the family: {ORDER_FAMILY}"
    if forced is not None and (bound is None or forced > bound):
        # the forced-recomputation bound holds for every schedule, in any order
        bound, bound_from, scope = min(forced, best.total_cost), "forced_bound", "every schedule"
    if bound is None:
        # nothing else is known in time: every node runs at least once, in every schedule
        bound, bound_from, scope = graph.total_cost, "each_node_once", "every schedule"
    if bound_from == "checkpoint_all":
        scope = "every schedule"  # it computes every node once: no schedule costs less
    covers_all = scope == "every schedule" or bound_from in BOUNDS_FOR_EVERY_SCHEDULE
    if bound is not None and covers_all and best.total_cost <= bound * (1 + 1e-9) + 1e-9:
        status = Status.OPTIMAL  # no schedule the planner can run costs less
    elif exact is not None and exact.status is Status.OPTIMAL and not bound_note:
        # best costs at most the proven (within-gap) optimum of the exact solver's family: that family alone
        status = Status.OPTIMAL_IN_FAMILY
        scope = scope or f"schedules of the family of {exact.solver}"
    elif bound_note:
        status = Status.HEURISTIC  # cheaper than the family optimum: only the forced bound covers it
    else:
        status = Status.FEASIBLE if exact is not None else Status.HEURISTIC
    info = {"chosen": best.solver, "tried": tried, "bound_from": bound_from}
    if scope:
        info["bound_scope"] = scope
    if bound_note:
        info["bound_note"] = bound_note
    if best.info:
        info["chosen_info"] = {k: v for k, v in best.info.items() if k != "kept"}
    return Proposal(best.schedule, status, lower_bound_cost=bound, info=info)
