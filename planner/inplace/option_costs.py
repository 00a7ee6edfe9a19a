"""What a block's options cost again, in the chain's ranking unit (FLOPs), from the operators of its kept forward
(capture.op_record): the figure `solvers.exact.option_chain` minimises.

An operator run again costs its FLOPs plus FLOPS_PER_BYTE a byte it writes (`op_cost`). Wrapping a block in
torch.utils.checkpoint costs beyond that, on the host: the wrapper's own work once a block (`WRAP_SECONDS`: saved
tensor hooks, generator states), the dispatch and Python of every operator run again (`RECOMPUTE_OP_SECONDS`), and,
for a selective block, torch's caching dispatch modes on every operator of its forward and of its recomputation and
the save policy asked on each (`SELECTIVE_OP_SECONDS`). Those are seconds, turned into FLOPs at the device's rate
(`Overheads.on`).

Measured on this project's CPU machine (2026-12-07, torch 2.13, one thread; `scripts/check_option_costs.py`): a
Qwen2 decoder layer of width 64 (70 operators): kept 0.71 + 1.19 ms forward + backward, checkpointed +0.52 / +1.44 ms,
selective (nearly all kept) +1.8 / +2.2 ms; of width 512 at 512 tokens: checkpointed +0.8 / +33.7 ms (its FLOPs and
bytes predicted 29.7 ms), selective +4.3 / +3.5 ms with 0.6 ms of predicted recomputation. A pass-through Python
dispatch mode alone costs 9-37 us an operator there. Not calibrated on a GPU, where the host's work overlaps the
kernels: there the wrappers count nothing and a selective block's policy 2e6 FLOPs an operator (the figure before this
calibration), so that keeping little is not ranked ahead of checkpointing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from capture.op_record import OpRecord
from planner.core.units import FLOPS_PER_BYTE
from solvers.exact.knapsack import knapsack

WRAP_SECONDS = 0.5e-3
RECOMPUTE_OP_SECONDS = 20e-6
SELECTIVE_OP_SECONDS = 70e-6
CPU_FLOPS_PER_SECOND_PER_THREAD = 1e11  # a 512 x 512 x 512 matmul's rate there, one thread: 268 MFLOP in 2.7 ms
GPU_SELECTIVE_OP_FLOPS = 2e6


@dataclass(frozen=True)
class Overheads:
    """The host's work of the wrapped options, in FLOPs (see the module docstring)."""
    wrap: float = 0.0  # once a checkpointed or selective block
    recompute_op: float = 0.0  # each operator a checkpointed block runs again
    selective_op: float = 0.0  # each operator of a selective block's forward (and its recomputation)

    @staticmethod
    def on(device: torch.device | str | None) -> "Overheads":
        """The overheads of a block whose tensors live on `device` (CPU at torch's thread count; other devices as the
        module docstring says)."""
        if device is None or torch.device(device).type == "cpu":
            rate = CPU_FLOPS_PER_SECOND_PER_THREAD * max(1, torch.get_num_threads())
            return Overheads(WRAP_SECONDS * rate, RECOMPUTE_OP_SECONDS * rate, SELECTIVE_OP_SECONDS * rate)
        return Overheads(selective_op=GPU_SELECTIVE_OP_FLOPS)


def op_cost(r: OpRecord) -> float:
    """What running one recorded operator again computes, in the ranking's unit: FLOPs plus FLOPS_PER_BYTE a byte
    written."""
    return float(r.flops) + FLOPS_PER_BYTE * r.written_bytes


def recomputed(records: list[OpRecord]) -> list[OpRecord]:
    """The operators a recomputation runs: up to the last whose output autograd keeps (torch.utils.checkpoint stops
    there)."""
    last = max((i for i, r in enumerate(records) if r.needed), default=-1)
    return records[:last + 1]


def checkpointed_cost(records: list[OpRecord], over: Overheads) -> float:
    again = recomputed(records)
    return sum(op_cost(r) for r in again) + over.recompute_op * len(again) + over.wrap


def selective_cost(records: list[OpRecord], saved: frozenset, over: Overheads) -> float:
    """What a selective option keeping `saved` computes again (every operator it does not keep runs again), and the
    host's work of its policy on every operator."""
    again = sum(op_cost(r) for r in recomputed(records) if (r.func, r.occurrence) not in saved)
    return again + over.selective_op * len(records) + over.wrap


def selective_options(records: list[OpRecord], fractions, over: Overheads) -> list[tuple[str, frozenset, float]]:
    """(name, the (func, occurrence) pairs to keep, cost) of each selective option: for each of `fractions` of the
    bytes of the savable operators' outputs (those a recomputation runs), the knapsack's most recompute saved within
    it; options keeping nothing, or what a larger fraction keeps, left out."""
    savable = [r for r in recomputed(records) if r.savable and r.out_bytes > 0]
    weights = [r.out_bytes for r in savable]
    total = sum(weights)
    if not savable or total <= 0:
        return []
    picks = knapsack(weights, [op_cost(r) for r in savable], [int(f * total) for f in fractions])
    out, seen = [], set()
    for frac, pick in zip(fractions, picks):
        saved = frozenset((savable[i].func, savable[i].occurrence) for i in pick)
        if not saved or saved in seen:
            continue
        seen.add(saved)
        out.append((f"selective@{frac:g}", saved, selective_cost(records, saved, over)))
    return out
