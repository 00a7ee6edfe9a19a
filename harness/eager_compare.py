"""Comparing a step with eager's, for the benchmarks and the tests: gradients, buffers and loss after one step."""
from __future__ import annotations

from typing import Callable

import torch

from planner.tools.measure import run_step


def _zero_grad(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def step_state(module: torch.nn.Module, inputs, loss_fn: Callable | None = None, seed: int = 0):
    """Gradients and buffers after one step under `torch.manual_seed(seed)`: ({name: grad}, {name: buffer}, loss).

    `module` may be a PlannedModule (its names then start with `module.`; they are stripped)."""
    _zero_grad(module)
    torch.manual_seed(seed)
    loss = run_step(module, inputs, loss_fn)

    def strip(name: str) -> str:
        return name[len("module."):] if name.startswith("module.") and hasattr(module, "plan") else name

    grads = {strip(n): (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}
    bufs = {strip(n): b.detach().clone() for n, b in module.named_buffers()}
    _zero_grad(module)
    return grads, bufs, loss


def relative_difference(got: dict, want: dict) -> float:
    """|got - want| / |want| over every gradient of `want` that is not None (float64; {name: tensor} dicts as
    `step_state` returns them)."""
    num = den = 0.0
    for k, g in want.items():
        if g is None:
            continue
        num += float((got[k].double() - g.double()).norm() ** 2)
        den += float(g.double().norm() ** 2)
    return (num / den) ** 0.5 if den else 0.0
