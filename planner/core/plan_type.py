"""The plan type: a solved schedule for one model and input shape, its figures, its JSON, and `apply`.

JSON (`remat-schedule` v1) holds the solver graph, the schedule and the predictions; what applying the plan to a
model needs (the model's fingerprint, the cost model, module names, which view of the planning problem the schedule
was solved on, the executor's order and peak) sits under extra.planner. A loaded plan re-traces the model when it is
applied and checks that the trace gives the stored graph.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from capture.call import CallSpec
from capture.module_tags import trace_model
from capture.state import autocast_state
from graphs.errors import PlanMismatchError, ScheduleFormatError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Schedule, Status
from graphs.schedule_json import load_result, result_to_dict
from graphs.simulate import reference_peak_bytes
from planner.core.problem import GraphKind, PlanningProblem
from planner.core.solver_graph import split_position, traced_sequence
from planner.core.units import GB
from planner.execution.runtime import PlannedModule
from planner.execution.step_builder import StepHalves, build_step

EXTRA_KEY = "planner"


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
        fp["autocast"] = [list(s) for s in autocast_state()]  # JSON: [device, dtype] lists
    return fp


def bound_covers(info: dict, solver: str) -> str:
    """Which schedules a result's lower bound covers, in words (auto's `bound_scope` and `bound_from`)."""
    if info.get("bound_scope") == "every schedule":
        return "every schedule"
    if info.get("bound_from") == "order_bound":
        return "program-order schedules"  # solvers.bounds.order_bound: every schedule a solver here returns
    return f"the family of {info.get('bound_from') or solver}"


@dataclass
class Plan:
    """A solved schedule for one model and input shape, ready to apply.

    graph: the view of the planning problem the schedule was solved on (`graph_kind`: the solver graph, the one
        with secondary outputs pinned, or the executor's exact view; see planner.core.problem).
    predicted_peak_bytes: the peak the executor reaches, in bytes: parameters, buffers, inputs, the incoming
        gradient of the output, activations and parameter gradients.
    overhead: predicted recompute cost / cost without recomputation (0.1 = 10 % more compute), in the
        trace's cost model.
    status: optimal (proven by an exact solver), feasible, or heuristic.
    executor_computes: the computations (solver indices) in the order the executor runs them, where it differs
        from the schedule's (a recomputed secondary output taken right after its op's computation).
    """

    graph: Graph
    result: SolveResult
    fingerprint: dict
    cost_model: str
    exact_peak_bytes: int
    traced_nodes: int  # nodes of the trace: solver labels from this on are the tangents and the loss's workspace
    graph_kind: GraphKind = GraphKind.SOLVER
    executor_computes: list[int] | None = None
    loss_bytes: int = 0  # the loss function's temporaries (capture.loss_workspace.LossMemory)
    loss_held_bytes: int = 0  # of those, what the loss tensor keeps alive to the end of the step
    modules: dict[int, str] = field(default_factory=dict)
    trace_seconds: float = 0.0
    reference_peak_bytes: int = 0  # the solver graph's peak without recomputation
    traced: Any = field(default=None, repr=False, compare=False)
    problem: PlanningProblem | None = field(default=None, repr=False, compare=False)
    halves: StepHalves | None = field(default=None, repr=False, compare=False)  # built by plan(), used by apply()

    @classmethod
    def of(cls, solved, problem: PlanningProblem, *, fingerprint: dict, cost_model: str,
           modules: dict[int, str] | None = None) -> "Plan":
        """The plan of a problem solved by the core (`planner.core.solve.Solved`), for the model and input that
        `fingerprint` describes."""
        traced = problem.traced
        seq = solved.executor_computes
        return cls(graph=solved.graph, result=solved.result, fingerprint=fingerprint, cost_model=cost_model,
                   exact_peak_bytes=solved.exact_peak_bytes, traced_nodes=traced.graph.n, graph_kind=solved.kind,
                   executor_computes=None if seq == list(solved.result.schedule.computes) else seq,
                   loss_bytes=problem.loss_bytes, loss_held_bytes=problem.loss_held_bytes,
                   modules=dict(modules or {}), trace_seconds=traced.trace_seconds,
                   reference_peak_bytes=reference_peak_bytes(problem.solver_graph), traced=traced, problem=problem,
                   halves=solved.halves)

    # ---- figures ------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def _computes(self) -> list[int]:
        return list(self.result.schedule.computes) if self.executor_computes is None else self.executor_computes

    @property
    def compute_sequence(self) -> list[int]:
        """The computations in order, as node ids of the trace (what the executor runs)."""
        return traced_sequence(self.graph, self._computes, self.traced_nodes)

    @property
    def split_position(self) -> int:
        """How many computations of `compute_sequence` run in the forward: those before the schedule's first
        node that is not the model's (the loss or a tangent)."""
        return split_position(self.graph, self._computes, self.traced_nodes)

    @property
    def budget_bytes(self) -> int:
        return self.result.budget_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """The peak the executor reaches: the schedule replayed on the exact view, multi-output ops counted as they
        allocate (at most the solver's own figure, `result.peak_bytes`)."""
        return self.exact_peak_bytes

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

    def __repr__(self) -> str:  # the dataclass's own would print the whole graph and schedule
        return (f"Plan({self.graph.n} nodes, budget {self.budget_bytes} B, predicted peak {self.predicted_peak_bytes} "
                f"B, overhead {100 * self.overhead:.2f}%, status {self.status.value}, solver {self.solver!r})")

    def summary(self) -> str:
        lb = "" if self.lower_bound_cost is None else \
            f", lower bound cost {self.lower_bound_cost:.6g} (for {bound_covers(self.result.info, self.solver)})"
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
            "graph_kind": GraphKind(self.graph_kind).value,
            "traced_nodes": int(self.traced_nodes),
            "executor_computes": None if self.executor_computes is None else [int(v) for v in self.executor_computes],
            "exact_peak_bytes": int(self.exact_peak_bytes),
            "loss_bytes": int(self.loss_bytes),
            "loss_held_bytes": int(self.loss_held_bytes),
            "modules": {str(k): v for k, v in self.modules.items()},
            "reference_peak_bytes": int(self.reference_peak_bytes),
            "trace_seconds": float(self.trace_seconds),
        }}
        return result_to_dict(self.graph, self.result, extra)

    def to_json(self, path: str | Path) -> None:
        """Write the plan as `remat-schedule` v1 JSON (the solver graph, the schedule, the predictions), with
        what re-application needs (model fingerprint, cost model, module names) under extra.planner."""
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
        missing = [k for k in ("cost_model", "graph_kind", "traced_nodes", "exact_peak_bytes") if k not in meta]
        if missing:
            raise ScheduleFormatError(f"{path}: extra.planner has no {', '.join(missing)} (a plan written by an "
                                      "older version of the planner: plan again)")
        try:
            kind = GraphKind(meta["graph_kind"])
        except ValueError as e:
            raise ScheduleFormatError(f"{path}: extra.planner.graph_kind {meta['graph_kind']!r} is not one of "
                                      f"{[k.value for k in GraphKind]}") from e
        doc = json.loads(Path(path).read_text())
        result = SolveResult(ls.schedule, ls.status, ls.solver, ls.budget_bytes, ls.solve_seconds, ls.sim,
                             ls.lower_bound_cost, dict(doc.get("info") or {}))
        return cls(graph=ls.graph, result=result, fingerprint=meta["fingerprint"], cost_model=meta["cost_model"],
                   exact_peak_bytes=int(meta["exact_peak_bytes"]), traced_nodes=int(meta["traced_nodes"]),
                   graph_kind=kind,
                   executor_computes=_executor_computes_from(path, meta.get("executor_computes"), ls.schedule),
                   loss_bytes=int(meta.get("loss_bytes", 0)), loss_held_bytes=int(meta.get("loss_held_bytes", 0)),
                   modules={int(k): v for k, v in meta.get("modules", {}).items()},
                   trace_seconds=float(meta.get("trace_seconds", 0.0)),
                   reference_peak_bytes=int(meta.get("reference_peak_bytes", 0)))

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

    def trace_for(self, model: torch.nn.Module, sample_input):
        """Trace `model` on `sample_input` and check that it gives this plan's graph (used by loaded plans)."""
        self.check_model(model)
        self.check_inputs(CallSpec.of(sample_input)[1])
        # the plan's own cost model: the contraction folds free views only where they cost nothing, so a graph
        # traced with measured times has more nodes than one traced with FLOPs (costs themselves are not compared)
        traced = trace_model(model, sample_input, self.cost_model)
        got = PlanningProblem(traced, self.loss_bytes, self.loss_held_bytes).graph(self.graph_kind)
        diff = _graph_difference(self.graph, got, compare_costs=self.cost_model == "flops")
        if diff is not None:
            raise PlanMismatchError(
                f"the model traces to another graph than the plan's: {diff}. The input's shapes and dtypes are the "
                "plan's: the model's Python took another path, on this input's values (an attention mask without "
                "padding skips the mask's ops; a branch on a value) or because its code, configuration or a global "
                "changed since the plan was made. Plan with an input like this one, or use planner.enable(model, "
                "budget_gb), which plans each path as it comes")
        return traced

    def apply(self, model: torch.nn.Module, sample_input=None, *, compile: bool = False) -> PlannedModule:
        """A drop-in training module for `model` that runs this plan (see planner.execution.runtime.PlannedModule).

        The model must have the parameters, buffers and mode the plan was made for (PlanMismatchError
        otherwise). A plan loaded from JSON re-traces the model to rebuild its joint graph: on
        `sample_input` now if given, else on the first call's input; the traced graph must equal the
        stored one. Inputs of another shape or dtype are refused with PlanMismatchError. With `compile`, the step's
        halves are compiled by inductor at the first call (planner.execution.inductor).
        """
        self.check_model(model)
        traced = None
        if self.traced is not None:
            traced = self.traced if self.traced.model is model else dataclasses.replace(self.traced, model=model)
        elif sample_input is not None:
            traced = self.trace_for(model, sample_input)
        halves = None
        if traced is not None:  # build the halves now (fail now, not at the first step), once
            halves = self.halves if self.halves is not None and not compile else \
                build_step(traced, self.compute_sequence, self.split_position, for_inductor=compile)
        return PlannedModule(model, self, traced, compile=compile, halves=halves)


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
        fields = ("name", "bytes", "inputs", "backward", "retain", "recomputable")
        fields += ("cost",) if compare_costs else ()
        for f in fields:
            x, y = getattr(a, f), getattr(b, f)
            if f == "cost" and math.isclose(x, y, rel_tol=1e-9):
                continue
            if x != y:
                return f"node {a.id} '{a.name}' has {f} {y!r}, the plan has {x!r}"
    return None


def _executor_computes_from(path, value, schedule: Schedule) -> list[int] | None:
    """A stored executor sequence, checked against the schedule: the same nodes, none computed more often."""
    if value is None:
        return None
    want = Counter(schedule.computes)
    try:
        got = Counter(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise ScheduleFormatError(f"{path}: extra.planner.executor_computes is not a list of node ids") from e
    if set(got) != set(want) or any(got[v] > want[v] for v in got):
        raise ScheduleFormatError(f"{path}: extra.planner.executor_computes does not run the schedule's computations")
    return [int(v) for v in value]
