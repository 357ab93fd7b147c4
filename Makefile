# `make demo` and `make test` each build .venv from nothing and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs bench clean

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
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # not --quiet: it also silences --strict
	$(BIN)/python -m pytest -q tests

# The documentation site, from docs/ into site/ (warnings are errors); `$(BIN)/mkdocs serve` to browse it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/data_parallel.py

clean:
	rm -rf $(VENV) *.egg-info site
