"""Exact formulations: the Checkmate MILP and its stage model, LP rounding, CP-SAT and its helpers, the chain DP."""
