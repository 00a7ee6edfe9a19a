# Quick start: `make demo` runs the planner on a bundled example; `make test` runs ruff, then the test suite.
# Both install what they need into .venv at the repo root (torch pinned to the CPU build 2.13.0).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo lint test clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) scripts/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache
