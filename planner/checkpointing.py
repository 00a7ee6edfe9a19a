"""Per-block checkpointing, the hand-written baseline the planner is compared with: torch.utils.checkpoint around
each repeated block of a model, and the largest size it fits in a memory."""
from __future__ import annotations

import copy
import types

import torch


def per_block_checkpointed(model: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of `model` whose repeated blocks each run under torch.utils.checkpoint (non-reentrant, RNG state
    preserved): the usual hand-written baseline. The blocks are the children of the outermost `nn.ModuleList` or
    `nn.Sequential` holding two or more modules of one class with parameters (transformer layers, ResNet stages);
    None when the model has none."""
    from torch.utils.checkpoint import checkpoint

    wrapped = copy.deepcopy(model)
    found = []
    for name, m in wrapped.named_modules():
        kids = list(m.children()) if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) else []
        if len(kids) > 1 and len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
            found.append((name.count(".") if name else -1, -len(kids), kids))
    if not found:
        return None
    for blk in min(found, key=lambda f: f[:2])[2]:
        plain = blk.forward
        blk.forward = types.MethodType(
            lambda self, *a, _f=plain, **kw: checkpoint(_f, *a, use_reentrant=False, **kw), blk)
    return wrapped


def largest_checkpointed_size(make, budget_bytes: int, *, start: int = 1, limit: int = 256) -> int | None:
    """The largest size n (from `start`, at most `limit`) whose step `make(n)` under per-block checkpointing fits
    `budget_bytes`, measured (storage-tracking mode on CPU); None when not even `start` fits or the model has no
    repeated blocks. The baseline `max_batch` is compared with."""
    from planner.measure import measure_peak_bytes

    best = None
    for n in range(start, limit + 1):
        model, sample = make(n)
        wrapped = per_block_checkpointed(model)
        if wrapped is None or measure_peak_bytes(wrapped, sample) > budget_bytes:
            return best
        best = n
    return best
