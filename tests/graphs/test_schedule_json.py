import copy
import json

import pytest

from graphs.benchmarks import load_benchmark
from graphs.errors import ScheduleFormatError
from graphs.generate import random_training_graph
from graphs.schedule_json import load_result, result_from_dict, result_to_dict, save_result
from graphs.simulate import budget_from_multiplier
from solvers.base import solve
from tests.reference_sim import replay


@pytest.mark.parametrize("name, solver, mult", [("vgg19", "chen_greedy", 0.9), ("rl100", "checkpoint_all", 1.0),
                                                ("unet", "chen_sqrtn_linear", 0.8)])
def test_export_replays_to_predicted(bench_dir, tmp_path, name, solver, mult):
    g = load_benchmark(bench_dir / f"{name}.json")
    res = solve(g, budget_from_multiplier(g, mult), solver)
    path = tmp_path / "s.json"
    save_result(path, g, res)
    doc = json.loads(path.read_text())
    peak, cost = replay(doc)
    assert peak == doc["predicted"]["peak_bytes"] == res.peak_bytes
    assert cost == pytest.approx(doc["predicted"]["total_cost"], rel=1e-12)
    assert peak <= doc["budget_bytes"]
    # ids in the file are the benchmark's own ids
    raw = json.loads((bench_dir / f"{name}.json").read_text())
    file_ids = {nd.get("id", nd.get("name")) for nd in raw["nodes"]}
    assert {v for _, v in doc["ops"]} <= file_ids
    back = load_result(path)
    assert back.schedule == res.schedule and back.sim.peak_bytes == res.peak_bytes and back.status == res.status


def test_round_trip_keeps_flags():
    g = random_training_graph(6, seed=3)
    res = solve(g, 10**9, "checkpoint_all")
    back = result_from_dict(json.loads(json.dumps(result_to_dict(g, res))))
    assert back.graph.nodes == g.nodes and back.graph.labels == g.labels


@pytest.fixture()
def doc():
    g = random_training_graph(5, seed=1)
    return result_to_dict(g, solve(g, 10**9, "checkpoint_all"))


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.update(format="other"), "'format'"),
        (lambda d: d.update(version=2), "'version'"),
        (lambda d: d.pop("budget_bytes"), "'budget_bytes'"),
        (lambda d: d.update(status="great"), "'status'"),
        (lambda d: d["graph"]["nodes"][0].pop("cost"), r"graph.nodes\[0\].cost"),
        (lambda d: d["graph"]["nodes"][2].update(bytes="x"), r"graph.nodes\[2\].bytes"),
        (lambda d: d["ops"].__setitem__(0, ["eat", 0]), r"ops\[0\]"),
        (lambda d: d["ops"].__setitem__(0, ["compute", 999]), r"ops\[0\] names unknown"),
        (lambda d: d["ops"].insert(0, ["free", 0]), r"op 0 \(free"),
        (lambda d: d["predicted"].update(peak_bytes=1), "predicted.peak_bytes"),
        (lambda d: d["predicted"].update(total_cost=0.5), "predicted.total_cost"),
        (lambda d: d["predicted"].pop("lower_bound_cost"), "predicted.lower_bound_cost"),
        (lambda d: d.update(budget_bytes=1), "'budget_bytes'"),
        (lambda d: d["graph"]["nodes"][1].update(inputs=[4]), "'graph'"),
    ],
)
def test_import_rejects_malformed(doc, mutate, fragment):
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(ScheduleFormatError, match=fragment):
        result_from_dict(bad)
