"""Checkpointing by blocks as people write it by hand, run by torch: the baselines the planner is measured against
(the curve's and the fit's points of comparison, and the benchmarks').

- `per_block_checkpointed(model)`: a copy of the model with torch.utils.checkpoint around each repeated block
  (`capture.module_tags.repeated_blocks`), or selective checkpointing (matmul and attention outputs saved);
- `layer_checkpointed(model, every)`: torchtitan's layer checkpointing, every `every`-th block checkpointed whole;
- `wrapped_blocks(model, options_of)`: the copy they all make, block k checkpointed with `options_of(k)`
  (planner.tools.auto_sac builds PyTorch's automatic selective checkpointing on it);
- `largest_checkpointed_size`: the largest size per-block checkpointing fits in a memory.
"""
from __future__ import annotations

import copy
import types
from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from capture.kv_cache import recompute_without_cache_updates
from capture.module_tags import repeated_blocks
from planner.core.candidates import SAVED_BY_SELECTIVE
from planner.tools.measure import measure_peak_bytes


def per_block_checkpointed(model: torch.nn.Module, *, selective: bool = False) -> torch.nn.Module | None:
    """A copy of `model` whose repeated blocks (`repeated_blocks`) each run under torch.utils.checkpoint
    (non-reentrant, RNG state preserved): the usual hand-written baseline; None when the model has none. With
    `selective`, selective activation checkpointing instead (torch.utils.checkpoint's
    create_selective_checkpoint_contexts): the outputs of the ops in SAVED_BY_SELECTIVE are saved, the rest of each
    block is recomputed. A key/value cache among a block's arguments is updated by its forward alone
    (capture.kv_cache.recompute_without_cache_updates)."""
    options: dict = {"use_reentrant": False}
    if selective:
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    return wrapped_blocks(model, lambda k: options)


def layer_checkpointed(model: torch.nn.Module, every: int) -> torch.nn.Module | None:
    """A copy of `model` with torchtitan's layer checkpointing ("selective" by layer, `ac_freq`): the repeated blocks
    0, `every`, 2 * `every`, ... run under torch.utils.checkpoint as `per_block_checkpointed` runs each block
    (non-reentrant, RNG state preserved, a key/value cache updated by the forward alone); the others run eager.
    `every=1` is per-block checkpointing. None when the model has no repeated blocks."""
    if every < 1:
        raise ValueError(f"every must be at least 1, not {every}")
    return wrapped_blocks(model, lambda k: {"use_reentrant": False} if k % every == 0 else None)


def wrapped_blocks(model: torch.nn.Module, options_of: Callable[[int], dict | None],
             hook: Callable | None = None) -> torch.nn.Module | None:
    """A deep copy of `model` whose k-th repeated block runs under torch.utils.checkpoint with `options_of(k)` (left
    eager where that is None); `hook`, where given, is registered as a forward hook on each checkpointed block."""
    names = repeated_blocks(model)
    if not names:
        return None
    wrapped = copy.deepcopy(model)
    for k, blk in enumerate(wrapped.get_submodule(name) for name in names):
        options = options_of(k)
        if options is None:
            continue
        plain = blk.forward
        blk.forward = types.MethodType(
            lambda self, *a, _f=plain, _o=options, **kw: _checkpointed(_f, _o, a, kw), blk)
        if hook is not None:
            blk.register_forward_hook(hook)
    return wrapped


def _checkpointed(forward, options: dict, args: tuple, kwargs: dict):
    forward, args, kwargs = recompute_without_cache_updates(forward, args, kwargs)
    return checkpoint(forward, *args, **options, **kwargs)


def _selective_policy(ctx, op, *args, **kwargs):
    packet = getattr(op, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def largest_checkpointed_size(make, budget_bytes: int, *, start: int = 1, limit: int = 256) -> int | None:
    """The largest size n (from `start`, at most `limit`) whose step `make(n)` under per-block checkpointing fits
    `budget_bytes`, measured (storage-tracking mode on CPU); None when not even `start` fits or the model has no
    repeated blocks. The baseline `max_batch` is compared with."""
    best = None
    for n in range(start, limit + 1):
        model, sample = make(n)
        wrapped = per_block_checkpointed(model)
        if wrapped is None or measure_peak_bytes(wrapped, sample) > budget_bytes:
            return best
        best = n
    return best
