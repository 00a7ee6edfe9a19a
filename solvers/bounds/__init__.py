"""Bounds: lower bounds on cost (forced recomputation, program order) and on the budget (subgraph relaxation), and
the smallest-budget search."""
