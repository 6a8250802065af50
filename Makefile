# The commands the README names. `make test` and `make run` do all set-up on a fresh machine.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup test run lint format bench

$(STAMP): pyproject.toml
	@scripts/check_java.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[tf-cpu,dev]"
	@touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

run: setup
	$(VENV)/bin/flyte-hvd-run -np 2 python examples/data_parallel_regression.py
	$(PY) examples/spark_data_parallel.py

lint: setup
	$(PY) -m ruff check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: setup
	$(PY) -m benchmarks.allreduce
	$(PY) -m benchmarks.startup
