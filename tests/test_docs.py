"""The README stays a page and the docs stay current: sizes, dates without times of day, links that resolve."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIME_OF_DAY = re.compile(r"\b[0-2]?[0-9]:[0-5][0-9]\b")


def test_the_readme_is_one_page_and_benchmarks_one_table_per_question():
    assert len((ROOT / "README.md").read_bytes()) <= 8 * 1024
    assert len((ROOT / "docs" / "benchmarks.md").read_bytes()) <= 25 * 1024


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_time_of_day(page):
    hits = [line for line in page.read_text().splitlines() if TIME_OF_DAY.search(line)]
    assert not hits, f"{page.name}: dates only, never a time of day: {hits[:3]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
