"""Bounds on a longer call's memory, read from a shorter one's.

A pad-to-longest stream calls the model with another sequence length nearly every step. Each tensor a transformer
makes has a size that is a product of its dimensions, each a constant times a power of the length `S` (hidden states
`B x S x D`, a mask `B x 1 x S x S`, flattened logits `(B*S) x V`). Where one dimension is `c * S^k`, `S^k` divides
it, so the sum over a tensor's dimensions of the largest power of `S` dividing each (`size_degree`) is at least the
tensor's degree in `S`; at a length `S' <= r * S` it then holds at most `r^degree` times its bytes at `S`.

`ScalingTracker` is a StorageTracker that also counts each storage at each ratio of RATIOS (its bytes times
`r^degree`): what it reads at `S` (live bytes at a moment, the peak over a stretch) bounds what the same moment or
stretch holds at any length up to `r * S`, when the code runs the same operators in the same order and frees them at
the same points (the same block structure, the same path through the model's Python). A dimension within NEAR of
`S` but not a multiple of it (`S - 1`: a shifted sequence; `S` rounded up) counts as degree 1 where the rule would
give it 0.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from capture.measure_memory import StorageTracker

# the longer lengths a reading bounds, as multiples of `S`: a call between two of them is bounded at the larger (a
# step of 0.025 to twice the length: a length 1.56 times the measured one is bounded within 1 % of its own ratio)
RATIOS = (*(round(1 + 0.025 * k, 3) for k in range(1, 41)), 2.25, 2.5, 2.75, 3.0)
MAX_DEGREE = 3  # a storage counted at a higher degree counts at this one (no transformer tensor has degree 3)
NEAR = 8
_POWERS = tuple(tuple(r ** k for k in range(MAX_DEGREE + 1)) for r in RATIOS)


def _power_dividing(d: int, scale: int) -> int:
    k = 0
    while d and d % scale == 0:
        d //= scale
        k += 1
    return k


def size_degree(dims, scale: int) -> int:
    """An upper bound on the degree in `scale` of a tensor of these dimensions (see the module docstring)."""
    k = 0
    for d in dims:
        d = int(d)
        v = _power_dividing(d, scale)
        if v == 0 and 0 < abs(d - scale) <= NEAR:
            v = 1
        k += v
    return min(k, MAX_DEGREE)


def scaled(nbytes: int, degree: int) -> tuple[int, ...]:
    """`nbytes` at each ratio of RATIOS (rounded up)."""
    return tuple(math.ceil(nbytes * p[degree]) for p in _POWERS)


def zero() -> tuple[int, ...]:
    return (0,) * len(RATIOS)


def add(a: tuple, b: tuple) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b))


def sub_floor(a: tuple, b: tuple) -> tuple[int, ...]:
    """a - b, each at least 0."""
    return tuple(max(0, x - y) for x, y in zip(a, b))


def storage_bytes_scaled(tensors, scale: int) -> tuple[int, ...]:
    """storage_bytes (capture.measure_memory) at each ratio: each distinct storage by its tensor's dimensions."""
    seen: dict = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            st = t.untyped_storage()
            seen[StorageWeakRef(st)] = (int(st.nbytes()), _tensor_degree(t, int(st.nbytes()), scale))
    out = zero()
    for nbytes, k in seen.values():
        out = add(out, scaled(nbytes, k))
    return out


def _tensor_degree(t: torch.Tensor, nbytes: int, scale: int) -> int:
    """The degree of a storage seen through `t`: by `t`'s dimensions where `t` covers it, else by its element count
    (`S^k` divides the count where it divides a dimension: an upper bound all the same)."""
    if t.numel() * t.element_size() == nbytes:
        return size_degree(t.shape, scale)
    return size_degree((max(1, nbytes // max(1, t.element_size())),), scale)


class ScalingTracker(StorageTracker):
    """A StorageTracker that also reads live and peak bytes at each ratio of RATIOS (see the module docstring):
    `live_scaled()`, `peak_scaled` (reset with `reset_peak()`), `bytes_still_alive_scaled(storages)`,
    `tracked_bytes_scaled(tensors)`. Without a `scale` (None) it is a plain StorageTracker."""

    def __init__(self, scale: int | None) -> None:
        super().__init__()
        self.scale = scale if scale is not None and scale >= 2 else None
        self._by_degree = [0] * (MAX_DEGREE + 1)
        self._degree: dict[StorageWeakRef, int] = {}
        self._peak = [0.0] * len(RATIOS)
        # live bytes by degree at the moments since the peaks were last folded in that may hold a ratio's peak (one
        # dominated by the next is dropped as it comes): each op adds a tuple, not a reading at every ratio
        self._pending: list[tuple[int, ...]] = []
        self._grew = False

    def _live_floats(self, by_degree=None) -> list[float]:
        b0, b1, b2, b3 = self._by_degree if by_degree is None else by_degree
        return [b0 + b1 * p1 + b2 * p2 + b3 * p3 for _, p1, p2, p3 in _POWERS]

    def live_scaled(self) -> tuple[int, ...]:
        return tuple(math.ceil(v) for v in self._live_floats())

    @property
    def peak_scaled(self) -> tuple[int, ...]:
        self._fold()
        return tuple(math.ceil(v) for v in self._peak)

    def _fold(self) -> None:
        for by_degree in self._pending:
            self._peak = [max(a, b) for a, b in zip(self._peak, self._live_floats(by_degree))]
        self._pending.clear()

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self._pending.clear()
        self._peak = self._live_floats()

    def bytes_still_alive_scaled(self, storages) -> tuple[int, ...]:
        out = zero()
        for k in storages:
            if k in self._tracked:
                out = add(out, scaled(self._tracked[k], self._degree[k]))
        return out

    def tracked_bytes_scaled(self, tensors) -> tuple[int, ...]:
        keys = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)}
        return self.bytes_still_alive_scaled(keys)

    def _add(self, key: StorageWeakRef, st, t: torch.Tensor) -> None:
        if self.scale is None:
            return super()._add(key, st, t)
        nbytes = int(st.nbytes())
        k = _tensor_degree(t, nbytes, self.scale)
        self._tracked[key] = nbytes
        self._degree[key] = k
        self.live_bytes += nbytes
        self.created_bytes += nbytes
        self._by_degree[k] += nbytes
        self._grew = True
        weakref.finalize(st, self._release_scaled, key, nbytes, k)

    def _after_op(self) -> None:
        super()._after_op()
        if self._grew:
            self._grew = False
            now = tuple(self._by_degree)
            pending = self._pending
            if pending:
                last = pending[-1]
                if now[0] <= last[0] and now[1] <= last[1] and now[2] <= last[2] and now[3] <= last[3]:
                    return  # no more at any ratio than the last
                if now[0] >= last[0] and now[1] >= last[1] and now[2] >= last[2] and now[3] >= last[3]:
                    pending.pop()  # at least as much at every ratio
            pending.append(now)
            if len(pending) > 64:
                self._fold()

    def _release_scaled(self, key: StorageWeakRef, nbytes: int, k: int) -> None:
        self._tracked.pop(key, None)
        self._degree.pop(key, None)
        self.live_bytes -= nbytes
        self._by_degree[k] -= nbytes
