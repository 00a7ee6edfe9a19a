"""Split a training graph into a chain of blocks joined at narrow boundaries (the structure `block_dp` plans on).

A *cut* is a forward node c such that no forward value computed up to c, other than c itself, is read by a
forward node after c, except values that are never dropped anyway (sources without inputs, non-recomputable or
retained values) and values small beside what they span (GLUE_RATIO): a transformer's residual sums, a conv net's
stage outputs. The forward nodes between two cuts
form a segment; consecutive segments are merged into blocks while a block has at most `max_choices` values to
choose about, and while the blocks' backward windows (from the first backward read of a block's values to the
last) stay disjoint and in reverse order, as the backward pass of a chain runs.

Within a block:
- *glue* values are always kept (the block's last node, which the next block reads; values that cross a cut;
  retained, non-recomputable and unused values);
- every other forward value of the block is *local*: computed once by the forward pass, dropped after its last
  forward use unless kept, and recomputed (once, from the block's kept values and glue) for the block's backward;
- *choices* are the local values a backward node reads (the only ones worth keeping); when a block has more than
  `max_choices`, the smallest are kept always (`forced`), and the family says so.

Blocks with the same shape (the same ops, sizes and wiring relative to their start; costs may differ) share a
`signature`, so their options are enumerated once.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from graphs.ir import Graph

MAX_CHOICES = 14  # 2**14 kept sets per block shape, enumerated at once (numpy) in a fraction of a second
# A block's enumeration costs about 2**choices x local values x (forward span + backward window) steps: blocks with
# many local values or long windows get fewer choices (the rest kept), so that one shape costs at most this many.
ENUMERATION_STEPS = 60_000_000
GLUE_RATIO = 64  # a value may cross cuts (kept) when the forward values it spans hold this many times its bytes


@dataclass(frozen=True)
class Block:
    first: int  # the block's first forward node id
    last: int  # the block's last forward node id (its boundary: glue)
    local: tuple[int, ...]  # local values, ascending
    choices: tuple[int, ...]  # local values free to keep or drop, ascending
    forced: tuple[int, ...]  # local values read by the backward pass that are always kept
    bwd_window: tuple[int, int] | None  # first and last backward node reading a local value (None: none does)
    signature: tuple  # equal for blocks of the same shape


@dataclass(frozen=True)
class Blocks:
    blocks: tuple[Block, ...]
    glue: frozenset[int]  # forward values always kept
    forced_choices: int  # how many read-by-backward values were kept always because a block had too many

    @property
    def n_choices(self) -> int:
        return sum(len(b.choices) for b in self.blocks)


def _base_name(name: str) -> str:
    return re.sub(r"_\d+", "", name)


def split_blocks(graph: Graph, max_choices: int = MAX_CHOICES) -> Blocks | None:
    """The block chain of `graph`, or None when it has none worth planning on (no backward pass, forward and
    backward nodes interleaved, or nothing to choose)."""
    nodes = graph.nodes
    n = graph.n
    fwd = [v for v in range(n) if not nodes[v].backward]
    bwd = [v for v in range(n) if nodes[v].backward]
    if not fwd or not bwd or max(fwd) > min(bwd):
        return None
    users = graph.users
    fusers = [[u for u in users[v] if not nodes[u].backward] for v in range(n)]
    busers = [[u for u in users[v] if nodes[u].backward] for v in range(n)]
    last_fwd_user = [max(fu) if fu else -1 for fu in fusers]

    prefix = [0]
    for v in range(n):
        prefix.append(prefix[-1] + (0 if nodes[v].backward else int(nodes[v].bytes)))

    def pinned(v: int) -> bool:  # kept by every schedule of the family, whatever the block
        nd = nodes[v]
        if nd.retain or not nd.recomputable or not nd.inputs or not users[v]:
            return True
        # a small value read far ahead (an attention mask every layer reads): keeping it costs little, and letting
        # it cross cuts keeps the blocks small
        lf = last_fwd_user[v]
        return lf > v and GLUE_RATIO * int(nd.bytes) <= prefix[lf + 1] - prefix[v + 1]

    # cuts: sweep the forward order counting values open across each position that would have to cross it
    open_count = 0
    closes: dict[int, int] = {}
    cuts = []
    for v in fwd:
        open_count -= closes.pop(v, 0)
        if last_fwd_user[v] > v and not pinned(v):
            open_count += 1
            closes[last_fwd_user[v]] = closes.get(last_fwd_user[v], 0) + 1
        # v's own reads close after v; v itself may stay open (it is the boundary)
        self_open = 1 if (last_fwd_user[v] > v and not pinned(v)) else 0
        if open_count - self_open == 0:
            cuts.append(v)
    if not cuts or cuts[-1] != fwd[-1]:
        cuts.append(fwd[-1])
    segments = []
    start = fwd[0]
    for c in cuts:
        segments.append((start, c))
        start = c + 1
    reads_bwd = [bool(busers[v]) for v in range(n)]

    def local_of(lo: int, hi: int) -> list[int]:
        return [v for v in range(lo, hi + 1) if not nodes[v].backward and v != hi and not pinned(v)
                and all(u <= hi for u in fusers[v])]

    def n_saved(lo: int, hi: int) -> int:
        return sum(1 for v in local_of(lo, hi) if reads_bwd[v])

    def window(lo: int, hi: int):
        rd = [u for v in local_of(lo, hi) for u in busers[v]]
        return (min(rd), max(rd)) if rd else None

    # merge segments while the block stays small enough to enumerate
    merged: list[tuple[int, int]] = []
    for lo, hi in segments:
        if merged and n_saved(merged[-1][0], hi) <= max_choices:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    # backward windows must be disjoint and in reverse order: merge neighbours until they are
    changed = True
    while changed:
        changed = False
        wins = [window(lo, hi) for lo, hi in merged]
        prev = None  # index of the previous block with a window
        for i, w in enumerate(wins):
            if w is None:
                continue
            if prev is not None and not (w[1] < wins[prev][0]):
                merged[prev:i + 1] = [(merged[prev][0], merged[i][1])]
                changed = True
                break
            prev = i
    blocks = []
    local_all: set[int] = set()
    forced_count = 0
    for lo, hi in merged:
        local = local_of(lo, hi)
        saved = [v for v in local if reads_bwd[v]]
        free = list(saved)
        free.sort(key=lambda v: (-int(nodes[v].bytes), v))
        win = window(lo, hi)
        steps = max(1, len(local)) * (hi - lo + 2 + (win[1] - win[0] + 1 if win else 0))
        cap = max(0, min(max_choices, int(math.log2(max(1.0, ENUMERATION_STEPS / steps)))))
        choices = sorted(free[:cap])
        forced = sorted(set(saved) - set(choices))
        forced_count += max(0, len(free) - cap)
        local_all.update(local)
        blocks.append(Block(lo, hi, tuple(local), tuple(choices), tuple(forced), win,
                            _signature(graph, lo, local, choices, forced, win, fusers, busers)))
    if not any(b.choices for b in blocks):
        return None
    glue = frozenset(v for v in fwd if v not in local_all)
    return Blocks(tuple(blocks), glue, forced_count)


def _signature(graph: Graph, lo: int, local, choices, forced, win, fusers, busers) -> tuple:
    """What the enumeration of a block's options depends on, relative to the block's start and window."""
    nodes = graph.nodes
    w0 = win[0] if win else 0
    pos = {v: k for k, v in enumerate(local)}
    rows = []
    for v in local:
        nd = nodes[v]
        rows.append((v - lo, _base_name(nd.name), int(nd.bytes),
                     tuple(pos[i] for i in nd.inputs if i in pos),
                     tuple(pos[u] for u in fusers[v] if u in pos),
                     max(fusers[v]) - lo if fusers[v] else -1,
                     tuple(u - w0 for u in busers[v])))
    return (tuple(rows), tuple(pos[v] for v in choices), tuple(pos[v] for v in forced),
            None if win is None else win[1] - win[0])
