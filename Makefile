# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The installed legs (test-floors, test-newest) leave out the benchmarks'
# own runs, which test the benchmark scripts and the source tree.
INSTALLED_MARKS ?= not bench_smoke
# What the floors leg runs where make test already ran the whole suite on
# the same Python and packages (FLOORS_SUITE=auto, below): the tests whose
# outcome depends on how the package is installed, and the docstring
# examples of the installed modules (tests/conftest.py marks them).
FLOORS_AUTO_MARKS ?= installed
# After the whole suite passed (no PYTEST_ARGS), make test writes here the
# Python and the packages it ran on; test-floors reads it.
SUITE_RAN ?= build/suite-ran-on.txt
# The Python and the packages of a virtual environment as the suite sees
# them: all but optaxaccum itself (editable or installed) and pip.
versions = { $(1) -c 'import sys; print("Python", sys.version.split()[0])' \
	&& $(1) -m pip list --format=freeze --exclude optaxaccum --exclude pip; }

.PHONY: demo test test-floors test-newest test-gpu-compile dist docs bench \
	bench-gpu bench-gpu-compile lint clean

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
	rm -f $(SUITE_RAN)
	$(MAKE) lint
	$(MAKE) dist
	OPTAXACCUM_DIST=$(abspath $(DIST)) $(PY) -m pytest -n 2 $(PYTEST_ARGS)
	$(if $(strip $(PYTEST_ARGS) $(PYTEST_ADDOPTS)),,mkdir -p $(dir $(SUITE_RAN)) \
		&& $(call versions,$(PY)) > $(SUITE_RAN))
	$(MAKE) docs

# The sdist, and the wheel built from it, in $(DIST); twine checks both.
DIST ?= dist
dist: $(VENV)/.installed-dev
	rm -rf $(DIST)
	$(PY) -m build -q --outdir $(DIST) .
	$(PY) -m twine check --strict $(DIST)/*

# The suite from a copy of tests/ (with the examples, benchmarks and tools/
# some tests run or import) in $(1)/run, where no source tree of the package
# can be imported, run by the python $(2) of the leg named $(3)
# (tests/repo/test_packaging.py reads it), the tests the marker expression in the
# file $(1)/marks selects.
define suite-from-copy
	mkdir -p $(1)/run/.ci $(1)/run/docs
	cp -R tests examples benchmarks tools pyproject.toml CHANGELOG.md LICENSE \
		$(1)/run/
	cp -R docs README.md Makefile $(1)/run/
	rm -rf $(1)/run/docs/_build
	cp .ci/floors.txt $(1)/run/.ci/
	marks="$$(cat $(1)/marks)" && cd $(1)/run \
		&& OPTAXACCUM_TEST_INSTALLED=$(3) \
		OPTAXACCUM_DIST=$(abspath $(DIST)) $(abspath $(2)) \
		-m pytest -n 2 -p no:cacheprovider -c pyproject.toml --rootdir . \
		-m "$$marks" $(PYTEST_ARGS) tests --pyargs optaxaccum
endef

# The suite against the wheel as users install it: not editable, in a fresh
# virtual environment, with jax, jaxlib, optax and flax at the floors
# pyproject declares (.ci/floors.txt; tests/repo/test_packaging.py keeps the two
# equal), run from a copy of tests/ (with the examples and benchmarks some
# tests run) where no source tree can be imported.
# FLOORS_SUITE=whole (the default) runs the whole suite. With
# FLOORS_SUITE=auto (.ci/run, right after make test) it runs only the tests
# marked installed where make test's whole suite ran on exactly this
# Python and these packages ($(SUITE_RAN)): then the two legs differ only in
# how optaxaccum is installed. It says which it runs, and why.
FLOORS_DIR ?= build/floors
FLOORS_PY := $(FLOORS_DIR)/venv/bin/python
FLOORS_SUITE ?= whole
test-floors: $(VENV)/.installed-dev
	@case "$(FLOORS_SUITE)" in whole|auto) ;; *) echo "FLOORS_SUITE is \
	whole or auto, got '$(FLOORS_SUITE)'" >&2; exit 1;; esac
	$(MAKE) dist
	rm -rf $(FLOORS_DIR)
	$(PYTHON) -m venv $(FLOORS_DIR)/venv
	$(FLOORS_PY) -m pip install -q --upgrade pip
	$(FLOORS_PY) -m pip install -q -c .ci/floors.txt \
		"$$(ls $(DIST)/optaxaccum-*.whl)[test]"
	$(call versions,$(FLOORS_PY)) > $(FLOORS_DIR)/versions.txt
	grep -iE '^(python|jax|jaxlib|flax|optax|numpy)[ =]' \
		$(FLOORS_DIR)/versions.txt
	@if [ "$(FLOORS_SUITE)" = whole ]; then why="FLOORS_SUITE=whole"; \
	elif [ ! -f $(SUITE_RAN) ]; then \
	why="no whole run of make test recorded in $(SUITE_RAN)"; \
	elif ! grep -q '^jax==' $(FLOORS_DIR)/versions.txt; then \
	why="pip list named no jax"; \
	elif grep -vxFf $(SUITE_RAN) $(FLOORS_DIR)/versions.txt \
	> $(FLOORS_DIR)/not-run.txt; [ $$? -ne 1 ]; then why="make test's \
	whole suite did not run on (or grep failed on) $$(tr '\n' ' ' \
	< $(FLOORS_DIR)/not-run.txt)"; \
	else why=; fi; \
	if [ -z "$$why" ]; then echo "$(FLOORS_AUTO_MARKS)" \
	> $(FLOORS_DIR)/marks; echo "test-floors: make test ran the whole \
	suite on this Python and these packages ($(SUITE_RAN)): this leg \
	runs what depends on the install, -m '$(FLOORS_AUTO_MARKS)'"; \
	else echo "$(INSTALLED_MARKS)" > $(FLOORS_DIR)/marks; \
	echo "test-floors: the whole suite, -m '$(INSTALLED_MARKS)' ($$why)"; \
	fi
	$(call suite-from-copy,$(FLOORS_DIR),$(FLOORS_PY),floors)

# The suite against the wheel on the newest releases: as test-floors, but in
# a virtual environment of the newest Python the package declares (jax 0.12
# needs 3.12 or later) with whatever versions pip resolves there (nothing
# pinned; they are printed first). PYTHON313 is found with pyenv (3.13.0)
# or as python3.13 on the PATH; pass PYTHON313=/path/to/python3.13 otherwise.
PYTHON313 ?= $(shell for p in "PYENV_VERSION=3.13.0 python" python3.13; do \
	env $$p -c 'import sys; assert sys.version_info[:2] == (3, 13); \
	print(sys.executable)' 2>/dev/null && break; done)
NEWEST_DIR ?= build/newest
NEWEST_PY := $(NEWEST_DIR)/venv/bin/python
test-newest: $(VENV)/.installed-dev
	@test -n "$(PYTHON313)" || { echo "make test-newest needs Python \
	3.13: none found (pyenv's 3.13.0, python3.13); install one or pass \
	PYTHON313=/path/to/python3.13" >&2; exit 1; }
	$(MAKE) dist
	rm -rf $(NEWEST_DIR)
	$(PYTHON313) -m venv $(NEWEST_DIR)/venv
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q "$$(ls $(DIST)/optaxaccum-*.whl)[test]"
	$(NEWEST_PY) -m pip check
	$(NEWEST_PY) -c 'import sys; print("Python", sys.version.split()[0])'
	$(NEWEST_PY) -m pip list --format=freeze \
		| grep -iE '^(jax|jaxlib|flax|optax|numpy)=='
	echo "$(INSTALLED_MARKS)" > $(NEWEST_DIR)/marks
	$(call suite-from-copy,$(NEWEST_DIR),$(NEWEST_PY),newest)

# The HTML build, a check of the built pages as a reader sees them (code
# lines, table widths, no remote assets; tests/repo/docs_site_check.py), and the
# doctest build of every page.
docs: $(VENV)/.installed-docs
	rm -rf docs/_build
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html
	$(PY) tests/repo/docs_site_check.py docs/_build/html
	$(PY) -m sphinx -W --keep-going -b doctest docs docs/_build/doctest

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/run_all.py

# ruff (lint and format) and pyright's standard mode (basedpyright: a wheel
# with its own Node runtime; configured in pyproject.toml).
LINTED := optaxaccum tests examples benchmarks tools docs/conf.py docs/_ext
lint: $(VENV)/.installed-dev
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(VENV)/bin/basedpyright -p pyproject.toml

clean:
	rm -rf $(VENV) docs/_build .pytest_cache $(DIST) $(FLOORS_DIR) \
		$(NEWEST_DIR) $(GPU_COMPILE_CACHE) $(SUITE_RAN)

# On a machine with a GPU: per gated step, the conditionals left in the
# compiled HLO and the pipelined cost vs the floor, Adam alone and
# optax.MultiSteps at 512 MiB per tree; fails when a gate became a select.
# Elsewhere it says there is no GPU and exits 0. It runs the checkout with
# .venv's python if there is one, else with $(PYTHON) if that imports jax (a
# GPU machine's own JAX, offline: nothing installed), else it makes .venv
# with the package (jax, optax) as the other targets do. BENCH_PY=... picks
# the python.
BENCH_PY ?=
BENCH_DEPS :=
ifneq ($(filter bench-gpu,$(MAKECMDGOALS)),)
ifeq ($(BENCH_PY),)
ifneq ($(wildcard $(PY)),)
BENCH_PY := $(PY)
else ifeq ($(shell $(PYTHON) -c "import jax" >/dev/null 2>&1 && echo y),y)
BENCH_PY := $(PYTHON)
else
BENCH_PY := $(PY)
BENCH_DEPS := $(VENV)/.installed
endif
endif
endif

# The package alone (jax, optax), for bench-gpu.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

bench-gpu: $(BENCH_DEPS)
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR) \
		$(BENCH_PY) benchmarks/bench_gpu.py

# The compiled XLA:GPU (H100, H200) and XLA:TPU (v5e) programs, without a
# GPU or TPU (tests/gpu_compile/README.md): installs the jax CUDA plugin of
# the jaxlib of $(GPU_COMPILE_PY) and the libtpu jax's tpu extra pins into
# $(GPU_COMPILE_CACHE) (about 350 MB of wheels; reruns reuse them) and runs
# the tests marked gpu_compile in a pytest process of their own. Where the
# package registry cannot serve the wheels it says why and exits 0. CI runs
# it with the floors leg's and the newest leg's python.
GPU_COMPILE_PY ?= $(PY)
GPU_COMPILE_CACHE ?= build/gpu-compile
test-gpu-compile: $(VENV)/.installed-dev
	$(GPU_COMPILE_PY) tests/gpu_compile/run.py \
		--cache $(abspath $(GPU_COMPILE_CACHE)) -n 2 $(PYTEST_ARGS)

# The same compiles summarized per gated step and train step, with the card
# and jaxlib named, into benchmarks/GPU_COMPILE.md.
bench-gpu-compile: $(VENV)/.installed-dev
	$(GPU_COMPILE_PY) benchmarks/gpu_compile.py \
		--cache $(abspath $(GPU_COMPILE_CACHE))
