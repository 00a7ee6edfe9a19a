"""The process state a step reads besides its tensors, each read one way: the autocast state, and the random
generators and buffers that a measurement or a trace must leave as it found them."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, str], ...]:
    """(device type, dtype name) of each device type whose autocast is on now, () when none is: what a traced graph's
    casts depend on (a disabled device's dtype setting changes nothing and is left out)."""
    return tuple((d, str(torch.get_autocast_dtype(d)).replace("torch.", "")) for d in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def describe_autocast(state) -> str:
    return " and ".join(f"autocast({d}, {t})" for d, t in state) if state else "no autocast"


@contextlib.contextmanager
def autocast_as(state) -> Iterator[None]:
    """Run under the autocast `state` (as `autocast_state()` returns it), on another thread say."""
    with contextlib.ExitStack() as stack:
        for d, dtype in state:
            stack.enter_context(torch.autocast(d, dtype=getattr(torch, dtype)))
        yield


def cuda_devices_in_use() -> list[int]:
    """The CUDA device whose generator a forward may draw from ([] without CUDA, or before CUDA is initialised)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


@contextlib.contextmanager
def restored_rng(devices=()) -> Iterator[None]:
    """The CPU generator and the CUDA ones in use (and of `devices`, CUDA indices) restored on exit, whatever ran
    (torch.random.fork_rng)."""
    with torch.random.fork_rng(devices=sorted(set(cuda_devices_in_use()) | set(devices))):
        yield


@contextlib.contextmanager
def restored(module: torch.nn.Module, devices=()) -> Iterator[None]:
    """Run work that must leave no trace: the generators (CPU and CUDA) and the module's buffers (BatchNorm's running
    statistics, a step counter) restored on exit."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    with restored_rng(devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    b.copy_(saved[n])
