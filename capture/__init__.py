"""Capture: a torch model's training step as the planner's graph (joint fx tracing, contraction, costs, memory
measurement). The only package besides planner/ that imports torch."""
