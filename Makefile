# The two commands of the README: `make demo` and `make test`. Both run `setup` first.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup test demo lint unit soak lab clean-lab
setup:
	@bash scripts/setup.sh

# Two pytest-xdist workers, a module per worker at a time (tests/plugins/schedule.py: slowest first);
# the lab tests mostly wait on sshd and servers. `make test WORKERS=0` runs it in one process.
WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest -q -m "not lab and not llama" $(PYTEST_ARGS)

# The long loops at their full count (tests/plugins/soak.py): run before closing the issue one guards.
soak: setup
	$(PY) -m pytest -q -m soak $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check orchestrator tests bench
	$(PY) -m ruff format --check orchestrator tests bench
	$(PY) -m mypy
	.venv/bin/lint-imports --no-cache

demo: setup
	$(PY) -m orchestrator demo

clean-lab: setup
	$(PY) -m orchestrator lab down --all
