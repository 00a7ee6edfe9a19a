"""One block of a model, planned on its own: how it was called, the options it offers, what each one holds.

The in-place planner (planner.inplace.controller) runs every repeated block through one of its options:

- "kept": the block's own forward, everything kept for the backward (eager);
- "checkpointed": torch.utils.checkpoint around the whole block (non-reentrant, RNG state preserved): only the
  input is kept, the block runs again for its backward;
- "planned@<fraction>": a schedule the solving core (planner.core.solve) made for the block alone at that fraction of
  its no-recomputation peak, run by the executor (planner.execution.runtime.PlannedModule) on the block's live
  parameters.

`BlockCall.of(block, args, kwargs)` flattens a call to its tensors and a key (shapes, dtypes, devices, strides,
which require grad, the non-tensor arguments, the autocast state, the block's mode and which of its parameters
require grad, with their dtypes): calls with one key share one profile. `profile_block` traces the block once at
that call, solves its one planning problem at a few budgets and measures each option on one real forward and
backward of the block under a storage tracker (gradients taken with torch.autograd.grad, so nothing accumulates; RNG
and buffers restored): what it stashes, what its forward and backward hold at once, and what it computes again (in
the trace's cost unit; the whole forward for "checkpointed"). A block that cannot be traced keeps the two
whole-block options, with the reason.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from capture.call import FlatCall
from capture.measure_memory import StorageTracker, storage_bytes
from capture.module_tags import node_modules, trace_model
from capture.state import autocast_state, restored
from graphs.errors import RematError
from graphs.simulate import reference_peak_bytes
from planner.core.candidates import checkpoint_candidates
from planner.core.plan_type import Plan, fingerprint
from planner.core.problem import PlanningProblem
from planner.core.solve import solve_problem
from solvers.exact.option_chain import BlockOption

PLAN_FRACTIONS = (0.8, 0.6, 0.45)  # of the block's no-recomputation peak: the planned options tried


def original_forward(block: torch.nn.Module) -> Callable:
    """The block's class forward bound to it (what runs when no instance attribute replaces it)."""
    return type(block).forward.__get__(block)


def _state_key(block: torch.nn.Module) -> tuple:
    """What a block's trace depends on besides its call: its mode, the autocast state, its parameters' flags."""
    params = tuple((n, p.requires_grad, str(p.dtype), str(p.device)) for n, p in block.named_parameters())
    return (block.training, autocast_state(), params)


@dataclass(frozen=True)
class BlockCall:
    """A block's call (capture.call.FlatCall) and its key: the call's and the block's state (`_state_key`)."""

    flat: FlatCall
    key: tuple

    @property
    def plannable(self) -> bool:
        """False when a non-tensor argument cannot be compared (a cache object): the block runs eager."""
        return self.flat.hashable

    @staticmethod
    def of(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple["BlockCall", list[torch.Tensor]]:
        flat, tensors = FlatCall.of(args, kwargs)
        return BlockCall(flat, (flat.key, _state_key(block))), tensors

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        return self.flat.rebuild(tensors)


class _Region(torch.nn.Module):
    """The block as the planner traces and runs it: flat tensors in, the block's class forward (the block's own
    hooks are the caller's), its output out. Parameters are read through `block` at each call."""

    def __init__(self, block: torch.nn.Module, call: BlockCall):
        super().__init__()
        self.block = block
        self._call = call
        self.train(block.training)

    def forward(self, *tensors):
        args, kwargs = self._call.rebuild(tensors)
        return original_forward(self.block)(*args, **kwargs)


class OptionKind(str, Enum):
    """How an option runs the block (see the module docstring); a planned option's name adds its fraction."""

    KEPT = "kept"
    CHECKPOINTED = "checkpointed"
    PLANNED = "planned"


@dataclass
class Option:
    """An option with its runner: `run(block, tensors) -> output`, inside the block's forward (one profile serves
    every block called with its key)."""
    kind: OptionKind
    figures: BlockOption
    run: Callable[[torch.nn.Module, list[torch.Tensor]], Any] = field(repr=False)


@dataclass
class BlockProfile:
    key: tuple
    options: list[Option]
    plan_seconds: float
    note: str = ""  # why only whole-block options, where that is so
    nodes: int = 0  # of the block's trace
    plans: dict[str, Any] = field(default_factory=dict, repr=False)  # option name -> Plan

    @property
    def figures(self) -> list[BlockOption]:
        return [o.figures for o in self.options]


def _checkpointed_runner(call: BlockCall):
    from torch.utils.checkpoint import checkpoint

    def run(block, tensors):
        args, kwargs = call.rebuild(tensors)
        return checkpoint(original_forward(block), *args, use_reentrant=False, **kwargs)
    return run


def _kept_runner(call: BlockCall):
    def run(block, tensors):
        args, kwargs = call.rebuild(tensors)
        return original_forward(block)(*args, **kwargs)
    return run


class _Seed(torch.autograd.Function):
    """Identity whose backward makes a dense incoming gradient of ones: the gradient a block's output receives is
    allocated inside the measurement (and freed by autograd once used, as the real one is)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.ones(g.shape, dtype=g.dtype, device=g.device)


def measure_option(block: torch.nn.Module, run, tensors: list[torch.Tensor]) -> tuple[int, int, int]:
    """(stash_bytes, forward_bytes, backward_bytes) of one option (see solvers.exact.option_chain), measured on one
    forward and backward of the block from fresh leaves of `tensors`. backward_bytes includes the output's incoming
    gradient, which is allocated when the backward starts and freed once used."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    params = [p for p in block.parameters() if p.requires_grad]
    wrt = params + [t for t in inputs if t.requires_grad]
    tracker = StorageTracker()
    with restored(block):
        with tracker:
            out = run(inputs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_bytes = storage_bytes(outs)
        diff = [t for t in outs if t.requires_grad and t.grad_fn is not None and t.is_floating_point()]
        forward_bytes = tracker.peak_bytes
        stash = max(0, tracker.live_bytes - out_bytes)
        if diff and wrt:
            total = sum(_Seed.apply(t).sum() for t in diff)  # scalars made outside the tracker: not the block's
            seed = torch.ones_like(total)
            tracker.peak_bytes = tracker.live_bytes
            with tracker:
                grads = torch.autograd.grad(total, wrt, grad_outputs=seed, allow_unused=True)
                del grads
            del total
        backward_bytes = max(0, tracker.peak_bytes - out_bytes)
        del out, outs, diff
    return int(stash), int(forward_bytes), int(backward_bytes)


def _planned_runner(p, region: _Region, compile: bool):
    """Runs the plan's schedule on the block of the call: one PlannedModule (its step built once) whose region is
    pointed at that block, so its parameters and buffers are read from it."""
    module = p.apply(region, compile=compile)

    def run(block, tensors):
        if region.block is not block:
            region.block = block
        return module(*tensors)
    return run


def _forward_cost(graph) -> float:
    return float(sum(n.cost for n in graph.nodes if not n.backward))


def _planned_options(region: _Region, sample: tuple, problem: PlanningProblem,
                     time_limit_s: float) -> list[tuple[str, Plan]]:
    """("planned@<fraction>", plan) for each of PLAN_FRACTIONS of the block's no-recomputation peak that a schedule
    meets, each solved by the core on the one planning problem of the block's trace, in a share of the time."""
    traced = problem.traced
    modules = node_modules(traced)
    candidates = checkpoint_candidates(region, traced, problem.solver_graph, modules)
    reference = reference_peak_bytes(problem.solver_graph)
    share = time_limit_s / (len(PLAN_FRACTIONS) + 1)
    fp = fingerprint(region, sample)
    out = []
    for frac in PLAN_FRACTIONS:
        try:
            solved = solve_problem(problem, int(frac * reference), time_limit_s=share, candidates=candidates)
        except RematError:
            break  # a smaller fraction will not fit either
        plan = Plan.of(solved, problem, fingerprint=fp, cost_model=traced.cost_model, modules=modules)
        out.append((f"{OptionKind.PLANNED.value}@{frac:g}", plan))
    return out


def profile_block(block: torch.nn.Module, call: BlockCall, tensors: list[torch.Tensor], *, time_limit_s: float,
                  cost_model: str = "flops", compile: bool = False, say=None) -> BlockProfile:
    """The options of a block at this call and their figures (see the module docstring): one trace, one planning
    problem (one solver graph), solved by the core at each of PLAN_FRACTIONS of its no-recomputation peak."""
    t0 = time.perf_counter()
    say = say or (lambda _msg: None)
    options: list[Option] = []
    plans: dict[str, Any] = {}
    note = ""
    nodes = 0
    region = _Region(block, call)
    sample = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
    forward_cost = None
    planned: list[tuple[str, Plan]] = []
    if not call.plannable:
        note = "a non-tensor argument cannot be compared between calls (a cache object?): the block runs eager"
    else:
        try:
            with restored(block), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = trace_model(region, sample, cost_model)
            nodes = traced.graph.n
        except (RematError, RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            traced = None
            note = f"the block could not be traced ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        if traced is not None:
            problem = PlanningProblem(traced)
            forward_cost = _forward_cost(problem.solver_graph)
            planned = _planned_options(region, sample, problem, time_limit_s)
    kept = Option(OptionKind.KEPT, BlockOption(OptionKind.KEPT.value, 0.0, 0, 0, 0), _kept_runner(call))
    ckpt = Option(OptionKind.CHECKPOINTED, BlockOption(OptionKind.CHECKPOINTED.value, 0.0, 0, 0, 0),
                  _checkpointed_runner(call))
    if forward_cost is None:
        forward_cost = _measured_flops(block, call, tensors)
    candidates = [(kept, 0.0), (ckpt, forward_cost)] if call.plannable else [(kept, 0.0)]
    for name, p in planned:
        candidates.append((Option(OptionKind.PLANNED, BlockOption(name, 0.0, 0, 0, 0),
                                  _planned_runner(p, region, compile)),
                           p.overhead * p.graph.total_cost))
        plans[name] = p
    seen = set()
    for opt, cost in candidates:
        stash, fwd, bwd = measure_option(block, lambda ts, run=opt.run: run(block, ts), tensors)
        if (stash, fwd, bwd) in seen and opt.kind is OptionKind.PLANNED:
            continue
        seen.add((stash, fwd, bwd))
        opt.figures = BlockOption(opt.figures.name, float(cost), stash, fwd, bwd)
        options.append(opt)
    seconds = time.perf_counter() - t0
    say(f"block {type(block).__name__}: {nodes} nodes, options " +
        ", ".join(f"{o.figures.name} (stash {o.figures.stash_bytes / 1e6:.2f} MB)" for o in options) +
        f", {seconds:.2f} s")
    return BlockProfile(call.key, options, seconds, note, nodes, plans)


def _measured_flops(block: torch.nn.Module, call: BlockCall, tensors) -> float:
    """The FLOPs of one forward of the block (torch.utils.flop_counter), for a block that could not be traced."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with restored(block), torch.no_grad(), counter:
        args, kwargs = call.rebuild([t.detach() for t in tensors])
        original_forward(block)(*args, **kwargs)
    return float(counter.get_total_flops())
