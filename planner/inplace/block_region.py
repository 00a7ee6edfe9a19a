"""One block of a model, planned on its own: how it was called, the options it offers, what each one holds.

The in-place planner (planner.inplace.controller) runs every repeated block through one of its options:

- "kept": the block's own forward, everything kept for the backward (eager);
- "checkpointed": torch.utils.checkpoint around the whole block (non-reentrant, RNG state preserved): only the
  input is kept, the block runs again for its backward (`recomputable`: from the Python, numpy and buffer state its
  forward began with, the step's state put back after, so the user's state is updated once, as eager does);
- "planned@<fraction>": a schedule the solving core (planner.core.solve) made for the block alone at that fraction of
  its no-recomputation peak, run by the executor (planner.execution.runtime.PlannedModule) on the block's live
  parameters.

`BlockCall.of(block, args, kwargs)` flattens a call to its tensors and a key (shapes, dtypes, devices, strides,
which require grad, the non-tensor arguments, a key/value cache by its class alone, the autocast state, the block's
mode and which of its parameters require grad, with their dtypes): calls with one key share one profile.
`profile_block` traces the block once at that call, solves its one planning problem at a few budgets and measures
each option on one real forward and backward of the block under a storage tracker (gradients taken with
torch.autograd.grad, so nothing accumulates; RNG and buffers restored): what it stashes, what its forward and
backward hold at once, and what it computes again (in the trace's cost unit; the whole forward for "checkpointed").
A block that cannot be traced keeps the two whole-block options, with the reason.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten

from capture.call import TENSOR, FlatCall
from capture.kv_cache import is_cache, reads_cache, recompute_without_cache_updates, scratch_copy
from capture.measure_memory import StorageTracker, storage_bytes
from capture.module_tags import node_modules, trace_model
from capture.state import autocast_state, host_rng_state, restored, same_host_rng
from graphs.errors import NoSolutionInTimeError, RematError
from graphs.simulate import reference_peak_bytes
from planner.core.candidates import checkpoint_candidates
from planner.core.plan_type import Plan, fingerprint
from planner.core.problem import PlanningProblem
from planner.core.solve import solve_problem
from planner.inplace.recompute import BufferUpdates, recomputable
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
    """A block's call (capture.call.FlatCall) and its key: the call's and the block's state (`_state_key`).

    Key/value cache objects among the arguments (capture.kv_cache.is_cache; keyed by their class) are not part of
    the call the planner traces: `flat` holds None in their places, and `caches` this call's objects, which only
    the kept and checkpointed options are given (a profile keeps `bare()`, without them)."""

    flat: FlatCall
    key: tuple
    cache_slots: tuple[int, ...] = ()  # where the cache objects go among flat's leaves
    caches: tuple = field(default=(), compare=False, repr=False)  # this call's, in those places

    @property
    def plannable(self) -> bool:
        """False when a non-tensor argument cannot be compared: the block runs eager."""
        return self.flat.hashable

    @staticmethod
    def of(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple["BlockCall", list[torch.Tensor]]:
        flat, tensors = FlatCall.of(args, kwargs)
        slots = tuple(i for i, c in enumerate(flat.constants) if is_cache(c))
        caches = tuple(flat.constants[i] for i in slots)
        if slots:
            flat = replace(flat, constants=tuple(None if i in slots else c for i, c in enumerate(flat.constants)))
        return BlockCall(flat, (flat.key, _state_key(block)), slots, caches), tensors

    def bare(self) -> "BlockCall":
        """This call without its cache objects."""
        return replace(self, caches=()) if self.caches else self

    def rebuild(self, tensors, caches=()) -> tuple[tuple, dict]:
        """(args, kwargs) with `tensors` in their places and `caches` in theirs (None where not given)."""
        if not (self.cache_slots and caches):
            return self.flat.rebuild(tensors)
        it = iter(tensors)
        leaves = [next(it) if c is TENSOR else c for c in self.flat.constants]
        for i, c in zip(self.cache_slots, caches):
            leaves[i] = c
        return tree_unflatten(leaves, self.flat.spec)


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

    def __str__(self) -> str:  # its value in messages and tables, as a plain string would print
        return self.value

    KEPT = "kept"
    CHECKPOINTED = "checkpointed"
    PLANNED = "planned"


@dataclass
class Option:
    """An option with its runner: `run(block, tensors, caches=()) -> output`, inside the block's forward (one profile
    serves every block called with its key; `caches`, the call's cache objects (BlockCall.caches), reach the kept
    and checkpointed options, None takes their place where not given)."""
    kind: OptionKind
    figures: BlockOption
    run: Callable[..., Any] = field(repr=False)


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


def _checkpointed_runner(call: BlockCall, updates: BufferUpdates | None = None):
    from torch.utils.checkpoint import checkpoint

    def run(block, tensors, caches=()):
        args, kwargs = call.rebuild(tensors, caches)
        # the caches' updates are the forward's alone (capture.kv_cache), composed with `recomputable`
        forward, args, kwargs = recompute_without_cache_updates(original_forward(block), args, kwargs)
        return checkpoint(recomputable(forward, block, updates), *args, use_reentrant=False, **kwargs)
    return run


def _kept_runner(call: BlockCall):
    def run(block, tensors, caches=()):
        args, kwargs = call.rebuild(tensors, caches)
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

    def run(block, tensors, caches=()):  # the schedule's trace saw no cache: None in its place, the cache not updated
        if region.block is not block:
            region.block = block
        return module(*tensors)
    return run


# Options are ranked by what they compute again: its FLOPs plus its bytes written, at this many FLOPs a byte (a
# balance between arithmetic and memory traffic; CPUs run near 10, GPUs far above), so that recomputing only
# elementwise ops, which FLOPs count as free, is never ranked as free as keeping everything.
FLOPS_PER_BYTE = 8.0


def _recompute_cost(graph, nodes, cost_model: str) -> float:
    """What computing `nodes` (node indices of `graph`, repeats counted) again costs in the ranking's unit: the
    trace's cost, plus FLOPS_PER_BYTE a byte written where that cost is FLOPs (a measured time already holds it)."""
    per_byte = FLOPS_PER_BYTE if cost_model == "flops" else 0.0
    return float(sum(graph.nodes[v].cost + per_byte * graph.nodes[v].bytes for v in nodes))


def _forward_cost(graph, cost_model: str) -> float:
    return _recompute_cost(graph, [v for v, n in enumerate(graph.nodes) if not n.backward], cost_model)


def _planned_cost(plan: Plan) -> float:
    """The recomputations of a planned option, in the ranking's unit (`_recompute_cost`)."""
    counts = plan.result.sim.compute_counts
    again = [v for v in range(len(counts)) for _ in range(int(counts[v]) - 1)]
    return _recompute_cost(plan.graph, again, plan.cost_model)


def _planned_options(region: _Region, sample: tuple, problem: PlanningProblem, time_limit_s: float,
                     cut: list[str]) -> list[tuple[str, Plan]]:
    """("planned@<fraction>", plan) for each of PLAN_FRACTIONS of the block's no-recomputation peak that a schedule
    meets, each solved by the core on the one planning problem of the block's trace, in a share of the time; the
    name of an option whose share ran out before a schedule was found goes to `cut`."""
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
        except NoSolutionInTimeError:
            cut.append(f"{OptionKind.PLANNED.value}@{frac:g}")
            break  # a smaller fraction will not be found in its share either
        except RematError:
            break  # proven out of reach: a smaller fraction will not fit either
        plan = Plan.of(solved, problem, fingerprint=fp, cost_model=traced.cost_model, modules=modules)
        out.append((f"{OptionKind.PLANNED.value}@{frac:g}", plan))
    return out


def profile_block(block: torch.nn.Module, call: BlockCall, tensors: list[torch.Tensor], *, time_limit_s: float,
                  cost_model: str = "flops", compile: bool = False, say=None, trace: bool = True) -> BlockProfile:
    """The options of a block at this call and their figures (see the module docstring): one trace, one planning
    problem (one solver graph), solved by the core at each of PLAN_FRACTIONS of its no-recomputation peak. The
    call's cache objects are not the profile's: it traces the block with None in their places and measures the kept
    and checkpointed options with throwaway copies of them (capture.kv_cache.scratch_copy). With `trace=False` (a
    new shape of a block structure traced before) it offers the whole-block options alone, untraced."""
    t0 = time.perf_counter()
    caches, call = call.caches, call.bare()
    say = say or (lambda _msg: None)
    options: list[Option] = []
    plans: dict[str, Any] = {}
    note = ""
    nodes = 0
    region = _Region(block, call)
    sample = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
    forward_cost = None
    planned: list[tuple[str, Plan]] = []
    cut: list[str] = []  # options whose time ran out
    if not call.plannable:
        note = "a non-tensor argument cannot be compared between calls: the block runs eager"
    elif not trace:
        note = "a new shape of a block structure traced before: the whole-block options, untraced"
    elif caches and _reads_cache(block, call, tensors, caches):
        note = "the block reads its cache's earlier content, which a schedule traced without it cannot"
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
            forward_cost = _forward_cost(problem.solver_graph, traced.cost_model)
            planned = _planned_options(region, sample, problem, time_limit_s, cut)
    kept = Option(OptionKind.KEPT, BlockOption(OptionKind.KEPT.value, 0.0, 0, 0, 0), _kept_runner(call))
    updates = BufferUpdates()  # the buffers the block updates: the kept measurement, first, learns them
    ckpt = Option(OptionKind.CHECKPOINTED, BlockOption(OptionKind.CHECKPOINTED.value, 0.0, 0, 0, 0),
                  _checkpointed_runner(call, updates))
    if forward_cost is None:
        forward_cost = _measured_cost(block, call, tensors, caches)
    candidates = [(kept, 0.0), (ckpt, forward_cost)] if call.plannable else [(kept, 0.0)]
    for name, p in planned:
        candidates.append((Option(OptionKind.PLANNED, BlockOption(name, 0.0, 0, 0, 0),
                                  _planned_runner(p, region, compile)),
                           _planned_cost(p)))
        plans[name] = p
    seen = set()
    draws: list[bool] = []  # the kept measurement drew from Python's or numpy's generator
    for opt, cost in candidates:
        if opt.kind is OptionKind.KEPT:  # copies made before the measurement, compared within it
            def measured(ts, run=opt.run, values={n: b.detach().clone() for n, b in block.named_buffers()}):
                host = host_rng_state()
                out = updates.run(block, values, run, block, ts, _scratch(caches))[0]
                draws.append(not same_host_rng(host, host_rng_state()))
                return out
        elif opt.kind is OptionKind.PLANNED and any(draws):
            # a traced schedule would replay the trace's draws as constants and draw nothing: not an option
            plans.pop(opt.figures.name, None)
            if "draws from Python's" not in note:
                said = "the block draws from Python's or numpy's generator, which a schedule cannot replay"
                note = f"{note}; {said}" if note else said
            continue
        else:
            def measured(ts, run=opt.run):
                return run(block, ts, _scratch(caches))
        stash, fwd, bwd = measure_option(block, measured, tensors)
        if (stash, fwd, bwd) in seen and opt.kind is OptionKind.PLANNED:
            continue
        seen.add((stash, fwd, bwd))
        opt.figures = BlockOption(opt.figures.name, float(cost), stash, fwd, bwd)
        options.append(opt)
    seconds = time.perf_counter() - t0
    say(f"block {type(block).__name__}: {nodes} nodes, options " +
        ", ".join(f"{o.figures.name} (stash {o.figures.stash_bytes / 1e6:.2f} MB)" for o in options) +
        f", {seconds:.2f} s")
    if cut:
        share = time_limit_s / (len(PLAN_FRACTIONS) + 1)
        said = f"{', '.join(cut)}: no schedule found in its share of the time limit ({share:.2f} s; raise time_limit_s)"
        note = f"{note}; {said}" if note else said
    return BlockProfile(call.key, options, seconds, note, nodes, plans)


def _scratch(caches: tuple) -> tuple:
    return tuple(scratch_copy(c) for c in caches)


def _reads_cache(block: torch.nn.Module, call: BlockCall, tensors, caches: tuple) -> bool:
    """Whether the block's call reads what its caches held before it (capture.kv_cache.reads_cache)."""
    with restored(block):
        args, kwargs = call.rebuild([t.detach() for t in tensors], caches)
        return reads_cache(original_forward(block), args, kwargs)


def _measured_cost(block: torch.nn.Module, call: BlockCall, tensors, caches: tuple = ()) -> float:
    """One forward of the block in the ranking's unit (`_recompute_cost` under FLOPs): its FLOPs
    (torch.utils.flop_counter) plus FLOPS_PER_BYTE a byte it creates; for a block profiled without a trace."""
    from torch.utils.flop_counter import FlopCounterMode

    counter, tracker = FlopCounterMode(display=False), StorageTracker()
    with restored(block), torch.no_grad(), counter, tracker:
        args, kwargs = call.rebuild([t.detach() for t in tensors], _scratch(caches))
        original_forward(block)(*args, **kwargs)
    return float(counter.get_total_flops()) + FLOPS_PER_BYTE * tracker.created_bytes


def structure_key(key: tuple) -> tuple:
    """A block key (BlockCall.key) with each tensor's shape and strides replaced by its rank: the key of the block's
    structure, which every sequence length and batch size of one call form shares."""
    (spec, parts), state = key
    return ((spec, tuple(("tensor", len(p[1]), *p[3:]) if p and p[0] == "tensor" and len(p) == 6 else p
                         for p in parts)), state)
