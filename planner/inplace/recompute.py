"""A block's forward as torch.utils.checkpoint runs it twice, with the user's state consumed and updated once:
`recomputable` gives the recomputation the Python/numpy generator states and buffer values the forward began with,
and puts the step's back after; `BufferUpdates` learns which buffers a block's forward updates."""
from __future__ import annotations

from typing import Any, Callable

import torch

from capture.measure_memory import has_buffers
from capture.state import drew_from_host, host_rng_mark, host_rng_state, set_host_rng_state


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no counter (and no in-place update outside inference mode)
        return None


class BufferUpdates:
    """The buffers (their names in the block) a block's forward was seen to update; None before any call was watched.
    One per profile, shared by its runners: the profile's kept measurement teaches it before any recomputing option
    runs, each checkpointed forward adds to it."""

    def __init__(self):
        self.names: set[str] | None = None

    def run(self, block: torch.nn.Module, values: dict, fn: Callable, *args, **kwargs) -> tuple[Any, set[str]]:
        """`fn(*args, **kwargs)` watched: (its output, the names of the block's buffers it updated: replaced, moved
        their version counter, or, of those `values` holds copies of from before, changed value; batch_norm updates
        the running statistics without moving their counters)."""
        if not has_buffers(block):  # (most blocks: their walks by name cost more than the rest of this)
            out = fn(*args, **kwargs)
            updated = {n for n, _ in block.named_buffers()} if has_buffers(block) else set()  # registered by it
        else:
            before = {n: (b, _version(b)) for n, b in block.named_buffers()}
            out = fn(*args, **kwargs)
            updated = {n for n, b in block.named_buffers()
                       if n not in before or before[n][0] is not b or before[n][1] != _version(b)
                       or (n in values and not torch.equal(b, values[n]))}
        self.names = updated if self.names is None else self.names | updated
        return out, updated


def recomputable(forward: Callable, block: torch.nn.Module, updates: BufferUpdates | None = None) -> Callable:
    """`forward` (the block's) as torch.utils.checkpoint is to run it, made for one checkpoint call: the user's state
    is consumed and updated once, as eager does. Its first call (the forward) records Python's and numpy's generators,
    kept where the forward drew from them (capture.state.drew_from_host), and copies the block's buffers that `updates`
    says the forward updates (all of them while it knows none), keeping the copies of those the forward did update.
    Each later call (a recomputation) runs from the generators' recorded states with fresh copies of those buffers in
    their place, then puts back the step's buffers and the generators as they were before it. torch's generators are
    checkpoint's (preserve_rng_state)."""
    # this call's: [(Python's and numpy's states where the forward drew, else None; {buffer name: its value before})]
    saved: list = []

    def run(*args, **kwargs):
        if not saved:  # the forward
            names = updates.names if updates is not None else None
            before = {n: b.detach().clone() for n, b in block.named_buffers() if names is None or n in names} \
                if names is None or names else {}
            mark = host_rng_mark()
            # values compared (a device sync each) only while no update is known: then the copies not updated go
            out, updated = (updates or BufferUpdates()).run(block, before if names is None else {}, forward, *args,
                                                             **kwargs)
            # a forward that drew nothing from them leaves the generators alone in its recomputation, which runs as
            # the forward did (checkpoint's contract)
            host = mark[0] if drew_from_host(mark) else None
            saved.append((host, before if names is not None else {n: v for n, v in before.items() if n in updated}))
            return out
        host, before = saved[0]
        if host is None and not before:
            return forward(*args, **kwargs)
        now = host_rng_state() if host is not None else None
        swapped = []
        if host is not None:
            set_host_rng_state(host)
        try:
            for name, value in before.items():
                path, _, local = name.rpartition(".")
                owner = block.get_submodule(path)
                if local in owner._buffers:
                    swapped.append((owner, local, owner._buffers[local]))
                    owner._buffers[local] = value.clone()  # the recomputation updates a copy, not the step's
            return forward(*args, **kwargs)
        finally:
            for owner, local, value in reversed(swapped):
                owner._buffers[local] = value
            if now is not None:
                set_host_rng_state(now)
    return run
