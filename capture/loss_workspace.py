"""The memory of a loss computed outside the model, for a plan that counts it at the forward/backward boundary."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from capture.fx_nodes import strided_bytes
from capture.measure_memory import StorageTracker
from capture.state import restored


@dataclass(frozen=True)
class LossMemory:
    """What a loss computed outside the model holds beyond the outputs' gradient. workspace_bytes: its peak over a
    forward+backward of the loss; held_bytes: what the loss tensor itself keeps alive to the end of the step (on CPU
    mse_loss's 0-d result is a view of the unreduced loss, which lives as long as the caller's `loss`)."""

    workspace_bytes: int = 0
    held_bytes: int = 0


def loss_memory(model: torch.nn.Module, inputs: tuple, loss_fn, call=None) -> LossMemory:
    """`loss_fn`'s memory (LossMemory), measured on a copy of the model's output (the model runs once without
    gradients; buffers and RNG are restored)."""
    with restored(model), torch.no_grad():
        out = model(*inputs) if call is None else call.call(model, inputs)
    leaves = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                      if isinstance(t, torch.Tensor) else t, out)
    tracker = StorageTracker()
    with tracker:
        loss = loss_fn(leaves)
        loss.backward()
        # beyond the scalar itself (the plan reserves that): a buffer the 0-d loss is a view of
        held = max(0, tracker.tracked_bytes([loss]) - loss.numel() * loss.element_size())
    grads = sum(strided_bytes(t.grad) for t in tree_leaves(leaves)
                if isinstance(t, torch.Tensor) and t.grad is not None)
    workspace = max(0, int(tracker.peak_bytes) - grads)
    return LossMemory(workspace, min(held, workspace))


def default_loss(out) -> torch.Tensor:
    """The model's own loss where it computed one (a scalar output, or an output with a `loss`, as transformers
    models given labels return); else the sum of every floating-point tensor in the output (any nesting)."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    own = getattr(out, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if hasattr(out, "values") and not leaves:  # dict-like objects pytree does not know
        leaves = [t for t in out.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the output has no floating-point tensor to sum into a loss")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total
