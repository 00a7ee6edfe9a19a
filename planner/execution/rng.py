"""The generator state of a device: what a recomputed random op starts from (eager and compiled paths alike)."""
from __future__ import annotations

import torch


def get_rng_state(device: str) -> torch.Tensor:
    """The generator state of `device` (what a random op's recomputation must start from)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_rng_state(dev)
    return torch.get_rng_state()


def set_rng_state(device: str, state: torch.Tensor) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)
