# `make demo` and `make test` each build .venv from nothing and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[demo,rl,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/replicator demo

test: $(STAMP)
	$(BIN)/ruff check replicator tests benchmarks scripts examples
	$(BIN)/mypy replicator
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/data_parallel.py

clean:
	rm -rf $(VENV) *.egg-info
