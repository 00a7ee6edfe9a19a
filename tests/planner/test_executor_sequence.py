"""executor_sequence (a recomputed secondary output as the executor holds it) and the CPU dropout backward."""
from graphs.ir import Graph, Node
from planner.core.solver_graph import executor_sequence


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


def test_the_cpu_dropout_backward_is_aten_bit_for_bit():
    import torch

    from planner.execution.step_builder import dropout_backward_cpu

    torch.manual_seed(0)
    for magnitude in (1e-30, 1.0, 3.2e38):  # the last overflows when scaled
        g = torch.randn(3, 5, 7) * magnitude
        g[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])
        _, mask = torch.ops.aten.native_dropout(torch.randn_like(g), 0.3, True)
        want = torch.ops.aten.native_dropout_backward(g, mask, 1 / 0.7)
        assert torch.equal(dropout_backward_cpu(g, mask, 1 / 0.7).view(torch.int32), want.view(torch.int32))
