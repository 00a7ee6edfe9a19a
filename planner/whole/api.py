"""The public API: `plan(model, sample_input, budget_gb)` -> `Plan`, and the smallest budget a plan can meet.

Units: budgets are given in gigabytes at this edge only, 1 GB = 10^9 bytes; everything inside is bytes.
plan() is validation, warnings and the fingerprint around the solving core: trace the model
(capture.module_tags) -> the planning problem of that trace (core.problem) -> the checkpointing candidates
(core.candidates) -> solve, finalise and build the step once (core.solve) -> a Plan (core.plan_type), whose
`apply(model)` returns the drop-in module (execution.runtime).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from capture.call import CallSpec
from capture.loss_workspace import LossMemory, loss_memory
from capture.module_tags import node_modules, trace_model
from capture.trace import TraceResult
from graphs.errors import ArgumentError, RematError
from planner.core.arguments import choice_arg, module_arg, optional_callable_arg, progress_arg
from planner.core.candidates import checkpoint_candidates
from planner.core.plan_type import Plan, fingerprint
from planner.core.problem import PlanningProblem, SmallestBudget
from planner.core.progress import Reporter
from planner.core.solve import solve_problem
from planner.core.units import GB, budget_bytes_from_gb, seconds_value

COST_MODELS = ("auto", "flops", "time", "roofline")
# what a loss computed outside the model holds beyond its outputs' gradient, per output byte, when no loss_fn says:
# cross-entropy (log-softmax and its gradient), MSE and smooth-L1 (a zero target, the unreduced loss) hold 2x at the
# forward/backward boundary, and on CPU the mean of MSE, smooth-L1 and binary cross-entropy is a view of the
# unreduced loss, 1x held to the step's end (capture.loss_workspace.loss_memory on a GPT's logits, 2026-12-07)
LOSS_RESERVE_PER_OUTPUT_BYTE = 2
LOSS_HELD_PER_OUTPUT_BYTE = 1


def smallest_budget(plan_or_traced, time_limit_s: float = 30.0, *, loss_bytes: int = 0,
                    loss_held_bytes: int = 0) -> SmallestBudget:
    """The smallest budget (bytes) a schedule plan() can run is known to meet, for a Plan's model or a TraceResult
    (with `loss_bytes` and `loss_held_bytes`, the memory of a loss computed outside the model: LossMemory), how that
    is known and the solver that met it; budget_bytes is None when nothing is known within `time_limit_s`."""
    time_limit_s = seconds_value(time_limit_s)
    if not isinstance(plan_or_traced, (Plan, TraceResult)):
        raise ArgumentError(f"smallest_budget takes a Plan or a TraceResult, got {type(plan_or_traced).__name__}")
    if isinstance(plan_or_traced, Plan):
        if plan_or_traced.traced is None:
            raise ValueError("a plan loaded from JSON holds no trace: pass the TraceResult of the model")
        problem = plan_or_traced.problem or PlanningProblem(plan_or_traced.traced, plan_or_traced.loss_bytes,
                                                            plan_or_traced.loss_held_bytes)
    else:
        problem = PlanningProblem(plan_or_traced, loss_bytes, loss_held_bytes)
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
    with Reporter(progress_arg(progress)) as say:
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
    module_arg(model)
    refuse_wrapper(model)
    budget_bytes = budget_bytes_from_gb(budget_gb)
    time_limit_s = seconds_value(time_limit_s)
    cm = _resolve_cost_model(cost_model)
    if not isinstance(solver, str):
        raise ArgumentError(f"solver must be a solver's name (a str), got {type(solver).__name__} {solver!r}")
    optional_callable_arg(loss_fn, "loss_fn")
    if traced is not None and not isinstance(traced, TraceResult):
        raise ArgumentError(f"traced must be the TraceResult of an earlier plan of this model (Plan.traced), got "
                            f"{type(traced).__name__}")
    call, inputs = CallSpec.of(sample_input)
    if traced is None:
        say(f"tracing {type(model).__name__} (cost model {cm})")
        traced = trace_model(model, sample_input, cm, device_name)
    elif traced.model is not model:
        raise ValueError("`traced` belongs to another model object")
    loss = _loss_reserve(traced) if loss_fn is None else loss_memory(model, inputs, loss_fn, call)
    problem = PlanningProblem(traced, loss.workspace_bytes, loss.held_bytes)
    modules = node_modules(traced)  # graph node -> its module: the plan's report, the blocks of the candidates
    say(f"solving: {traced.graph.n} nodes, budget {budget_bytes / GB:.6f} GB, solver {solver}, "
        f"limit {time_limit_s:g} s")
    # the schedules the user would otherwise write (per-block and selective checkpointing) join auto's portfolio
    candidates = checkpoint_candidates(model, traced, problem.solver_graph, modules) if solver == "auto" else []
    solved = solve_problem(problem, budget_bytes, solver=solver, time_limit_s=time_limit_s, candidates=candidates,
                           say=say, search_progress=say.search if say.active else None)
    return Plan.of(solved, problem, fingerprint=fingerprint(model, inputs), cost_model=cm, modules=modules)


def _resolve_cost_model(cost_model: str) -> str:
    choice_arg(cost_model, "cost_model", COST_MODELS)
    # measured time prices every op, elementwise ones included (FLOPs call them free)
    return "time" if cost_model == "auto" else cost_model


class LossNotPlannedWarning(UserWarning):
    """The model returns no scalar loss and no `loss_fn` was given: the plan reserves for a loss of the usual kind
    (LOSS_RESERVE_PER_OUTPUT_BYTE x the outputs), not for the one the step computes."""


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


def _loss_reserve(traced) -> LossMemory:
    """What is reserved for a loss computed outside the model when no `loss_fn` says which: nothing where an output
    is a scalar (the model's own loss); else LOSS_RESERVE_PER_OUTPUT_BYTE per byte of the differentiated outputs at
    the forward/backward boundary, LOSS_HELD_PER_OUTPUT_BYTE of it to the step's end, with a LossNotPlannedWarning
    saying so."""
    phs = [n for n in traced.joint_module.graph.nodes if n.op == "placeholder"][traced.num_primals:]
    vals = [ph.meta["val"] for ph in phs]
    if not vals or any(v.numel() == 1 for v in vals):
        return LossMemory()
    out_bytes = sum(v.numel() * v.element_size() for v in vals)
    reserve = LossMemory(LOSS_RESERVE_PER_OUTPUT_BYTE * out_bytes, LOSS_HELD_PER_OUTPUT_BYTE * out_bytes)
    warnings.warn(LossNotPlannedWarning(
        f"the model's outputs ({out_bytes} bytes) are not a scalar loss and no loss_fn was given: "
        f"{reserve.workspace_bytes} bytes are reserved for the loss computed from them, {reserve.held_bytes} of them "
        f"to the step's end (what a cross-entropy, MSE, smooth-L1 or binary cross-entropy loss holds beyond the "
        "outputs' gradient); pass loss_fn= to plan the loss you use exactly, or let the model compute its loss (e.g. "
        "transformers models given labels)"), stacklevel=4)
    return reserve
