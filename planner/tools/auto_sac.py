"""PyTorch's automatic selective activation checkpointing (torch.distributed._tools: SACEstimator, then the
per-module ILP) as a baseline: `auto_sac_checkpointed(model, sample, memory_fraction)`, a copy of the model with one
op policy for every repeated block (planner.tools.baselines.wrapped_blocks). See `auto_sac_checkpointed` for how the
policy is derived, and `auto_sac_block_stats` for what runs on CPU."""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from capture.call import CallSpec
from capture.kv_cache import is_cache
from capture.module_tags import repeated_blocks
from planner.tools.baselines import wrapped_blocks

STOCK_ESTIMATES = ("operator-level-benchmark", "operator-level-cost-model")
CPU_ESTIMATE = "cpu-benchmark"


@dataclass
class AutoSACStats:
    """SACEstimator's statistics of one repeated block (`stats`: torch's SACStats: per forward op its name, runtime
    in ms and output bytes) and how its runtimes were estimated."""
    block: str  # the block measured (the first repeated block; all share its policy)
    block_class: str
    stats: object  # torch.distributed._tools.sac_estimator.SACStats
    estimate: str  # "operator-level-benchmark", "operator-level-cost-model" or CPU_ESTIMATE
    stock_errors: dict = field(default_factory=dict)  # estimate mode -> the exact error it raised here
    estimate_seconds: float = 0.0


@dataclass
class AutoSACPolicy:
    """The per-op decisions of the ILP for one memory fraction, in the order of the block's forward ops as
    SACEstimator recorded them (OPS_TO_ALWAYS_SKIP left out)."""
    memory_fraction: float
    names: list[str]
    save: list[bool]
    saved_bytes: int
    total_bytes: int
    solve_seconds: float
    estimate: str
    stock_errors: dict

    def describe(self) -> dict:
        saved: dict[str, int] = {}
        for n, s in zip(self.names, self.save):
            if s:
                saved[n] = saved.get(n, 0) + 1
        return {"memory_fraction": self.memory_fraction, "ops": len(self.names), "saved_ops": sum(self.save),
                "saved_bytes": self.saved_bytes, "op_output_bytes": self.total_bytes, "saved_by_name": saved,
                "runtime_estimate": self.estimate, "stock_estimate_errors": self.stock_errors,
                "solve_seconds": self.solve_seconds}


class _Stop(Exception):
    pass


def _first_block_call(model: torch.nn.Module, sample, name: str) -> tuple[tuple, dict]:
    """The arguments the block `name` is called with in a training forward of `model` on `sample` (the forward
    stopped there; the RNG state restored)."""
    seen: list = []

    def grab(mod, args, kwargs):
        seen.append((args, kwargs))
        raise _Stop

    handle = model.get_submodule(name).register_forward_pre_hook(grab, with_kwargs=True)
    spec, tensors = CallSpec.of(sample)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            spec.call(model, tensors)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"the block {name} was not called in the model's forward")
    return seen[0]


def _cpu_op_milliseconds(fake_mode, func, args, kwargs, iters: int = 3):
    """SACEstimator's runtime estimate on CPU: like torch's "operator-level-benchmark" (the op run on random real
    tensors of the fake inputs' shapes, 1 warm-up and `iters` timed runs), timed with time.perf_counter instead of
    CUDA events. Returns (the fake result, ms); 0 ms for a view op or an op that fails on random data."""
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._runtime_estimation import _VIEW_OPS

    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if func._overloadpacket in _VIEW_OPS:
        return out, 0.0

    def real(e):
        if isinstance(e, torch.Tensor) and fake_mode.is_our_fake(e):
            make = torch.rand_like if e.dtype.is_floating_point else torch.ones_like
            return make(e, device=e.fake_device)
        return e

    with no_dispatch():
        a, k = tree_map(real, (args, kwargs))
        try:
            func(*a, **k)
            t0 = time.perf_counter()
            for _ in range(iters):
                func(*a, **k)
            ms = (time.perf_counter() - t0) / iters * 1e3
        except Exception:  # noqa: BLE001 - an op that cannot run on random data counts as free, as torch's does
            ms = 0.0
    return out, ms


def _fake_block(block: torch.nn.Module, fake_mode) -> torch.nn.Module:
    fake = copy.deepcopy(block)
    for mod in fake.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[n] = torch.nn.Parameter(fake_mode.from_tensor(p.detach()),
                                                        requires_grad=p.requires_grad)
        for n, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[n] = fake_mode.from_tensor(b)
    return fake


class _RuntimeEstimate:
    """SACEstimator's runtime estimate per op: torch's own estimates in order (RuntimeEstimator's
    "operator-level-benchmark", then "operator-level-cost-model"), each dropped at its first error (the exact error
    kept), then the CPU stand-in `_cpu_op_milliseconds`. The errors are caught here, inside the estimator's dispatch:
    let out of it, they abort the process (a C++ terminate from ModTracker's pre-forward hook, whose
    grad-accumulator lookup dispatches a view_as)."""

    def __init__(self, fake_mode, estimates: tuple):
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator

        stock = {"operator-level-benchmark": RuntimeEstimator._benchmark_estimate,
                 "operator-level-cost-model": RuntimeEstimator._roofline_estimate}
        self.fake_mode = fake_mode
        self.stock = [(m, stock[m]) for m in estimates]
        self.errors: dict = {}
        self.used: set = set()

    def __call__(self, func, args, kwargs):
        while self.stock:
            name, estimate = self.stock[0]
            try:
                out = estimate(func, args, kwargs)
            except Exception as e:  # noqa: BLE001 - kept, and the next estimate tried
                self.errors[name] = f"{type(e).__name__}: {e}"
                self.stock.pop(0)
                continue
            self.used.add(name)
            return out
        self.used.add(CPU_ESTIMATE)
        return _cpu_op_milliseconds(self.fake_mode, func, args, kwargs)


def auto_sac_block_stats(model: torch.nn.Module, sample, *, estimates: tuple = STOCK_ESTIMATES) -> AutoSACStats:
    """Runs torch.distributed._tools.sac_estimator.SACEstimator over one forward of the model's first repeated
    block, under FakeTensorMode, with the arguments that block gets in a forward of `model` on `sample` (a key/value
    cache among them replaced by None: the estimate covers the block's own ops). The runtime of each op is torch's
    own estimate where it runs, each of `estimates` tried in order; both need CUDA (the benchmark times with CUDA
    events, the cost model reads the device's FLOP/s), so on CPU each raises at the first op, its exact error is kept
    in `stock_errors`, and the CPU stand-in (`_cpu_op_milliseconds`: the benchmark timed with perf_counter) is used
    (`_RuntimeEstimate`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator

    names = repeated_blocks(model)
    if not names:
        raise ValueError(f"{type(model).__name__} has no repeated blocks")
    block = model.get_submodule(names[0])
    args, kwargs = _first_block_call(model, sample, names[0])
    fake_mode = FakeTensorMode()
    leaves, spec = tree_flatten((args, kwargs), is_leaf=is_cache)

    def fake(x):
        if is_cache(x):
            return None
        if isinstance(x, torch.Tensor):
            return fake_mode.from_tensor(x.detach().requires_grad_(x.requires_grad))
        return x

    def non_leaf(x):
        # an input that requires grad made a non-leaf, as in the model: ModTracker's pre-forward hook dispatches a
        # view_as for a leaf's grad accumulator, which the estimator would count among the block's ops
        return x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x
    leaves = [fake(x) for x in leaves]
    with fake_mode:
        fargs, fkwargs = tree_unflatten([non_leaf(x) for x in leaves], spec)
    fblock = _fake_block(block, fake_mode)
    est = SACEstimator()
    estimate = _RuntimeEstimate(fake_mode, estimates)
    t0 = time.perf_counter()
    format_warning = warnings.formatwarning  # ModTracker replaces it, for good, where it warns
    try:
        with warnings.catch_warnings():
            # transformers' hub-kernel wrappers (a `Func` module around rotary embedding, inside another) are not
            # children of the block: ModTracker names both "Func" and warns of a nesting it cannot tell apart
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
            with fake_mode, est:
                est._estimate_runtime = estimate  # SACEstimator's hook for the runtime of each op (__call__ sets it)
                fblock(*fargs, **fkwargs)
    finally:
        warnings.formatwarning = format_warning
    key = type(block).__name__  # ModTracker names the root module by its class
    return AutoSACStats(names[0], key, est.sac_mod_stats[key], "+".join(sorted(estimate.used)), estimate.errors,
                        time.perf_counter() - t0)


def auto_sac_policy(stats: AutoSACStats, memory_fraction: float) -> AutoSACPolicy:
    """torch.distributed._tools.sac_ilp.get_optimal_checkpointing_policy_per_module on a block's statistics: the
    ILP (pulp's CBC) that saves the ops whose outputs, summed, stay within `memory_fraction` of the block's op
    outputs' bytes and recomputes the rest, the estimated recompute time least (views always recomputed, in-place ops
    decided with their parent, random ops all alike)."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    s = stats.stats
    t0 = time.perf_counter()
    decisions = get_optimal_checkpointing_policy_per_module(s, memory_fraction)
    if len(decisions) != len(s.func_names):
        raise RuntimeError(f"the SAC ILP found no solution at memory fraction {memory_fraction}")
    save = [bool(d) for d in decisions]
    return AutoSACPolicy(memory_fraction, list(s.func_names), save,
                         sum(m for m, k in zip(s.memory, save) if k), sum(s.memory), time.perf_counter() - t0,
                         stats.estimate, dict(stats.stock_errors))


class _AlignedPolicy:
    """One block call's SAC policy from the ILP's decisions: the forward's ops taken in order and matched to the
    estimator's op list by name; an op the list does not hold at that point (a cache update the estimate left out)
    is recomputed and matches nothing. The policy runs in the forward alone (torch replays its choices by index)."""

    def __init__(self, policy: AutoSACPolicy):
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

        self.policy, self.skip, self.at, self.extra = policy, OPS_TO_ALWAYS_SKIP, 0, []

    def __call__(self, ctx, op, *args, **kwargs):
        if op in self.skip:
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = op._overloadpacket.__name__
        p = self.policy
        if self.at < len(p.names) and p.names[self.at] == name:
            self.at += 1
            return CheckpointPolicy.MUST_SAVE if p.save[self.at - 1] else CheckpointPolicy.PREFER_RECOMPUTE
        self.extra.append(name)
        return CheckpointPolicy.PREFER_RECOMPUTE


class _AutoSACContexts:
    """context_fn for torch.utils.checkpoint: a fresh `_AlignedPolicy` per block call, the last one kept so that the
    block's forward hook can check that every op of the estimate was matched."""

    def __init__(self, policy: AutoSACPolicy):
        self.policy, self.last = policy, None

    def __call__(self):
        self.last = _AlignedPolicy(self.policy)
        return create_selective_checkpoint_contexts(self.last)

    def check(self, module, args, output):
        last = self.last
        if last is not None and last.at != len(self.policy.names):
            raise RuntimeError(
                f"auto SAC: the block's forward ops did not match the estimate's ({last.at} of "
                f"{len(self.policy.names)} matched; next expected {self.policy.names[last.at]!r}; unmatched "
                f"{last.extra[:8]})")


def auto_sac_checkpointed(model: torch.nn.Module, sample, memory_fraction: float, *,
                          stats: AutoSACStats | None = None) -> torch.nn.Module | None:
    """A copy of `model` with PyTorch's automatic selective activation checkpointing on each repeated block, at
    `memory_fraction` (0 to 1) of a block's activation memory; None when the model has no repeated blocks. The copy's
    `auto_sac` attribute is the policy (`AutoSACPolicy.describe()` for the record).

    How the policy is derived: `auto_sac_block_stats` runs torch.distributed._tools.sac_estimator.SACEstimator over
    one forward of the first repeated block under FakeTensorMode, with the arguments it gets from `sample`: per op
    (in forward order) its output bytes, a runtime estimate (torch's own where it runs; on CPU a perf_counter
    benchmark of the op on random tensors of its shapes), which ops are views, in-place or random. Then
    torch.distributed._tools.sac_ilp.get_optimal_checkpointing_policy_per_module solves the ILP: save a set of ops
    whose output bytes sum to at most `memory_fraction` of all the block's op outputs (the last op's counted free),
    the estimated runtime of those recomputed least. Every block gets that policy (they share a structure), run by
    torch.utils.checkpoint's create_selective_checkpoint_contexts, non-reentrant, as `per_block_checkpointed(model,
    selective=True)` runs its fixed one; a forward op the estimate does not hold (a key/value cache's update, left
    out of the estimate) is recomputed. Pass `stats` to reuse one estimate for several fractions."""
    if not repeated_blocks(model):
        return None
    stats = stats or auto_sac_block_stats(model, sample)
    policy = auto_sac_policy(stats, memory_fraction)
    contexts = _AutoSACContexts(policy)
    wrapped = wrapped_blocks(model, lambda k: {"use_reentrant": False, "context_fn": contexts}, hook=contexts.check)
    wrapped.auto_sac = policy
    return wrapped


