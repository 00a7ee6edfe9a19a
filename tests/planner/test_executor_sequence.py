"""executor_sequence: a recomputed secondary output of a multi-output op, as the executor holds it."""
from graphs.ir import Graph, Node
from planner.solver_graph import executor_sequence


def _graph():
    # 1 is a two-output op whose other output is node 2; 5 and 4 read 2, 3 and 6 read the op's main output
    return Graph((Node(0, "x", 1.0, 4, ()), Node(1, "op", 1.0, 8, (0,)), Node(2, "op[1]", 0.0, 8, (0, 1)),
                  Node(3, "a", 1.0, 4, (1,)), Node(4, "b", 1.0, 4, (2, 3)), Node(5, "d", 1.0, 4, (2,)),
                  Node(6, "e", 1.0, 4, (3,))))


def test_a_secondary_output_reindexed_from_the_first_result_is_kept_instead():
    # the op ran once: "recomputing" 2 would index the first result, which the executor keeps alive
    assert executor_sequence(_graph(), [0, 1, 2, 5, 3, 2, 4], {1: [2]}) == [0, 1, 2, 5, 3, 4]


def test_a_secondary_output_is_held_from_the_ops_recomputation_on():
    seq = [0, 1, 2, 5, 3, 1, 6, 2, 4]
    assert executor_sequence(_graph(), seq, {1: [2]}) == [0, 1, 2, 5, 3, 1, 2, 6, 4]
    assert executor_sequence(_graph(), seq, {}) == seq  # no multi-output op: unchanged
