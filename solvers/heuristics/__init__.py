"""Heuristics: the keep-policy baselines, the cheapest recomputation for a kept set, DTR-style eviction, the offline
eviction search, perturbed rollouts, the minimum-memory rebuild."""
