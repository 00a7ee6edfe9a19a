"""The chain's choice of one option per block: least cost within the budget, checked against every choice."""
from __future__ import annotations

import itertools
import random

import pytest

from graphs.errors import InfeasibleBudgetError
from solvers.exact.option_chain import BlockOption, ChainSites, chain_peak_bytes, choose_options, least_peak


def _instance(rng: random.Random, n: int, k: int):
    options = []
    for _ in range(n):
        opts = []
        for j in range(k):
            stash = rng.randrange(0, 1000)
            opts.append(BlockOption(f"o{j}", float(rng.randrange(0, 50)), stash, stash + rng.randrange(0, 500),
                                    stash + rng.randrange(0, 800)))
        options.append(opts)
    fwd = tuple(rng.randrange(0, 300) * (i + 1) for i in range(n))
    bwd = tuple(f + rng.randrange(0, 400) for f in fwd)
    return options, ChainSites(fwd, bwd, rng.randrange(0, 2000))


@pytest.mark.parametrize("seed", range(30))
def test_least_cost_choice_within_budget_matches_every_choice(seed):
    rng = random.Random(seed)
    n, k = rng.randrange(1, 6), rng.randrange(1, 4)
    options, sites = _instance(rng, n, k)
    every = [(sum(options[i][c].cost for i, c in enumerate(ch)), chain_peak_bytes(options, sites, ch), ch)
             for ch in itertools.product(range(k), repeat=n)]
    least = min(p for _, p, _ in every)
    _, peak = least_peak(options, sites)
    assert peak == least
    budget = least + rng.randrange(0, 1500)
    # the grid rounding may only make the choice dearer than the best, never over the budget; a fine grid is exact
    got = choose_options(options, sites, budget, resolution=10 ** 9)
    best = min(c for c, p, _ in every if p <= budget)
    assert got.peak_bytes == chain_peak_bytes(options, sites, got.choice) <= budget
    assert got.cost == pytest.approx(best)
    coarse = choose_options(options, sites, budget, resolution=16)
    assert coarse.peak_bytes == chain_peak_bytes(options, sites, coarse.choice) <= budget
    assert coarse.cost >= best - 1e-9


def test_infeasible_budget_names_the_least_peak():
    options = [[BlockOption("kept", 0.0, 100, 150, 200), BlockOption("ckpt", 5.0, 0, 50, 220)]] * 3
    sites = ChainSites((10, 20, 30), (40, 50, 60), 90)
    _, least = least_peak(options, sites)
    with pytest.raises(InfeasibleBudgetError) as info:
        choose_options(options, sites, least - 1)
    assert info.value.min_budget_bytes == least
    assert choose_options(options, sites, least).peak_bytes <= least
