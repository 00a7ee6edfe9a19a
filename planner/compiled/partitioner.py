"""The project's partitioner for torch.compile: which forward values a compiled region saves, which its backward
recomputes, chosen by the project's solvers within the step's budget.

`PlannedPartitioner` is a `torch._inductor.custom_graph_pass.CustomPartitionerFn`: inductor calls it with each
compiled region's joint forward+backward graph (`torch.compile(m, options={"custom_partitioner_fn": P})`), and an
AOTAutograd backend takes it as its `partition_fn` (aot_eager: `planner.compiled.api`). For each region it

1. prices the joint graph as the project's graph (`capture.joint_graph.region_graph`: groups of aten ops, FLOPs plus
   `COST_PER_BYTE` a byte written as the cost of computing a group, the region's own allocations as its memory;
   symbolic sizes at the largest each can take where that is known: `planner.compiled.sizes`, which also says where
   it is not, and then the partitioner warns);
2. solves it with the project's solvers (`solvers.base.solve`, the "auto" portfolio by default) within a byte
   budget for the region's own peak;
3. turns the schedule into a saved set: the forward values resident where the schedule starts the backward (the
   `tangents` node) that the backward reads; every other forward value the backward needs is recomputed in it.
   Random ops (`capture.random_draws`: dropout, rand; inductor's seed draw) are never recomputed: a recomputation
   would draw a new mask (PyTorch's own memory-budget partitioner does, pytorch/pytorch#190758). Inductor's
   `inductor_random` is not among them: it is a pure function of the seeds drawn once, which are saved;
4. builds the forward and backward modules with torch's own helpers, as `min_cut_rematerialization_partition` does
   (`_extract_fwd_bwd_modules`, `reordering_to_mimic_autograd_engine`: each recomputation just before its first
   use, `raise_getitems`), and replays what they hold (`capture.joint_graph.held_bytes`).

What a region may hold: the step's budget less what lies outside the blocks, in each phase of the step
(`planner.compiled.budget`: `StepRoom`), is shared by `block_calls` calls of the region. While one call works, each
of the others holds what its forward left (saved values and output: `boundary`) or, once its backward has run, what that
left (gradients: `grads`). A split is taken when, in every phase,

    forward:   (block_calls - 1) x boundary + forward_peak             <= room.forward_bytes
    loss:       block_calls x boundary                                 <= room.loss_bytes
    backward:  (block_calls - 1) x max(boundary, grads) + backward_peak <= room.backward_bytes
    tail:       block_calls x max(boundary, grads)                     <= room.tail_bytes

(`StepRoom.excess`: the largest left side less its right side, <= 0 where the split fits).

How the solver is asked: for a cap c on the boundary and a budget for the region's peak, the region graph's
`boundary` node holds budget - c where the backward starts (`capture.joint_graph.RegionGraph.with_boundary_probe`), so
a schedule within the budget leaves at most c from its forward. The no-recomputation split is tried first (taken where
it fits: nothing is recomputed); then caps of `BOUNDARY_SHARES` of the largest the loss and tail phases allow
(min(room.loss, room.tail) / block_calls), each with the largest peak budget the forward and backward phases allow it
(min(room.forward - (block_calls - 1) x c, room.backward - (block_calls - 1) x max(c, grads))): a smaller cap leaves a
larger peak budget. Where the modules hold more than the schedule (they recompute a value once where a schedule may
recompute it twice), the cap and the budget are lowered by each call's part of the excess, once. The cheapest split
that fits is kept (the solver's cost: FLOPs and bytes written); the caps stop shrinking once a split fits and a smaller
cap costs more. Each solve runs within `time_limit_s / (len(BOUNDARY_SHARES) + 2)`. Where no split fits,
InfeasibleBudgetError names the step budget the closest split found would need. The rule assumes the block calls are
alike (one compiled graph serving every block, as a decoder's layers): blocks of different graphs each assume the
others hold what they hold themselves.

`uuid()` is None, so that inductor's and AOTAutograd's caches never hand back a partition made for another budget.
Every decision is kept (`regions`) and told by `summary()`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._functorch import config as functorch_config
from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
from torch._functorch.partitioners import (
    _extract_fwd_bwd_modules,
    default_partition,
    reordering_to_mimic_autograd_engine,
)
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_leaves

from capture.joint_graph import HeldBytes, RegionGraph, forward_ops_in, held_bytes, region_graph, saved_storage_bytes
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.schedule import OpKind, Schedule
from graphs.simulate import reference_peak_bytes
from planner.compiled.sizes import PlannedSize, SizeChooser
from planner.core.units import FLOPS_PER_BYTE
from solvers.base import solve

COST_PER_BYTE = FLOPS_PER_BYTE  # a recomputation writes its output: priced as the in-place planner prices it
BOUNDARY_SHARES = (1.0, 0.75, 0.5, 0.3, 0.15)  # of the largest boundary the room allows: the caps tried
PHASES = ("forward", "loss", "backward", "tail")


@dataclass(frozen=True)
class StepRoom:
    """What the step leaves to the block calls in each phase (bytes), and how many calls share it."""

    forward_bytes: int
    loss_bytes: int
    backward_bytes: int
    tail_bytes: int
    block_calls: int

    def scaled(self, share: float) -> StepRoom:
        """The room with every phase's bytes times `share` (a graph-broken block's part: `BlockPart`)."""
        if share >= 1:
            return self
        return StepRoom(int(self.forward_bytes * share), int(self.loss_bytes * share), int(self.backward_bytes * share),
                        int(self.tail_bytes * share), self.block_calls)

    def by_phase(self) -> dict[str, int]:
        return {"forward": self.forward_bytes, "loss": self.loss_bytes, "backward": self.backward_bytes,
                "tail": self.tail_bytes}

    def held(self, h: HeldBytes) -> dict[str, int]:
        """What the block calls hold in each phase when every call splits as `h` says (see the module docstring)."""
        n = self.block_calls
        return {"forward": (n - 1) * h.boundary + h.forward_peak, "loss": n * h.boundary,
                "backward": (n - 1) * max(h.boundary, h.grads) + h.backward_peak,
                "tail": n * max(h.boundary, h.grads)}

    def excess(self, h: HeldBytes) -> int:
        """The most the block calls hold beyond the room in any phase (<= 0: the split fits)."""
        room = self.by_phase()
        return max(v - room[k] for k, v in self.held(h).items())


@dataclass(frozen=True)
class BlockPart:
    """Where a region lies in its block's forward: `position` (0: the forward's first region; k: the k-th resume
    after a graph break), whether a graph break ends it (`breaks`), dynamo's frame (`frame`: the function's name),
    and the share of the blocks' room it is planned within (see `block_part`)."""

    position: int
    breaks: bool
    frame: str
    share: float


@dataclass(frozen=True)
class RegionDecision:
    """One region's partition: what its forward saves and its backward recomputes, and what that holds (bytes).

    index: the how-many-th region this partitioner split; aten_ops: call_function nodes of its joint graph;
    symbolic / sizes: the joint graph had symbolic sizes, planned at these (symbol -> `PlannedSize`: the size and
    where it came from, `planner.compiled.sizes`);
    room: what the step left to the block calls it was planned for (`StepRoom`);
    saved: names of the saved fx values (tensors; primals included, as torch's helpers keep them);
    saved_bytes: distinct storages saved beyond the region's inputs (`capture.joint_graph.saved_storage_bytes`);
    recomputed: the forward ops the backward computes again; held: what the modules hold (`HeldBytes`);
    excess: the most the calls hold beyond the room in a phase (<= 0: fits; see the module docstring);
    solver / status / solve_seconds: the solver's answer at `region_budget_bytes` with the boundary capped at
    `boundary_cap_bytes` (None: not capped); solves: how many solves the search made."""

    index: int
    aten_ops: int
    room: StepRoom
    symbolic: bool
    sizes: dict[str, PlannedSize]
    saved: tuple[str, ...]
    saved_bytes: int
    recomputed: tuple[str, ...]
    held: HeldBytes
    excess: int
    solver: str
    status: str
    solve_seconds: float
    region_budget_bytes: int
    boundary_cap_bytes: int | None
    solves: int
    part: BlockPart = None

    @property
    def hints(self) -> dict[str, int]:
        """symbol -> the size it was planned at."""
        return {k: v.size for k, v in self.sizes.items()}

    @property
    def bounded(self) -> bool:
        """Every symbolic size was planned at a largest size (False: a longer input holds more than planned)."""
        return all(v.bounded for v in self.sizes.values())

    def describe(self) -> str:
        sizes = ""
        if self.symbolic:
            told = ", ".join(f"{k}={v.size} ({v.origin}{'' if v.bounded else ', NOT BOUNDED'}; {v.source})"
                             for k, v in self.sizes.items())
            sizes = f", symbolic sizes planned at {told}"
        held = self.room.held(self.held)
        room = self.room.by_phase()
        phases = ", ".join(f"{k} {held[k]} of {room[k]} B" for k in PHASES)
        over = f" (OVER by {self.excess} B)" if self.excess > 0 else ""
        recomputed = ", ".join(self.recomputed) if self.recomputed else "nothing"
        if self.part is not None and self.part.share < 1:
            sizes += (f", part {self.part.position + 1} of a block that graph breaks ({self.part.frame}), planned "
                      f"within {self.part.share:g} of the blocks' room")
        return (f"region {self.index} ({self.aten_ops} aten ops{sizes}): {self.room.block_calls} calls hold "
                f"{phases} left to the blocks{over}; one call holds "
                f"{self.held.peak} B at most, {self.held.boundary} B after its forward; saves {len(self.saved)} "
                f"values, {self.saved_bytes} B: {', '.join(self.saved)}; recomputes {len(self.recomputed)} ops: "
                f"{recomputed}; {self.solver} ({self.status}, {self.solve_seconds:.2f} s) at a region budget of "
                f"{self.region_budget_bytes} B, boundary cap {self.boundary_cap_bytes} B, {self.solves} solves")


def block_frame() -> tuple[str, bool, bool, object]:
    """(dynamo frame's function name, whether a graph break ends the region being compiled, whether the frame is a
    resume function (the rest of a frame after a graph break), the frame's code object) for the compilation under way;
    ("", False, False, None) outside dynamo (a direct AOTAutograd call)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - no dynamo frame under way
        return "", False, False, None
    if tx is None:
        return "", False, False, None
    reason = getattr(tx.output, "compile_subgraph_reason", None)
    breaks = bool(getattr(reason, "graph_break", False))
    code = tx.f_code
    resumed = code.co_name.startswith("torch_dynamo_resume_in_")
    return code.co_name, breaks, resumed, code


def block_part(position: int, breaks: bool, frame: str) -> BlockPart:
    """A block whose forward graph breaks runs as several regions, one after the other in each block call. Each is
    planned within a share of the blocks' room: the region at `position` p takes 1/2^(p+1) where a graph break ends
    it, and all that the earlier ones leave, 1/2^p, where it ends the forward. The shares of one block's regions add up
    to at most 1, so what they hold together is bounded: while one region works, each other region's calls hold at
    most what its own planned phase allows (the forward's peak of a split is at least what it leaves, the backward's
    at least its saved values and its gradients), within its own share. A region of another function the forward
    calls (a graph break in a submodule: dynamo traces that function as a frame of its own) is not told apart from the
    block's forward: it is planned as a first region (NOT bounded together with the forward's). What the eager code
    between the regions allocates is not counted (the measuring step books it inside the blocks)."""
    share = 1.0 / 2 ** (position + 1) if breaks else 1.0 / 2 ** position
    return BlockPart(position, breaks, frame, share)


class BudgetUnknownError(RematError):
    """A region compiled before its budget was known (planner.compiled.api sets it at the model's first call)."""


@dataclass
class _Candidate:
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    held: HeldBytes
    result: object  # SolveResult
    region_budget_bytes: int
    boundary_cap_bytes: int | None
    excess: int


@dataclass
class PlannedPartitioner(CustomPartitionerFn):
    """See the module docstring. `room`: what the step leaves to the block calls (None until known);
    `step_budget_bytes`: the step's budget (for messages); `time_limit_s`: per region; `solver`: a name of
    `solvers.base`'s registry."""

    room: StepRoom | None = None
    step_budget_bytes: int | None = None
    time_limit_s: float = 10.0
    solver: str = "auto"
    regions: list[RegionDecision] = field(default_factory=list)
    sizes: SizeChooser = field(default_factory=SizeChooser)
    _positions: dict = field(default_factory=dict, repr=False)  # dynamo frame's code -> its BlockPart's position
    _next_position: int = field(default=1, repr=False)

    def _part(self) -> BlockPart:
        """Where the region being compiled lies in its block's forward (see `block_part`)."""
        frame, breaks, resumed, code = block_frame()
        if code is not None and code in self._positions:
            position = self._positions[code]
        else:
            position = self._next_position if resumed else 0
            if code is not None:
                self._positions[code] = position
        if breaks:
            self._next_position = position + 1
        return block_part(position, breaks, frame)

    def uuid(self) -> Any | None:
        return None  # no caching: a partition depends on the budget, which no cache key holds

    def summary(self) -> str:
        if not self.regions:
            return "no region compiled yet"
        return "\n".join(r.describe() for r in self.regions)

    # ---- the partition ---------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, joint_inputs, **kwargs) -> tuple[torch.fx.GraphModule,
                                                                                 torch.fx.GraphModule]:
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static_indices = kwargs.get("static_lifetime_input_indices") or []
        gm.graph.eliminate_dead_code()
        gm.recompile()
        if functorch_config.cse:
            gm.graph = fx_graph_cse(gm.graph)
        phs = gm.graph.find_nodes(op="placeholder")
        if not any(p.name.startswith("tangents") and p.users for p in phs):  # nothing flows back
            self._part()
            return default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                     static_lifetime_input_indices=static_indices)
        if self.room is None:
            raise BudgetUnknownError("the region's budget is not known yet: planner.compile sets it at the model's "
                                     "first training call")
        part = self._part()
        sizes, planned = self.sizes.choose(gm)
        unbounded = {k: v for k, v in planned.items() if not v.bounded}
        if unbounded:
            told = ", ".join(f"{k} ({v.source}) at {v.size}" for k, v in unbounded.items())
            warnings.warn(f"planner.compile: a compiled region has symbolic sizes with no known largest value, planned "
                          f"at the input that compiled it: {told}; a larger input later holds more than the budget "
                          f"allowed for. Pass planner.compile(..., largest=<the largest inputs>) or bound the sizes "
                          f"with torch._dynamo.mark_dynamic(x, dim, max=...)", stacklevel=2)
        region = region_graph(gm, num_fwd_outputs, cost_per_byte=COST_PER_BYTE, sizes=sizes)
        primals = [p for p in phs if not p.name.startswith("tangents")]
        static_nodes = OrderedSet(p for i, p in enumerate(primals) if i in static_indices)
        room = self.room.scaled(part.share)
        search = _Search(self, gm, region, num_fwd_outputs, static_nodes, room)
        best = search.run()
        self.regions.append(_decision(len(self.regions), gm, region, best, room, search.solves, num_fwd_outputs,
                                      planned, part))
        return best.fw, best.bw


class _Search:
    """The search for the split (see the module docstring): one partitioner call's state."""

    def __init__(self, owner: PlannedPartitioner, gm, region: RegionGraph, num_fwd_outputs: int, static_nodes,
                 room: StepRoom):
        self.owner, self.gm, self.region, self.room = owner, gm, region, room
        self.num_fwd_outputs, self.static_nodes = num_fwd_outputs, static_nodes
        self.solves = 0
        self.solve_limit_s = owner.time_limit_s / (len(BOUNDARY_SHARES) + 2)

    @staticmethod
    def fits(c: _Candidate) -> bool:
        return c.excess <= 0

    def candidate(self, region_budget: int, boundary_cap: int | None = None) -> _Candidate:
        """Solve within `region_budget` leaving at most `boundary_cap` at the boundary, split as the schedule says,
        and replay what the split holds. Raises the solver's InfeasibleBudgetError or NoSolutionInTimeError."""
        self.solves += 1
        probe = 0 if boundary_cap is None else region_budget - boundary_cap
        graph = self.region.with_boundary_probe(probe)
        result = solve(graph, region_budget, self.owner.solver, time_limit_s=self.solve_limit_s)
        saved, saved_sym = saved_values(self.gm, self.region, result.schedule, self.num_fwd_outputs)
        fw, bw = _extract_fwd_bwd_modules(self.gm, list(saved), saved_sym_nodes=list(saved_sym),
                                          num_fwd_outputs=self.num_fwd_outputs,
                                          static_lifetime_input_nodes=self.static_nodes)
        bw = raise_getitems(reordering_to_mimic_autograd_engine(bw))
        fw = raise_getitems(fw)
        held = held_bytes(fw, bw, self.region, self.num_fwd_outputs)
        return _Candidate(fw, bw, held, result, region_budget, boundary_cap, self.room.excess(held))

    def capped(self, cap: int, grads: int) -> _Candidate | None:
        """The split with the boundary capped at `cap` and the largest peak budget the room allows it, lowered once
        by each call's part of the excess where the modules hold more; None where the solvers find none."""
        room = self.room
        n = room.block_calls
        for _ in range(2):
            budget = min(room.forward_bytes - (n - 1) * cap, room.backward_bytes - (n - 1) * max(cap, grads))
            cap = min(cap, budget)
            if cap <= 0:
                return None
            try:
                c = self.candidate(budget, cap)
            except (InfeasibleBudgetError, NoSolutionInTimeError):
                return None
            if self.fits(c):
                return c
            cap -= -(-c.excess // n)
        return c

    def run(self) -> _Candidate:
        room = self.room
        top = reference_peak_bytes(self.region.graph)  # every value computed once, in the joint's order
        whole = self.candidate(top)
        if self.fits(whole):
            return whole
        largest = min(room.loss_bytes, room.tail_bytes) // room.block_calls
        best, closest = None, whole
        for share in BOUNDARY_SHARES:
            c = self.capped(int(share * largest), whole.held.grads)
            if c is None:
                continue
            if not self.fits(c):
                closest = min(closest, c, key=lambda k: k.excess)
                continue
            if best is not None and c.result.total_cost >= best.result.total_cost:
                break  # a smaller cap costs more from here on
            best = c
        if best is None:
            raise self._refusal(closest)
        return best

    def _refusal(self, closest: _Candidate, e: RematError | None = None) -> InfeasibleBudgetError:
        """The error for a room no split fits: it names the step budget the closest split found would need."""
        owner, room = self.owner, self.room
        step_budget = owner.step_budget_bytes
        need = None if step_budget is None else step_budget + closest.excess
        why = f"; the solvers: {e}" if e is not None else ""
        return InfeasibleBudgetError(
            step_budget if step_budget is not None else min(room.by_phase().values()), need, owner.solver,
            f"a compiled region ({self.region.aten_node_count} aten ops) called {room.block_calls} times does not "
            f"fit what the code outside the blocks leaves them ({room}): its closest split found holds "
            f"{closest.excess} bytes more in a phase{why}")


def saved_values(gm: torch.fx.GraphModule, region: RegionGraph, schedule: Schedule,
                 num_fwd_outputs: int) -> tuple[list, list]:
    """(tensor values, size values) the forward saves for a schedule of the region's graph, in the joint's order.

    A forward group resident where the schedule computes the `tangents` node is saved where the backward reads it;
    the backward recomputes every other forward value it needs, back to the saved ones and the primals (a primal it
    reads is saved: a parameter costs nothing more). A forward size (SymInt) it needs is saved (a scalar)."""
    resident: set[int] = set()
    for op in schedule.ops:
        if op.kind is OpKind.COMPUTE:
            if op.node == region.tangents_id:
                break
            resident.add(op.node)
        else:
            resident.discard(op.node)
    nodes = region.graph.nodes
    keep = {g for g in resident if not nodes[g].backward}
    tangents = {p for p in gm.graph.find_nodes(op="placeholder") if p.name.startswith("tangents")}
    from_tangents: set[torch.fx.Node] = set(tangents)
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in from_tangents for a in n.all_input_nodes):
            from_tangents.add(n)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(tree_leaves(out.args[0], is_leaf=lambda x: x is None))
    stack = [o for o in outs[num_fwd_outputs:] if isinstance(o, torch.fx.Node)]
    seen: set[torch.fx.Node] = set()
    saved: set[torch.fx.Node] = set()
    sizes: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in tangents:
            continue
        if n.op == "placeholder":
            (sizes if is_sym_node(n) else saved).add(n)
            continue
        if n.op != "call_function":
            continue
        if n not in from_tangents and is_sym_node(n):
            sizes.add(n)
            continue
        if n not in from_tangents and region.group_of.get(n.name) in keep:
            saved.add(n)
            continue
        stack.extend(n.all_input_nodes)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    return sorted(saved, key=order.__getitem__), sorted(sizes, key=order.__getitem__)


def _decision(index: int, gm, region: RegionGraph, c: _Candidate, room: StepRoom, solves: int,
              num_fwd_outputs: int, sizes: dict[str, PlannedSize], part: "BlockPart") -> RegionDecision:
    fw_out = next(n for n in c.fw.graph.nodes if n.op == "output")
    saved = tuple(o.name for o in tree_leaves(fw_out.args[0])[num_fwd_outputs:] if isinstance(o, torch.fx.Node))
    return RegionDecision(
        index=index, aten_ops=region.aten_node_count, room=room, symbolic=region.symbolic,
        sizes=dict(sizes), saved=saved,
        saved_bytes=saved_storage_bytes(c.fw, num_fwd_outputs), recomputed=tuple(forward_ops_in(c.bw, gm)),
        held=c.held, excess=c.excess, solver=c.result.solver, status=c.result.status.value,
        solve_seconds=c.result.solve_seconds, region_budget_bytes=c.region_budget_bytes,
        boundary_cap_bytes=c.boundary_cap_bytes, solves=solves, part=part)
