"""`python -m planner plan MODULE:FACTORY --budget ... --out` and `python -m planner show`."""
import json
import subprocess
import sys

import pytest

from planner.tools.cli import parse_budget
from tests.conftest import ROOT


def run(*args):
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True)


def test_parse_budget_is_decimal():
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget("800MB") == 800_000_000
    assert parse_budget("123456B") == 123456
    assert parse_budget("2") == 2 * 10**9
    with pytest.raises(Exception):
        parse_budget("lots")


def test_plan_then_show(tmp_path):
    out = tmp_path / "plan.json"
    p = run("plan", "tests.models:make_gpt", "--budget", "0.00028GB", "--cost-model", "flops",
            "--time-limit", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "predicted peak" in p.stdout and "status" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "remat-schedule" and doc["budget_bytes"] == 280_000
    assert doc["predicted"]["peak_bytes"] <= 280_000
    s = run("show", str(out))
    assert s.returncode == 0, s.stderr
    assert "overhead" in s.stdout and "status" in s.stdout
    assert "node(s) recomputed" in s.stdout  # grouped by module: "  blocks.0.attn: 2 node(s) recomputed, ..."


def test_plan_infeasible_names_minimum_in_gb(tmp_path):
    p = run("plan", "tests.models:make_mlp", "--budget", "1000B", "--cost-model", "flops", "--time-limit", "2",
            "--out", str(tmp_path / "x.json"))
    assert p.returncode == 2
    assert "smallest feasible budget" in p.stderr and " GB" in p.stderr
