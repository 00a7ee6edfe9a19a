"""The sizes a symbolic region is planned at: the largest the training will give it, where that is known.

Once a block has been called with a second shape, torch.compile recompiles it with symbolic sizes (`s27` for a
sequence length) and the one compiled region then serves every later length without recompiling. A split planned at
the length that triggered that compilation (the symbol's hint) holds more at any longer length, so each symbol is
planned at the largest size it can take, in this order:

1. "largest": the size the symbol's source (dynamo's `L['hidden_states'].size()[1]`: an argument of the block's
   forward) has in the block calls of the measuring step, run at the model's `largest` inputs
   (`planner.compile(..., largest=...)`; the largest over the block calls; capped by the guard's bound below where
   one is finite, and never below the hint);
2. "guard bound": the upper end of the symbol's value range where it is finite (`torch._dynamo.mark_dynamic(x, dim,
   max=...)` on a block's input);
3. "hint": the size of the input that triggered the compilation. Then nothing bounds a later, longer input:
   `SizeChooser.choose` says so (`PlannedSize.bounded` is False) and `planner.compiled.partitioner` warns.

A resume function's frame (after a graph break inside a block) has locals of its own that the measuring step does not
see: its sizes fall to 2 or 3.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from capture.joint_graph import symbols_of

LARGEST, GUARD_BOUND, HINT = "largest", "guard bound", "hint"


@dataclass(frozen=True)
class PlannedSize:
    """A symbol's size as planned: `size`, where it came from (`origin`: "largest", "guard bound" or "hint"), the
    size that triggered the compilation (`hint`) and the symbol's source in dynamo's words."""

    size: int
    origin: str
    hint: int | None
    source: str

    @property
    def bounded(self) -> bool:
        return self.origin != HINT


class TensorSizes:
    """A tensor's sizes, strides and storage offset, without the tensor (what dynamo's size sources read:
    `.size()[1]`, `.stride()[0]`, `.storage_offset()`): nothing is allocated, so a measuring tracker sees nothing."""

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(int(d) for d in t.shape)
        self._stride = tuple(int(d) for d in t.stride())
        self._offset = int(t.storage_offset())

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim: int | None = None):
        return self._stride if dim is None else self._stride[dim]

    def storage_offset(self) -> int:
        return self._offset

    def dim(self) -> int:
        return len(self.shape)


def _sizes_only(value):
    return TensorSizes(value) if isinstance(value, torch.Tensor) else value


def block_call_locals(forward, args: tuple, kwargs: dict) -> list[dict[str, Any]]:
    """A block's `forward` arguments by name, as the frame dynamo traces sees them (its sources' `L[...]`), tensors as
    their sizes only (`TensorSizes`: nothing allocated, nothing held). Two readings where `forward` is wrapped (a
    decorator's `wrapped(*args, **kwargs)`, as transformers' layers have: dynamo's frame is the wrapper's) and one
    otherwise; none where the arguments do not bind."""
    func = getattr(forward, "__func__", forward)
    owner = getattr(forward, "__self__", None)
    call = (owner, *args) if owner is not None else tuple(args)
    found = []
    for follow in ((False, True) if inspect.unwrap(func) is not func else (False,)):
        try:
            bound = inspect.signature(func, follow_wrapped=follow).bind(*call, **kwargs)
        except (TypeError, ValueError):
            continue
        found.append(tree_map(_sizes_only, dict(bound.arguments)))  # `**kwargs` is one local: L['kwargs'][...]
    return found


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _backed_values(shape_env) -> dict:
    values = getattr(shape_env, "backed_var_to_val", None)  # torch 2.13; var_to_val before (deprecated there)
    return values if values is not None else shape_env.var_to_val


@dataclass
class SizeChooser:
    """Chooses the size of each symbol of a symbolic region (see the module docstring). `block_inputs`: the block
    calls' arguments at the largest inputs (`block_call_locals`), empty where `largest` was not given."""

    block_inputs: list[dict[str, Any]] = field(default_factory=list)

    def _from_largest(self, sources: list[str]) -> int | None:
        best = None
        for name in sources:
            for frame_locals in self.block_inputs:
                try:
                    value = eval(name, {"__builtins__": {}}, {"L": frame_locals})  # noqa: S307 - dynamo's own source text
                except Exception:  # noqa: BLE001 - a source of another frame (a resume function's locals)
                    continue
                value = _int_or_none(value)
                if value is not None:
                    best = value if best is None else max(best, value)
            if best is not None:
                return best
        return None

    def choose(self, gm: torch.fx.GraphModule) -> tuple[dict, dict[str, PlannedSize]]:
        """(sympy symbol -> size, for `capture.joint_graph.region_graph`; symbol name -> PlannedSize) for the
        symbols of `gm`'s placeholders."""
        sizes: dict = {}
        planned: dict[str, PlannedSize] = {}
        for sym, symint in symbols_of(gm):
            env = symint.node.shape_env
            hint = _int_or_none(_backed_values(env).get(sym)) if env is not None else None
            sources = [s.name for s in env.var_to_sources.get(sym, [])] if env is not None else []
            vr = env.var_to_range.get(sym) if env is not None else None
            upper = int(vr.upper) if vr is not None and isinstance(vr.upper, (int, sympy.Integer)) else None
            largest = self._from_largest(sources)
            if largest is not None:
                size, origin = (largest if upper is None else min(largest, upper)), LARGEST
            elif upper is not None:
                size, origin = upper, GUARD_BOUND
            elif hint is not None:
                size, origin = hint, HINT
            else:
                continue  # an unbacked size: capture.joint_graph refuses it
            if hint is not None:
                size = max(size, hint)
            sizes[sym] = size
            planned[str(sym)] = PlannedSize(size, origin, hint, sources[0] if sources else "")
        return sizes, planned
