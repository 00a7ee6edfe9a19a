"""What `auto` (solvers.auto) tunes: one frozen object, one field per constant, a line each on what it tunes.

Seconds are wall-clock seconds. A share "of the limit" is of the caller's time limit less the safety margin; a share
"of what remains" is of the time that limit still leaves when the step starts. docs/solvers.md gives the measurements
behind the defaults.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutoConfig:
    """Every tunable constant of `auto`; `CONFIG` holds the defaults it runs with."""

    # the time limit when the caller gives none
    default_time_limit_s: float = 60.0
    # margin kept in the caller's limit for what follows the solvers (replay, export, start-up): at most this long...
    safety_s: float = 8.0
    # ...and at most this share of the limit
    safety_share: float = 0.12
    # where no whole-graph exact solver runs, stop once the best schedule is within this share of a bound covering it
    mip_gap: float = 0.01

    # graph sizes: CP-SAT on training graphs up to this many nodes; above, block_dp runs first and no whole-graph
    # exact solver runs (the eviction search and the guided rollouts get the time)
    cpsat_max_nodes: int = 400
    # the MILP on graphs without a backward pass up to this size; CP-SAT's wider family first on training graphs up to
    # it; the forced bound's windows (1-6 s on 185-1000 nodes, lifting nothing there) on graphs up to it
    milp_max_nodes: int = 120

    # fast heuristics, in order: an incumbent and a fallback in milliseconds to a second where they fit
    fast_heuristics: tuple[str, ...] = ("chen_greedy", "chen_greedy_linear", "dtr", "dtr_local", "lowest_memory")
    # each fast heuristic's share of the limit (where nothing fits, their smallest-budget bisection can take 70 s)
    fast_share: float = 0.06
    # share of what remains for a DTR rollout cut by its share while nothing fits yet (decoder75 at 0.1: 1.2 s)
    retry_share: float = 0.2
    # the block-chain program's share of the limit (under a second on 1000-2000-node traced transformers)
    block_dp_share: float = 0.3

    # the forced-recomputation bound (< 0.5 s on the benchmarks, ~4 s with windows): at most this long...
    forced_bound_s: float = 5.0
    # ...and at most this share of the limit
    forced_bound_share: float = 0.1
    # the subgraph relaxation, when nothing fits: at most this long (resnet50 below its smallest budget: 1.4 s)...
    subgraph_s: float = 5.0
    # ...and at most this share of what remains
    subgraph_share: float = 0.2
    # the program-order bound, where no schedule meets the forced one (0.1-20 s on 145-770-node transformers): at
    # most this long...
    order_bound_s: float = 4.0
    # ...and at most this share of the limit (the bound the gap is measured against; CP-SAT gains little at the end)
    order_bound_share: float = 0.35

    # lowest_memory's keep-greedy pass, when only it fits: at most this long...
    lowest_memory_improve_s: float = 20.0
    # ...and at most this share of what remains
    lowest_memory_improve_share: float = 0.3

    # the perturbed rollouts (rollout_search) after the fast heuristics: at most this long...
    rollout_search_s: float = 5.0
    # ...and this share of what remains where no CP-SAT follows (large graphs)
    rollout_search_share: float = 0.1
    # ...or this share where CP-SAT follows: their schedule is its hint, worth more than CP-SAT's last seconds
    rollout_search_share_before_cpsat: float = 0.2

    # the guided rollouts' score factor on values the program-order bound recomputes (0.1 best of 0.1-0.3 on T5)
    guided_prior: float = 0.1
    # the guided rollouts on training graphs above cpsat_max_nodes: at most this long...
    guided_s: float = 5.0
    # ...and at most this share of what remains
    guided_share: float = 0.3
    # guided rollouts again at the end, while the gap is above mip_gap: only with at least this much left...
    guided_min_left_s: float = 0.5
    # ...and at most this long
    guided_left_s: float = 10.0

    # the eviction search's share of what remains where an exact solver follows...
    evict_share_with_exact: float = 0.25
    # ...and where none does (the random layered graphs of 500+ nodes)
    evict_share_alone: float = 0.95

    # an exact solver (CP-SAT, the MILP) starts only with at least this many seconds left
    exact_min_s: float = 1.0
    # CP-SAT over a family of at most this many computations per value first, on training graphs up to milp_max_nodes
    wider_computations: int = 3
    # that run's share of what remains; the default family's run gets the rest
    wider_family_share: float = 0.6
    # on larger training graphs CP-SAT's family widens to hold its hint, up to this many computations per value
    hint_max_computations: int = 4
    # the MILP's warm starts: this many of the cheapest schedules so far
    milp_start_sequences: int = 3
    # where nothing is found, rollouts from further seeds run while at least this many seconds are left
    last_rollouts_min_s: float = 0.1


CONFIG = AutoConfig()
