"""`auto`: pick among the registered solvers by the graph's size and shape, within one time limit.

Each call is one `Portfolio`: one method per step, in `Portfolio.run`'s order, with what it has tried and found so
far as its attributes; the constants (sizes, shares of the time, seconds) are the fields of
`solvers.auto_config.AutoConfig`, and `CONFIG` holds the ones it runs with.

Plan (every step replayed by the simulator through solvers.base.solve):
1. checkpoint_all: if it fits, no schedule can cost less (every node must run once): done.
2. the forced-recomputation bound (solvers.bounds.forced_bound), a lower bound valid for every schedule; then fast
   heuristics (Chen greedy, DTR in two scores, the lowest-memory rebuild) give an incumbent and a fallback, and
   a few seconds of randomly perturbed eviction rollouts (`rollout_search`) improve it where DTR's rollout fits,
   and find schedules where it gets stuck.
   When none of them fits, the subgraph relaxation (solvers.bounds.subgraph_bound) may prove that no schedule of any
   kind does: auto then raises at once (resnet50 at 0.1 x reference: 3 s instead of the whole limit).
   The block-chain program (`block_dp`, solvers.exact.block_dp), where the graph splits into blocks: first on graphs
   of more than cpsat_max_nodes nodes, with the DTR rollouts and before the forced bound (it often is the answer
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
   backward nodes) up to cpsat_max_nodes, over the wider family (three computations per value) first on graphs up to
   milp_max_nodes, on larger ones over a family wide enough to hold its hint (up to hint_max_computations; the
   eviction rollouts, which get a larger share of the time on these graphs, recompute some values three times);
   the Checkmate MILP on graphs without a backward pass up to milp_max_nodes nodes. CP-SAT, not the MILP, is the
   exact step on training graphs of every size it holds: it proves the same optima sooner on the benchmark graphs,
   and on traced models' graphs it proves in seconds where the MILP may find no schedule within the limit.
The cheapest schedule wins; its status is OPTIMAL when an exact solver proved it or when it costs no more than the
forced-recomputation bound (auto then stops at once, without the later steps). The reported lower bound is the
larger of the exact solver's (for its schedule family, dropped when a schedule outside the family beats it) and
the forced-recomputation bound (for every schedule); `info["bound_from"]` and `info["bound_scope"]` say which.
`info["chosen"]` names the solver whose schedule was returned and `info["tried"]` lists every attempt.

The time limit is a hard limit: each step gets at most its share (fast_share of it for each fast heuristic,
forced_bound_share for the bound, ...) and the shared deadline of `solvers.deadline`; a solver that fails with a
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
from graphs.schedule import Schedule, Status
from graphs.simulate import simulate
from solvers.auto_config import CONFIG, AutoConfig
from solvers.base import Proposal, check_budget_floor, solve, solver_names
from solvers.bounds.forced_bound import forced_recompute_bound
from solvers.bounds.order_bound import FAMILY as ORDER_FAMILY
from solvers.bounds.order_bound import order_bound
from solvers.bounds.subgraph_bound import subgraph_floor_bytes
from solvers.exact.blocks import split_blocks
from solvers.exact.chain_dp import is_training_chain
from solvers.exact.cpsat_family import stage_normal_form
from solvers.progress import Progress, SearchState

EXACT_SOLVERS = ("milp", "milp_cbc", "cpsat", "chain_dp")
# bounds that hold for every schedule the planner can run: every schedule (the forced-recomputation bound, each node
# once), every program-order schedule (the family of every solver here)
BOUNDS_FOR_EVERY_SCHEDULE = ("forced_bound", "each_node_once", "order_bound")
# what `info["tried"]` says of the guided rollouts' prior
GUIDED_NOTE = "evicts first the values the program-order bound's solution recomputes"


def auto(graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
         mip_gap: float = CONFIG.mip_gap, progress: Progress | None = None,
         candidates: Sequence[tuple[str, dict]] = ()) -> Proposal:
    """See the module docstring. `progress` (solvers.progress) is told each step as it starts, with the best cost
    and the largest bound known then. `candidates`: (label, block_checkpoint options) of the schedules the caller
    would otherwise run (the model's per-block and selective checkpointing): members of the portfolio, tried first,
    named by their label. The other constants are `CONFIG`'s (solvers.auto_config), read at each call."""
    return Portfolio(graph, budget_bytes, time_limit_s=time_limit_s, mip_gap=mip_gap, progress=progress,
                     config=CONFIG).run(candidates)


class Portfolio:
    """One call of `auto`: what it has tried and found so far, and one method per step, run in `run`'s order."""

    def __init__(self, graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None,
                 mip_gap: float = CONFIG.mip_gap, progress: Progress | None = None, config: AutoConfig = CONFIG):
        self.graph, self.budget_bytes, self.mip_gap, self.progress, self.config = \
            graph, budget_bytes, mip_gap, progress, config
        self.time_limit_s = time_limit_s  # as the caller gave it (NoSolutionInTimeError reports it)
        limit = config.default_time_limit_s if time_limit_s is None else float(time_limit_s)
        # a margin for what follows the solvers (replay, export, process start-up) inside the caller's limit
        self.limit = limit - min(config.safety_s, config.safety_share * limit)
        self.t0 = time.perf_counter()
        self.tried: list[dict] = []  # every attempt, as info["tried"] lists it
        self.results: list[SolveResult] = []  # every schedule found
        self.infeasible: list[InfeasibleBudgetError] = []
        self.timed_out: list[NoSolutionInTimeError] = []
        self.big = graph.n > config.cpsat_max_nodes  # no whole-graph exact solver runs
        self.training = any(nd.backward for nd in graph.nodes)
        self.has_blocks = False  # the graph splits into a chain of blocks (block_dp runs)
        self.blocks: SolveResult | None = None  # block_dp's result
        self.forced: float | None = None  # the forced-recomputation bound: every schedule
        self.order: float | None = None  # the program-order bound: every schedule a solver here returns
        self.guided: list[float] | None = None  # the guided rollouts' prior, where they ran
        self.exact_name: str | None = None  # the whole-graph exact solver that follows the eviction search
        self.exact: SolveResult | None = None  # an exact solver's result, whose bound is its family's

    def run(self, candidates: Sequence[tuple[str, dict]] = ()) -> Proposal:
        check_budget_floor(self.graph, self.budget_bytes, "auto")
        done = self.baselines(candidates)
        if done is None:
            done = self.block_program_first()
        if done is not None:
            return done
        self.forced_bound()
        self.fast_heuristics()
        self.when_nothing_fits()
        self.rollouts()
        self.block_program_after()
        self.order_bound()
        if self.proven():
            return self.choose()
        self.evict()
        if self.proven():
            return self.choose()
        self.exact_solvers()
        self.guided_rollouts_again()
        self.exact = _better_bound(self.exact, self.blocks, self.results)
        self.search_on()
        return self.choose(self.exact)

    # --- the bookkeeping every step shares

    def remaining(self) -> float:
        return max(0.0, self.limit - (time.perf_counter() - self.t0))

    def best_cost(self) -> float | None:
        return min((r.total_cost for r in self.results), default=None)

    def known_bound(self) -> float | None:
        """The larger of the bound for every schedule and the one for every program-order schedule (the family every
        solver here returns)."""
        return max((b for b in (self.forced, self.order) if b is not None), default=None)

    def proven(self) -> bool:
        """A schedule costs no more than a bound that covers it: nothing can do better."""
        known, best = self.known_bound(), self.best_cost()
        return known is not None and best is not None and best <= known * (1 + 1e-9) + 1e-9

    def report(self, step: str) -> None:
        if self.progress is not None:
            self.progress(SearchState(step, self.best_cost(), self.known_bound(), self.graph.total_cost))

    def attempt(self, name: str, seconds: float | None, label: str | None = None, **options) -> SolveResult | None:
        """Run one solver (under `label` in `tried` and as the result's solver); None where it found nothing."""
        if name not in solver_names():
            return None
        label = label or name
        self.report(label)
        # what auto chose for it: the family CP-SAT ran over, the guided rollouts' prior
        noted: dict = {"max_computations": options["max_computations"]} if "max_computations" in options else {}
        if "prior" in options:
            noted["prior"] = GUIDED_NOTE
        try:
            r = solve(self.graph, self.budget_bytes, name, time_limit_s=seconds, **options)
        except InfeasibleBudgetError as e:
            self.tried.append({"solver": label, "outcome": "infeasible", "min_budget_bytes": e.min_budget_bytes,
                               "reason": e.reason})
            self.infeasible.append(e)
            return None
        except NoSolutionInTimeError as e:
            self.tried.append({"solver": label, "outcome": "no solution in time", "detail": str(e), **noted})
            self.timed_out.append(e)
            return None
        except SolverError as e:
            # a solver bug (an invalid or over-budget proposal) or a backend failure: the portfolio goes on without
            # it, and says so in `tried`
            self.tried.append({"solver": label, "outcome": "failed", "detail": f"{type(e).__name__}: {e}"})
            return None
        self.tried.append({"solver": label, "outcome": r.status.value, "total_cost": r.total_cost,
                           "lower_bound_cost": r.lower_bound_cost, "seconds": round(r.solve_seconds, 3), **noted})
        if label != name:
            r = dataclasses.replace(r, solver=label)
        self.results.append(r)
        return r

    # --- the steps, in order

    def baselines(self, candidates: Sequence[tuple[str, dict]]) -> Proposal | None:
        """checkpoint_all, the answer where it fits; else the caller's candidates (one schedule each: milliseconds)."""
        first = self.attempt("checkpoint_all", None)
        if first is not None:
            return self.choose(first)  # no recomputation: optimal, bound = its cost
        for label, options in candidates:
            self.attempt("block_checkpoint", None, label=label, **options)
        return None

    def block_program_first(self) -> Proposal | None:
        """On large graphs that split into blocks: block_dp first (the best start there is, and often the answer)
        and the DTR rollouts, before the forced bound (seconds there: ~3 s on 2000 nodes). Its schedule is returned
        where it is the cheapest and within mip_gap of its family's bound after a few seconds of perturbed
        rollouts, whose schedules lie outside that family."""
        c = self.config
        self.has_blocks = _has_blocks(self.graph)
        if not (self.has_blocks and self.big):
            return None
        self.blocks = self.attempt("block_dp", min(self.remaining(), c.block_dp_share * self.limit))
        for name in ("dtr", "dtr_local"):
            self.attempt(name, min(self.remaining(), c.fast_share * self.limit))
            if self.tried[-1]["solver"] == name and self.tried[-1]["outcome"] == "no solution in time":
                # cut by its share, it says nothing: once more, longer, before the block program's schedule is
                # taken as the cheapest
                self.attempt(name, c.retry_share * self.remaining())
        if self.blocks is not None and _within_gap(self.blocks, self.results, self.mip_gap):
            self.attempt("rollout_search", min(c.rollout_search_s, c.rollout_search_share * self.remaining()))
            if _within_gap(self.blocks, self.results, self.mip_gap):
                return self.choose(self.blocks)
        return None

    def forced_bound(self) -> None:
        """The forced-recomputation bound (valid for every schedule), or None if not solved in its time.

        Raises InfeasibleBudgetError when non-recomputable values make the budget infeasible for every schedule."""

        c = self.config
        self.report("forced-recomputation bound")
        try:
            # windows on small graphs only (they lift no bound on larger ones); no closures: the program-order
            # bound, run later where nothing meets this one, holds them and more for every schedule returned here
            fb = forced_recompute_bound(self.graph, self.budget_bytes,
                                        time_limit_s=min(c.forced_bound_s, c.forced_bound_share * self.limit),
                                        windows=self.graph.n <= c.milp_max_nodes, closures=False)
        except NoSolutionInTimeError:
            self.tried.append({"solver": "forced_bound", "outcome": "no solution in time"})
            return
        self.tried.append({"solver": "forced_bound", "outcome": "optimal" if fb.proven else "bound",
                           "lower_bound_cost": fb.lower_bound_cost, "recomputed": list(fb.recomputed)})
        self.forced = fb.lower_bound_cost

    def fast_heuristics(self) -> None:
        """Each fast heuristic not run yet, within its share of the limit."""
        c = self.config
        for name in c.fast_heuristics:
            if any(t["solver"] == name for t in self.tried):
                continue  # run above
            if name == "lowest_memory" and self.big and self.has_blocks and self.results:
                continue  # a fallback for budgets nothing else meets; on large training graphs it costs its share
            if name.startswith("chen") and self.big and self.blocks is not None:
                continue  # Chen's segments are a coarser family than the block program's (and cost seconds here)
            self.attempt(name, min(self.remaining(), c.fast_share * self.limit))

    def when_nothing_fits(self) -> None:
        """Where nothing fits yet: the DTR rollouts cut by their share run longer (2000 nodes: about a second), then
        the subgraph relaxation may prove that nothing does (and raises); where only the lowest-memory rebuild fits,
        it keeps what it can (at resnet50's smallest budget: an order of magnitude less recomputation)."""
        c = self.config
        if not self.results and self.training:
            for name in ("dtr", "dtr_local"):
                if any(t["solver"] == name and t["outcome"] == "no solution in time" for t in self.tried):
                    self.attempt(name, c.retry_share * self.remaining())
        if not self.results:
            self.raise_if_no_schedule_fits(min(c.subgraph_s, c.subgraph_share * self.remaining()))
        if self.results and all(r.solver == "lowest_memory" for r in self.results):
            self.attempt("lowest_memory", self.remaining(),
                         improve_s=min(c.lowest_memory_improve_s, c.lowest_memory_improve_share * self.remaining()))

    def rollouts(self) -> None:
        """Perturbed eviction rollouts: cheaper schedules where DTR fits (a better start for the exact solvers), and
        schedules where the unperturbed rollouts get stuck (traced transformers with perturbed op costs)."""
        c = self.config
        if self.proven() or self.remaining() <= 0:
            return
        share = c.rollout_search_share if self.big else c.rollout_search_share_before_cpsat
        self.attempt("rollout_search", min(c.rollout_search_s, share * self.remaining()), stop_at_cost=self.forced)

    def block_program_after(self) -> None:
        """block_dp on smaller graphs, after the fast heuristics (which often meet the forced bound at once)."""
        if self.has_blocks and not self.big and not self.proven() and self.remaining() > 0:
            self.blocks = self.attempt("block_dp", min(self.remaining(), self.config.block_dp_share * self.limit))

    def order_bound(self) -> None:
        """Where nothing meets a bound yet: the bound for every program-order schedule (solvers.bounds.order_bound);
        on training graphs with no whole-graph exact solver, rollouts that evict first what its solution recomputes
        (not where CP-SAT follows: they give it no better start and take its time)."""

        c = self.config
        if self.proven() or self.remaining() <= 0:
            return
        self.report("program-order bound")
        ob = order_bound(self.graph, self.budget_bytes,
                         time_limit_s=min(c.order_bound_s, c.order_bound_share * self.limit, self.remaining()))
        if ob is None:
            self.tried.append({"solver": "order_bound", "outcome": "no solution in time"})
            return
        if not ob.fits:  # it bounds nothing a solver here returns
            self.tried.append({"solver": "order_bound", "outcome": "infeasible",
                               "reason": "no program-order schedule fits: a node's inputs, output and "
                                         "non-recomputable values alive across it overflow the budget"})
            return
        self.tried.append({"solver": "order_bound", "outcome": "optimal" if ob.proven else "bound",
                           "lower_bound_cost": ob.lower_bound_cost, "rows": ob.rows, "rows_used": ob.rows_used})
        self.order = ob.lower_bound_cost
        recomputed = frozenset(ob.recomputed)
        if recomputed and self.big and self.training and not self.proven() and self.remaining() > 0:
            self.guided = [c.guided_prior if v in recomputed else 1.0 for v in range(self.graph.n)]
            self.attempt("rollout_search", min(c.guided_s, c.guided_share * self.remaining()),
                         stop_at_cost=self.order, prior=self.guided)

    def evict(self) -> None:
        """The eviction search with local search: a share of what remains where an exact solver follows, nearly all
        of it where none does."""
        c = self.config
        if self.graph.n <= c.cpsat_max_nodes and self.training:
            name = "cpsat"  # on every training graph it holds: it proves sooner than the MILP there
        elif self.graph.n <= c.milp_max_nodes:
            name = "milp"
        else:
            # wide fan-in graphs without a backward pass (the random layered graphs): CP-SAT's stage family rarely
            # finds a schedule there in time, and the eviction search's drop-gap MILP does better with all of it
            name = None
        self.exact_name = name if name in solver_names() else None
        share = c.evict_share_with_exact if self.exact_name else c.evict_share_alone
        if self.remaining() > 0:
            self.attempt("evict", self.remaining() * share)

    def exact_solvers(self) -> None:
        """chain_dp on training chains; else the exact solver chosen above with the time left, started from the
        schedules found so far (where those lie in its family)."""
        c = self.config
        if _is_chain(self.graph) and self.remaining() > 0:
            chain = self.attempt("chain_dp", self.remaining())
            if chain is not None and chain.lower_bound_cost is not None:  # else optimal in its family only
                self.exact = chain
        if self.exact is not None or self.exact_name is None or self.remaining() < c.exact_min_s:
            return
        options = {}
        if self.results:
            ranked = sorted(self.results, key=lambda r: r.total_cost)
            if self.exact_name == "cpsat":
                options["hint_sequence"] = ranked[0].schedule.computes
                known = self.known_bound()
                if known is not None:
                    # CP-SAT stops once a schedule meets it (its family lies within the program-order one)
                    options["known_lower_bound_cost"] = known
            else:
                options["start_sequences"] = [r.schedule.computes for r in ranked[:c.milp_start_sequences]]
        if self.exact_name == "cpsat" and self.graph.n <= c.milp_max_nodes:
            self.cpsat_wider_first(options)
            return
        if self.exact_name == "cpsat" and "hint_sequence" in options:
            # a family wide enough to hold the best schedule so far as its hint (the eviction rollouts' schedules
            # recompute some values three times, and a hint outside the family is lost to CP-SAT)
            need = _hint_computations(self.graph, self.budget_bytes, options["hint_sequence"])
            if need is not None and 2 < need <= c.hint_max_computations:
                options["max_computations"] = need
        self.exact = self.attempt(self.exact_name, self.remaining(), **options)

    def cpsat_wider_first(self, options: dict) -> None:
        """Small training graphs: CP-SAT over the wider family first (it reaches the MILP's optimum where two
        computations fall short, as on vgg19 at 0.8); where it proves nothing in its share, the default family,
        whose proof (for that family) comes sooner."""
        c = self.config
        exact = self.attempt("cpsat", self.remaining() * c.wider_family_share, max_computations=c.wider_computations,
                             **options)
        if not self.proven() and (exact is None or exact.status is not Status.OPTIMAL) \
                and self.remaining() >= c.exact_min_s:
            if self.results:  # the best schedule so far, which may now be the wider family's
                options["hint_sequence"] = min(self.results, key=lambda r: r.total_cost).schedule.computes
            exact = _better_bound(exact, self.attempt("cpsat", self.remaining(), **options), self.results)
        self.exact = exact

    def guided_rollouts_again(self) -> None:
        """The time the steps above left (the eviction search ends once its local search settles), while the best
        schedule is not within mip_gap of the program-order bound: more guided rollouts, from another seed."""
        best = self.best_cost()
        if self.guided is None or best is None or self.order is None \
                or self.remaining() < self.config.guided_min_left_s or best <= self.order * (1 + self.mip_gap):
            return
        self.attempt("rollout_search", min(self.config.guided_left_s, self.remaining()),
                     stop_at_cost=self.order * (1 + self.mip_gap), prior=self.guided, seed=1)

    def search_on(self) -> None:
        """Nothing found and nothing proven: the time left goes to perturbed rollouts from other seeds until one
        fits or the limit is reached (finding nothing proves nothing, so the whole limit is the user's); then raise:
        InfeasibleBudgetError where an exact solver proved that none of its family fits, else
        NoSolutionInTimeError."""
        seed = 1
        while not self.results and self.remaining() >= self.config.last_rollouts_min_s:
            seed += 1
            self.attempt("rollout_search", self.remaining(), seed=seed)
        if self.results:
            return
        floor = self.graph.single_op_bound_bytes()
        least = _least_named(self.infeasible, self.timed_out)
        proofs = [f"{e.solver}: {e.reason}" for e in self.infeasible if e.solver in EXACT_SOLVERS]
        if proofs:
            raise InfeasibleBudgetError(self.budget_bytes, least, "auto",
                                        "no solver found a schedule, and an exact solver proved that none of its "
                                        "schedule family fits: " + "; ".join(proofs) +
                                        f"; single-operation bound {floor} bytes")
        known = "no budget is known to work" if least is None else f"the least budget known to work is {least} bytes"
        raise NoSolutionInTimeError(
            f"auto: no schedule found in {time.perf_counter() - self.t0:.1f} s for budget {self.budget_bytes} bytes, "
            f"and nothing proves that none exists; {known} (single-operation bound {floor} bytes)",
            budget_bytes=self.budget_bytes, min_budget_bytes=least, solver="auto", seconds=self.time_limit_s)

    def raise_if_no_schedule_fits(self, seconds: float) -> None:
        """Raise InfeasibleBudgetError when the subgraph relaxation proves that no schedule of any kind fits."""

        sub = subgraph_floor_bytes(self.graph, self.budget_bytes, deadline=time.perf_counter() + seconds)
        if sub is None or not sub.capped:
            return
        raise InfeasibleBudgetError(self.budget_bytes, _least_named(self.infeasible), "auto",
                                    f"no schedule of any kind fits (subgraph relaxation: {sub.describe(self.graph)}); "
                                    f"the budget named is the least a heuristic meets")

    # --- the answer

    def choose(self, exact: SolveResult | None = None) -> Proposal:
        """The cheapest schedule, its status and the largest bound that covers it: `exact`'s (for its family, dropped
        where a schedule outside it costs less), the program-order bound, the forced-recomputation bound, or each
        node computed once."""
        forced, order = self.forced, self.order
        best = min(self.results, key=lambda r: (r.total_cost, r.peak_bytes))
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

            bound, bound_from, scope = order, "order_bound", f"schedules of the family: {ORDER_FAMILY}"
        if forced is not None and (bound is None or forced > bound):
            # the forced-recomputation bound holds for every schedule, in any order
            bound, bound_from, scope = min(forced, best.total_cost), "forced_bound", "every schedule"
        if bound is None:
            # nothing else is known in time: every node runs at least once, in every schedule
            bound, bound_from, scope = self.graph.total_cost, "each_node_once", "every schedule"
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
        info = {"chosen": best.solver, "tried": self.tried, "bound_from": bound_from}
        if scope:
            info["bound_scope"] = scope
        if bound_note:
            info["bound_note"] = bound_note
        if best.info:
            info["chosen_info"] = {k: v for k, v in best.info.items() if k != "kept"}
        return Proposal(best.schedule, status, lower_bound_cost=bound, info=info)


def computations_needed(sequence) -> int:
    """The most computations of one node in the stage normal form of `sequence` (solvers.exact.cpsat_family): the
    smallest C whose CP-SAT family can take it as a hint."""
    from collections import Counter


    return max(Counter(stage_normal_form(sequence)).values(), default=1)


def _hint_computations(graph: Graph, budget_bytes: int, sequence) -> int | None:
    """The computations per value a CP-SAT family needs to take `sequence` as its hint, in its stage normal form;
    None where that form does not fit the budget (CP-SAT would not use it)."""

    normal = stage_normal_form(sequence)
    if simulate(graph, Schedule.from_sequence(graph, normal)).peak_bytes > budget_bytes:
        return None
    return computations_needed(normal)  # the normal form is its own normal form


def _is_chain(graph: Graph) -> bool:
    if "chain_dp" not in solver_names():
        return False

    return is_training_chain(graph)


def _has_blocks(graph: Graph) -> bool:
    if "block_dp" not in solver_names():
        return False

    return split_blocks(graph) is not None


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
