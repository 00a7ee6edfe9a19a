"""The tracer: one joint forward+backward aten graph of an nn.Module, priced and turned into a `Graph`.

`trace(model, sample_input)` captures the joint graph with AOTAutograd (a custom partition_fn that
keeps the joint module and stops there), runs it once on real tensors to learn which outputs share
storage and what every op allocates and costs, contracts it (`capture.contract`) and returns a
`TraceResult`: the project's graph plus everything the executor needs to run a schedule of it.

A first eager forward (no grad, state restored) records every scalar the forward reads from a tensor.
When there are any, the capture runs on real values (fake tensors that carry real data,
`fake_tensor_propagate_real_tensors`; parameters are fakeified as plain tensors, whose data torch copies),
so models that read a tensor's value in Python (`.item()`, `if torch.all(mask):`) trace, the graph
specialised to the sample input; otherwise the capture is purely symbolic on static shapes. Either way
the joint graph then runs once on real tensors to learn storages and costs. The specialisation (input
shapes, dtypes, and every scalar the forward read from a tensor, in order) is recorded in
`TraceResult.specialisation`; `TraceResult.check_input` refuses an input that differs in shape or dtype
or that would read different values. The module-level globals the forward code reads are recorded too
(`TraceResult.global_reads`, checked by the planned module at every call), and a forward that draws from
Python's or numpy's global generator is refused: the graph would replay the numbers drawn while tracing.

This is the only module of the project that imports torch.fx (with `costs`, `contract` and
`measure_memory`, its helpers). Solvers see only the returned `graphs.ir.Graph`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from capture import costs as _costs
from capture import counter_momentum, meta_overrides
from capture.call import CallSpec
from capture.contract import OpRecord
from capture.contract import contract as _contract
from capture.fx_nodes import nodes_by_name
from capture.global_reads import GlobalReads
from capture.guards import Guard, record_reads_and_guard
from capture.measure_memory import peak_bytes_created_during, storage_bytes
from capture.random_draws import node_draws_random
from capture.state import drawn_host_generators, host_rng_state, restored_rng, swapped_state
from graphs.errors import SpecialisationError, TraceError  # noqa: F401 (re-exported for callers of trace)
from graphs.ir import Graph, Node

COST_MODELS = ("flops", "time", "roofline")


# ---------------------------------------------------------------------------------------------
# Output structure
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputSpec:
    """The structure of the model's output, with tensor leaves replaced by slots.

    kind: "tensor" (one slot), "const" (a non-tensor value kept as is: None, a number, a string),
    "sequence" (a tuple, list or namedtuple), "mapping" (a dict or a dict-like object such as an
    OrderedDict subclass). `unflatten(leaves)` rebuilds the object from the tensors in slot order.
    """

    kind: str
    type: Any = None
    keys: tuple = ()
    children: tuple["OutputSpec", ...] = ()
    value: Any = None

    @property
    def num_leaves(self) -> int:
        if self.kind == "tensor":
            return 1
        return sum(c.num_leaves for c in self.children)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        it = iter(leaves)
        out = self._build(it)
        return out

    def _build(self, it) -> Any:
        if self.kind == "tensor":
            return next(it)
        if self.kind == "const":
            return self.value
        vals = [c._build(it) for c in self.children]
        if self.kind == "sequence":
            if hasattr(self.type, "_fields"):  # namedtuple
                return self.type(*vals)
            return self.type(vals)
        try:
            return self.type(zip(self.keys, vals))
        except Exception:  # a dict-like type whose constructor wants something else
            return dict(zip(self.keys, vals))


def own_loss_leaf(out: Any, leaves: list[torch.Tensor]) -> int | None:
    """The index among the output's leaves of the loss the model computed itself (a scalar floating-point `loss`
    entry, as transformers models given labels return), or None.

    When there is one, the step differentiates that loss alone: the trace gives the other outputs no incoming
    gradient, so the backward holds no zero gradient of the logits that eager would not hold either. The planned
    module refuses, at the backward, a gradient that reaches one of the other outputs (see the executor)."""
    loss = out.get("loss") if isinstance(out, Mapping) else None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point() and loss.requires_grad):
        return None
    return next((k for k, t in enumerate(leaves) if t is loss), None)


def flatten_output(out: Any, where: str = "output") -> tuple[list[torch.Tensor], OutputSpec]:
    """Tensor leaves of a model output and its OutputSpec. Raises TraceError on unknown containers."""
    leaves: list[torch.Tensor] = []

    def go(x: Any, path: str) -> OutputSpec:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return OutputSpec("tensor")
        if x is None or isinstance(x, (bool, int, float, str)):
            return OutputSpec("const", value=x)
        if isinstance(x, Mapping):
            keys = tuple(x.keys())
            return OutputSpec("mapping", type(x), keys, tuple(go(x[k], f"{path}[{k!r}]") for k in keys))
        if isinstance(x, (tuple, list)):
            return OutputSpec("sequence", type(x), (), tuple(go(v, f"{path}[{i}]") for i, v in enumerate(x)))
        hint = ""
        if type(x).__name__.endswith("Cache"):  # a transformers key/value cache, returned when use_cache is on
            hint = ("; a training step does not use the key/value cache: plan with use_cache=False in the batch, or "
                    "plan in place with planner.enable(model, budget_gb), which runs the model's code as written")
        raise TraceError(
            f"the model's {path} is a {type(x).__name__}, which the tracer cannot look into: return tensors, "
            f"or tuples, lists or dicts of them{hint}"
        )

    spec = go(out, where)
    if not leaves:
        raise TraceError("the model's output carries no tensors: there is nothing to differentiate")
    return leaves, spec


# ---------------------------------------------------------------------------------------------
# Specialisation
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Specialisation:
    """What the traced graph assumes about its input.

    input_shapes / input_dtypes / input_devices: one entry per user input tensor, in order.
    training: the model's `training` flag when traced.
    scalar_reads: every scalar the forward read from a tensor, in program order, as (op, value);
    the graph took the branches these values chose and baked them in as constants.
    read_sites: where in the model's code each of them was read, as `file:line (source)`.
    """

    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    input_devices: tuple[str, ...]
    training: bool
    scalar_reads: tuple[tuple[str, Any], ...]
    read_sites: tuple[str, ...] = ()

    def describe(self) -> str:
        reads = ", ".join(f"{op}={v!r}" for op, v in self.scalar_reads) or "none"
        return f"shapes {list(self.input_shapes)}, dtypes {list(self.input_dtypes)}, scalar reads: {reads}"


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------
@dataclass
class TraceResult:
    """A traced training step: the planner's graph and what the executor needs to run it.

    graph: the `graphs.ir.Graph`. Node ids follow a topological order of the joint graph (the fx
        order with alias groups placed at their first op). `fixed_bytes` = distinct storage bytes of
        parameters, buffers, user inputs and tangents (the gradients fed to the backward, ones for a
        scalar loss). Every node whose value is an output of the joint module (forward outputs,
        updated buffers, parameter gradients) has retain=True. `backward` comes from AOTAutograd's
        partitioner tag of the group's anchor op. Random ops (dropout...) make their node
        recomputable=False: their RNG state is not replayed. A node's bytes are the storages its ops
        newly allocate; views, aliases and the first getitem of a multi-output op join the node of
        the op owning their storage. Each further output of a multi-output op (a layer norm's
        statistics, a dropout mask, a backward op's weight gradient) is a node of its own (the
        getitem), listing the op's node and the op's inputs as inputs, recomputable=False: an
        executor materialises it from the op's result when the op runs, keeping that result until
        every such getitem node has run. Secondary outputs of one op with the same readers share one
        node.
    joint_module: the fx GraphModule of the joint forward+backward aten graph, called as
        `joint_module(primals, tangents)` (two lists; pytree codegen) and returning a pair
        (forward outputs, gradients) of tuples; `run_joint` returns them as one flat list, the joint
        outputs described by `output_kinds`.
    node_map: graph node id -> the names of the fx nodes (of `joint_module`) it covers, in fx order.
    num_fwd_outputs: how many leading joint outputs belong to the forward (buffer updates, user
        outputs, intermediate bases); the rest are gradients, one per primal (None where no gradient).
    param_names / buffer_names: the primals, in order: parameters (tied parameters appear once, under
        their first name), then buffers, then `num_user_inputs` user input tensors.
    tangent_outputs: for each tangent placeholder, the index of the user output leaf it is the
        gradient of.
    own_loss_leaf: the leaf of the loss the model computed itself (`own_loss_leaf`), the only one then
        differentiated; None when the model returns no such loss.
    global_reads: the module-level globals the forward code read and their values, which the graph holds as
        constants (`capture.global_reads.GlobalReads`; None in a TraceResult made otherwise).
    check_bytes: the peak bytes that checking an input against the scalar reads makes beside the model and its
        inputs (`check_input`: the guard's replay, or without a guard the forward run again), measured on the
        sample; 0 when the forward reads no values. A step checks before it runs: its peak is at least the model,
        its inputs and this.
    output_kinds: one entry per joint output: ("buffer_update", buffer name), ("output", leaf index),
        ("intermediate_base", None), ("grad", primal index) or ("none", primal index) for a primal
        without a gradient.
    output_spec: the structure of the model's output (`OutputSpec.unflatten(leaves)` rebuilds it).
    specialisation: what the graph assumes about its input (see `Specialisation`).
    cost_model / cost_unit: "flops" (FLOPs), "time" (seconds measured here) or "roofline" (seconds
        on `device_name`).
    aten_node_count: call_function nodes of the joint module; `graph.n` is the count after contraction.
    flops: FLOPs per fx node name (registry formulas, whatever the cost model).
    fixed_views: names of fx nodes that are views of fixed memory only (a weight's `t`, a view of a
        tangent or of another such view). They allocate nothing, cost nothing and their graph node
        lists no inputs: an executor rebuilds them from the primals whenever a group needs one that
        is not at hand (e.g. `t_7 = t(t_4)` where `t_4` sits in another group).
    trace_seconds: wall time of `trace`; phase_seconds splits it (scalar_reads, capture,
        analysis_and_costs, contract_and_graph).
    """

    graph: Graph
    joint_module: torch.fx.GraphModule
    node_map: dict[int, list[str]]
    num_fwd_outputs: int
    param_names: list[str]
    buffer_names: list[str]
    num_user_inputs: int
    tangent_outputs: list[int]
    output_kinds: list[tuple[str, Any]]
    output_spec: OutputSpec
    specialisation: Specialisation
    cost_model: str
    cost_unit: str
    aten_node_count: int
    flops: dict[str, int] = field(default_factory=dict)
    fixed_views: set[str] = field(default_factory=set)
    device_name: str | None = None
    trace_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    model: torch.nn.Module | None = field(default=None, repr=False)
    guard: Guard | None = field(default=None, repr=False)
    call_spec: CallSpec | None = None  # how the model is called (None: positional inputs only)
    own_loss_leaf: int | None = None
    global_reads: GlobalReads | None = field(default=None, repr=False)  # the globals the forward code read
    check_bytes: int = 0

    @cached_property
    def fx_nodes(self) -> dict[str, torch.fx.Node]:
        """fx node name -> node of `joint_module`."""
        return nodes_by_name(self.joint_module)

    @property
    def total_flops(self) -> int:
        return int(sum(self.flops.values()))

    @property
    def num_primals(self) -> int:
        return len(self.param_names) + len(self.buffer_names) + self.num_user_inputs

    def primals(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """The primal list for `joint_module`: the model's parameters, buffers, then `inputs`."""
        if self.model is None:
            raise TraceError("this TraceResult holds no model")
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        return [params[n] for n in self.param_names] + [buffers[n] for n in self.buffer_names] + list(inputs)

    def run_joint(self, primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]) -> list:
        """Run `joint_module` and return its outputs as one flat list (see `output_kinds`)."""
        with torch._C._DisableAutocast():  # the graph holds autocast's casts from its capture
            fwd, grads = self.joint_module(list(primals), list(tangents))
        return [*fwd, *grads]

    def tangents_like(self, primals: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Tangents of ones with the traced shapes, dtypes and strides (the gradient of a summed output)."""
        out = []
        for ph in _placeholders(self.joint_module)[self.num_primals :]:
            out.append(_ones_like_meta(ph.meta["val"]))
        return out

    def check_input(self, *inputs: torch.Tensor) -> None:
        """Raise SpecialisationError if `inputs` would not take the traced path.

        Checks count, shapes, dtypes and devices; if the traced forward read scalars from tensors, recomputes
        them with `guard` (the reads' backward slices, usually a few ops on the inputs: see capture.guards) and
        compares; without a guard (a slice that mutates state or draws random numbers) it runs the forward once
        more (no grad, buffers and RNG restored).
        """
        sp = self.specialisation
        if len(inputs) != len(sp.input_shapes):
            raise SpecialisationError(f"traced with {len(sp.input_shapes)} inputs, got {len(inputs)}")
        for k, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise SpecialisationError(f"input {k} is a {type(t).__name__}, the trace took a tensor")
            if tuple(t.shape) != sp.input_shapes[k]:
                raise SpecialisationError(
                    f"input {k} has shape {tuple(t.shape)}; the graph is specialised to {sp.input_shapes[k]}"
                )
            if str(t.dtype) != sp.input_dtypes[k] or str(t.device) != sp.input_devices[k]:
                raise SpecialisationError(
                    f"input {k} is {t.dtype} on {t.device}; the graph is specialised to "
                    f"{sp.input_dtypes[k]} on {sp.input_devices[k]}"
                )
        if self.model is not None and self.model.training != sp.training:
            raise SpecialisationError(f"the model was traced with training={sp.training}")
        if sp.scalar_reads and self.model is not None:
            if self.guard is not None:
                reads = tuple((op, value) for (op, _), value in
                              zip(sp.scalar_reads, self.guard.reads(self.model, *inputs)))
            else:
                reads, _, _ = record_reads_and_guard(self.model, tuple(inputs), self.call_spec)
            for k, (old, new) in enumerate(zip(sp.scalar_reads, reads)):
                if old != new:
                    at = f" at {sp.read_sites[k]}" if k < len(sp.read_sites) else ""
                    raise SpecialisationError(
                        f"the forward's scalar read #{k} ({old[0]}{at}) gave {new[1]!r} where the trace saw "
                        f"{old[1]!r}: this input takes another path than the traced graph"
                    )
            if len(reads) != len(sp.scalar_reads):
                raise SpecialisationError(
                    f"the forward read {len(reads)} scalars from tensors where the trace read "
                    f"{len(sp.scalar_reads)}: this input takes another path than the traced graph"
                )

    def forward_bytes_for_backward(self) -> int:
        """Bytes of forward nodes read by backward nodes: what checkpoint-all keeps for the backward."""
        g = self.graph
        total = 0
        for v in range(g.n):
            if not g.nodes[v].backward and any(g.nodes[u].backward for u in g.users[v]):
                total += int(g.nodes[v].bytes)
        return total

    def summary(self) -> str:
        ratio = self.graph.n / max(self.aten_node_count, 1)
        return (
            f"{self.graph.name}: {self.aten_node_count} aten nodes -> {self.graph.n} graph nodes "
            f"({100 * ratio:.1f}%), fixed {self.graph.fixed_bytes} B, {self.total_flops} FLOPs, "
            f"cost model {self.cost_model}, traced in {self.trace_seconds:.2f} s"
        )


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------
class _NeedsValues(Exception):
    """The symbolic capture met a data-dependent read: capture again on real values."""


def _is_data_dependent(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 20:
        if type(e).__name__ in ("DynamicOutputShapeException",) or "DataDependent" in type(e).__name__ \
                or "data-dependent" in str(e) or "data dependent" in str(e):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _has_unbacked_shapes(gm: torch.fx.GraphModule) -> bool:
    """Whether a value of the graph has a size known only when it runs (nonzero, masked_select)."""
    for n in gm.graph.nodes:
        for v in tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
                return True
    return False


_HOST_GENERATORS = {
    "random": "Python's global generator (random.random, random.choice, ...)",
    "numpy.random": "numpy's global generator (np.random.rand, np.random.choice, ...)",
}


@contextlib.contextmanager
def _refusing_host_draws() -> Iterator[None]:
    """Raise TraceError when the forward traced within draws from Python's or numpy's global generator: the graph
    holds the numbers drawn while tracing as constants, and every planned step would reuse them."""
    before = host_rng_state()
    yield
    drawn = drawn_host_generators(before, host_rng_state())
    if drawn:
        raise TraceError(
            f"the forward draws from {' and '.join(_HOST_GENERATORS[g] for g in drawn)}, which a traced graph "
            "cannot replay: every planned step would reuse the numbers drawn while tracing; draw with torch's "
            "generator instead (torch.rand, torch.randint, torch.randperm, dropout), which the plan replays exactly"
        )


class _Captured(Exception):
    """Raised by the partition function to stop AOTAutograd once the joint graph is in hand."""


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _ones_like_meta(val: torch.Tensor) -> torch.Tensor:
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
    return t.fill_(1)


@contextlib.contextmanager
def _quiet_symbolic_shapes():
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain leaf tensor on the same storage (requires_grad kept), for fakeifying with real values: torch
    2.13's fake-tensor converter copies the data of a plain `torch.Tensor` only, and gives a parameter (an
    nn.Parameter is a subclass) an uninitialised real tensor, whose garbage the forward's value reads then see."""
    return t.detach().requires_grad_(t.requires_grad)


def _capture_joint(model, params, buffers, inputs, call: CallSpec, real_values: bool):
    """AOTAutograd joint capture. Returns (gm, num_fwd_outputs, output spec).

    With `real_values` the fake tensors carry real data (every op also runs for real), so that a
    forward that reads tensor values traces, specialised to them; without it the capture is
    purely symbolic on static shapes (faster; enough when the forward reads no values).
    """
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    names = list(params) + list(buffers)
    n_state = len(names)
    holder: dict[str, Any] = {}

    def flat_fn(*args):
        state = dict(zip(names, args[:n_state]))
        call_args, call_kwargs = call.split(args[n_state:])
        with swapped_state(model, state):
            out = model(*call_args, **call_kwargs)
        leaves, spec = flatten_output(out)
        holder["spec"] = spec
        loss_at = own_loss_leaf(out, leaves)
        holder["own_loss_leaf"] = loss_at
        if loss_at is not None:  # only the model's own loss is differentiated (see own_loss_leaf)
            leaves = [t if k == loss_at else t.detach() for k, t in enumerate(leaves)]
        return tuple(leaves)

    def capture(joint_module, joint_inputs, *, num_fwd_outputs, **_):
        holder["gm"] = joint_module
        holder["num_fwd_outputs"] = num_fwd_outputs
        raise _Captured()

    def nop(gm, _inputs):
        return gm

    compiled = aot_function(flat_fn, fw_compiler=nop, bw_compiler=nop, partition_fn=capture)
    real = [*params.values(), *buffers.values(), *inputs]
    with torch._functorch.config.patch(
        enable_autograd_cache=False, fake_tensor_propagate_real_tensors=real_values
    ), _quiet_symbolic_shapes(), meta_overrides.overrides():
        mode = FakeTensorMode(shape_env=ShapeEnv() if real_values else None)
        fake = [mode.from_tensor(_plain_tensor(t), static_shapes=True) for t in real]
        try:
            compiled(*fake)
        except _Captured:
            pass
        except TraceError:
            raise
        except Exception as e:  # AOTAutograd's own errors: name the cause
            if not real_values and _is_data_dependent(e):
                raise _NeedsValues() from e
            raise TraceError(f"AOTAutograd could not capture the joint graph: {type(e).__name__}: {e}") from e
    if "gm" not in holder:
        raise TraceError(
            "AOTAutograd produced no joint graph: no output of the model requires grad "
            "(are all parameters frozen, or is the model under torch.no_grad?)"
        )
    return holder["gm"], holder["num_fwd_outputs"], holder["spec"], holder["own_loss_leaf"]


def _grads_in_parameter_layout(gm: torch.fx.GraphModule, kinds: list, params: list[torch.Tensor]) -> None:
    """Give each parameter's gradient the parameter's (contiguous) layout in the graph, where the graph makes it in
    another (a convolution fed a channels-last-strided input computes its weight gradient channels-last): autograd
    would copy it into the parameter's layout when it accumulates it, a gradient-sized allocation outside the graph
    that the memory model would not see. The copy made in the graph instead is counted, and autograd copies
    nothing (the values are the same)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    order = {n: j for j, n in enumerate(gm.graph.nodes)}  # the nodes before any copy is inserted
    changed = False
    for k, (kind, i) in enumerate(kinds):
        g = outs[k] if k < len(outs) else None
        if kind != "grad" or i >= len(params) or not isinstance(g, torch.fx.Node):
            continue
        val, param = g.meta.get("val"), params[i]
        if not isinstance(val, torch.Tensor) or not param.is_contiguous() or val.is_contiguous() or \
                val.shape != param.shape:
            continue
        at = g
        if g.target is operator.getitem and isinstance(g.args[0], torch.fx.Node):  # after every output of its op
            at = max(g.args[0].users, key=order.__getitem__)
        with gm.graph.inserting_after(at):  # where it is made, so the graph's own layout dies at once
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (g,),
                                          {"memory_format": torch.contiguous_format})
        copy.meta = {**{m: v for m, v in g.meta.items() if m != "val"},
                     "val": val.clone(memory_format=torch.contiguous_format)}
        outs[k] = copy
        changed = True
    if changed:
        out_node.args = (type(out_node.args[0])(outs), *out_node.args[1:])
        gm.recompile()


def _describe_outputs(gm, n_params, n_buffers, buffer_names, num_leaves):
    """output_kinds and tangent_outputs from AOTAutograd's descriptors; refuse what cannot run."""
    from torch._functorch._aot_autograd import descriptors as D

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    descs = out_node.meta.get("desc")
    if descs is None:
        raise TraceError("the joint graph carries no output descriptors (unexpected torch version?)")
    kinds: list[tuple[str, Any]] = []
    seen_leaves = set()
    for k, d in enumerate(descs):
        if isinstance(d, D.InputMutationAOTOutput):
            idx = d.mutated_input.idx
            if idx < n_params:
                raise TraceError(f"the forward mutates parameter #{idx} in place; the tracer refuses it")
            if idx >= n_params + n_buffers:
                raise TraceError(
                    f"the forward mutates its input #{idx - n_params - n_buffers} in place; a replayed or "
                    "recomputed forward would see the mutated value, so the tracer refuses it"
                )
            kinds.append(("buffer_update", buffer_names[idx - n_params]))
        elif isinstance(d, D.PlainAOTOutput):
            kinds.append(("output", d.idx))
            seen_leaves.add(d.idx)
        elif isinstance(d, D.IntermediateBaseAOTOutput):
            kinds.append(("intermediate_base", None))
        elif isinstance(d, D.GradAOTOutput):
            kinds.append(("grad", d.grad_of.idx))
        elif d is None:
            kinds.append(("none", k))
        else:
            raise TraceError(f"joint output {k} is a {type(d).__name__}, which the tracer does not handle")
    missing = sorted(set(range(num_leaves)) - seen_leaves)
    if missing:
        raise TraceError(
            f"output leaves {missing} are not computed by the graph (they alias an input or a parameter); "
            "return a computed tensor instead (e.g. clone it)"
        )
    # fix "none" entries to carry the primal index they stand for
    n_grads = len(descs) - sum(1 for kd in kinds if kd[0] in ("buffer_update", "output", "intermediate_base"))
    first_grad = len(descs) - n_grads
    kinds = [("none", k - first_grad) if kd[0] == "none" else kd for k, kd in enumerate(kinds)]
    tangents = []
    for ph in _placeholders(gm):
        d = ph.meta.get("desc")
        if isinstance(d, D.TangentAOTInput):
            out = d.output
            tangents.append(out.idx if isinstance(out, D.PlainAOTOutput) else -1)
    return kinds, tangents


# ---------------------------------------------------------------------------------------------
# Real run: storages, FLOPs, bytes moved
# ---------------------------------------------------------------------------------------------
class _RecordingInterpreter(torch.fx.Interpreter):
    """Runs the joint graph on real tensors keeping every value, and notes each op's real args."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.calls: dict[str, tuple] = {}

    def run_node(self, n):
        if n.op != "call_function":
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = self.call_function(n.target, args, kwargs)
        self.calls[n.name] = (args, kwargs)
        return out


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen: dict[torch.fx.Node, None] = {}
    for a in node.all_input_nodes:
        seen[a] = None
    return list(seen)


@functools.cache
def _cpu_loss_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mse_loss.default, aten.smooth_l1_loss.default, aten.binary_cross_entropy.default,
                      aten.soft_margin_loss.default})


def _cpu_reduction_buffer_bytes(n: torch.fx.Node, args, value) -> int:
    """The storage a CPU loss kernel really returns: mse_loss, smooth_l1_loss, binary_cross_entropy and
    soft_margin_loss compute the unreduced loss into a buffer of the broadcast inputs' size and return the mean or
    sum as a 0-d view of it, so the scalar loss holds that buffer for as long as it lives (checked on torch 2.13;
    fake tensors give 4 bytes). 0 for any other op or device."""
    if n.target not in _cpu_loss_ops() or not isinstance(value, torch.Tensor):
        return 0
    inputs = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if len(inputs) < 2 or getattr(inputs[0], "fake_device", inputs[0].device).type != "cpu":
        return 0
    return math.prod(torch.broadcast_shapes(inputs[0].shape, inputs[1].shape)) * value.element_size()


def _build_records(gm, flat_args, cost_model, device, real_run):
    """One OpRecord per call_function node, in fx order, from a (fake or real) run of the joint graph."""
    interp = _RecordingInterpreter(gm)
    if real_run:
        with torch.no_grad():
            interp.run(*flat_args, enable_io_processing=False)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(t, static_shapes=True) for t in flat_args]
        with torch.no_grad(), mode:
            interp.run(*fake_args, enable_io_processing=False)
    env = interp.env
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(ops)}
    owner: dict[StorageWeakRef, int] = {}
    for ph in _placeholders(gm):
        for t in tree_leaves(env[ph]):
            if isinstance(t, torch.Tensor):
                owner[StorageWeakRef(t.untyped_storage())] = -1
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = {a for a in tree_leaves(out_node.args) if isinstance(a, torch.fx.Node)}
    tangent_nodes = {ph for ph in _placeholders(gm) if ph.name.startswith("tangents")}
    depends_on_tangent: set[torch.fx.Node] = set()
    records: list[OpRecord] = []
    flops: dict[str, int] = {}
    fixed_views: set[str] = set()
    main_output: dict[int, int] = {}  # multi-output op -> the output index that stays with it
    for n in ops:
        if n.target is operator.getitem and n.args[0] in index:
            op_i = index[n.args[0]]
            main_output[op_i] = min(main_output.get(op_i, n.args[1]), n.args[1])
    device_spec = _costs.get_device(device) if cost_model == "roofline" else None
    for i, n in enumerate(ops):
        value = env[n]
        new_bytes = 0
        shares: set[int] = set()
        for t in tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = StorageWeakRef(st)
            if key in owner:
                if owner[key] >= 0 and owner[key] != i:
                    shares.add(owner[key])
                continue
            owner[key] = i
            new_bytes += int(st.nbytes())
        if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
            # a size read at run time (sym_size of a nonzero's output): part of the tensor it measures, so that the
            # ops reading both (an expand to that size) cannot separate them
            shares.update(index[a] for a in _tensor_inputs(n) if a in index)
        is_secondary = False
        if n.target is operator.getitem and n.args[0] in index and isinstance(env[n.args[0]], (tuple, list)):
            # A getitem of a multi-output op: the op's first output stays with the op (same group);
            # every other output it allocated becomes this node's own value, so that outputs with
            # different lifetimes (a normalised activation and its saved statistics, grad_input and
            # grad_weight) are freed separately. The node reads the op's inputs too, so the inputs
            # stay alive until every output exists (as they do when the op runs), and it is not
            # recomputable on its own (recomputing it means rerunning the op).
            op_i = index[n.args[0]]
            if n.args[1] != main_output.get(op_i, 0):
                moved = 0
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        key = StorageWeakRef(t.untyped_storage())
                        if owner.get(key) == op_i:
                            owner[key] = i
                            moved += int(t.untyped_storage().nbytes())
                if moved:
                    records[op_i].bytes -= moved
                    new_bytes, shares, is_secondary = moved, set(), True
        args, kwargs = interp.calls[n.name]
        if not real_run and new_bytes:
            new_bytes = max(new_bytes, _cpu_reduction_buffer_bytes(n, args, value))
        f = _costs.node_flops(n, args, kwargs, value)
        flops[n.name] = f
        ins = _tensor_inputs(n)
        if any(a in tangent_nodes or a in depends_on_tangent for a in ins):
            depends_on_tangent.add(n)
        tag = n.meta.get("partitioner_tag")
        backward = (tag == "is_backward") if tag is not None else (n in depends_on_tangent)
        aliasing = new_bytes == 0 and bool(shares or any(owner.get(StorageWeakRef(t.untyped_storage())) == -1
                                                         for t in tree_leaves(value) if isinstance(t, torch.Tensor)))
        if cost_model == "flops":
            cost = float(f)
        elif cost_model == "roofline":
            cost = _costs.roofline_seconds(f, _costs.bytes_moved(args, kwargs, value, aliasing), device_spec)
        else:
            cost = 0.0  # filled in from timings
        rec_inputs = {index[a] for a in ins if a in index}
        if new_bytes == 0 and not shares and aliasing:
            # a view of fixed memory only (a weight's transpose, a view of a tangent): free to
            # rebuild from the parameters at any time, so it depends on no other op
            fixed_views.add(n.name)
            rec_inputs = set()
        if is_secondary:
            rec_inputs |= set(records[index[n.args[0]]].inputs)
        records.append(
            OpRecord(
                name=n.name,
                inputs=tuple(sorted(rec_inputs)),
                shares_with=tuple(sorted(shares)),
                bytes=new_bytes,
                cost=cost,
                backward=backward,
                random=node_draws_random(n),
                retain=n in outputs,
                cheap=not _costs.has_flop_formula(n),
                flops=f,
                recomputable=not is_secondary,
            )
        )
    del interp, env
    return records, flops, fixed_views


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def trace(
    model: torch.nn.Module,
    sample_input: torch.Tensor | tuple | list,
    *,
    cost_model: str = "flops",
    device_name: str | None = None,
    contract: bool = True,
    merge_chains: bool = False,
    time_repeats: int = 3,
    real_run: bool = False,
) -> TraceResult:
    """Trace one training step of `model` on `sample_input` into a `TraceResult`.

    sample_input: a tensor, a tuple/list of tensors (the positional arguments of `model`), a dict of keyword
        arguments, or (args, kwargs) (see capture.call: non-tensor keyword values are constants of the graph).
    cost_model: "flops" (registry FLOPs), "time" (seconds per op measured here: 1 warm-up run, the
        median of `time_repeats` runs) or "roofline" (seconds on `device_name`, one of
        `capture.costs.DEVICES`).
    real_run: learn storages and FLOPs by running the joint graph on real tensors (default: on fake
        tensors, which model storage sharing the same way and cost no compute).
    contract: group views and getitems with the op that owns their storage, fold free views of
        weights into their user, and (with `merge_chains`, off by default: it saves few nodes and sizes
        a merged chain by its transient peak, a slight overestimate) fold chains of cheap ops. Without it the
        graph has one node per aten op and the readers of a view also read the view's base.
    The model runs in its current mode (call `model.train()` first for a training step); its
    parameters, buffers and RNG state are left as they were.
    Raises TraceError naming the cause when the model cannot be traced, ValueError for a bad
    cost_model or device.
    """
    t0 = time.perf_counter()
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model '{cost_model}'; choose one of {', '.join(COST_MODELS)}")
    if cost_model == "roofline":
        if device_name is None:
            raise ValueError("cost_model='roofline' needs device_name (one of " + ", ".join(_costs.DEVICES) + ")")
        _costs.get_device(device_name)
    call, inputs = CallSpec.of(sample_input)
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    buffers = dict(model.named_buffers())

    phases: dict[str, float] = {}
    devices = sorted({t.device.index for t in inputs if t.is_cuda} - {None})
    scalar_reads: tuple = ()
    check_bytes = 0
    read_sites: tuple = ()
    guard: Guard | None = None
    with counter_momentum.counted_momenta(model) as counters:  # BatchNorm momentum=None: see capture.counter_momentum
        try:  # symbolic capture first: fast, and enough unless the forward reads tensor values
            with restored_rng(devices), _refusing_host_draws():
                gm, num_fwd_outputs, out_spec, loss_leaf = _capture_joint(model, params, buffers, inputs, call, False)
        except _NeedsValues:
            check_bytes, (scalar_reads, guard, read_sites) = peak_bytes_created_during(
                record_reads_and_guard, model, inputs, call, refuse_self_updating=True)
            if guard is not None:  # what a step's check makes: the replay of the reads' slices
                check_bytes, _ = peak_bytes_created_during(guard.reads, model, *inputs)
            phases["scalar_reads"] = time.perf_counter() - t0
            with restored_rng(devices), _refusing_host_draws():
                gm, num_fwd_outputs, out_spec, loss_leaf = _capture_joint(model, params, buffers, inputs, call, True)
    placeholders = _placeholders(gm)
    counter_momentum.rewrite(gm, counters, dict(zip(buffers, placeholders[len(params):len(params) + len(buffers)])))
    phases["capture"] = time.perf_counter() - t0 - sum(phases.values())
    spec = Specialisation(
        input_shapes=tuple(tuple(t.shape) for t in inputs),
        input_dtypes=tuple(str(t.dtype) for t in inputs),
        input_devices=tuple(str(t.device) for t in inputs),
        training=bool(model.training),
        scalar_reads=scalar_reads,
        read_sites=read_sites,
    )
    kinds, tangent_outputs = _describe_outputs(gm, len(params), len(buffers), list(buffers), out_spec.num_leaves)
    _grads_in_parameter_layout(gm, kinds, list(params.values()))

    primals = [*params.values(), *buffers.values(), *inputs]
    tangents = [_ones_like_meta(ph.meta["val"]) for ph in _placeholders(gm)[len(primals):]]
    flat_args = [p.detach() for p in primals] + tangents
    fixed_bytes = storage_bytes(flat_args)
    # the joint graph holds the casts autocast made while it was captured: it runs with autocast off
    with restored_rng(devices), torch._C._DisableAutocast(), meta_overrides.overrides():
        # a graph with data-dependent output shapes (nonzero: captured on real values) runs for real
        records, flops, fixed_views = _build_records(gm, flat_args, cost_model, device_name,
                                                     real_run or _has_unbacked_shapes(gm))
        if cost_model == "time":
            times = _costs.time_nodes(gm, flat_args, warmup=1, repeats=time_repeats)
            for r in records:
                r.cost = times.get(r.name, 0.0)

    phases["analysis_and_costs"] = time.perf_counter() - t0 - sum(phases.values())
    con = _contract(records, merge_chains=merge_chains, alias_only_edges=not contract)
    nodes = []
    node_map: dict[int, list[str]] = {}
    for gid, grp in enumerate(con.groups):
        names = [records[i].name for i in grp.members]
        node_map[gid] = names
        anchor_name = records[grp.anchor].name
        nodes.append(
            Node(
                id=gid,
                name=anchor_name if len(names) == 1 else f"{anchor_name}+{len(names) - 1}",
                cost=float(grp.cost),
                bytes=int(grp.bytes),
                inputs=grp.inputs,
                backward=grp.backward,
                retain=grp.retain,
                recomputable=grp.recomputable,
            )
        )
    graph = Graph(tuple(nodes), fixed_bytes=fixed_bytes, name=type(model).__name__)
    phases["contract_and_graph"] = time.perf_counter() - t0 - sum(phases.values())
    return TraceResult(
        graph=graph,
        joint_module=gm,
        node_map=node_map,
        num_fwd_outputs=num_fwd_outputs,
        param_names=list(params),
        buffer_names=list(buffers),
        num_user_inputs=len(inputs),
        tangent_outputs=tangent_outputs,
        output_kinds=kinds,
        output_spec=out_spec,
        specialisation=spec,
        cost_model=cost_model,
        cost_unit="FLOPs" if cost_model == "flops" else "seconds",
        aten_node_count=len(records),
        flops=flops,
        fixed_views=fixed_views,
        device_name=device_name,
        trace_seconds=time.perf_counter() - t0,
        phase_seconds=phases,
        model=model,
        guard=guard,
        call_spec=call,
        own_loss_leaf=loss_leaf,
        global_reads=GlobalReads.of(model),
        check_bytes=int(check_bytes),
    )
