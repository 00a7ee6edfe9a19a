"""One block of a model, planned on its own: how it was called, the options it offers, what each one holds.

The in-place planner (planner.inplace.controller) runs every repeated block through one of its options:

- "kept": the block's own forward, everything kept for the backward (eager);
- "checkpointed": torch.utils.checkpoint around the whole block (non-reentrant, RNG state preserved): only the
  input is kept, the block runs again for its backward (`recomputable`: from the Python, numpy and buffer state its
  forward began with, the step's state put back after, so the user's state is updated once, as eager does);
- "selective@<fraction>": torch.utils.checkpoint around the block with a per-operator save policy
  (`create_selective_checkpoint_contexts`): the outputs of the operators a knapsack (solvers.exact.knapsack) picks
  within that fraction of the bytes of the outputs a policy may keep, for the most recompute saved, are kept, the
  rest computed again. The block's own Python runs in the forward and again in the recomputation, as with
  "checkpointed"; the policy names operators by their order in the forward (capture.op_record), so it serves every
  shape of the block's structure;
- "planned@<fraction>" (with `planned=True`): a schedule the solving core (planner.core.solve) made for the block
  alone at that fraction of its no-recomputation peak, run by the project's executor
  (planner.execution.runtime.PlannedModule) on the block's live parameters; traced at one shape.
- with `compile=True` (planner.inplace.compiled_options) the kept, checkpointed and selective options are replaced by
  "compiled kept", "compiled checkpointed" and "compiled selective@<fraction>": the same under torch.compile, each
  measured as compiled; a measuring call runs their eager counterparts (`Option.measuring_run`).

`BlockCall.of(block, args, kwargs)` flattens a call to its tensors and a key (shapes, dtypes, devices, strides,
which require grad, the non-tensor arguments, a key/value cache by its class alone, the autocast state, the block's
mode and which of its parameters require grad, with their dtypes): calls with one key share one profile.
`profile_block` measures the kept and checkpointed options (and the planned ones) on one real forward and backward
of the block each under a storage tracker (gradients taken with torch.autograd.grad, so nothing accumulates; RNG and
buffers restored): what it stashes, what its forward and backward hold at once, and what it computes again
(planner.inplace.option_costs: FLOPs plus FLOPS_PER_BYTE a byte written, summed over the operators it runs again,
and the host's work of the checkpoint wrappers). The kept one's
forward records the block's operators (capture.op_record), from which the selective options are built and their
figures bounded (`_derived`). With `planned=True` it also traces the block and solves its one planning problem at a
few budgets.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten

from capture.call import TENSOR, FlatCall, tensor_meta
from capture.kv_cache import cache_tensors, is_cache, reads_cache, recompute_without_cache_updates, scratch_copy
from capture.measure_memory import named_parameters, storage_bytes
from capture.module_tags import node_modules, trace_model
from capture.op_record import OpRecord, record_kept_forward
from capture.state import autocast_state, host_rng_state, restored, same_host_rng
from graphs.errors import NoSolutionInTimeError, RematError
from graphs.simulate import reference_peak_bytes
from planner.core.candidates import checkpoint_candidates
from planner.core.plan_type import Plan, fingerprint
from planner.core.problem import PlanningProblem
from planner.core.solve import solve_problem
from planner.core.units import FLOPS_PER_BYTE
from planner.inplace import scaling
from planner.inplace.compiled_options import (
    COMPILED_PREFIX,
    matches_recording,
    measure_compiled,
    profiler_running,
    warm,
)
from planner.inplace.forwards import GradientSeed, original_forward
from planner.inplace.option_costs import Overheads, checkpointed_cost, selective_cost, selective_options
from planner.inplace.recompute import BufferUpdates, recomputable
from planner.inplace.scaling import ScalingTracker
from solvers.exact.option_chain import BlockOption

PLAN_FRACTIONS = (0.8, 0.6, 0.45)  # of the block's no-recomputation peak: the planned options tried
# of the savable outputs' bytes: the selective options. A step of 0.05: a policy such as "matmuls and attention
# kept" holds about 0.35 of a decoder layer's savable bytes, and the chain can only match the memory of what it is
# offered. Compiled, each option is compiled and measured on its own: fewer.
SELECTIVE_FRACTIONS = tuple(round(0.05 * k, 2) for k in range(19, 0, -1))
COMPILED_SELECTIVE_FRACTIONS = (0.9, 0.75, 0.6, 0.45, 0.3, 0.15)


def _state_key(block: torch.nn.Module, flags: tuple | None = None) -> tuple:
    """What a block's trace depends on besides its call: its mode, the autocast state, its parameters' flags
    (`parameter_flags(block)`, or `flags` where the caller has them)."""
    return (block.training, autocast_state(), parameter_flags(block) if flags is None else flags)


def parameter_flags(block: torch.nn.Module) -> tuple:
    """The block's parameters by name, with whether each requires grad, its dtype and device."""
    return tuple((n, p.requires_grad, p.dtype, p.device) for n, p in named_parameters(block))


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
    def of(block: torch.nn.Module, args: tuple, kwargs: dict,
           flags: tuple | None = None) -> tuple["BlockCall", list[torch.Tensor]]:
        """The call and its tensors; `flags`, where the caller has them, the block's `parameter_flags`."""
        flat, tensors = FlatCall.of(args, kwargs)
        slots = tuple(i for i, c in enumerate(flat.constants) if is_cache(c))
        caches = tuple(flat.constants[i] for i in slots)
        if slots:
            flat = replace(flat, constants=tuple(None if i in slots else c for i, c in enumerate(flat.constants)))
        return BlockCall(flat, (flat.key, _state_key(block, flags)), slots, caches), tensors

    def again(self, block: torch.nn.Module, args: tuple, kwargs: dict, last: tuple,
              flags: tuple) -> list[torch.Tensor] | None:
        """The tensors of a call of `block` with `args` and `kwargs` where it is this call again (what `BlockCall.of`
        would give, the key equal), read without flattening it: None unless every keyword argument is the object it
        was in this call (`last`: the number of positional arguments it had, all tensors, its keyword arguments, and
        their tensors in order), in the same order, each a tensor, a cache, None, a number, a string or a tuple of
        those, every positional argument a tensor, and every tensor's metadata and the block's state (`flags` its
        parameter flags) as this call's key has them. A decoder's layers are called so in turn: the next hidden
        states, the same mask, positions and cache."""
        last_nargs, last_kwargs, last_kw_tensors = last
        if len(args) != last_nargs or tuple(kwargs) != tuple(last_kwargs):
            return None
        for k, v in kwargs.items():
            if v is not last_kwargs[k] or not _immutable(v):
                return None
        if not all(type(a) is torch.Tensor for a in args):
            return None
        tensors = [*args, *last_kw_tensors]
        if _state_key(block, flags) != self.key[1]:
            return None
        metas = [p for p in self.flat.key[1] if p[0] == "tensor"]
        if len(metas) != len(tensors) or any(("tensor", *tensor_meta(t)) != m for t, m in zip(tensors, metas)):
            return None
        return tensors

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


def _immutable(v) -> bool:
    """Whether a keyword argument passed again as the same object is the same argument: a tensor (its metadata read
    again), a cache (keyed by its class), None, a number, a string, or a tuple of those."""
    if type(v) is tuple:
        return all(_immutable(x) for x in v)
    return v is None or type(v) in (torch.Tensor, bool, int, float, str) or is_cache(v)


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
    SELECTIVE = "selective"
    PLANNED = "planned"


@dataclass
class Option:
    """An option with its runner: `run(block, tensors, caches=()) -> output`, inside the block's forward (one profile
    serves every block called with its key; `caches`, the call's cache objects (BlockCall.caches), reach the kept
    and checkpointed options, None takes their place where not given)."""
    kind: OptionKind
    figures: BlockOption
    run: Callable[..., Any] = field(repr=False)
    # a compiled option's eager counterpart, which a measuring call runs (its storage tracker cannot see inside
    # compiled code): None where `run` is eager
    measuring_run: Callable[..., Any] | None = field(default=None, repr=False)


@dataclass
class BlockProfile:
    key: tuple
    options: list[Option]
    plan_seconds: float
    note: str = ""  # why only whole-block options, where that is so
    nodes: int = 0  # of the block's trace
    plans: dict[str, Any] = field(default_factory=dict, repr=False)  # option name -> Plan
    # the selective options' policies, (name, the (func, occurrence) pairs kept): the block structure's other shapes
    # take them as they are (`profile_block(policies=...)`)
    policies: list[tuple[str, frozenset]] = field(default_factory=list, repr=False)
    # with a `scale` (profile_block): per ratio of scaling.RATIOS, bounds on the options' figures (in their order) at a
    # call of this structure whose dimensions equal to `scale` are at most that ratio times longer
    scale: int | None = None
    scaled: list[list[BlockOption]] | None = field(default=None, repr=False)
    bounded_at: float | None = None  # a profile made of another shape's bounds at this ratio (`at_ratio`), unprofiled

    @property
    def figures(self) -> list[BlockOption]:
        return [o.figures for o in self.options]

    def at_ratio(self, j: int, key: tuple) -> "BlockProfile":
        """This profile's options with their bounds at ratio j (scaling.RATIOS[j]), as the profile of a call `key`:
        the runners serve every shape of the structure."""
        options = [replace(o, figures=f) for o, f in zip(self.options, self.scaled[j])]
        return BlockProfile(key, options, 0.0, self.note, 0, {}, self.policies, bounded_at=scaling.RATIOS[j])


def _checkpointed_runner(call: BlockCall, updates: BufferUpdates | None = None):
    from torch.utils.checkpoint import checkpoint

    def run(block, tensors, caches=()):
        args, kwargs = call.rebuild(tensors, caches)
        # the caches' updates are the forward's alone (capture.kv_cache), composed with `recomputable`
        forward, args, kwargs = recompute_without_cache_updates(original_forward(block), args, kwargs)
        return checkpoint(recomputable(forward, block, updates), *args, use_reentrant=False, **kwargs)
    return run


def _selective_runner(call: BlockCall, saved: frozenset, updates: BufferUpdates | None = None):
    """torch.utils.checkpoint around the block with a save policy: the outputs of the operators in `saved` ((func,
    occurrence) pairs, capture.op_record) are kept, every other operator runs again in the recomputation."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def context_fn():
        counts: tuple[dict, dict] = ({}, {})  # the forward's and the recomputation's counts per operator

        def policy(ctx, func, *args, **kwargs):  # (a cache's update is not seen: capture.kv_cache)
            seen = counts[bool(ctx.is_recompute)]
            k = seen.get(func, 0)
            seen[func] = k + 1
            return CheckpointPolicy.MUST_SAVE if (func, k) in saved else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def run(block, tensors, caches=()):
        args, kwargs = call.rebuild(tensors, caches)
        forward, args, kwargs = recompute_without_cache_updates(original_forward(block), args, kwargs)
        return checkpoint(recomputable(forward, block, updates), *args, use_reentrant=False, context_fn=context_fn,
                          **kwargs)
    return run


def _kept_runner(call: BlockCall):
    def run(block, tensors, caches=()):
        args, kwargs = call.rebuild(tensors, caches)
        return original_forward(block)(*args, **kwargs)
    return run


def measure_option(block: torch.nn.Module, run, tensors: list[torch.Tensor],
                   held_elsewhere: Callable[[], list] = list) -> tuple[int, int, int]:
    """(stash_bytes, forward_bytes, backward_bytes) of one option (see solvers.exact.option_chain), measured on one
    forward and backward of the block from fresh leaves of `tensors`. backward_bytes includes the output's incoming
    gradient, which is allocated when the backward starts and freed once used. What the forward made that
    `held_elsewhere()` holds after it (a key/value cache's new entries, which the step's sites count where the step's
    cache holds them) is neither stash nor backward."""
    return measure_option_scaled(block, run, tensors, held_elsewhere)[0]


def measure_option_scaled(block: torch.nn.Module, run, tensors: list[torch.Tensor],
                          held_elsewhere: Callable[[], list] = list, scale: int | None = None):
    """(measure_option's three figures, None or, with `scale`, the three at each ratio of scaling.RATIOS: bounds
    on them at a call whose dimensions equal to `scale` are at most that ratio times longer)."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    params = [p for p in block.parameters() if p.requires_grad]
    wrt = params + [t for t in inputs if t.requires_grad]
    tracker = ScalingTracker(scale)
    scaled = tracker.scale is not None
    with restored(block):
        with tracker:
            out = run(inputs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_bytes = storage_bytes(outs)
        diff = [t for t in outs if t.requires_grad and t.grad_fn is not None and t.is_floating_point()]
        forward_bytes = tracker.peak_bytes
        held = held_elsewhere()
        elsewhere = tracker.tracked_bytes(held)
        stash = max(0, tracker.live_bytes - out_bytes - elsewhere)
        if scaled:  # the outputs and the cache's entries are held through the stretches read: subtracted, a bound
            out_s = scaling.add(scaling.storage_bytes_scaled(outs, tracker.scale), tracker.tracked_bytes_scaled(held))
            forward_s = tracker.peak_scaled
            stash_s = scaling.sub_floor(tracker.live_scaled(), out_s)
        if diff and wrt:
            total = sum(GradientSeed.apply(t).sum() for t in diff)  # scalars made outside the tracker: not the block's
            seed = torch.ones_like(total)
            tracker.reset_peak()
            with tracker:
                grads = torch.autograd.grad(total, wrt, grad_outputs=seed, allow_unused=True)
                del grads
            del total
        backward_bytes = max(0, tracker.peak_bytes - out_bytes - elsewhere)
        columns = None
        if scaled:
            backward_s = scaling.sub_floor(tracker.peak_scaled, out_s)
            columns = list(zip(stash_s, forward_s, backward_s))
        del out, outs, diff, held
    return (int(stash), int(forward_bytes), int(backward_bytes)), columns


def _planned_runner(p, region: _Region, compile: bool):
    """Runs the plan's schedule on the block of the call: one PlannedModule (its step built once) whose region is
    pointed at that block, so its parameters and buffers are read from it."""
    module = p.apply(region, compile=compile)

    def run(block, tensors, caches=()):  # the schedule's trace saw no cache: None in its place, the cache not updated
        if region.block is not block:
            region.block = block
        return module(*tensors)
    return run



def _recompute_cost(graph, nodes, cost_model: str) -> float:
    """What computing `nodes` (node indices of `graph`, repeats counted) again costs in the ranking's unit: the
    trace's cost, plus FLOPS_PER_BYTE a byte written where that cost is FLOPs (a measured time already holds it)."""
    per_byte = FLOPS_PER_BYTE if cost_model == "flops" else 0.0
    return float(sum(graph.nodes[v].cost + per_byte * graph.nodes[v].bytes for v in nodes))


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
                  cost_model: str = "flops", compile: bool = False, say=None, planned: bool = False,
                  policies: list[tuple[str, frozenset]] | None = None, scale: int | None = None,
                  compiled=None) -> BlockProfile:
    """The options of a block at this call and their figures (see the module docstring): the block's operators
    recorded on one forward, the selective options a knapsack builds from them, and with `planned` one trace and one
    planning problem (one solver graph), solved by the core at each of PLAN_FRACTIONS of its no-recomputation peak.
    With `policies` (those of the block structure's first shape, BlockProfile.policies) the selective options are
    those. A selective option's figures are bounds derived from the shape's recording and its kept and checkpointed
    measurements (`_derived`), not measurements of its own.
    The call's cache objects are not the profile's: it records and measures with throwaway copies of them
    (capture.kv_cache.scratch_copy) and traces the block with None in their places. With `scale` (CPU) it also
    bounds every option's figures at calls whose dimensions equal to `scale` are up to each ratio of
    scaling.RATIOS longer (BlockProfile.scaled).
    With `compiled` (planner.inplace.compiled_options.CompiledOptions: `enable(compile=True)`) the kept, checkpointed
    and selective options are replaced by their compiled counterparts, each measured on its own (`_compiled_options`),
    where the block can be compiled."""
    t0 = time.perf_counter()
    caches, call = call.caches, call.bare()
    say = say or (lambda _msg: None)
    options: list[Option] = []
    plans: dict[str, Any] = {}
    notes: list[str] = []
    nodes = 0
    planned_plans: list[tuple[str, Plan]] = []
    cut: list[str] = []  # options whose time ran out
    updates = BufferUpdates()  # the buffers the block updates: the kept measurement, first, learns them
    kept = Option(OptionKind.KEPT, BlockOption(OptionKind.KEPT.value, 0.0, 0, 0, 0), _kept_runner(call))
    derived: list[tuple[Option, frozenset, float]] = []  # selective options whose figures are derived, not measured
    policy_list: list[tuple[str, frozenset]] = []
    records: list[OpRecord] = []
    seen = set()
    draws: list[bool] = []  # the kept measurement drew from Python's or numpy's generator
    scratch: list = []  # the measured call's cache copies, held through its measurement

    def cache_held() -> list:
        return [t for c in scratch for t in cache_tensors(c)]

    columns: dict[int, list] = {}  # id(option) -> its figures at each ratio (measure_option_scaled)
    over = Overheads.on(tensors[0].device if tensors else next((p.device for p in block.parameters()), None))

    def measure(opt: Option, cost: float, measured) -> None:
        scratch[:] = _scratch(caches)
        (stash, fwd, bwd), cols = measure_option_scaled(block, measured, tensors, cache_held, scale)
        scratch.clear()
        if (stash, fwd, bwd) in seen and opt.kind in (OptionKind.PLANNED, OptionKind.SELECTIVE):
            return
        seen.add((stash, fwd, bwd))
        opt.figures = BlockOption(opt.figures.name, float(cost), stash, fwd, bwd)
        options.append(opt)
        columns[id(opt)] = cols

    def kept_measured(ts, values={n: b.detach().clone() for n, b in block.named_buffers()}):
        # copies of the buffers made before the measurement, compared within it; the operators recorded on the way,
        # through the caches' stand-ins as the selective runner calls the block (their updates unseen)
        host = host_rng_state()

        def forward():
            if not call.plannable:
                return kept.run(block, ts, tuple(scratch))
            args, kwargs = call.rebuild(ts, tuple(scratch))
            fn, args, kwargs = recompute_without_cache_updates(original_forward(block), args, kwargs)
            out, recs = record_kept_forward(fn, *args, **kwargs)
            records.extend(recs)
            return out
        out = updates.run(block, values, forward)[0]
        draws.append(not same_host_rng(host, host_rng_state()))
        return out

    measure(kept, 0.0, kept_measured)
    if not call.plannable:
        notes.append("a non-tensor argument cannot be compared between calls: the block runs eager")
    else:
        ckpt = Option(OptionKind.CHECKPOINTED, BlockOption(OptionKind.CHECKPOINTED.value, 0.0, 0, 0, 0),
                      _checkpointed_runner(call, updates))
        candidates = [(ckpt, checkpointed_cost(records, over))]
        fractions = SELECTIVE_FRACTIONS if compiled is None else COMPILED_SELECTIVE_FRACTIONS
        chosen = selective_options(records, fractions, over) if policies is None else \
            [(name, saved, selective_cost(records, saved, over)) for name, saved in policies]
        for name, saved, cost in chosen:
            opt = Option(OptionKind.SELECTIVE, BlockOption(name, 0.0, 0, 0, 0), _selective_runner(call, saved, updates))
            derived.append((opt, saved, cost))
            policy_list.append((name, saved))
        if planned and any(draws):
            # a traced schedule would replay the trace's draws as constants and draw nothing: not an option
            notes.append("the block draws from Python's or numpy's generator, which a schedule cannot replay")
        elif planned:
            planned_plans, nodes = _traced_options(block, call, tensors, caches, time_limit_s, cost_model, notes, cut)
            region = _Region(block, call)
            for name, p in planned_plans:
                candidates.append((Option(OptionKind.PLANNED, BlockOption(name, 0.0, 0, 0, 0),
                                          _planned_runner(p, region, compile)), _planned_cost(p)))
                plans[name] = p
        for opt, cost in candidates:
            try:
                measure(opt, cost, lambda ts, run=opt.run: run(block, ts, tuple(scratch)))
            except (RematError, RuntimeError) as e:
                if opt.kind is not OptionKind.PLANNED:
                    raise
                # the traced schedule does not run on the real tensors (a fake layout the kernel does not give):
                # the block keeps the options that run its own code
                scratch.clear()
                notes.append(f"{opt.figures.name} did not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    measured_options = list(options)
    whole = whole_option(options)
    sizes = _output_sizes(records)
    for opt, saved, cost in derived:
        if compiled is None and whole.kind is OptionKind.CHECKPOINTED and cost >= whole.figures.cost:
            continue  # no cheaper than checkpointing, and holding more: never chosen (its policy's overhead)
        figures = _derived(options[0].figures, whole.figures, sizes, saved)
        if figures is not None:
            opt.figures = replace(figures, name=opt.figures.name, cost=float(cost))
            options.append(opt)
    if compiled is not None and call.plannable:
        refusal = _compile_refusal(caches, any(draws), updates)
        if refusal:
            notes.append(f"runs its eager options under compile=True: {refusal}")
        else:
            options = _compiled_options(block, call, tensors, options, records, dict(policy_list), compiled, notes,
                                        over)
            measured_options = []  # no bounds at other lengths for compiled options: each shape is measured
    scaled = None
    if scale is not None and measured_options and \
            all(columns.get(id(o)) is not None for o in measured_options):
        scaled = _scaled_figures(options, measured_options, columns, derived, records, scale)
    seconds = time.perf_counter() - t0
    say(f"block {type(block).__name__}: options " +
        ", ".join(f"{o.figures.name} (stash {o.figures.stash_bytes / 1e6:.2f} MB)" for o in options) +
        f", {seconds:.2f} s")
    if cut:
        share = time_limit_s / (len(PLAN_FRACTIONS) + 1)
        notes.append(f"{', '.join(cut)}: no schedule found in its share of the time limit ({share:.2f} s; raise "
                     "time_limit_s)")
    return BlockProfile(call.key, options, seconds, "; ".join(notes), nodes, plans, policy_list,
                        scale if scaled is not None else None, scaled)


def _compile_refusal(caches: tuple, draws: bool, updates: BufferUpdates) -> str:
    """Why a block's options cannot run compiled ('' where they can; see planner.inplace.compiled_options)."""
    if caches:
        return "it is given a key/value cache, which a compiled checkpoint would not leave as its forward did"
    if draws:
        return "it draws from Python's or numpy's generator, which a compiled recomputation would not replay"
    if updates.names:
        return (f"it updates buffers ({', '.join(sorted(updates.names))}), which a compiled recomputation would not "
                "leave as its forward did")
    return ""


def _compiled_options(block, call: BlockCall, tensors, options: list[Option], records: list[OpRecord],
                      policies: dict[str, frozenset], compiled, notes: list[str], over: Overheads) -> list[Option]:
    """The options with their kept, checkpointed and selective ones replaced by compiled ones, each compiled on one
    forward and backward of the block and measured on another (compiled_options.measure_compiled); where the block
    does not compile whole, or a selective policy names other operators under torch.compile than in the eager
    recording, the eager option stays (the reason in `notes`)."""
    structure = structure_key(call.key)
    if profiler_running():  # its reading would need a second session (and two at once crash the process)
        notes.append("compile=True: a torch.profiler session was running when the block was profiled: its eager "
                     "options run")
        return options
    out: list[Option] = []
    seen: set = set()
    failed = False
    for opt in options:
        if opt.kind is OptionKind.PLANNED or failed:
            out.append(opt)
            continue
        name = opt.figures.name
        saved = None if opt.kind is OptionKind.KEPT else policies.get(name, frozenset())
        run, traced = compiled.runner(structure, COMPILED_PREFIX + name, saved, call, eager=opt.run)
        try:
            warm(block, run, tensors)  # compiles it (dynamo, then the backend)
        except Exception as e:  # noqa: BLE001 - a graph break, a backend's failure: the eager options stay
            notes.append(f"compile=True: {COMPILED_PREFIX + name} did not compile ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''}); the eager options run")
            failed = True
            out.append(opt)
            continue
        why = matches_recording(traced, records, saved) if saved else None
        if why is not None:
            notes.append(f"compile=True: {name} runs eagerly ({why})")
            out.append(opt)
            continue
        figures = measure_compiled(block, run, tensors)
        if opt.kind is OptionKind.SELECTIVE and figures in seen:
            continue  # as another compiled option
        seen.add(figures)
        cost = opt.figures.cost
        if opt.kind is OptionKind.SELECTIVE:  # the policy runs at trace time only
            cost = max(0.0, cost - over.selective_op * len(records))
        out.append(Option(opt.kind, BlockOption(COMPILED_PREFIX + name, float(cost), *figures), run,
                          measuring_run=opt.measuring_run or opt.run))
    if failed:  # all eager, not a mix of compiled options and the one that failed
        return [o for o in options]
    return out


def _scaled_figures(options: list[Option], measured: list[Option], columns: dict, derived: list, records, scale: int):
    """Per ratio of scaling.RATIOS, the options' figures there (BlockProfile.scaled): the measured ones' bounds, the
    selective ones derived from those and the recording's outputs at that ratio (`_derived`); None where a selective
    option's derivation fails at a ratio (it does where it fails at the profiled shape)."""
    by_opt = {id(o): derived_saved for o, derived_saved, _ in derived}
    measured_ids = {id(o) for o in measured}
    any_derived = any(id(o) not in measured_ids for o in options)
    # each record's outputs' bytes at every ratio, where a selective option is derived from them
    scaled_bytes = [[sum(c) for c in zip(*(scaling.scaled(b, scaling.size_degree(dims, scale))
                                           for b, dims in r.new_sizes))] or [0] * len(scaling.RATIOS)
                    for r in records] if any_derived else []
    out = []
    for j in range(len(scaling.RATIOS)):
        sizes = _output_sizes(records, [sb[j] for sb in scaled_bytes]) if any_derived else {}
        figs = {id(o): BlockOption(o.figures.name, o.figures.cost, *columns[id(o)][j]) for o in measured}
        kept, whole = figs[id(measured[0])], figs[id(whole_option(measured))]
        row = []
        for o in options:
            if id(o) in figs:
                row.append(figs[id(o)])
            else:
                f = _derived(kept, whole, sizes, by_opt[id(o)])
                if f is None:
                    return None
                row.append(replace(f, name=o.figures.name, cost=o.figures.cost))
        out.append(row)
    return out


def whole_option(options: list[Option]) -> Option:
    """The checkpointed option (the kept one where the block cannot be checkpointed)."""
    return next((o for o in options if o.kind is OptionKind.CHECKPOINTED), options[0])


def _output_sizes(records: list[OpRecord], out_bytes=None) -> dict:
    """(func, occurrence) -> (its outputs' bytes, whether autograd keeps them): what `_derived` reads of a recording;
    `out_bytes`, per record, replaces the recorded bytes (the recording's at another length)."""
    sizes = (r.out_bytes for r in records) if out_bytes is None else out_bytes
    return {(r.func, r.occurrence): (b, r.needed) for r, b in zip(records, sizes)}


def _derived(kept: BlockOption, ckpt: BlockOption, by: dict, saved: frozenset) -> BlockOption | None:
    """Bounds on a selective option's figures from this shape's kept and checkpointed ones and its recording (None
    where the recording lacks an operator the policy keeps: the block took another path). It stashes what
    checkpointing does and the outputs it keeps (selective checkpointing holds exactly those); its forward holds no
    more than checkpointing's and that stash, nor, where autograd keeps all it keeps, than keeping everything; its
    backward recomputes what the block's backward reads, as checkpointing's does, holding besides, until the
    recomputation has used them, the kept outputs autograd does not keep."""
    if any(k not in by for k in saved):
        return None
    kept_bytes = sum(by[k][0] for k in saved)
    extra = sum(by[k][0] for k in saved if not by[k][1])
    stash = ckpt.stash_bytes + kept_bytes
    forward = ckpt.forward_bytes + stash if extra else min(kept.forward_bytes, ckpt.forward_bytes + stash)
    return BlockOption("", 0.0, stash, forward, max(kept.backward_bytes, ckpt.backward_bytes) + extra)


def _traced_options(block, call: BlockCall, tensors, caches: tuple, time_limit_s: float, cost_model: str,
                    notes: list[str], cut: list[str]) -> tuple[list[tuple[str, Plan]], int]:
    """The planned options of a block (`_planned_options`) and its trace's node count; none, with the reason in
    `notes`, where the block reads its cache's earlier content or cannot be traced."""
    if caches and _reads_cache(block, call, tensors, caches):
        notes.append("the block reads its cache's earlier content, which a schedule traced without it cannot")
        return [], 0
    region = _Region(block, call)
    sample = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
    try:
        with restored(block), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = trace_model(region, sample, cost_model)
    except (RematError, RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        notes.append(f"the block could not be traced ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return [], 0
    return _planned_options(region, sample, PlanningProblem(traced), time_limit_s, cut), traced.graph.n


def _scratch(caches: tuple) -> tuple:
    return tuple(scratch_copy(c) for c in caches)


def _reads_cache(block: torch.nn.Module, call: BlockCall, tensors, caches: tuple) -> bool:
    """Whether the block's call reads what its caches held before it (capture.kv_cache.reads_cache)."""
    with restored(block):
        args, kwargs = call.rebuild([t.detach() for t in tensors], caches)
        return reads_cache(original_forward(block), args, kwargs)


def structure_key(key: tuple) -> tuple:
    """A block key (BlockCall.key) with each tensor's shape and strides replaced by its rank: the key of the block's
    structure, which every sequence length and batch size of one call form shares."""
    (spec, parts), state = key
    return ((spec, tuple(("tensor", len(p[1]), *p[3:]) if p and p[0] == "tensor" and len(p) == 6 else p
                         for p in parts)), state)
