"""Peak memory and step time of one training step: what `curve` and the per-block baseline measure, and what the
demo and the benchmarks report.

A step is `out = module(*inputs); loss = loss_fn(out); loss.backward()`, starting with no gradients. `inputs` is a
sample input in any form `plan()` takes (a tensor, a tuple, a dict of keyword arguments, or (args, kwargs)).

Peak memory (bytes) counts what the step holds at once: parameters, buffers, inputs, activations,
gradients. On CPU it comes from a storage-tracking dispatch mode (`capture.measure_memory`): the bytes
of the parameters, buffers and inputs plus the peak of live storages created during the step
(exact for tensors; kernel scratch space is invisible). On CUDA it is torch.cuda.max_memory_allocated
during the step, less whatever else was allocated on the device beforehand that is not the model or
the inputs.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from capture.call import CallSpec
from capture.loss_workspace import default_loss  # noqa: F401 (re-exported: the loss a step computes by default)
from capture.measure_memory import StorageTracker, allocation_peak_bytes, profiler_allocations, storage_bytes


def _call(module: torch.nn.Module, inputs):
    spec, tensors = CallSpec.of(inputs)
    return spec.call(module, tensors)


def _tensors(inputs) -> tuple:
    return CallSpec.of(inputs)[1]


def _device(module: torch.nn.Module, inputs) -> torch.device | None:
    """The device of the step: its first parameter's, else its first input tensor's."""
    return next((t.device for t in (*module.parameters(), *_tensors(inputs)) if isinstance(t, torch.Tensor)), None)


def _zero_grad(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def run_step(module: torch.nn.Module, inputs, loss_fn: Callable | None = None) -> torch.Tensor:
    """One training step without the optimizer; returns the loss (detached).

    The output stays referenced until the backward is done, as in a usual training loop
    (`out = model(x); loss = crit(out, y); loss.backward()`).
    """
    out = _call(module, inputs)
    loss = (loss_fn or default_loss)(out)
    loss.backward()
    del out
    return loss.detach()


def resident_bytes(module: torch.nn.Module, inputs) -> int:
    """Distinct storage bytes of the module's parameters and buffers and of the inputs."""
    return storage_bytes([*module.parameters(), *module.buffers(), *_tensors(inputs)])


def first_step_seconds(module: torch.nn.Module, inputs, loss_fn: Callable | None = None) -> float:
    """Seconds of one step (`run_step`), its gradients then cleared: a compiled module's first, compilation
    included."""
    t0 = time.perf_counter()
    run_step(module, inputs, loss_fn)
    for p in module.parameters():
        p.grad = None
    return time.perf_counter() - t0


def measure_peak_bytes(module: torch.nn.Module, inputs, loss_fn: Callable | None = None) -> int:
    """Peak bytes held during one step (see the module docstring). Gradients are reset to None first."""
    _zero_grad(module)
    base = resident_bytes(module, inputs)
    device = _device(module, inputs)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(module, inputs, loss_fn)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - (before - base)
    else:
        tracker = StorageTracker()
        with tracker:
            run_step(module, inputs, loss_fn)
        peak = base + tracker.peak_bytes
    _zero_grad(module)
    return int(peak)


def allocator_peak_bytes(module: torch.nn.Module, inputs, loss_fn: Callable | None = None) -> int:
    """Peak bytes held during one step as the allocator saw them: the bytes of the parameters, buffers and inputs
    plus the peak of what the step allocated and had not yet freed (torch.profiler's memory events, paired by
    address; a free of memory allocated before the step is ignored). Unlike the dispatch mode of
    `measure_peak_bytes` it sees every allocation, those of compiled (inductor) kernels and their scratch space
    included. On CUDA it is `measure_peak_bytes`."""
    device = _device(module, inputs)
    if device is not None and device.type == "cuda":
        return measure_peak_bytes(module, inputs, loss_fn)
    from torch.profiler import ProfilerActivity, profile

    _zero_grad(module)
    base = resident_bytes(module, inputs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(module, inputs, loss_fn)
    peak = allocation_peak_bytes(profiler_allocations(prof))
    _zero_grad(module)
    return int(base + peak)


@dataclass
class StepTime:
    median_s: float
    samples_s: list[float]


def interleaved_step_seconds(modules: dict, inputs, loss_fn: Callable | None = None, *, repeats: int = 7,
                             warmup: int = 2) -> dict[str, StepTime]:
    """Median step time of several modules measured in turns (round robin), so that machine noise
    affects them alike. `modules` maps a label to a module. The order of the turns is shuffled each round (with a
    fixed seed), so that no module always runs right after the same other one: what ran just before moves a step's
    time (two compiled copies of one plan, always run in the same turns, measured 8.1 and 8.4 ms)."""
    samples: dict[str, list[float]] = {k: [] for k in modules}
    cuda = any(t.is_cuda for t in _tensors(inputs))
    order = random.Random(0)
    labels = list(modules)
    for k in range(warmup + repeats):
        order.shuffle(labels)
        for label in labels:
            m = modules[label]
            _zero_grad(m)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_step(m, inputs, loss_fn)
            if cuda:
                torch.cuda.synchronize()
            if k >= warmup:
                samples[label].append(time.perf_counter() - t0)
            _zero_grad(m)
    return {k: StepTime(statistics.median(v), v) for k, v in samples.items()}
