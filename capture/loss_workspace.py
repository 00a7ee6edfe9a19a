"""The memory of a loss computed outside the model, for a plan that counts it at the forward/backward boundary."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

from capture.fx_nodes import strided_bytes
from capture.measure_memory import StorageTracker
from capture.state import restored


def loss_workspace_bytes(model: torch.nn.Module, inputs: tuple, loss_fn, call=None) -> int:
    """Bytes `loss_fn` holds beyond the output's gradient: its peak over a forward+backward of the loss on a
    copy of the model's output (the model runs once without gradients; buffers and RNG are restored)."""
    with restored(model), torch.no_grad():
        out = model(*inputs) if call is None else call.call(model, inputs)
    leaves = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                      if isinstance(t, torch.Tensor) else t, out)
    tracker = StorageTracker()
    with tracker:
        loss = loss_fn(leaves)
        loss.backward()
    grads = sum(strided_bytes(t.grad) for t in tree_leaves(leaves)
                if isinstance(t, torch.Tensor) and t.grad is not None)
    return max(0, int(tracker.peak_bytes) - grads)
