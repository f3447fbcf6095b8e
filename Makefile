# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test docs bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# One stamp per extra; reinstalled when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[$*]"
	touch $@

demo: $(VENV)/.installed-examples
	$(PY) examples/quickstart.py

test: $(VENV)/.installed-dev
	$(MAKE) lint
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)
	$(MAKE) docs

docs: $(VENV)/.installed-docs
	rm -rf docs/_build
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html
	$(PY) -m sphinx -W --keep-going -b doctest docs docs/_build/doctest

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/run_all.py

# ruff (lint and format) and pyright's standard mode (basedpyright: a wheel
# with its own Node runtime; configured in pyproject.toml).
LINTED := optaxaccum tests examples benchmarks docs/conf.py docs/_ext
lint: $(VENV)/.installed-dev
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(VENV)/bin/basedpyright -p pyproject.toml

clean:
	rm -rf $(VENV) docs/_build .pytest_cache
