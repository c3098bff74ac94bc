# Quick start: `make demo` and `make test` on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml requirements-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-cpu.txt
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mhmoe demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/mhmoe bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
