"""Harness of the benchmarks and the tests (not part of the installed library)."""
