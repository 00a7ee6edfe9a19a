"""Every name the README and docs/planner.md use as `planner.X` or `from planner import X` exists."""
from __future__ import annotations

import importlib
import re

import pytest

import planner
from tests.conftest import ROOT

PAGES = ("README.md", "docs/planner.md")


def _documented_names() -> set[str]:
    names: set[str] = set()
    for page in PAGES:
        text = (ROOT / page).read_text()
        for m in re.finditer(r"from planner import ([A-Za-z_][A-Za-z_0-9, ]*)", text):
            names |= {n.strip() for n in m.group(1).split(",") if n.strip()}
        # `planner.X` in prose and code, not file names (planner/x.py) nor docs links (planner.md)
        names |= set(re.findall(r"(?<![\w/])planner\.([A-Za-z_][A-Za-z_0-9]*)(?!\.md\b)", text))
    return names


def test_the_pages_name_something():
    assert {"plan", "max_batch", "smallest_budget"} <= _documented_names()


@pytest.mark.parametrize("name", sorted(_documented_names()))
def test_every_documented_name_resolves(name):
    try:
        importlib.import_module(f"planner.{name}")  # a module of the package
    except ModuleNotFoundError:
        assert hasattr(planner, name), f"the docs use planner.{name}, which the package does not export"
    if name in planner.__all__:
        getattr(planner, name)
