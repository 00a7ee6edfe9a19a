"""Bad arguments to the API and the command line: an ArgumentError (a ValueError and a TypeError both) naming the
argument and what would work, raised before any work starts; the command line exits 2 with one line, no traceback."""
import subprocess
import sys

import numpy as np
import pytest
import torch

import planner
from graphs.errors import ArgumentError
from planner.core.units import budget_bytes_from_gb
from tests.conftest import ROOT
from tests.models import make_gpt, make_mlp


@pytest.mark.parametrize("budget, match", [
    (float("nan"), "budget_gb must be a finite number"), (float("inf"), "budget_gb must be a finite number"),
    (1e-13, "less than one byte"), (0, "must be > 0"), (-1.0, "must be > 0"), (True, "must be a number, got bool"),
    ("1GB", "must be a number, got str"), (torch.ones(2), "must be a number, got Tensor"),
])
def test_a_bad_budget_is_named(budget, match):
    with pytest.raises(ArgumentError, match=match):
        budget_bytes_from_gb(budget)


def test_numpy_and_zero_dim_tensor_budgets_read_as_their_decimal():
    assert budget_bytes_from_gb(np.float32(0.01)) == 10_000_000
    assert budget_bytes_from_gb(torch.tensor(0.01)) == 10_000_000  # float32, read as 0.01, not 0.00999999977
    assert budget_bytes_from_gb(np.array(0.25)) == 250_000_000
    assert budget_bytes_from_gb(np.int64(2)) == 2 * 10**9


def test_plan_names_each_bad_argument():
    model, x = make_mlp()
    with pytest.raises(ArgumentError, match="model must be a torch.nn.Module, got function"):
        planner.plan(lambda t: t * 2, x, 1.0)
    with pytest.raises(ArgumentError, match="cost_model='bogus' is not one of"):
        planner.plan(model, x, 1.0, cost_model="bogus")
    with pytest.raises(ArgumentError, match="time_limit_s must be a number of seconds > 0"):
        planner.plan(model, x, 1.0, time_limit_s=-1)
    with pytest.raises(ArgumentError, match="loss_fn must be a callable"):
        planner.plan(model, x, 1.0, loss_fn="mse")
    with pytest.raises(ArgumentError, match="progress must be"):
        planner.plan(model, x, 1.0, progress="yes")
    with pytest.raises(ArgumentError, match="budget_gb must be a finite number"):
        planner.plan(model, x, float("nan"))


def test_enable_names_each_bad_argument():
    with pytest.raises(ArgumentError, match="blocks must be a module name, a Module class, or a list"):
        planner.enable(make_gpt()[0], 1.0, blocks=3)
    with pytest.raises(ArgumentError, match="'model.layer.0' is not a submodule of GPT.*'blocks.0'"):
        planner.enable(make_gpt()[0], 1.0, blocks="model.layer.0")
    with pytest.raises(ArgumentError, match="'blocks.0' and 'blocks.0.attn' are nested"):
        planner.enable(make_gpt()[0], 1.0, blocks=["blocks.0", "blocks.0.attn"])
    with pytest.raises(ArgumentError, match="time_limit_s"):
        planner.enable(make_gpt()[0], 1.0, time_limit_s=float("nan"))
    with pytest.raises(ArgumentError, match="cost_model='bogus'"):
        planner.enable(make_gpt()[0], 1.0, cost_model="bogus")
    with pytest.raises(ArgumentError, match="compile must be True or False"):
        planner.enable(make_gpt()[0], 1.0, compile="inductor")
    with pytest.raises(ArgumentError, match="model must be a torch.nn.Module"):
        planner.enable(lambda t: t, 1.0)
    model = make_gpt()[0]
    with pytest.raises(ArgumentError):
        planner.enable(model, float("inf"))
    assert planner.inplace_plan(model) is None and model.forward.__func__ is type(model).forward  # nothing left on


def test_a_plan_prints_in_one_line():
    model, x = make_mlp()
    p = planner.plan(model, x, 1.0, cost_model="flops", time_limit_s=5, loss_fn=lambda out: out.sum())
    assert len(repr(p)) < 200 and "\n" not in repr(p) and "nodes" in repr(p)


def cli(*args, cwd=ROOT):
    env_path = f"{ROOT}:{cwd}"
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})


def test_the_command_line_refuses_bad_input_with_exit_2_and_no_traceback(tmp_path):
    (tmp_path / "factories.py").write_text(
        "from tests.models import make_mlp\n"
        "def two(a, b):\n    return make_mlp()\n"
        "NOT_A_FUNCTION = 3\n")
    cases = [
        (("plan", "factories:two", "--budget", "nanGB", "--out", "p.json"), "finite"),
        (("plan", "factories:two", "--budget", "infGB", "--out", "p.json"), "finite"),
        (("plan", "factories:two", "--budget", "1e-12GB", "--out", "p.json"), "at least 1 byte"),
        (("plan", "factories:two", "--budget", "1GB", "--out", "p.json"), "callable with no arguments"),
        (("plan", "factories:NOT_A_FUNCTION", "--budget", "1GB", "--out", "p.json"), "not a function"),
        (("plan", "tests.models:make_mlp", "--budget", "1GB", "--time-limit", "-1", "--out", "p.json"), "> 0"),
        (("plan", "tests.models:make_mlp", "--budget", "1GB", "--out", "no/such/folder/p.json"), "does not exist"),
        (("show", "missing.json"), "no plan file"),
    ]
    for args, message in cases:
        p = cli(*args, cwd=tmp_path)
        assert p.returncode == 2, (args, p.stderr)
        assert message in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
