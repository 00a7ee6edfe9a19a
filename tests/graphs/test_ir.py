import pytest

from graphs.errors import GraphError
from graphs.ir import Graph, Node


def n(i, inputs=(), cost=1.0, b=1, **kw):
    return Node(i, f"v{i}", cost, b, tuple(inputs), **kw)


def test_valid_graph_properties():
    g = Graph((n(0), n(1, [0]), n(2, [0, 1], retain=True)), fixed_bytes=5)
    assert g.users == ((1, 2), (2,), ())
    assert g.sinks == (2,)
    assert g.retained == (2,)
    assert g.total_cost == 3.0
    assert g.single_op_bound_bytes() == 5 + 3


@pytest.mark.parametrize(
    "nodes, fragment",
    [
        ((n(0), n(1, [2]), n(2, [1])), "comes later"),
        ((n(0), n(1, [1])), "reads itself"),
        ((n(0), n(1, [7])), "unknown node id 7"),
        ((n(0), n(1, [0], cost=-1.0)), "negative cost"),
        ((n(0), n(1, [0], b=-3)), "negative bytes"),
        ((n(0), n(2, [0])), "position 1"),
        ((n(0, cost=float("nan")),), "finite"),
    ],
)
def test_validation_names_the_problem(nodes, fragment):
    with pytest.raises(GraphError, match=fragment):
        Graph(nodes)


def test_wrong_order_with_cycle_is_called_a_cycle():
    with pytest.raises(GraphError, match="cycle"):
        Graph((n(0), n(1, [2]), n(2, [1])))


def test_from_unordered_sorts_and_keeps_labels():
    recs = [dict(id=10, inputs=[30]), dict(id=30), dict(id=20, inputs=[10])]
    g = Graph.from_unordered(recs, order=[30, 10, 20])
    assert g.labels == (30, 10, 20)
    assert g.inputs == ((), (0,), (1,))


def test_from_unordered_rejects_cycle_and_unknown():
    with pytest.raises(GraphError, match="cycle"):
        Graph.from_unordered([dict(id=1, inputs=[2]), dict(id=2, inputs=[1])])
    with pytest.raises(GraphError, match="unknown node id 9"):
        Graph.from_unordered([dict(id=1, inputs=[9])])
