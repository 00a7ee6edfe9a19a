import json

import pytest

from graphs.benchmarks import CHECKMATE_GRAPHS, RANDOM_LAYERED_GRAPHS, graph_from_node_link, load_benchmark
from graphs.errors import GraphError
from graphs.simulate import reference_peak_bytes

# Reference peaks listed in ../shared/benchmarks/README.md
REFERENCE_PEAKS = {
    "vgg16": 15825108992, "vgg19": 17058234368, "fcn8": 13484795520, "segnet": 19943884288,
    "unet": 20959461376, "mobilenet": 34701056000, "resnet50": 38059356160, "rl100": 46319,
    "rl250": 146840, "rl500": 284439, "rl1000": 608619,
}
SINGLE_OP = {"vgg16": 0.831, "vgg19": 0.771, "fcn8": 0.615, "segnet": 0.416, "unet": 0.395, "mobilenet": 0.191,
             "resnet50": 0.097, "rl100": 0.432, "rl250": 0.597, "rl500": 0.174, "rl1000": 0.080}


@pytest.mark.parametrize("name", CHECKMATE_GRAPHS + RANDOM_LAYERED_GRAPHS)
def test_reference_peak_and_single_op_bound(bench_dir, name):
    g = load_benchmark(bench_dir / f"{name}.json")
    ref = reference_peak_bytes(g)
    assert ref == REFERENCE_PEAKS[name]
    assert round(g.single_op_bound_bytes() / ref, 3) == pytest.approx(SINGLE_OP[name], abs=1e-9)


def test_random_layered_dialect_uses_order_and_file_ids(bench_dir):
    raw = json.loads((bench_dir / "rl100.json").read_text())
    g = load_benchmark(bench_dir / "rl100.json")
    assert list(g.labels) == raw["graph"]["order"]
    by_name = {nd["name"]: nd for nd in raw["nodes"]}
    for nd in g.nodes:
        src = by_name[g.labels[nd.id]]
        assert nd.bytes == src["out_cost"] and nd.cost == src["duration"]
    edges = {(lk["0"], lk["1"]) for lk in raw["links"]}
    assert edges == {(g.labels[i], g.labels[nd.id]) for nd in g.nodes for i in nd.inputs}


def test_checkmate_dialect_fields(bench_dir):
    g = load_benchmark(bench_dir / "vgg16.json")
    assert g.nodes[0].name == "block1_conv1" and g.nodes[0].cost == 385 and g.nodes[0].bytes == 3288334336
    assert sum(nd.backward for nd in g.nodes) == 23


def test_malformed_node_link():
    with pytest.raises(GraphError, match="no 'links'"):
        graph_from_node_link({"nodes": [{"id": 0}]})
    with pytest.raises(GraphError, match="field"):
        graph_from_node_link({"nodes": [{"id": 0, "cost_ram": 1}], "links": []})
    bad = {"nodes": [{"id": 0, "name": "a", "cost_cpu": 1, "cost_ram": 1, "backward": False},
                     {"id": 1, "name": "b", "cost_cpu": 1, "cost_ram": 1, "backward": False}],
           "links": [{"source": 0, "target": 1}, {"source": 1, "target": 0}]}
    with pytest.raises(GraphError, match="cycle"):
        graph_from_node_link(bad)
