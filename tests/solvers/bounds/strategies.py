"""Graphs small enough for the exhaustive oracle, with random (non-recomputable) ops: what the bounds are checked on."""
from hypothesis import strategies as st

from graphs.generate import linear_training_graph, random_dag, random_training_graph
from tests.solvers.heuristics.heuristic_cases import with_random_ops

small_graphs = st.one_of(
    st.builds(random_dag, st.integers(1, 8), st.integers(0, 10**6), retain_prob=st.sampled_from([0.0, 0.3])),
    st.builds(random_training_graph, st.integers(1, 3), st.integers(0, 10**6)),
    st.builds(lambda L: linear_training_graph(L), st.integers(1, 5)),
)
oracle_graphs = st.builds(with_random_ops, small_graphs, st.integers(0, 255) | st.just(0))
