"""Loaders for the public benchmark graphs (networkx node-link JSON, two dialects).

Checkmate layer graphs: nodes {"id", "name", "backward", "cost_cpu", "cost_ram"}, links {"source", "target"};
ids already in a topological order. Random layered graphs (Moccasin): nodes {"name" (the id), "out_cost",
"duration", "param_cost"}, links {"0": source, "1": target}, `graph.order` the reference order.
The returned Graph's node i is the i-th node of the reference order; `graph.labels` are the file's ids.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from graphs.errors import GraphError
from graphs.ir import Graph

# ../shared/benchmarks/graphs beside the checkout; REMAT_BENCHMARKS_DIR overrides it.
DEFAULT_DIR = Path(os.environ.get("REMAT_BENCHMARKS_DIR")
                   or Path(__file__).resolve().parent.parent.parent / "shared" / "benchmarks" / "graphs")
CHECKMATE_GRAPHS = ("vgg16", "vgg19", "fcn8", "segnet", "unet", "mobilenet", "resnet50")
RANDOM_LAYERED_GRAPHS = ("rl100", "rl250", "rl500", "rl1000")


def benchmark_path(name: str, directory: str | Path | None = None) -> Path:
    return Path(directory or DEFAULT_DIR) / f"{name}.json"


def load_benchmark(path: str | Path) -> Graph:
    """Load a benchmark graph file in either dialect; raises GraphError naming what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GraphError(f"{path}: cannot read benchmark graph: {e}") from e
    return graph_from_node_link(data, default_name=path.stem)


def graph_from_node_link(data: dict, default_name: str = "graph") -> Graph:
    for key in ("nodes", "links"):
        if key not in data:
            raise GraphError(f"node-link graph has no '{key}' field")
    nodes = data["nodes"]
    meta = data.get("graph") or {}
    if not nodes:
        raise GraphError("node-link graph has no nodes")
    checkmate = "cost_ram" in nodes[0]
    inputs: dict[int, list[int]] = {}
    recs = []
    for k, nd in enumerate(nodes):
        try:
            if checkmate:
                rec = dict(id=int(nd["id"]), name=str(nd.get("name", nd["id"])), cost=float(nd["cost_cpu"]),
                           bytes=int(nd["cost_ram"]), backward=bool(nd.get("backward", False)))
            else:
                rec = dict(id=int(nd["name"]), name=str(nd["name"]), cost=float(nd["duration"]),
                           bytes=int(nd["out_cost"]))
        except KeyError as e:
            raise GraphError(f"node-link node {k} has no field {e}") from e
        inputs[rec["id"]] = []
        recs.append(rec)
    for j, link in enumerate(data["links"]):
        if "source" in link:
            s, t = link["source"], link["target"]
        elif "0" in link:
            s, t = link["0"], link["1"]
        else:
            raise GraphError(f"link {j} has neither source/target nor 0/1: {link!r}")
        if int(t) not in inputs:
            raise GraphError(f"link {j} points to unknown node id {t}")
        if int(s) not in inputs[int(t)]:
            inputs[int(t)].append(int(s))
    for rec in recs:
        rec["inputs"] = sorted(inputs[rec["id"]])
    order = meta.get("order")
    return Graph.from_unordered(recs, name=str(default_name), order=order)
