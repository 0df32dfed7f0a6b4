# From a fresh clone: `make demo` (the main job) or `make test` (the test suite, what CI runs).
# `make test` lints first (ruff: pyflakes and import order, configured in pyproject.toml), then runs
# the suite on every core (pytest-xdist: a test file per worker at a time).
# Each first runs scripts/setup.sh, which installs into the Python environment you are in only
# what is missing (it checks what is installed each time) and says so in one line when it does.
# PYTHON=... picks the interpreter; ARGS=... passes options on (`make demo ARGS="--stages 4"`).
PYTHON ?= python
ARGS ?=
export PYTHON

.PHONY: setup demo test

setup:
	@bash scripts/setup.sh

demo: setup
	$(PYTHON) -m spd demo $(ARGS)

test: setup
	$(PYTHON) -m ruff check src tests scripts
	$(PYTHON) -m pytest -q -p no:cacheprovider -n auto --dist loadfile $(ARGS)
