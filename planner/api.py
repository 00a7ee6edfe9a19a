"""The public API: `plan(model, sample_input, budget_gb)` -> `Plan`, and `Plan.apply(model)` -> a planned module.

Units: budgets are given in gigabytes at this edge only, 1 GB = 10^9 bytes; everything inside is bytes.
Data flows one way: model -> trace (capture.trace) -> solver graph -> solver -> schedule -> executor.
JSON (`remat-schedule` v1) can cut in after the solver (`Plan.to_json`) and before the executor
(`Plan.load(path).apply(model)`).
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from capture.call import CallSpec
from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, RematError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Schedule, Status
from graphs.schedule_json import load_result, result_to_dict
from graphs.simulate import reference_peak_bytes, simulate
from planner.executor import PlanMismatchError, PlannedModule, compile_schedule
from planner.solver_graph import (
    co_outputs,
    exact_peak_bytes,
    executor_sequence,
    loss_workspace_bytes,
    node_modules,
    secondary_outputs,
    solver_graph,
    solver_groups,
    split_position,
    trace_model,
    traced_sequence,
)
from solvers.base import solve

GB = 10**9
EXTRA_KEY = "planner"
COST_MODELS = ("auto", "flops", "time", "roofline")


# ---------------------------------------------------------------------------------------------
# Inputs, budgets, fingerprints
# ---------------------------------------------------------------------------------------------
def _as_inputs(sample_input) -> tuple:
    """The user-input tensors of a sample input (a tensor, a tuple of tensors, a dict of keyword arguments, or
    (args, kwargs): see capture.call)."""
    return CallSpec.of(sample_input)[1]


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


def bound_covers(info: dict, solver: str) -> str:
    """Which schedules a result's lower bound covers, in words (auto's `bound_scope` and `bound_from`)."""
    if info.get("bound_scope") == "every schedule":
        return "every schedule"
    if info.get("bound_from") == "order_bound":
        return "program-order schedules"  # solvers.bounds.order_bound: every schedule a solver here returns
    return f"the family of {info.get('bound_from') or solver}"


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
    exact_peak_bytes: int | None = None  # the executor's peak (solver_graph.exact_peak_bytes); None: the result's
    pinned_secondaries: bool = False  # secondary outputs not recomputable (solver_graph's pin_secondaries)
    # the computations as the executor runs them (solver indices): the schedule's, each secondary output computed
    # again right after the op's computation it is indexed out of (solver_graph.executor_sequence); None: the
    # schedule's own
    executor_computes: list[int] | None = None

    # ---- figures ------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def compute_sequence(self) -> list[int]:
        """The computations in order, as node ids of the trace (what the executor runs)."""
        return traced_sequence(self.graph, self._executor_computes, self.groups)

    @property
    def split_position(self) -> int:
        """How many computations of `compute_sequence` run in the forward: those before the schedule's first
        node that is not the model's (the loss or a tangent)."""
        return split_position(self.graph, self._executor_computes, self.groups)

    @property
    def _executor_computes(self) -> list[int]:
        return list(self.result.schedule.computes) if self.executor_computes is None else self.executor_computes

    @property
    def budget_bytes(self) -> int:
        return self.result.budget_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """The peak the executor reaches: the schedule replayed with multi-output ops counted exactly (at most the
        solver's own figure, `result.peak_bytes`, which counts a recomputed op's other outputs as long as it lives)."""
        return self.result.peak_bytes if self.exact_peak_bytes is None else self.exact_peak_bytes

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
            "modules": {str(k): v for k, v in self.modules.items()},
            "reference_peak_bytes": int(self.reference_peak_bytes),
            "trace_seconds": float(self.trace_seconds),
            "groups": {str(k): v for k, v in self.groups.items()},
            "inflated": sorted(self.inflated),
            "loss_bytes": int(self.loss_bytes),
            "exact_peak_bytes": None if self.exact_peak_bytes is None else int(self.exact_peak_bytes),
            "pinned_secondaries": bool(self.pinned_secondaries),
            "executor_computes": None if self.executor_computes is None else [int(v) for v in self.executor_computes],
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
                   loss_bytes=int(meta.get("loss_bytes", 0)),
                   exact_peak_bytes=None if meta.get("exact_peak_bytes") is None else int(meta["exact_peak_bytes"]),
                   pinned_secondaries=bool(meta.get("pinned_secondaries", False)),
                   executor_computes=_executor_computes_from(path, meta.get("executor_computes"), ls.schedule))

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

    def _trace_for(self, model: torch.nn.Module, sample_input):
        """Trace `model` on `sample_input` and check that it gives this plan's graph (used by loaded plans)."""
        self.check_model(model)
        self.check_inputs(_as_inputs(sample_input))
        # the plan's own cost model: the contraction folds free views only where they cost nothing, so a graph
        # traced with measured times has more nodes than one traced with FLOPs (costs themselves are not compared)
        traced = trace_model(model, sample_input, self.cost_model)
        got = solver_graph(traced, self.inflated, self.loss_bytes, self.pinned_secondaries)
        diff = _graph_difference(self.graph, got, compare_costs=self.cost_model == "flops")
        if diff is not None:
            raise PlanMismatchError(f"the model traces to another graph than the plan's: {diff}")
        return traced

    def curve(self, model: torch.nn.Module, sample_input, **options):
        """The memory-time curve of this plan's model and input (`planner.curve.overhead_curve`, reusing this
        plan's trace and loss_fn options as given)."""
        from planner.curve import overhead_curve

        if self.traced is None:
            raise ValueError("a plan loaded from JSON holds no trace: call planner.curve.overhead_curve(model, input)")
        return overhead_curve(model, sample_input, traced=self.traced, cost_model=self.cost_model, **options)

    def apply(self, model: torch.nn.Module, sample_input=None, *, compile: bool = False) -> PlannedModule:
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
            traced = self._trace_for(model, sample_input)
        module = PlannedModule(model, self, traced, compile=compile)
        if traced is not None:  # fail now, not at the first step
            compile_schedule(traced, self.compute_sequence, self.split_position, for_compiler=compile)
        return module


# ---------------------------------------------------------------------------------------------
# plan()
# ---------------------------------------------------------------------------------------------
def _resolve_cost_model(cost_model: str) -> str:
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model '{cost_model}'; choose one of {', '.join(COST_MODELS)}")
    # measured time prices every op, elementwise ones included (FLOPs call them free)
    return "time" if cost_model == "auto" else cost_model


def _smallest_budget(graph: Graph, time_limit_s: float, adapt=None) -> tuple[int | None, str, str | None]:
    """The smallest budget a schedule is known to meet, how that is known, and the solver that met it
    (`solvers.bounds.min_budget`, with its `adapt`); (None, why, None) when no solver met any budget in time."""
    from solvers.bounds.min_budget import min_budget

    try:
        mb = min_budget(graph, time_limit_s=time_limit_s, adapt=adapt)
    except (InfeasibleBudgetError, NoSolutionInTimeError) as e:
        return None, f"no solver met any budget within {time_limit_s:g} s ({e})", None
    # the budget the solver was given when it met the minimum: planning at it reproduces the schedule
    # (a greedy solver is not monotone in the budget, so its peak itself may not be reproducible)
    return max(mb.budget_bytes, mb.result.budget_bytes), mb.proof, mb.result.solver


def _executable(graph: Graph, uncounted: dict[int, list[int]], result: SolveResult) -> SolveResult | None:
    """`result` as the executor runs it, or None where that does not fit the budget it was solved for
    (uncounted: `_uncounted_co_outputs(graph, traced)`).

    A recomputed secondary output is indexed out of its op's newest result, which holds it from that computation of
    the op on. A forward op's node counts its secondary outputs for as long as it is resident (solver_graph's
    inflated bytes), and the op's result lives no longer than that (the secondary output reads it): nothing to move
    there. A backward op's node does not count them: replay what the executor holds (executor_sequence)."""
    seq = executor_sequence(graph, result.schedule.computes, uncounted)
    if seq == list(result.schedule.computes):
        return result
    sched = Schedule.from_sequence(graph, seq)
    sim = simulate(graph, sched)
    return dataclasses.replace(result, schedule=sched, sim=sim) if sim.peak_bytes <= result.budget_bytes else None


def _smallest_executable_budget(traced, loss_bytes: int, time_limit_s: float) -> tuple[int | None, str, str | None]:
    """_smallest_budget for what plan() can run: on the graph plan() solves first, counting only the schedules whose
    executor sequence fits (`_executable`); where none is found, on the graph plan() falls back to (secondary
    outputs not recomputable, whose schedules the executor holds as simulated) with the time left."""
    t0 = time.perf_counter()
    graph = solver_graph(traced, None, loss_bytes)
    uncounted = _uncounted_co_outputs(graph, traced)  # once: min_budget adapts every schedule it finds
    found = _smallest_budget(graph, time_limit_s, adapt=lambda r: _executable(graph, uncounted, r))
    left = time_limit_s - (time.perf_counter() - t0)
    if found[0] is not None or not secondary_outputs(traced) or left < 1.0:
        return found
    return _smallest_budget(solver_graph(traced, None, loss_bytes, pin_secondaries=True), left)


def smallest_budget(plan_or_traced, time_limit_s: float = 30.0) -> tuple[int | None, str | None]:
    """(the smallest budget in bytes a schedule is known to meet, the solver that met it) for a Plan's
    or a TraceResult's graph; (None, None) when nothing is known."""
    traced = plan_or_traced.traced if isinstance(plan_or_traced, Plan) else plan_or_traced
    if traced is None:
        raise ValueError("a plan loaded from JSON holds no trace: pass the TraceResult of the model")
    loss_bytes = plan_or_traced.loss_bytes if isinstance(plan_or_traced, Plan) else 0
    found, _, solver = _smallest_executable_budget(traced, loss_bytes, time_limit_s)
    return found, solver


def smallest_budget_bytes(plan_or_traced, time_limit_s: float = 30.0) -> int | None:
    """The smallest budget (bytes) a schedule is known to meet for a Plan's or a TraceResult's graph."""
    return smallest_budget(plan_or_traced, time_limit_s)[0]


def plan(model: torch.nn.Module, sample_input, budget_gb: float, *, solver: str = "auto",
         cost_model: str = "auto", time_limit_s: float = 60.0, device_name: str | None = None,
         traced=None, loss_fn=None) -> Plan:
    """Plan one training step of `model` on `sample_input` within `budget_gb` gigabytes (1 GB = 10^9 bytes).

    sample_input: a tensor, a tuple of tensors, a dict of keyword arguments (`model(**batch)`), or (args, kwargs);
    non-tensor keyword values are constants of the plan. A model that computes its own loss (a transformers
    model given `labels`) is planned with that loss in the graph.

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
    NoSolutionInTimeError when no schedule was found within `time_limit_s` and nothing proves that none exists,
    capture.trace.TraceError when the model cannot be traced.
    """
    call, inputs = CallSpec.of(sample_input)
    budget_bytes = budget_bytes_from_gb(budget_gb)
    cm = _resolve_cost_model(cost_model)
    if traced is None:
        traced = trace_model(model, sample_input, cm, device_name)
    elif traced.model is not model:
        raise ValueError("`traced` belongs to another model object")
    loss_bytes = 0 if loss_fn is None else loss_workspace_bytes(model, inputs, loss_fn, call)
    if loss_fn is None:
        _warn_if_no_loss(traced)
    graph = solver_graph(traced, None, loss_bytes)
    t0 = time.perf_counter()
    sources = secondary_outputs(traced)
    # a schedule that recomputes a secondary output may have to be solved again with it pinned (below): keep time
    # for that second solve inside the limit
    first_limit = time_limit_s * FIRST_SOLVE_SHARE if sources else time_limit_s
    keep_all = _keep_all_if_it_fits(traced, loss_bytes, budget_bytes) if solver == "auto" else None
    try:
        result = keep_all or solve(graph, budget_bytes, solver, time_limit_s=first_limit)
    except InfeasibleBudgetError as e:
        # naming the minimum need not cost the whole time limit again
        left = max(5.0, min(time_limit_s / 2, time_limit_s - (time.perf_counter() - t0)))
        smallest, how, by = _smallest_executable_budget(traced, loss_bytes, left)
        if smallest is None and e.min_budget_bytes is not None:
            smallest, how, by = e.min_budget_bytes, e.reason, solver
        gb = "unknown" if smallest is None else f"{smallest / GB:.9f} GB ({smallest} bytes)"
        if smallest is not None and by not in (None, solver):
            gb += f", met by solver '{by}'"
        raise InfeasibleBudgetError(
            budget_bytes, smallest, solver,
            f"budget {budget_bytes / GB:.9f} GB is below the smallest feasible budget {gb}; {how}") from e
    # what the executor holds must fit too (`_executable`); where it does not, solve again with secondary outputs
    # not recomputable
    pinned = False
    executable = _executable(graph, _uncounted_co_outputs(graph, traced), result)  # (solved for budget_bytes)
    if executable is not None:
        result = executable
    else:
        pinned = True
        graph = solver_graph(traced, None, loss_bytes, pin_secondaries=True)
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            raise NoSolutionInTimeError(
                f"{solver}: the schedule found recomputes a secondary output whose op's result the executor would "
                "keep alive, and no time is left to solve again without it", budget_bytes=budget_bytes,
                seconds=time.perf_counter() - t0)
        result = solve(graph, budget_bytes, solver, time_limit_s=left)
    # Secondary outputs need counting only where the op is recomputed, or where one of them is indexed again out of
    # a result of the op: count them there alone, and replay the same computations on that graph (bytes only
    # shrink, so it stays within the budget).
    inflated = _counted_sources(graph, result.sim.recomputed, traced, sources)
    graph = solver_graph(traced, inflated, loss_bytes, pinned)
    result = _free_at_last_use(graph, result)
    # what the executor runs: a secondary output indexed again out of a result is taken right after that computation
    # of the op (the same memory: the result holds it from there on; and the result itself is then not handed from
    # the forward to the backward, which the compiled step cannot take)
    held = executor_sequence(graph, result.schedule.computes, co_outputs(graph, traced))
    groups = solver_groups(traced)
    compile_schedule(traced, traced_sequence(graph, held, groups),
                     split_position(graph, held, groups))  # the executor can run it (raises otherwise)
    return Plan(graph=graph, result=result, fingerprint=fingerprint(model, inputs), cost_model=cm, inflated=inflated,
                pinned_secondaries=pinned, executor_computes=None if held == list(result.schedule.computes) else held,
                loss_bytes=loss_bytes,
                exact_peak_bytes=exact_peak_bytes(traced, loss_bytes, [graph.labels[v] for v in held]),
                modules=node_modules(traced), traced=traced, trace_seconds=traced.trace_seconds,
                reference_peak_bytes=reference_peak_bytes(graph), groups=solver_groups(traced))


def _executor_computes_from(path, value, schedule: Schedule) -> list[int] | None:
    """A stored executor sequence, checked against the schedule: the same nodes, none computed more often."""
    if value is None:
        return None
    from collections import Counter

    from graphs.errors import ScheduleFormatError

    want = Counter(schedule.computes)
    try:
        got = Counter(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise ScheduleFormatError(f"{path}: extra.planner.executor_computes is not a list of node ids") from e
    if set(got) != set(want) or any(got[v] > want[v] for v in got):
        raise ScheduleFormatError(f"{path}: extra.planner.executor_computes does not run the schedule's computations")
    return [int(v) for v in value]


def _uncounted_co_outputs(graph: Graph, traced) -> dict[int, list[int]]:
    """co_outputs(graph, traced) of the multi-output ops whose node in `graph` does not count its secondary outputs'
    bytes (solver_graph: the backward ops, and the forward ops left out of `inflate`)."""
    return {v: ss for v, ss in co_outputs(graph, traced).items()
            if int(graph.nodes[v].bytes) < int(traced.graph.nodes[graph.labels[v]].bytes) +
            sum(int(traced.graph.nodes[graph.labels[s]].bytes) for s in ss)}


def _counted_sources(graph: Graph, recomputed, traced, sources: dict[int, list[int]]) -> set[int]:
    """Labels of the forward multi-output ops (of `sources`, secondary_outputs(traced)) whose node must count its
    secondary outputs: those computed more than once, and those with a secondary output computed more than once
    (indexed again out of a result of the op, which holds it from the op's computation on)."""
    again = {graph.labels[v] for v in recomputed}
    return {src for src, secs in sources.items()
            if not traced.graph.nodes[src].backward and (src in again or again.intersection(secs))}


def _keep_all_if_it_fits(traced, loss_bytes: int, budget_bytes: int) -> SolveResult | None:
    """The schedule that keeps every value, if what the executor holds for it fits the budget: it computes every
    node once, so no schedule costs less. The solver graph counts a multi-output op's secondary outputs twice (to
    keep recomputations within the peak); without recomputation they are counted once, so this finds the budgets
    between the two peaks, where a solver on that graph would recompute for nothing."""
    if not secondary_outputs(traced):
        return None  # the solver graph is exact, and auto tries this schedule on it first itself
    exact = solver_graph(traced, set(), loss_bytes)
    try:
        return dataclasses.replace(solve(exact, budget_bytes, "checkpoint_all"), solver="auto (checkpoint_all)")
    except InfeasibleBudgetError:
        return None


FIRST_SOLVE_SHARE = 0.75  # of plan()'s time limit, for the first solve of a graph with secondary outputs


class LossNotPlannedWarning(UserWarning):
    """The model returns no scalar loss and no `loss_fn` was given: the loss's memory is not in the plan."""


def _warn_if_no_loss(traced) -> None:
    """Warn when no differentiated output is a scalar: the loss the step computes from them lies outside the
    plan, and its temporaries (a cross-entropy's log-softmax: about one more copy of the logits) are not counted."""
    phs = [n for n in traced.joint_module.graph.nodes if n.op == "placeholder"][traced.num_primals:]
    vals = [ph.meta["val"] for ph in phs]
    if not vals or any(v.numel() == 1 for v in vals):
        return
    out_bytes = sum(v.numel() * v.element_size() for v in vals)
    warnings.warn(LossNotPlannedWarning(
        f"the model's outputs ({out_bytes} bytes) are not a scalar loss and no loss_fn was given: the memory the "
        f"loss holds beyond a scalar (for a cross-entropy about {out_bytes} bytes more) is not planned for; pass "
        "loss_fn=, or let the model compute its loss (e.g. transformers models given labels)"), stacklevel=3)


def _free_at_last_use(graph: Graph, result: SolveResult) -> SolveResult:
    """The same computations, each value freed right after its last use: what the executor's fx code does."""
    sched = Schedule.from_sequence(graph, result.schedule.computes)
    sim = simulate(graph, sched)
    if sim.peak_bytes > result.budget_bytes:  # cannot happen: last-use frees are optimal for a sequence
        raise RematError(f"internal error: freeing at last use raised the peak to {sim.peak_bytes}")
    return dataclasses.replace(result, schedule=sched, sim=sim)
