"""Planned training steps of the cnn test model equal eager and stay within budget (see exec_cases)."""
from tests.planner.exec_cases import make_test

case, test_budget = make_test("cnn")
