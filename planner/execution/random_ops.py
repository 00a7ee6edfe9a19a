"""Random ops as opaque custom ops, so that a compiled planned step draws exactly what eager draws.

Inductor replaces random ops by its own seeded generator, drawing fresh seeds in each compiled graph: a dropout
recomputed in the compiled backward would draw another mask than its first computation in the compiled forward. The
compiled path (`execution.inductor`) therefore emits every random fx node of a planned step as one of two custom ops
that inductor calls as they are (it cannot look inside, so it neither reorders their draws nor fuses them):

- `remat::draw(tensors, after, key)`: the generator state of the op's device, then the op run on the eager
  generator; returns [*outputs, state]. `after` holds the previous draw's state, so that the draws happen in eager's
  order whatever inductor's scheduler does.
- `remat::redraw(tensors, state, key)`: the op run again from `state` (the global generator is restored after), so
  a recomputation reproduces its first draw bit for bit.

`key` names an entry of a process-wide registry (`register`): the op and its non-tensor arguments, and the
metadata of its outputs for tracing. Keys are content hashes, the same in every process for the same op call, so a
cached compiled graph calls entries that exist.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from capture.call import FlatCall
from planner.execution.rng import get_rng_state, set_rng_state


@dataclass(frozen=True)
class RandomCall:
    """One random fx node: its op, its arguments with tensors taken out, the metadata of its outputs."""

    target: Any
    call: FlatCall  # its arguments, each tensor argument (an fx node when registered) a slot
    outputs: tuple  # (shape, stride, dtype, device) per output tensor
    single: bool  # the op returns one tensor (not a tuple)
    device: str

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        args, kwargs = self.call.rebuild(tensors)
        out = self.target(*args, **kwargs)
        return [out] if self.single else list(out)

    def fake_outputs(self) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.outputs]


_REGISTRY: dict[str, RandomCall] = {}


def register(node: torch.fx.Node) -> tuple[str, list[torch.fx.Node]]:
    """Register the random fx node `node`; returns its key and its tensor arguments (fx nodes, in order)."""
    flat, tensors = FlatCall.of(node.args, node.kwargs, leaf_type=torch.fx.Node)
    val = node.meta["val"]
    single = isinstance(val, torch.Tensor)
    outs = [val] if single else list(val)
    if not all(isinstance(t, torch.Tensor) for t in outs):
        raise TypeError(f"random op '{node.name}' returns something other than tensors")
    outputs = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in outs)
    device = outputs[0][3]
    call = RandomCall(node.target, flat, outputs, single, device)
    key = hashlib.sha1(repr((str(node.target), str(flat.spec), flat.constants, outputs)).encode()).hexdigest()[:20]
    _REGISTRY[key] = call
    return key, tensors


_STATE_NUMEL: dict[str, int] = {}


def num_outputs(key: str) -> int:
    return len(_REGISTRY[key].outputs)


def device_of(key: str) -> str:
    return _REGISTRY[key].device


def returns_one_tensor(key: str) -> bool:
    return _REGISTRY[key].single


def state_like(device: str) -> torch.Tensor:
    """An uninitialised tensor shaped like the generator state of `device` (a fake one under a fake mode)."""
    if device not in _STATE_NUMEL:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            _STATE_NUMEL[device] = get_rng_state(device).numel()
    return torch.empty(_STATE_NUMEL[device], dtype=torch.uint8, device="cpu")


@torch.library.custom_op("remat::draw", mutates_args=())
def draw(tensors: list[torch.Tensor], after: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    call = _REGISTRY[key]
    state = get_rng_state(call.device)
    return [*call.run(tensors), state]


@draw.register_fake
def _draw_fake(tensors, after, key):
    call = _REGISTRY[key]
    return [*call.fake_outputs(), state_like(call.device)]


@torch.library.custom_op("remat::redraw", mutates_args=())
def redraw(tensors: list[torch.Tensor], state: torch.Tensor, key: str) -> list[torch.Tensor]:
    call = _REGISTRY[key]
    current = get_rng_state(call.device)
    set_rng_state(call.device, state)
    try:
        return call.run(tensors)
    finally:
        set_rng_state(call.device, current)


@redraw.register_fake
def _redraw_fake(tensors, state, key):
    return _REGISTRY[key].fake_outputs()

