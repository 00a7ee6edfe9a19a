"""The public API: `plan(model, sample_input, budget_gb)` -> `Plan`, and `Plan.apply(model)` -> a planned module.

Units: budgets are given in gigabytes at this edge only, 1 GB = 10^9 bytes; everything inside is bytes.
Data flows one way: model -> trace (graphs.trace) -> solver graph -> solver -> schedule -> executor.
JSON (`remat-schedule` v1) can cut in after the solver (`Plan.to_json`) and before the executor
(`Plan.load(path).apply(model)`).
"""
from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from graphs.errors import (InfeasibleBudgetError, NoSolutionInTimeError, RematError, ScheduleError,
                           SolverError)
from graphs.ir import Graph
from graphs.schedule import Schedule, SolveResult, Status
from graphs.schedule_json import load_result, result_to_dict
from graphs.simulate import reference_peak_bytes, simulate
from planner.executor import PlanMismatchError, PlannedModule, compile_schedule, free_view_root
from solvers.auto import MILP_MAX_NODES
from solvers.base import solve, solver_names

GB = 10**9
EXTRA_KEY = "planner"
COST_MODELS = ("auto", "flops", "time", "roofline")
# A scalar loss and the gradient autograd seeds it with: two 512-byte blocks of CUDA's caching allocator.
LOSS_RESERVE_BYTES = 1024


# ---------------------------------------------------------------------------------------------
# Tracing with module attribution, and the graph the solver sees
# ---------------------------------------------------------------------------------------------
def _as_inputs(sample_input) -> tuple:
    if isinstance(sample_input, torch.Tensor):
        return (sample_input,)
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input)
    raise TypeError(f"sample_input must be a tensor or a tuple of tensors, not {type(sample_input).__name__}")


def trace_model(model: torch.nn.Module, inputs: tuple, cost_model: str = "flops", device_name: str | None = None):
    """`graphs.trace.trace` with each fx forward node tagged with the module that ran it.

    The tags (`meta["nn_module_stack"]`) come from forward pre/post hooks that write the current module
    path into torch.fx's node-meta context while AOTAutograd traces; `node_modules` reads them back.
    """
    import torch.fx.traceback as fx_traceback

    from graphs.trace import trace

    stack: list[str] = []
    had_key = "nn_module_stack" in fx_traceback.current_meta
    saved = fx_traceback.current_meta.get("nn_module_stack")

    def pre(mod, args, name):
        stack.append(name)
        fx_traceback.current_meta["nn_module_stack"] = {"planner": (name, type(mod).__name__)}

    def post(mod, args, out, name):
        if stack:
            stack.pop()
        fx_traceback.current_meta["nn_module_stack"] = {"planner": (stack[-1] if stack else "", "")}

    handles = []
    for name, sub in model.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name)))
        handles.append(sub.register_forward_hook(lambda m, a, o, name=name: post(m, a, o, name)))
    try:
        return trace(model, inputs, cost_model=cost_model, device_name=device_name, contract=True)
    finally:
        for h in handles:
            h.remove()
        if had_key:
            fx_traceback.current_meta["nn_module_stack"] = saved
        else:
            fx_traceback.current_meta.pop("nn_module_stack", None)


def node_modules(traced) -> dict[int, str]:
    """Graph node id -> the path of the module whose forward produced it ('' for the top level).

    Backward ops are attributed to the module of the forward op they differentiate (same seq_nr).
    """
    gm = traced.joint_module
    by_seq: dict[Any, str] = {}
    fx_mod: dict[str, str] = {}
    for n in gm.graph.nodes:
        st = n.meta.get("nn_module_stack")
        if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward" and st:
            path = list(st.values())[-1][0]
            fx_mod[n.name] = path
            by_seq.setdefault(n.meta.get("seq_nr"), path)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.name not in fx_mod and n.meta.get("seq_nr") in by_seq:
            fx_mod[n.name] = by_seq[n.meta["seq_nr"]]
    out = {}
    for gid, names in traced.node_map.items():
        c = Counter(fx_mod.get(nm, "") for nm in names)
        out[gid] = c.most_common(1)[0][0] if c else ""
    return out


def solver_graph(traced, inflate: set[int] | None = None, loss_bytes: int = 0) -> Graph:
    """The graph the solver plans: the traced graph, adjusted to what the executor really holds.

    - Recomputable unless a node produces one of the model's outputs (the caller holds the output from
      the forward to the end of the backward, so a second copy would cost its memory twice). Random
      ops (dropout) ARE recomputable here, although the trace marks them not: the executor saves the
      generator state before their first computation and replays it for every recomputation, so a
      recomputed mask is bitwise the first one (tests/planner check gradients against eager).
    - Retained (resident to the end) only the model's outputs and the gradients; new buffer values
      are copied into the buffers during the forward and are not held.
    - Each tangent (incoming gradient of an output) is a node of its own instead of fixed memory: it
      exists from the start of the backward, which is when autograd hands it over, to the end. It has
      no inputs, costs nothing, cannot be recomputed, and reads as the label `traced.graph.n + j`.
    - A forward multi-output op's node also counts the bytes of its secondary outputs (their own nodes
      keep theirs): each computation allocates them all, and this keeps every recomputation within the
      peak at the price of counting them twice while both nodes are resident. `inflate` limits this to
      the given node ids (plan() keeps it only where the schedule recomputes). A backward multi-output
      op is not recomputable.
    - With `loss_bytes` (see `loss_workspace_bytes`), a node `loss` of that size reads the model's outputs
      and is read by the tangents: the loss function's temporaries at the forward/backward boundary.
    - Fixed memory gains LOSS_RESERVE_BYTES for the scalar loss and its seed gradient, which live
      outside the model during the step.
    Labels: a traced node keeps its traced id as its label, so `graph.labels` maps back to `node_map`.
    """
    from torch.utils._pytree import tree_leaves

    g = traced.graph
    gm = traced.joint_module
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))
    keep_names = {o.name for o, (kind, _) in zip(outs, traced.output_kinds)
                  if kind in ("output", "grad") and o is not None}
    user_out_names = {o.name for o, (kind, _) in zip(outs, traced.output_kinds) if kind == "output" and o is not None}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = phs[traced.num_primals:]
    readers: dict[int, list[int]] = {j: [] for j in range(len(tangents))}
    by_name = {n.name: n for n in gm.graph.nodes}
    for gid, names in traced.node_map.items():
        mine = {by_name[nm] for nm in names}
        read = {a for m in mine for a in m.all_input_nodes if a not in mine}
        # a free view of a tangent grouped elsewhere is made where it is read (see the executor)
        read |= {free_view_root(a) for a in read if a.op == "call_function"}
        for j, t in enumerate(tangents):
            if t in read:
                readers[j].append(gid)
    groups = solver_groups(traced)
    secondary = secondary_outputs(traced)
    recs = []
    for nd in g.nodes:
        names = traced.node_map[nd.id]
        extra_inputs = [g.n + j for j, rs in readers.items() if nd.id in rs]
        # A recomputation of a multi-output op allocates its secondary outputs again: a forward op's node
        # counts them; a backward one (whose secondary outputs are weight gradients) is not recomputed.
        multi = nd.id in secondary
        counts = multi and not nd.backward and (inflate is None or nd.id in inflate)
        extra_bytes = sum(int(g.nodes[i].bytes) for i in secondary[nd.id]) if counts else 0
        recs.append({
            "id": nd.id, "name": nd.name, "cost": nd.cost, "bytes": int(nd.bytes) + extra_bytes,
            "inputs": list(nd.inputs) + extra_inputs, "backward": nd.backward,
            "retain": any(nm in keep_names for nm in names),
            "recomputable": not any(nm in user_out_names for nm in names) and not (multi and nd.backward),
        })
    order = list(groups)
    tangent_bytes = 0
    loss_label = g.n + len(tangents)
    out_groups = sorted({gid for gid, names in traced.node_map.items() if any(nm in user_out_names for nm in names)})
    for j, t in enumerate(tangents):
        if not readers[j]:
            continue
        nbytes = _strided_bytes(t.meta["val"])
        tangent_bytes += nbytes
        recs.append({"id": g.n + j, "name": f"tangent_{j}", "cost": 0.0, "bytes": nbytes,
                     "inputs": [loss_label] if loss_bytes else [],
                     "backward": True, "retain": True, "recomputable": False})
        first = min(readers[j])
        order.insert(order.index(first), g.n + j)
    if loss_bytes:
        # the loss's own temporaries (e.g. cross-entropy's log-softmax) live from the end of the forward
        # until autograd hands the gradients over
        recs.append({"id": loss_label, "name": "loss", "cost": 0.0, "bytes": int(loss_bytes), "inputs": out_groups,
                     "backward": False, "retain": False, "recomputable": False})
        first_tangent = next(k for k, lab in enumerate(order) if lab >= g.n)
        order.insert(first_tangent, loss_label)
    return Graph.from_unordered(recs, fixed_bytes=g.fixed_bytes - tangent_bytes + LOSS_RESERVE_BYTES,
                                name=g.name, order=order)


def secondary_outputs(traced) -> dict[int, list[int]]:
    """Traced node id of a multi-output op -> the ids of the nodes the trace made of its other outputs.

    The trace makes each secondary output of a multi-output op (a pooling's indices, a layer norm's
    statistics, a dropout's mask: a getitem) a node of its own, computed once. But every computation of
    the op, a recomputation included, allocates all its outputs at once.
    """
    by_name = {n.name: n for n in traced.joint_module.graph.nodes}
    group_of = {nm: gid for gid, names in traced.node_map.items() for nm in names}
    out: dict[int, list[int]] = {}
    for gid, names in traced.node_map.items():
        nodes = [by_name[nm] for nm in names]
        if nodes and all(n.target is operator.getitem for n in nodes):
            sources = {group_of.get(n.args[0].name) for n in nodes}
            if len(sources) == 1 and None not in sources and gid not in sources:
                out.setdefault(sources.pop(), []).append(gid)
    return out


def solver_groups(traced) -> dict[int, list[int]]:
    """Solver node label -> the traced node ids it runs (one each; the tangents run none)."""
    return {gid: [gid] for gid in range(traced.graph.n)}


def _strided_bytes(val) -> int:
    """Bytes of the storage a tensor of this shape and stride needs (what the trace counted for it)."""
    if val.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()))
    return int(span * val.element_size())


def _split_position(graph: Graph, computes, groups: dict[int, list[int]]) -> int:
    count = 0
    for v in computes:
        ids = groups.get(graph.labels[v])
        if ids is None:
            break
        count += len(ids)
    return count


def traced_sequence(graph: Graph, computes, groups: dict[int, list[int]]) -> list[int]:
    """A solver-graph compute sequence in traced node ids (tangent nodes dropped, merged nodes expanded)."""
    out: list[int] = []
    for v in computes:
        out.extend(groups.get(graph.labels[v], ()))
    return out


def budget_bytes_from_gb(budget_gb: float) -> int:
    """floor(budget_gb x 10^9), read in decimal so that 1.5 GB is exactly 1_500_000_000 bytes."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float, Fraction)):
        raise TypeError(f"budget_gb must be a number, not {type(budget_gb).__name__}")
    value = Fraction(str(budget_gb)) if isinstance(budget_gb, float) else Fraction(budget_gb)
    if value <= 0:
        raise ValueError(f"budget_gb must be > 0, got {budget_gb}")
    return math.floor(value * GB)


def fingerprint(model: torch.nn.Module, inputs: tuple | None) -> dict:
    """What a plan assumes about the model (and the input, when given): names, shapes, dtypes, flags."""
    fp = {
        "model": type(model).__qualname__,
        "training": bool(model.training),
        "parameters": [[n, list(p.shape), str(p.dtype), bool(p.requires_grad)] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
    }
    if inputs is not None:
        fp["inputs"] = [[list(t.shape), str(t.dtype)] for t in inputs]
    return fp


def _first_difference(want: dict, got: dict) -> str | None:
    for key in ("model", "training", "parameters", "buffers", "inputs"):
        if key not in want or key not in got:
            continue
        a, b = want[key], got[key]
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            for k, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return f"{key}[{k}] is {y}, the plan was made for {x}"
            return f"{len(b)} {key}, the plan was made for {len(a)}"
        return f"{key} is {b!r}, the plan was made for {a!r}"
    return None


def _graph_difference(want: Graph, got: Graph, compare_costs: bool) -> str | None:
    if want.n != got.n:
        return f"{got.n} graph nodes, the plan has {want.n}"
    if want.fixed_bytes != got.fixed_bytes:
        return f"fixed bytes {got.fixed_bytes}, the plan has {want.fixed_bytes}"
    for a, b in zip(want.nodes, got.nodes):
        for f in ("name", "bytes", "inputs", "backward", "retain", "recomputable") + (("cost",) if compare_costs else ()):
            x, y = getattr(a, f), getattr(b, f)
            if f == "cost" and math.isclose(x, y, rel_tol=1e-9):
                continue
            if x != y:
                return f"node {a.id} '{a.name}' has {f} {y!r}, the plan has {x!r}"
    return None


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """A solved schedule for one model and input shape, ready to apply.

    predicted_peak_bytes: the simulator's peak of the schedule, in bytes: parameters, buffers, inputs,
        the incoming gradient of the output, activations and parameter gradients.
    overhead: predicted recompute cost / cost without recomputation (0.1 = 10 % more compute), in the
        trace's cost model.
    status: optimal (proven by an exact solver), feasible, or heuristic.
    """

    graph: Graph
    result: SolveResult
    fingerprint: dict
    cost_model: str
    modules: dict[int, str] = field(default_factory=dict)
    traced: Any = field(default=None, repr=False)
    trace_seconds: float = 0.0
    reference_peak_bytes: int = 0
    groups: dict[int, list[int]] = field(default_factory=dict)  # solver label -> trace node ids (solver_groups)
    inflated: set[int] = field(default_factory=set)  # nodes counting their secondary outputs (solver_graph)
    loss_bytes: int = 0  # the loss function's temporaries (solver_graph)

    # ---- figures ------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def compute_sequence(self) -> list[int]:
        """The computations in order, as node ids of the trace (what the executor runs)."""
        return traced_sequence(self.graph, self.result.schedule.computes, self.groups)

    @property
    def split_position(self) -> int:
        """How many computations of `compute_sequence` run in the forward: those before the schedule's first
        node that is not the model's (the loss or a tangent)."""
        return _split_position(self.graph, self.result.schedule.computes, self.groups)

    @property
    def budget_bytes(self) -> int:
        return self.result.budget_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.result.peak_bytes

    @property
    def overhead(self) -> float:
        return self.result.overhead

    @property
    def status(self) -> Status:
        return self.result.status

    @property
    def lower_bound_cost(self) -> float | None:
        return self.result.lower_bound_cost

    @property
    def solver(self) -> str:
        chosen = self.result.info.get("chosen")
        return f"{self.result.solver} ({chosen})" if chosen else self.result.solver

    @property
    def solve_seconds(self) -> float:
        return self.result.solve_seconds

    def recomputed(self) -> dict[str, list[tuple[int, str, int]]]:
        """Module path -> [(graph node id, node name, extra computations)] of every recomputed node."""
        counts = self.result.sim.compute_counts
        out: dict[str, list] = defaultdict(list)
        for v in range(self.graph.n):
            if counts[v] > 1:
                lab = self.graph.labels[v]
                out[self.modules.get(lab, "")].append((v, self.graph.nodes[v].name, int(counts[v]) - 1))
        return dict(out)

    def summary(self) -> str:
        lb = "" if self.lower_bound_cost is None else f", lower bound cost {self.lower_bound_cost:.6g}"
        return (f"budget {self.budget_bytes / GB:.6f} GB, predicted peak {self.predicted_peak_bytes / GB:.6f} GB, "
                f"overhead {100 * self.overhead:.2f}%, status {self.status.value}, solver {self.solver}{lb}")

    def explain(self) -> str:
        """A readable report: figures, then what is recomputed, grouped by module."""
        lines = [self.summary()]
        groups = self.recomputed()
        if not groups:
            lines.append("nothing is recomputed")
        costs = self.graph.costs
        base = max(self.graph.total_cost, 1e-300)
        for mod in sorted(groups):
            items = groups[mod]
            extra = sum(costs[v] * k for v, _, k in items)
            lines.append(f"  {mod or '(top level)'}: {len(items)} node(s) recomputed, "
                         f"+{100 * extra / base:.2f}% cost")
            for v, name, k in items:
                times = "" if k == 1 else f" x{k}"
                lines.append(f"    {name} ({self.graph.nodes[v].bytes} B){times}")
        return "\n".join(lines)

    # ---- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        extra = {EXTRA_KEY: {
            "fingerprint": self.fingerprint,
            "cost_model": self.cost_model,
            "modules": {str(k): v for k, v in self.modules.items()},
            "reference_peak_bytes": int(self.reference_peak_bytes),
            "trace_seconds": float(self.trace_seconds),
            "groups": {str(k): v for k, v in self.groups.items()},
            "inflated": sorted(self.inflated),
            "loss_bytes": int(self.loss_bytes),
        }}
        return result_to_dict(self.graph, self.result, extra)

    def to_json(self, path: str | Path) -> None:
        """Write the plan as `remat-schedule` v1 JSON (the solver graph, the schedule, the predictions), with
        what re-application needs (model fingerprint, cost model, module names) under extra.planner."""
        import json

        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by `to_json`. Raises ScheduleFormatError for a malformed or inconsistent file
        and PlanMismatchError if it was not written by the planner (no extra.planner block)."""
        ls = load_result(path)
        meta = ls.extra.get(EXTRA_KEY)
        if not isinstance(meta, dict) or "fingerprint" not in meta:
            raise PlanMismatchError(f"{path}: a remat-schedule file without the planner's model fingerprint "
                                    "(extra.planner); it cannot be applied to a model")
        import json

        doc = json.loads(Path(path).read_text())
        result = SolveResult(ls.schedule, ls.status, ls.solver, ls.budget_bytes, ls.solve_seconds, ls.sim,
                             ls.lower_bound_cost, dict(doc.get("info") or {}))
        return cls(graph=ls.graph, result=result, fingerprint=meta["fingerprint"], cost_model=meta["cost_model"],
                   modules={int(k): v for k, v in meta.get("modules", {}).items()},
                   trace_seconds=float(meta.get("trace_seconds", 0.0)),
                   reference_peak_bytes=int(meta.get("reference_peak_bytes", 0)),
                   groups={int(k): [int(i) for i in v] for k, v in meta["groups"].items()},
                   inflated={int(i) for i in meta.get("inflated", [])},
                   loss_bytes=int(meta.get("loss_bytes", 0)))

    # ---- applying -------------------------------------------------------------------------------
    def check_model(self, model: torch.nn.Module) -> None:
        """Raise PlanMismatchError if `model` is not the kind of model this plan was made for."""
        diff = _first_difference(self.fingerprint, fingerprint(model, None))
        if diff is not None:
            raise PlanMismatchError(f"this plan was made for another model: {diff}")

    def check_inputs(self, inputs: tuple) -> None:
        want = self.fingerprint.get("inputs")
        got = [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else [type(t).__name__] for t in inputs]
        if want is not None and want != got:
            if len(want) != len(got):
                raise PlanMismatchError(f"this plan was made for {len(want)} input(s), got {len(got)}")
            k = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
            raise PlanMismatchError(f"this plan was made for input {k} of shape {want[k][0]} and dtype {want[k][1]}, "
                                    f"got shape {got[k][0]}" + (f" and dtype {got[k][1]}" if len(got[k]) > 1 else ""))

    def _trace_for(self, model: torch.nn.Module, inputs: tuple):
        """Trace `model` on `inputs` and check that it gives this plan's graph (used by loaded plans)."""
        self.check_model(model)
        self.check_inputs(inputs)
        cm = "flops" if self.cost_model != "flops" else self.cost_model  # structure does not depend on costs
        traced = trace_model(model, inputs, cm)
        got = solver_graph(traced, self.inflated, self.loss_bytes)
        diff = _graph_difference(self.graph, got, compare_costs=self.cost_model == "flops")
        if diff is not None:
            raise PlanMismatchError(f"the model traces to another graph than the plan's: {diff}")
        return traced

    def apply(self, model: torch.nn.Module, sample_input=None) -> PlannedModule:
        """A drop-in training module for `model` that runs this plan (see PlannedModule).

        The model must have the parameters, buffers and mode the plan was made for (PlanMismatchError
        otherwise). A plan loaded from JSON re-traces the model to rebuild its joint graph: on
        `sample_input` now if given, else on the first call's input; the traced graph must equal the
        stored one. Inputs of another shape or dtype are refused with PlanMismatchError.
        """
        self.check_model(model)
        traced = None
        if self.traced is not None:
            traced = self.traced if self.traced.model is model else dataclasses.replace(self.traced, model=model)
        elif sample_input is not None:
            traced = self._trace_for(model, _as_inputs(sample_input))
        module = PlannedModule(model, self, traced)
        if traced is not None:
            compile_schedule(traced, self.compute_sequence, self.split_position)  # fail now, not at the first step
        return module


# ---------------------------------------------------------------------------------------------
# plan()
# ---------------------------------------------------------------------------------------------
def _resolve_cost_model(cost_model: str) -> str:
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model '{cost_model}'; choose one of {', '.join(COST_MODELS)}")
    # measured time prices every op, elementwise ones included (FLOPs call them free)
    return "time" if cost_model == "auto" else cost_model


def _smallest_budget(graph: Graph, time_limit_s: float) -> tuple[int | None, str, str | None]:
    """The smallest budget a schedule is known to meet, how that is known, and the solver that met it."""
    t0 = time.perf_counter()
    try:
        from solvers.min_budget import min_budget

        mb = min_budget(graph, time_limit_s=time_limit_s)
        # the budget the solver was given when it met the minimum: planning at it reproduces the schedule
        # (a greedy solver is not monotone in the budget, so its peak itself may not be reproducible)
        return max(mb.budget_bytes, mb.result.budget_bytes), mb.proof, mb.result.solver
    except (ImportError, InfeasibleBudgetError, ScheduleError, SolverError):
        pass  # not installed, or a solver inside it failed: ask the solvers directly
    floor = graph.single_op_bound_bytes()
    named: list[int] = []
    for name in ("dtr", "checkpoint_all"):
        try:
            solve(graph, floor, name)
            return floor, "single-operation bound, met by a schedule", name
        except InfeasibleBudgetError as e:
            if e.min_budget_bytes is not None:
                named.append(e.min_budget_bytes)
        except (ScheduleError, SolverError, ImportError, KeyError):
            continue
    for b in sorted(set(named)):
        left = max(1.0, time_limit_s - (time.perf_counter() - t0))
        try:
            r = _solve(graph, b, "auto", left)
            return (r.peak_bytes, f"the least budget a heuristic named and met (single-operation bound {floor})",
                    r.info.get("chosen") or r.solver)
        except RematError:
            continue
    return None, "no solver met any budget", None


def smallest_budget(plan_or_traced, time_limit_s: float = 30.0) -> tuple[int | None, str | None]:
    """(the smallest budget in bytes a schedule is known to meet, the solver that met it) for a Plan's
    or a TraceResult's graph; (None, None) when nothing is known."""
    traced = plan_or_traced.traced if isinstance(plan_or_traced, Plan) else plan_or_traced
    if traced is None:
        raise ValueError("a plan loaded from JSON holds no trace: pass the TraceResult of the model")
    found, _, solver = _smallest_budget(solver_graph(traced), time_limit_s)  # the graph plan() solves
    return found, solver


def smallest_budget_bytes(plan_or_traced, time_limit_s: float = 30.0) -> int | None:
    """The smallest budget (bytes) a schedule is known to meet for a Plan's or a TraceResult's graph."""
    return smallest_budget(plan_or_traced, time_limit_s)[0]


def plan(model: torch.nn.Module, sample_input, budget_gb: float, *, solver: str = "auto",
         cost_model: str = "auto", time_limit_s: float = 60.0, device_name: str | None = None,
         traced=None, loss_fn=None) -> Plan:
    """Plan one training step of `model` on `sample_input` within `budget_gb` gigabytes (1 GB = 10^9 bytes).

    The budget covers everything one forward+backward holds at once: parameters, buffers, inputs, the
    gradient of the output, activations and parameter gradients (what torch.cuda.max_memory_allocated
    reports for one step on a device that held only the model and the inputs). Call `model.train()`
    first for a training step; the model is traced in its current mode.

    solver: a registered solver name ("auto" picks the best available within `time_limit_s` seconds).
    cost_model: "flops", "time" (each op measured here), "roofline" (needs `device_name`), or "auto"
        (= "time").
    traced: a TraceResult from an earlier plan of this model and input (`Plan.traced`) to skip tracing.
    loss_fn: the loss the training step computes from the output (`loss_fn(out)` -> scalar); its own
        memory (measured once on the sample output) is planned for at the forward/backward boundary.
        Without it, only a scalar loss is reserved for.
    Raises InfeasibleBudgetError (its message names the smallest feasible budget in GB) when nothing fits,
    graphs.trace.TraceError when the model cannot be traced.
    """
    inputs = _as_inputs(sample_input)
    budget_bytes = budget_bytes_from_gb(budget_gb)
    cm = _resolve_cost_model(cost_model)
    if traced is None:
        traced = trace_model(model, inputs, cm, device_name)
    elif traced.model is not model:
        raise ValueError("`traced` belongs to another model object")
    loss_bytes = 0 if loss_fn is None else loss_workspace_bytes(model, inputs, loss_fn)
    graph = solver_graph(traced, None, loss_bytes)
    t0 = time.perf_counter()
    try:
        result = _solve(graph, budget_bytes, solver, time_limit_s)
    except InfeasibleBudgetError as e:
        # naming the minimum need not cost the whole time limit again
        left = max(5.0, min(time_limit_s / 2, time_limit_s - (time.perf_counter() - t0)))
        smallest, how, _ = _smallest_budget(graph, left)
        if smallest is None and e.min_budget_bytes is not None:
            smallest, how = e.min_budget_bytes, e.reason
        gb = "unknown" if smallest is None else f"{smallest / GB:.9f} GB ({smallest} bytes)"
        raise InfeasibleBudgetError(
            budget_bytes, smallest, solver,
            f"budget {budget_bytes / GB:.9f} GB is below the smallest feasible budget {gb}; {how}") from e
    # Secondary outputs need counting only where the op is recomputed: count them there alone, and replay
    # the same computations on that graph (bytes only shrink, so it stays within the budget).
    inflated = {graph.labels[v] for v in result.sim.recomputed if graph.labels[v] in secondary_outputs(traced)}
    graph = solver_graph(traced, inflated, loss_bytes)
    result = _free_at_last_use(graph, result)
    groups = solver_groups(traced)
    compile_schedule(traced, traced_sequence(graph, result.schedule.computes, groups),
                     _split_position(graph, result.schedule.computes, groups))  # the executor can run it (raises otherwise)
    return Plan(graph=graph, result=result, fingerprint=fingerprint(model, inputs), cost_model=cm, inflated=inflated,
                loss_bytes=loss_bytes,
                modules=node_modules(traced), traced=traced, trace_seconds=traced.trace_seconds,
                reference_peak_bytes=reference_peak_bytes(graph), groups=solver_groups(traced))


# Used only when "auto" fails because one of the solvers it tries returned an invalid schedule.
_FALLBACK = ("checkpoint_all", "milp", "cpsat", "dtr")


def _solve(graph: Graph, budget_bytes: int, solver: str, time_limit_s: float) -> SolveResult:
    """`solvers.base.solve`, made robust for "auto": if a solver inside it produces an invalid schedule
    (ScheduleError: a solver bug, e.g. a baseline recomputing a random op), the exact solvers and DTR
    are tried directly and the cheapest schedule wins; the result's info records the failure."""
    t0 = time.perf_counter()
    try:
        return solve(graph, budget_bytes, solver, time_limit_s=time_limit_s)
    except (ScheduleError, SolverError) as e:
        if solver != "auto" or isinstance(e, NoSolutionInTimeError):
            raise
        failure = f"{type(e).__name__}: {e}"
    results, infeasible = [], []
    for name in _FALLBACK:
        if name not in solver_names() or (name == "milp" and graph.n > MILP_MAX_NODES):
            continue
        if name == "cpsat" and (graph.n <= MILP_MAX_NODES and results and "milp" in solver_names()):
            continue
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            break
        try:
            results.append(solve(graph, budget_bytes, name, time_limit_s=left))
        except InfeasibleBudgetError as ie:
            infeasible.append(ie)
        except (ScheduleError, SolverError, ImportError):
            continue
        if name == "checkpoint_all":
            break
    if not results:
        known = [ie.min_budget_bytes for ie in infeasible if ie.min_budget_bytes is not None]
        raise InfeasibleBudgetError(budget_bytes, min(known) if known else None, solver,
                                    f"fallback after '{failure}'")
    best = min(results, key=lambda r: (r.total_cost, r.peak_bytes))
    exact = [r for r in results if r.solver in ("checkpoint_all", "milp", "cpsat") and r.lower_bound_cost is not None]
    status = best.status if best in exact else (Status.FEASIBLE if exact else Status.HEURISTIC)
    bound = max((r.lower_bound_cost for r in exact), default=None)
    info = {"chosen": best.solver, "auto_failed": failure,
            "tried": [r.solver for r in results] + [ie.solver + " (infeasible)" for ie in infeasible]}
    return SolveResult(best.schedule, status, "auto", budget_bytes, time.perf_counter() - t0, best.sim,
                       bound if bound is not None and bound <= best.total_cost * (1 + 1e-9) + 1e-9 else None, info)


def loss_workspace_bytes(model: torch.nn.Module, inputs: tuple, loss_fn) -> int:
    """Bytes `loss_fn` holds beyond the output's gradient: its peak over a forward+backward of the loss on a
    copy of the model's output (the model runs once without gradients; buffers and RNG are restored)."""
    from graphs.measure_memory import StorageTracker

    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(), torch.no_grad():
            out = model(*inputs)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])
    from torch.utils._pytree import tree_map

    leaves = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                      if isinstance(t, torch.Tensor) else t, out)
    tracker = StorageTracker()
    with tracker:
        loss = loss_fn(leaves)
        loss.backward()
    from torch.utils._pytree import tree_leaves as _leaves

    grads = sum(_strided_bytes(t.grad) for t in _leaves(leaves) if isinstance(t, torch.Tensor) and t.grad is not None)
    return max(0, int(tracker.peak_bytes) - grads)


def _free_at_last_use(graph: Graph, result: SolveResult) -> SolveResult:
    """The same computations, each value freed right after its last use: what the executor's fx code does."""
    sched = Schedule.from_sequence(graph, result.schedule.computes)
    sim = simulate(graph, sched)
    if sim.peak_bytes > result.budget_bytes:  # cannot happen: last-use frees are optimal for a sequence
        raise RematError(f"internal error: freeing at last use raised the peak to {sim.peak_bytes}")
    return dataclasses.replace(result, schedule=sched, sim=sim)
