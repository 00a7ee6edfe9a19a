"""BatchNorm with `momentum=None`: the cumulative average's factor computed at run time, not baked into the trace.

`nn.BatchNorm*` with `momentum=None` (and running statistics tracked) increments `num_batches_tracked` in its forward
and passes `1.0 / float(num_batches_tracked)` as the momentum of the running statistics' update: a value read from a
buffer the forward itself updates, another at every step. A traced step would keep the value of the step it was
traced on (the running statistics then drift from eager's from the second step on).

While a model is captured (`counted_momenta(model)`), each such layer's momentum is a NaN whose payload numbers the
layer (no model passes a NaN momentum, and a NaN survives the capture bit for bit as the float argument of the
batch-norm op). The forward then reads no value, and `rewrite(gm, ...)` replaces every batch-norm node carrying one
by `remat::batch_norm_counted`, which takes the counter the graph has just incremented as a tensor input and
computes the momentum from it at run time as the layer's forward does (the same double), then makes the same kernel
call: the running statistics equal eager's bit for bit at every step. A layer called twice in one forward reads its
counter after each increment, in order, as eager does. A node the rewrite cannot match raises TraceError: a NaN
momentum never reaches a kernel.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from graphs.errors import TraceError

_PAYLOAD_BASE = 0xFFF8_5E17_0000_0000  # a negative quiet NaN; the low 32 bits number the layer
_BN_TRAIN = torch.ops.aten._native_batch_norm_legit_functional.default
_ADD = torch.ops.aten.add.Tensor


def _sentinel(k: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", _PAYLOAD_BASE + k))[0]


def _layer_of(value) -> int | None:
    """The layer number a sentinel momentum carries, or None for any other value."""
    if not isinstance(value, float) or not math.isnan(value):
        return None
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits - _PAYLOAD_BASE if bits >> 32 == _PAYLOAD_BASE >> 32 else None


def _counted(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.momentum is None
            and module.training and module.track_running_stats and module.num_batches_tracked is not None)


@contextmanager
def counted_momenta(model: torch.nn.Module) -> Iterator[dict[int, str]]:
    """Within: each BatchNorm layer of `model` whose forward would compute its momentum from its step counter has a
    sentinel momentum instead. Yields layer number -> the qualified name of its counter buffer. Restored after."""
    layers = [(name, m) for name, m in model.named_modules() if _counted(m)]
    counters = {k: f"{name}.num_batches_tracked" if name else "num_batches_tracked"
                for k, (name, _) in enumerate(layers)}
    for k, (_, m) in enumerate(layers):
        m.momentum = _sentinel(k)
    try:
        yield counters
    finally:
        for _, m in layers:
            m.momentum = None


def rewrite(gm: torch.fx.GraphModule, counters: dict[int, str], buffer_placeholders: dict[str, torch.fx.Node]
            ) -> int:
    """Replace each batch-norm node of `gm` whose momentum is a sentinel by `remat::batch_norm_counted` reading the
    layer's counter after the increment that precedes it. `buffer_placeholders`: buffer name -> its placeholder.
    Returns the number of nodes rewritten; TraceError where a sentinel cannot be matched to its counter."""
    if not counters:
        return 0
    calls: dict[int, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        marked = [a for a in (*n.args, *n.kwargs.values()) if _layer_of(a) is not None]
        if not marked:
            continue
        if n.target is not _BN_TRAIN or len(marked) != 1 or _layer_of(n.args[6]) is None:
            raise TraceError(f"BatchNorm with momentum=None was captured as {n.target}, which the planner cannot "
                             "give its run-time momentum; give the layer a fixed momentum")
        calls.setdefault(_layer_of(n.args[6]), []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, nodes in calls.items():
        counter = buffer_placeholders.get(counters.get(k, ""))
        chain = _increments(counter) if counter is not None else []
        if len(chain) != len(nodes) or any(order[c] > order[n] for c, n in zip(chain, nodes)):
            raise TraceError(f"BatchNorm with momentum=None ({counters.get(k)}): {len(nodes)} call(s) but "
                             f"{len(chain)} increment(s) of its counter in the graph; give the layer a fixed momentum")
        for c, n in zip(chain, nodes):
            x, weight, bias, running_mean, running_var, _training, _momentum, eps = n.args
            n.target = torch.ops.remat.batch_norm_counted.default
            n.args = (x, weight, bias, running_mean, running_var, c, eps)
    gm.graph.lint()
    gm.recompile()
    return sum(len(v) for v in calls.values())


def _increments(counter: torch.fx.Node) -> list[torch.fx.Node]:
    """The chain `add(counter, 1)`, `add(that, 1)`, ... in the graph: the counter after each increment."""
    chain, at = [], counter
    while True:
        nxt = [u for u in at.users if u.target is _ADD and u.args[0] is at and u.args[1] == 1]
        if len(nxt) != 1:
            return chain
        at = nxt[0]
        chain.append(at)


@torch.library.custom_op("remat::batch_norm_counted", mutates_args=())
def batch_norm_counted(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor,
                       running_var: Tensor, counter: Tensor, eps: float
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training batch norm whose momentum is `1.0 / float(counter)`, as nn.BatchNorm's forward computes it."""
    momentum = 1.0 / float(counter)
    return _BN_TRAIN(x, weight, bias, running_mean, running_var, True, momentum, eps)


@batch_norm_counted.register_fake
def _batch_norm_counted_fake(x, weight, bias, running_mean, running_var, counter, eps):
    return _BN_TRAIN(x, weight, bias, running_mean, running_var, True, 0.1, eps)
