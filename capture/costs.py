"""Per-node compute costs of a traced aten graph: FLOPs, measured time, or a device roofline.

All three work on one fx node at a time, given the real tensors it read and wrote (the tracer runs
the joint graph once on real tensors and hands them over):

- `node_flops`: FLOPs from torch's FLOP registry (matmul, convolution, attention; every other op
  counts 0). The CPU flash-attention op and its backward are not in torch's registry; the registry's
  SDPA formulas are applied to them here (`EXTRA_FLOP_FORMULAS`, usable as FlopCounterMode's
  `custom_mapping` so that eager counts agree).
- `time_nodes`: seconds per node, measured by an fx Interpreter (warm-up runs, then the median of
  repeats; CUDA events on a GPU).
- `roofline_seconds`: max(FLOPs / peak FLOP/s, bytes moved / bandwidth) for a named device in
  `DEVICES`, so a CPU machine can plan for a GPU it does not have.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _shape(x):
    # FlopCounterMode hands custom formulas shapes; the tracer hands them tensors.
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def _cpu_flash_fwd_flops(query, key, value, *args, out_val=None, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_flash_bwd_flops(grad_out, query, key, value, *args, out_val=None, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd_flops),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd_flops),
):
    if hasattr(aten, _name):
        EXTRA_FLOP_FORMULAS[getattr(aten, _name)] = _fn


def flop_formula(target):
    """torch's FLOP formula for an operator (EXTRA_FLOP_FORMULAS first), None where it has none."""
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return None
    return EXTRA_FLOP_FORMULAS.get(packet) or flop_registry.get(packet)


def node_flops(node: torch.fx.Node, args: Sequence[Any], kwargs: dict, out: Any) -> int:
    """FLOPs of one call_function node from the registry formulas (0 for unregistered ops)."""
    formula = flop_formula(node.target)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def has_flop_formula(node: torch.fx.Node) -> bool:
    """True for the ops the FLOP registry prices (matmul, convolution, attention)."""
    return node.op == "call_function" and flop_formula(node.target) is not None


def bytes_moved(args: Sequence[Any], kwargs: dict, out: Any, aliasing: bool) -> int:
    """Bytes a kernel reads and writes: its tensor inputs plus its outputs (0 for a view/alias)."""
    if aliasing:
        return 0
    total = 0
    for t in tree_leaves((list(args), kwargs, out)):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class Device:
    """Nominal dense peak throughput (FLOP/s) and memory bandwidth (bytes/s) of a device."""

    name: str
    peak_flops: float
    bandwidth_bytes_per_s: float


# Nominal vendor figures: dense BF16 tensor-core peak and HBM bandwidth (SXM parts), and a rough
# figure for a few-core CPU. Roofline costs are estimates; measure (cost_model="time") when you can.
DEVICES: dict[str, Device] = {
    "h100": Device("h100", 989e12, 3.35e12),
    "h200": Device("h200", 989e12, 4.8e12),
    "a100": Device("a100", 312e12, 2.039e12),
    "cpu": Device("cpu", 1e11, 20e9),
}


def get_device(device_name: str | Device) -> Device:
    if isinstance(device_name, Device):
        return device_name
    key = str(device_name).lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device '{device_name}' for the roofline cost model; known: {', '.join(DEVICES)}")
    return DEVICES[key]


def roofline_seconds(flops: int, moved_bytes: int, device: Device) -> float:
    """max(flops / peak, bytes / bandwidth), in seconds."""
    return max(flops / device.peak_flops, moved_bytes / device.bandwidth_bytes_per_s)


class _TimingInterpreter(torch.fx.Interpreter):
    """Runs the graph and records each call_function node's duration (seconds) in `times`."""

    def __init__(self, gm: torch.fx.GraphModule, use_cuda: bool):
        super().__init__(gm, garbage_collect_values=True)
        self.use_cuda = use_cuda
        self.times: dict[str, float] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        if self.use_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = super().run_node(n)
            end.record()
            torch.cuda.synchronize()
            self.times[n.name] = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            out = super().run_node(n)
            self.times[n.name] = time.perf_counter() - t0
        return out


def time_nodes(
    gm: torch.fx.GraphModule, flat_args: Sequence[Any], *, warmup: int = 1, repeats: int = 3
) -> dict[str, float]:
    """Median seconds per call_function node over `repeats` runs, after `warmup` untimed runs.

    The graph runs with values freed at their last use (as fx code does), on the device of its
    inputs; on a GPU each node is timed with CUDA events between synchronisations.
    """
    use_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in flat_args)
    samples: dict[str, list[float]] = {}
    for k in range(warmup + repeats):
        interp = _TimingInterpreter(gm, use_cuda)
        with torch.no_grad():
            interp.run(*flat_args, enable_io_processing=False)
        if k >= warmup:
            for name, t in interp.times.items():
                samples.setdefault(name, []).append(t)
    return {name: float(statistics.median(ts)) for name, ts in samples.items()}
