import pytest

from graphs.errors import ScheduleError
from graphs.generate import linear_training_graph
from graphs.ir import Graph, Node
from graphs.schedule import Schedule
from graphs.simulate import budget_from_multiplier, reference_peak_bytes, simulate


def chain3(retain_last=False, recomputable=True):
    return Graph((Node(0, "a", 1.0, 4, (), recomputable=recomputable), Node(1, "b", 2.0, 8, (0,)),
                  Node(2, "c", 3.0, 2, (0, 1), retain=retain_last)), fixed_bytes=100)


def test_peak_includes_inputs_output_and_fixed():
    g = chain3()
    s = Schedule.from_pairs([("compute", 0), ("compute", 1), ("compute", 2), ("free", 0), ("free", 1), ("free", 2)])
    r = simulate(g, s)
    assert r.peak_bytes == 100 + 4 + 8 + 2
    assert r.total_cost == 6.0 and r.overhead == 0.0
    assert list(r.timeline_bytes) == [104, 112, 114, 110, 102, 100]


def test_recomputation_counts_cost_and_overhead():
    g = chain3()
    s = Schedule.from_pairs([("compute", 0), ("compute", 1), ("free", 0), ("compute", 0), ("compute", 2)])
    r = simulate(g, s)
    assert r.total_cost == 7.0
    assert r.overhead == pytest.approx(1 / 6)
    assert r.recomputed == [0]


@pytest.mark.parametrize(
    "pairs, fragment",
    [
        ([("compute", 1)], "input .* is not resident"),
        ([("compute", 0), ("compute", 0)], "already resident"),
        ([("free", 0)], "not resident"),
        ([("compute", 0), ("compute", 9)], "unknown node id"),
        ([("compute", 0), ("compute", 1)], "never computes sink"),
    ],
)
def test_invalid_schedules_name_the_op(pairs, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        simulate(chain3(), Schedule.from_pairs(pairs))


def test_retained_must_stay_and_random_ops_are_not_recomputed():
    g = chain3(retain_last=True)
    with pytest.raises(ScheduleError, match="retained"):
        simulate(g, Schedule.from_pairs([("compute", 0), ("compute", 1), ("compute", 2), ("free", 2)]))
    g2 = chain3(recomputable=False)
    with pytest.raises(ScheduleError, match="not recomputable"):
        simulate(g2, Schedule.from_pairs([("compute", 0), ("compute", 1), ("free", 0), ("compute", 0),
                                          ("compute", 2)]))


def test_from_sequence_frees_at_last_use_and_keeps_retained():
    g = chain3(retain_last=True)
    s = Schedule.from_sequence(g, [0, 1, 2])
    assert s.to_pairs() == [["compute", 0], ["compute", 1], ["compute", 2], ["free", 0], ["free", 1]]
    assert simulate(g, s).peak_bytes == 114


def test_from_sequence_with_recomputation_frees_each_copy():
    g = linear_training_graph(2)  # 0 -> 1 -> 2(loss) -> 3 -> 4, 3 reads 1, 4 reads 0
    s = Schedule.from_sequence(g, [0, 1, 2, 3, 0, 4])
    r = simulate(g, s)
    assert r.compute_counts.tolist() == [2, 1, 1, 1, 1]
    # first copy of node 0 dies after node 1 reads it
    assert s.to_pairs()[:4] == [["compute", 0], ["compute", 1], ["free", 0], ["compute", 2]]


def test_linear_graph_reference_peak_and_budget_rounding():
    g = linear_training_graph(8)
    assert g.n == 17
    assert reference_peak_bytes(g) == 10  # 8 forward values + loss... peak while the first backward runs
    assert budget_from_multiplier(g, 0.85) == 9  # ceil(8.5)


def test_co_outputs_are_held_for_the_length_of_their_op():
    # node 1 is a two-output op (its other output is node 2, 6 bytes, read by node 3). Computing 1 allocates both:
    # at that op the peak covers node 2 too, whether the schedule computes 2 next (the same storage: no more) or
    # not (dropped at once)
    g = Graph((Node(0, "x", 1.0, 4, ()), Node(1, "op", 1.0, 8, (0,)), Node(2, "op[1]", 0.0, 6, (1,)),
               Node(3, "y", 1.0, 2, (0, 1, 2))), fixed_bytes=10)
    s = Schedule.from_sequence(g, [0, 1, 2, 3])
    assert simulate(g, s).peak_bytes == 10 + 4 + 8 + 6 + 2
    assert simulate(g, s, {1: [2]}).peak_bytes == 10 + 4 + 8 + 6 + 2  # 2 computed next: no double count
    s2 = Schedule.from_pairs([("compute", 0), ("compute", 1), ("compute", 2), ("free", 1), ("compute", 1),
                              ("compute", 3)])
    # the recomputation of 1 allocates its other output again, beside the resident node 2
    assert simulate(g, s2).peak_bytes == 10 + 4 + 8 + 6 + 2
    assert simulate(g, s2, {1: [2]}).peak_bytes == 10 + 4 + 8 + 6 + 6
    assert simulate(g, s2, {1: [2]}).timeline_bytes[4] == 10 + 4 + 6 + 8  # resident after the op: unchanged
