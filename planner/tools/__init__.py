"""Tools on top of the planner: fit, the curve, measurement, hand-written baselines, the command line."""
