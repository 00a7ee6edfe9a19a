"""`remat-schedule` JSON, version 1: a self-contained schedule with its graph and predictions.

Node ids in the file are the graph's labels (for a benchmark graph, the ids of its file).
Import checks the structure field by field, replays the ops in the simulator and compares the
replay with the `predicted` block; anything malformed or inconsistent raises ScheduleFormatError.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from graphs.errors import GraphError, ScheduleError, ScheduleFormatError
from graphs.ir import Graph
from graphs.result import SolveResult
from graphs.schedule import Schedule, Status
from graphs.simulate import SimResult, simulate

FORMAT = "remat-schedule"
VERSION = 1
_COST_RTOL = 1e-9


@dataclass
class LoadedSchedule:
    graph: Graph
    schedule: Schedule
    budget_bytes: int
    solver: str
    status: Status
    solve_seconds: float
    lower_bound_cost: float | None
    sim: SimResult
    extra: dict


def graph_to_dict(graph: Graph) -> dict:
    lab = graph.labels
    return {
        "name": graph.name,
        "fixed_bytes": graph.fixed_bytes,
        "nodes": [
            {"id": lab[nd.id], "name": nd.name, "cost": nd.cost, "bytes": int(nd.bytes),
             "inputs": [lab[i] for i in nd.inputs], "backward": nd.backward, "retain": nd.retain,
             "recomputable": nd.recomputable}
            for nd in graph.nodes
        ],
    }


def result_to_dict(graph: Graph, result: SolveResult, extra: dict | None = None) -> dict:
    lab = graph.labels
    sim = result.sim
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "graph": graph_to_dict(graph),
        "budget_bytes": int(result.budget_bytes),
        "solver": result.solver,
        "status": result.status.value,
        "solve_seconds": float(result.solve_seconds),
        "ops": [[op.kind.value, lab[op.node]] for op in result.schedule.ops],
        "predicted": {
            "peak_bytes": int(sim.peak_bytes),
            "total_cost": float(sim.total_cost),
            "overhead": float(sim.overhead),
            "lower_bound_cost": None if result.lower_bound_cost is None else float(result.lower_bound_cost),
        },
    }
    if result.info:
        doc["info"] = json.loads(json.dumps(result.info, default=str))
    if extra:
        doc["extra"] = extra
    return doc


def save_result(path: str | Path, graph: Graph, result: SolveResult, extra: dict | None = None) -> None:
    Path(path).write_text(json.dumps(result_to_dict(graph, result, extra), indent=1) + "\n")


def _need(d: dict, key: str, types, where: str):
    if not isinstance(d, dict):
        raise ScheduleFormatError(f"{where}: expected an object")
    if key not in d:
        raise ScheduleFormatError(f"missing field '{where}.{key}'" if where else f"missing field '{key}'")
    val = d[key]
    if isinstance(val, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ScheduleFormatError(f"field '{where + '.' if where else ''}{key}' has the wrong type (bool)")
    if not isinstance(val, types):
        raise ScheduleFormatError(
            f"field '{where + '.' if where else ''}{key}' has the wrong type ({type(val).__name__})")
    return val


def graph_from_dict(d: dict) -> Graph:
    name = _need(d, "name", str, "graph")
    fixed = _need(d, "fixed_bytes", int, "graph")
    nodes = _need(d, "nodes", list, "graph")
    recs = []
    for k, nd in enumerate(nodes):
        w = f"graph.nodes[{k}]"
        rec = {
            "id": _need(nd, "id", int, w),
            "name": _need(nd, "name", str, w),
            "cost": _need(nd, "cost", (int, float), w),
            "bytes": _need(nd, "bytes", int, w),
            "inputs": _need(nd, "inputs", list, w),
            "backward": _need(nd, "backward", bool, w),
            "retain": _need(nd, "retain", bool, w),
            "recomputable": _need(nd, "recomputable", bool, w),
        }
        for j, i in enumerate(rec["inputs"]):
            if not isinstance(i, int) or isinstance(i, bool):
                raise ScheduleFormatError(f"field '{w}.inputs[{j}]' is not an int id")
        recs.append(rec)
    order = [r["id"] for r in recs]
    try:
        return Graph.from_unordered(recs, fixed_bytes=fixed, name=name, order=order)
    except GraphError as e:
        raise ScheduleFormatError(f"field 'graph': {e}") from e


def result_from_dict(doc: dict) -> LoadedSchedule:
    if not isinstance(doc, dict):
        raise ScheduleFormatError("the document is not a JSON object")
    fmt = _need(doc, "format", str, "")
    if fmt != FORMAT:
        raise ScheduleFormatError(f"field 'format' is {fmt!r}, expected {FORMAT!r}")
    ver = _need(doc, "version", int, "")
    if ver != VERSION:
        raise ScheduleFormatError(f"field 'version' is {ver}, this reader knows version {VERSION}")
    graph = graph_from_dict(_need(doc, "graph", dict, ""))
    budget = _need(doc, "budget_bytes", int, "")
    solver = _need(doc, "solver", str, "")
    status_s = _need(doc, "status", str, "")
    try:
        status = Status(status_s)
    except ValueError:
        raise ScheduleFormatError(f"field 'status' is {status_s!r}: expected optimal, feasible or heuristic") from None
    secs = _need(doc, "solve_seconds", (int, float), "")
    raw_ops = _need(doc, "ops", list, "")
    pairs = []
    for k, op in enumerate(raw_ops):
        if (not isinstance(op, list) or len(op) != 2 or op[0] not in ("compute", "free")
                or not isinstance(op[1], int) or isinstance(op[1], bool)):
            raise ScheduleFormatError(f"ops[{k}] is {op!r}: expected [\"compute\" | \"free\", id]")
        if op[1] not in graph.label_to_id:
            raise ScheduleFormatError(f"ops[{k}] names unknown node id {op[1]}")
        pairs.append((op[0], graph.label_to_id[op[1]]))
    schedule = Schedule.from_pairs(pairs)
    try:
        sim = simulate(graph, schedule)
    except ScheduleError as e:
        raise ScheduleFormatError(f"ops: {e}") from e
    pred = _need(doc, "predicted", dict, "")
    peak = _need(pred, "peak_bytes", int, "predicted")
    cost = _need(pred, "total_cost", (int, float), "predicted")
    ovh = _need(pred, "overhead", (int, float), "predicted")
    if "lower_bound_cost" not in pred:
        raise ScheduleFormatError("missing field 'predicted.lower_bound_cost' (null where unknown)")
    lb = pred["lower_bound_cost"]
    if lb is not None and (not isinstance(lb, (int, float)) or isinstance(lb, bool)):
        raise ScheduleFormatError("field 'predicted.lower_bound_cost' must be a number or null")
    if peak != sim.peak_bytes:
        raise ScheduleFormatError(f"field 'predicted.peak_bytes' is {peak} but the ops peak at {sim.peak_bytes}")
    if not math.isclose(cost, sim.total_cost, rel_tol=_COST_RTOL, abs_tol=1e-12):
        raise ScheduleFormatError(f"field 'predicted.total_cost' is {cost} but the ops cost {sim.total_cost}")
    if not math.isclose(ovh, sim.overhead, rel_tol=1e-6, abs_tol=1e-9):
        raise ScheduleFormatError(f"field 'predicted.overhead' is {ovh} but the ops give {sim.overhead}")
    if lb is not None and lb > sim.total_cost * (1 + 1e-9) + 1e-9:
        raise ScheduleFormatError(f"field 'predicted.lower_bound_cost' ({lb}) exceeds the schedule's cost")
    if sim.peak_bytes > budget:
        raise ScheduleFormatError(f"field 'budget_bytes' ({budget}) is below the schedule's peak {sim.peak_bytes}")
    return LoadedSchedule(graph, schedule, budget, solver, status, float(secs), lb, sim, doc.get("extra") or {})


def load_result(path: str | Path) -> LoadedSchedule:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ScheduleFormatError(f"{path}: not valid JSON: {e}") from e
    return result_from_dict(doc)
