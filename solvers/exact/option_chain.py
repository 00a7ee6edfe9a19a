"""One option per block of a chain, the least recompute under a memory budget: the in-place planner's choice.

A chain of blocks runs forward in order, then backward in reverse. Each block offers options (keep everything, a
planned schedule, recompute the whole block); an option is described by what it costs again and by three byte
counts, all relative to what is live when the block starts (its input included):

- stash_bytes: what the block keeps from its forward for its backward, beyond its input and output;
- forward_bytes: the most its forward holds at once beyond what was live at its start;
- backward_bytes: the most its backward holds at once beyond what was live at its start, its own stash included.

The memory around the blocks comes from the site figures (`ChainSites`), measured on the model: what is live when
each block's forward starts and when its backward starts if every block stashed nothing, and the peak of the part
after the last block. Block i's forward then peaks at forward_start[i] + (stash of blocks < i) + forward_bytes, its
backward at backward_start[i] + (stash of blocks < i) + backward_bytes, the part after the blocks at
after_bytes + (stash of every block), and what runs after every block's backward at end_bytes.

`choose_options` minimises the summed cost by dynamic programming over the chain; its state is the stash so far,
rounded up to a grid of `resolution` steps of the budget (a choice it returns is within the budget by the exact
sums; near the budget the rounding may cost it the cheapest choice, and where it loses every choice it returns the
least-peak one). It raises InfeasibleBudgetError naming the least peak any choice reaches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from graphs.errors import InfeasibleBudgetError


@dataclass(frozen=True)
class BlockOption:
    name: str
    cost: float
    stash_bytes: int
    forward_bytes: int
    backward_bytes: int


@dataclass(frozen=True)
class ChainSites:
    forward_start_bytes: tuple[int, ...]  # per block
    backward_start_bytes: tuple[int, ...]  # per block
    after_bytes: int  # the peak of what runs after the last block's forward and before its backward
    end_bytes: int = 0  # the peak after every block's backward (no stash left): the same for every choice


@dataclass(frozen=True)
class ChainChoice:
    choice: tuple[int, ...]  # option index per block
    cost: float
    peak_bytes: int  # above what was live before the step (the sites' own baseline)


def chain_peak_bytes(options: list[list[BlockOption]], sites: ChainSites, choice) -> int:
    """The peak of a choice by the chain's memory model (see the module docstring)."""
    stash = 0
    peak = 0
    for i, k in enumerate(choice):
        o = options[i][k]
        peak = max(peak, sites.forward_start_bytes[i] + stash + o.forward_bytes,
                   sites.backward_start_bytes[i] + stash + o.backward_bytes)
        stash += o.stash_bytes
    return max(peak, sites.after_bytes + stash, sites.end_bytes)


def least_peak(options: list[list[BlockOption]], sites: ChainSites) -> tuple[tuple[int, ...], int]:
    """The choice with the least peak and that peak (dynamic programming on (stash, peak) pairs)."""
    states: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}  # stash -> (peak so far, choice)
    for i, opts in enumerate(options):
        nxt: dict[int, tuple[int, tuple[int, ...]]] = {}
        for stash, (peak, ch) in states.items():
            for k, o in enumerate(opts):
                p = max(peak, sites.forward_start_bytes[i] + stash + o.forward_bytes,
                        sites.backward_start_bytes[i] + stash + o.backward_bytes)
                s = stash + o.stash_bytes
                if s not in nxt or p < nxt[s][0]:
                    nxt[s] = (p, ch + (k,))
        # keep the pairs no other pair dominates (less stash and no higher peak)
        kept: dict[int, tuple[int, tuple[int, ...]]] = {}
        best = math.inf
        for s in sorted(nxt):
            if nxt[s][0] < best:
                kept[s] = nxt[s]
                best = nxt[s][0]
        states = kept
    s, (p, ch) = min(states.items(), key=lambda kv: max(kv[1][0], sites.after_bytes + kv[0]))
    return ch, max(p, sites.after_bytes + s, sites.end_bytes)


def choose_options(options: list[list[BlockOption]], sites: ChainSites, budget_bytes: int, *,
                   resolution: int = 4096) -> ChainChoice:
    """The least-cost choice whose peak is within `budget_bytes` (InfeasibleBudgetError, naming the least peak a
    choice reaches, when none is)."""
    n = len(options)
    if n == 0:
        raise ValueError("a chain of no blocks")
    grid = max(1, budget_bytes // resolution)

    def up(b: int) -> int:
        return -(-b // grid)

    # state: stash so far in grid units (rounded up) -> (cost, exact stash, choice)
    states: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for i, opts in enumerate(options):
        nxt: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for units, (cost, stash, ch) in states.items():
            for k, o in enumerate(opts):
                if max(sites.forward_start_bytes[i] + stash + o.forward_bytes,
                       sites.backward_start_bytes[i] + stash + o.backward_bytes) > budget_bytes:
                    continue
                s = stash + o.stash_bytes
                key = up(s)
                c = cost + o.cost
                if key not in nxt or c < nxt[key][0] or (c == nxt[key][0] and s < nxt[key][1]):
                    nxt[key] = (c, s, ch + (k,))
        kept = {}
        best = math.inf
        for key in sorted(nxt):  # drop a state with more stash and no less cost
            if nxt[key][0] < best:
                kept[key] = nxt[key]
                best = nxt[key][0]
        states = kept
        if not states:
            break
    finals = [(cost, ch) for cost, stash, ch in states.values()
              if max(sites.after_bytes + stash, sites.end_bytes) <= budget_bytes]
    if not finals or len(finals[0][1]) != n:
        ch, least = least_peak(options, sites)
        if least <= budget_bytes:  # the grid's rounding lost every state near the budget: the least-peak choice fits
            return ChainChoice(ch, sum(options[i][k].cost for i, k in enumerate(ch)), least)
        raise InfeasibleBudgetError(budget_bytes, least, "option_chain",
                                    "the least peak of any choice of one option per block")
    cost, ch = min(finals)
    return ChainChoice(ch, cost, chain_peak_bytes(options, sites, ch))
