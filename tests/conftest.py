import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from graphs.benchmarks import DEFAULT_DIR  # noqa: E402


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    if not DEFAULT_DIR.is_dir():
        pytest.skip(f"benchmark graphs not found at {DEFAULT_DIR} (../shared/benchmarks/graphs beside the checkout)")
    return DEFAULT_DIR
