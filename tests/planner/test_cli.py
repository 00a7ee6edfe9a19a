import json
import subprocess
import sys

from tests.conftest import ROOT
from tests.reference_sim import replay


def run(*args):
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True)


def test_solve_writes_schedule_and_summary(bench_dir, tmp_path):
    out = tmp_path / "s.json"
    p = run("solve", str(bench_dir / "vgg19.json"), "--budget-multiplier", "0.9", "--solver", "chen_greedy",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "solver=chen_greedy" in p.stdout and "status=heuristic" in p.stdout and "overhead=" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["budget_bytes"] == -(-17058234368 * 9 // 10)
    assert replay(doc)[0] == doc["predicted"]["peak_bytes"] <= doc["budget_bytes"]


def test_infeasible_budget_exits_2_and_names_minimum(bench_dir):
    p = run("solve", str(bench_dir / "vgg16.json"), "--budget-bytes", "1000", "--solver", "checkpoint_all")
    assert p.returncode == 2
    assert "15825108992" in p.stderr


def test_unknown_solver(bench_dir):
    p = run("solve", str(bench_dir / "vgg16.json"), "--budget-multiplier", "1", "--solver", "nope")
    assert p.returncode == 2 and "unknown solver 'nope'" in p.stderr
