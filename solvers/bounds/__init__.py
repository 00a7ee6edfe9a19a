"""Bounds: lower bounds on cost (forced recomputation) and on the budget (subgraph relaxation), and the smallest-budget search."""
