"""0/1 knapsack: the items to keep for the most value within a byte capacity.

Selective activation checkpointing keeps some operators' outputs for the backward and computes the rest again; each
kept output costs its bytes and saves its recomputation. `knapsack(weights, values, capacities)` answers every
capacity from one dynamic program over a grid of `resolution` steps of the largest capacity. Weights are rounded up
to the grid, so a returned set is within its capacity by the exact sums; the rounding can cost it the optimum by at
most what one grid step per item would have admitted.
"""
from __future__ import annotations

import math

import numpy as np


def knapsack(weights: list[int], values: list[float], capacities: list[int],
             resolution: int = 2000) -> list[tuple[int, ...]]:
    """For each capacity, the indices of the items of most summed value whose summed weight is within it."""
    if len(weights) != len(values):
        raise ValueError("weights and values differ in length")
    if any(w < 0 for w in weights) or any(c < 0 for c in capacities):
        raise ValueError("weights and capacities must be at least 0")
    top = max(capacities, default=0)
    if top <= 0 or not weights:
        free = tuple(i for i, w in enumerate(weights) if w == 0 and values[i] > 0)
        return [free for _ in capacities]
    step = max(1, math.ceil(top / resolution))
    grid = [math.ceil(w / step) for w in weights]
    size = top // step
    best = np.zeros(size + 1)
    take = np.zeros((len(weights), size + 1), dtype=bool)
    for i, (g, v) in enumerate(zip(grid, values)):
        if v <= 0 or g > size:
            continue
        cand = np.full(size + 1, -np.inf)
        cand[g:] = best[:size + 1 - g] + v
        better = cand > best
        take[i] = better
        best = np.where(better, cand, best)
    out = []
    for cap in capacities:
        c = cap // step
        chosen = []
        for i in range(len(weights) - 1, -1, -1):
            if c >= 0 and take[i, c]:
                chosen.append(i)
                c -= grid[i]
        chosen.reverse()
        assert sum(weights[i] for i in chosen) <= cap
        out.append(tuple(chosen))
    return out
