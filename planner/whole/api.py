"""The public API: `plan(model, sample_input, budget_gb)` -> `Plan`, and the smallest budget a plan can meet.

Units: budgets are given in gigabytes at this edge only, 1 GB = 10^9 bytes; everything inside is bytes.
plan() reads top to bottom: trace the model (capture.module_tags) -> the planning problem of that trace
(planner.core.problem: the solver graph, the executor's exact view) -> solve -> finalise (the schedule as the
executor runs it) -> build the step's halves once (execution.step_builder) -> a Plan (whole.plan_type), whose
`apply(model)` returns the drop-in module (planner.execution.runtime).
"""
from __future__ import annotations

import math
import time
import warnings
from fractions import Fraction
from typing import Callable

import torch

from capture.call import CallSpec
from capture.loss_workspace import loss_workspace_bytes
from capture.module_tags import node_modules, trace_model
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.simulate import reference_peak_bytes
from planner.core.problem import GraphKind, PlanningProblem, SmallestBudget
from planner.core.progress import Reporter
from planner.core.solver_graph import split_position, traced_sequence
from planner.execution.step_builder import build_step
from planner.whole.candidates import checkpoint_candidates
from planner.whole.plan_type import GB, Plan, fingerprint
from solvers.base import FLOOR_REASON, solve

COST_MODELS = ("auto", "flops", "time", "roofline")
FIRST_SOLVE_SHARE = 0.75  # of plan()'s time limit, for the first solve of a graph with secondary outputs


def budget_bytes_from_gb(budget_gb: float) -> int:
    """floor(budget_gb x 10^9), read in decimal so that 1.5 GB is exactly 1_500_000_000 bytes."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float, Fraction)):
        raise TypeError(f"budget_gb must be a number, not {type(budget_gb).__name__}")
    value = Fraction(str(budget_gb)) if isinstance(budget_gb, float) else Fraction(budget_gb)
    if value <= 0:
        raise ValueError(f"budget_gb must be > 0, got {budget_gb}")
    return math.floor(value * GB)


def smallest_budget(plan_or_traced, time_limit_s: float = 30.0, *, loss_bytes: int = 0) -> SmallestBudget:
    """The smallest budget (bytes) a schedule plan() can run is known to meet, for a Plan's model or a TraceResult
    (with `loss_bytes`, the memory of a loss computed outside the model), how that is known and the solver that met
    it; budget_bytes is None when nothing is known within `time_limit_s`."""
    if isinstance(plan_or_traced, Plan):
        if plan_or_traced.traced is None:
            raise ValueError("a plan loaded from JSON holds no trace: pass the TraceResult of the model")
        problem = plan_or_traced.problem or PlanningProblem(plan_or_traced.traced, plan_or_traced.loss_bytes)
    else:
        problem = PlanningProblem(plan_or_traced, loss_bytes)
    return problem.smallest_budget(time_limit_s)


def plan(model: torch.nn.Module, sample_input, budget_gb: float, *, solver: str = "auto",
         cost_model: str = "auto", time_limit_s: float = 60.0, device_name: str | None = None,
         traced=None, loss_fn=None, progress: bool | Callable[[str], None] = False) -> Plan:
    """Plan one training step of `model` on `sample_input` within `budget_gb` gigabytes (1 GB = 10^9 bytes).

    sample_input: a tensor, a tuple of tensors, a dict of keyword arguments (`model(**batch)`), or (args, kwargs);
    non-tensor keyword values are constants of the plan. A model that computes its own loss (a transformers
    model given `labels`) is planned with that loss in the graph.

    The budget covers everything one forward+backward holds at once: parameters, buffers, inputs, the
    gradient of the output, activations and parameter gradients (what torch.cuda.max_memory_allocated
    reports for one step on a device that held only the model and the inputs). Call `model.train()`
    first for a training step; the model is traced in its current mode.

    solver: a registered solver name ("auto" picks the best available within `time_limit_s` seconds).
    cost_model: "flops", "time" (each op measured here), "roofline" (needs `device_name`), or "auto"
        (= "time").
    traced: a TraceResult from an earlier plan of this model and input (`Plan.traced`) to skip tracing.
    loss_fn: the loss the training step computes from the output (`loss_fn(out)` -> scalar); its own
        memory (measured once on the sample output) is planned for at the forward/backward boundary.
        Without it, only a scalar loss is reserved for.
    progress: True prints lines to stderr as the work goes (elapsed seconds, the step running, the best overhead so
        far, the bound and the gap), at least every few seconds, the last one naming the plan's overhead; a callable
        receives the lines instead. The logger "planner" gets them at INFO either way.
    Raises InfeasibleBudgetError (its message names the smallest feasible budget in GB) when nothing fits,
    NoSolutionInTimeError when no schedule was found within `time_limit_s` and nothing proves that none exists,
    capture.trace.TraceError when the model cannot be traced.
    """
    with Reporter(progress) as say:
        try:
            p = _plan(model, sample_input, budget_gb, solver, cost_model, time_limit_s, device_name, traced, loss_fn,
                      say)
        except RematError as e:
            say(f"stopped: {type(e).__name__}: {e}")
            raise
        say(f"done: overhead {100 * p.overhead:.2f} %, predicted peak {p.predicted_peak_bytes / GB:.6f} GB of "
            f"{p.budget_bytes / GB:.6f} GB, status {p.status.value}, solver {p.solver}")
        return p


def _plan(model, sample_input, budget_gb, solver, cost_model, time_limit_s, device_name, traced, loss_fn,
          say: Reporter) -> Plan:
    refuse_wrapper(model)
    call, inputs = CallSpec.of(sample_input)
    budget_bytes = budget_bytes_from_gb(budget_gb)
    cm = _resolve_cost_model(cost_model)
    if traced is None:
        say(f"tracing {type(model).__name__} (cost model {cm})")
        traced = trace_model(model, sample_input, cm, device_name)
    elif traced.model is not model:
        raise ValueError("`traced` belongs to another model object")
    loss_bytes = 0 if loss_fn is None else loss_workspace_bytes(model, inputs, loss_fn, call)
    if loss_fn is None:
        _warn_if_no_loss(traced)
    problem = PlanningProblem(traced, loss_bytes)
    modules = node_modules(traced)  # graph node -> its module: the plan's report, the blocks of the candidates
    say(f"solving: {traced.graph.n} nodes, budget {budget_bytes / GB:.6f} GB, solver {solver}, "
        f"limit {time_limit_s:g} s")
    t0 = time.perf_counter()
    result = problem.keep_all(budget_bytes) if solver == "auto" else None
    if result is not None:
        kind = GraphKind.EXACT
    else:
        # the schedules the user would otherwise write (per-block and selective checkpointing) join auto's portfolio,
        # and are checked on the exact view too: never a costlier plan, nor none, where one of them fits
        candidates = checkpoint_candidates(model, traced, problem.solver_graph, modules) if solver == "auto" else []
        fallback = problem.best_candidate(budget_bytes, candidates) if candidates else None
        try:
            kind, result = _solve(problem, budget_bytes, solver, time_limit_s, t0, say, candidates,
                                  have_fallback=fallback is not None)
        except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
            if fallback is None:
                raise
            say(f"auto found nothing cheaper ({type(e).__name__}); taking {fallback.solver}")
            kind, result = GraphKind.EXACT, fallback
        else:
            if fallback is not None and fallback.total_cost < result.total_cost * (1 - 1e-12):
                say(f"{fallback.solver} costs less than auto's schedule: taking it")
                kind, result = GraphKind.EXACT, fallback
    graph = problem.graph(kind)
    done = problem.finalise(graph, result)
    seq = done.executor_computes
    say("building the step")
    # the step's halves, built once: plan() fails here if the executor cannot run the schedule, apply() uses them
    halves = build_step(traced, traced_sequence(graph, seq, traced.graph.n), split_position(graph, seq, traced.graph.n))
    return Plan(graph=graph, result=done.result, fingerprint=fingerprint(model, inputs), cost_model=cm,
                exact_peak_bytes=done.exact_peak_bytes, traced_nodes=traced.graph.n, graph_kind=kind,
                executor_computes=None if seq == list(done.result.schedule.computes) else seq,
                loss_bytes=loss_bytes, modules=modules, trace_seconds=traced.trace_seconds,
                reference_peak_bytes=reference_peak_bytes(problem.solver_graph), traced=traced, problem=problem,
                halves=halves)


def _solve(problem: PlanningProblem, budget_bytes: int, solver: str, time_limit_s: float, t0: float,
           say: Reporter, candidates: list[tuple[str, dict]], have_fallback: bool = False):
    """(the graph kind, the result) of solving the problem's solver graph, and, where what the executor holds for
    that schedule does not fit, its pinned graph in the time left. Raises InfeasibleBudgetError naming the smallest
    budget known to work, NoSolutionInTimeError where no time is left for the fallback."""
    # a schedule that recomputes a secondary output may have to be solved again with it pinned: keep time for that
    first_limit = time_limit_s * FIRST_SOLVE_SHARE if problem.secondaries else time_limit_s
    graph = problem.solver_graph
    options: dict = {"progress": say.search} if solver == "auto" and say.active else {}
    if candidates:
        options["candidates"] = candidates
    try:
        try:
            result = solve(graph, budget_bytes, solver, time_limit_s=first_limit, **options)
        except NoSolutionInTimeError:
            left = time_limit_s - (time.perf_counter() - t0)
            if have_fallback or left < 1.0:
                raise
            # the share kept for a second solve is not needed when the first found nothing: search on with it
            say(f"nothing found yet: searching on for the {left:.0f} s left")
            result = solve(graph, budget_bytes, solver, time_limit_s=left, **options)
    except InfeasibleBudgetError as e:
        if have_fallback:
            raise
        # naming the minimum need not cost the whole time limit again
        left = max(5.0, min(time_limit_s / 2, time_limit_s - (time.perf_counter() - t0)))
        say(f"infeasible; finding the smallest feasible budget ({left:.0f} s at most)")
        found = problem.smallest_budget(left)
        smallest, how, by = found.budget_bytes, found.proof, found.solver
        if smallest is None and e.min_budget_bytes is not None and not e.reason.startswith(FLOOR_REASON):
            smallest, how, by = e.min_budget_bytes, e.reason, solver
        if smallest is None:  # the proof stands; the search for a budget that works found none in its time
            raise InfeasibleBudgetError(
                budget_bytes, None, solver,
                f"budget {budget_bytes / GB:.9f} GB: {e.reason}; no budget known to work was found in {left:.0f} s; "
                f"{how}") from e
        gb = f"{smallest / GB:.9f} GB ({smallest} bytes)"
        if by not in (None, solver):
            gb += f", met by solver '{by}'"
        raise InfeasibleBudgetError(
            budget_bytes, smallest, solver,
            f"budget {budget_bytes / GB:.9f} GB is below the smallest feasible budget {gb}; {how}") from e
    executable = problem.executable(graph, result)
    if executable is not None:
        return GraphKind.SOLVER, executable
    left = time_limit_s - (time.perf_counter() - t0)
    if left <= 0:
        raise NoSolutionInTimeError(
            f"{solver}: the schedule found recomputes a secondary output whose op's result the executor would "
            "keep alive, and no time is left to solve again without it", budget_bytes=budget_bytes,
            seconds=time.perf_counter() - t0)
    say("the executor cannot hold that schedule within the budget: solving again with secondary outputs pinned")
    return GraphKind.PINNED, solve(problem.pinned_graph, budget_bytes, solver, time_limit_s=left, **options)


def _resolve_cost_model(cost_model: str) -> str:
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model '{cost_model}'; choose one of {', '.join(COST_MODELS)}")
    # measured time prices every op, elementwise ones included (FLOPs call them free)
    return "time" if cost_model == "auto" else cost_model


class LossNotPlannedWarning(UserWarning):
    """The model returns no scalar loss and no `loss_fn` was given: the loss's memory is not in the plan."""


def refuse_wrapper(model: torch.nn.Module) -> None:
    """A whole-model plan of a DDP, FSDP or torch.compile wrapper would trace the wrapper's own machinery once and
    then run without it (DDP all-reducing only in the first step): refuse it, naming the order that works."""
    name = type(model).__name__
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"plan() of a {name} (DistributedDataParallel) module: plan the inner module and wrap the "
                         "result, DistributedDataParallel(plan(model, ...).apply(model)), or plan in place, "
                         "planner.enable(model, budget_gb) and then DistributedDataParallel(model)")
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a build without torch.distributed
        FSDPModule = FullyShardedDataParallel = ()
    if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
        raise ValueError(f"plan() of a {name} (FSDP-sharded) module: a sharded model cannot be traced whole; plan in "
                         "place before sharding, planner.enable(model, budget_gb), then fully_shard each block and "
                         "the root")
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        raise ValueError(f"plan() of a {name} (torch.compile) module: plan the original module, "
                         "plan(model, ...).apply(model, compile=True) compiles the planned step with inductor")


def _warn_if_no_loss(traced) -> None:
    """Warn when no differentiated output is a scalar: the loss the step computes from them lies outside the
    plan, and its temporaries (a cross-entropy's log-softmax: about one more copy of the logits) are not counted."""
    phs = [n for n in traced.joint_module.graph.nodes if n.op == "placeholder"][traced.num_primals:]
    vals = [ph.meta["val"] for ph in phs]
    if not vals or any(v.numel() == 1 for v in vals):
        return
    out_bytes = sum(v.numel() * v.element_size() for v in vals)
    warnings.warn(LossNotPlannedWarning(
        f"the model's outputs ({out_bytes} bytes) are not a scalar loss and no loss_fn was given: the memory the "
        f"loss holds beyond a scalar (for a cross-entropy about {out_bytes} bytes more) is not planned for; pass "
        "loss_fn=, or let the model compute its loss (e.g. transformers models given labels)"), stacklevel=4)
