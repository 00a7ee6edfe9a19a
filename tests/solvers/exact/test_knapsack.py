"""solvers.exact.knapsack: the most value within each capacity, never over it."""
from __future__ import annotations

import itertools
import random

import pytest

from solvers.exact.knapsack import knapsack


def _best(weights, values, cap) -> float:
    best = 0.0
    for r in range(len(weights) + 1):
        for pick in itertools.combinations(range(len(weights)), r):
            if sum(weights[i] for i in pick) <= cap:
                best = max(best, sum(values[i] for i in pick))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_optimal_where_the_grid_is_exact(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    weights = [rng.randint(0, 40) for _ in range(n)]
    values = [rng.uniform(0, 10) for _ in range(n)]
    caps = [rng.randint(0, 120) for _ in range(3)]
    for cap, pick in zip(caps, knapsack(weights, values, caps, resolution=200)):  # a grid step of one byte
        assert sum(weights[i] for i in pick) <= cap
        assert sum(values[i] for i in pick) == pytest.approx(_best(weights, values, cap))


@pytest.mark.parametrize("seed", range(10))
def test_within_capacity_on_a_coarse_grid(seed):
    rng = random.Random(seed)
    weights = [rng.randint(1, 10**7) for _ in range(30)]
    values = [rng.uniform(0, 1e9) for _ in range(30)]
    caps = [sum(weights) // 4, sum(weights) // 2, 10**6]
    for cap, pick in zip(caps, knapsack(weights, values, caps, resolution=50)):
        assert len(set(pick)) == len(pick) and sum(weights[i] for i in pick) <= cap


def test_edge_cases():
    assert knapsack([], [], [10]) == [()]
    assert knapsack([0, 5], [1.0, 2.0], [0]) == [(0,)]  # a free item is taken at capacity 0
    assert knapsack([5], [-1.0], [10]) == [()]  # an item of no value is not
    with pytest.raises(ValueError):
        knapsack([-1], [1.0], [3])
    with pytest.raises(ValueError):
        knapsack([1, 2], [1.0], [3])
