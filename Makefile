# `make demo` and `make test` each build .venv from nothing and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-numerics docs bench clean

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
	$(BIN)/python -m pytest -q --durations=25 tests
	$(MAKE) test-numerics

# The tests marked `numerics` (results that kernels round differently) again under the kernels of other CPUs, so
# that a tolerance tuned to this CPU fails here before it fails on a user's machine. MKL picks its GEMM by
# instruction set (MKL_ENABLE_INSTRUCTIONS caps it); on AMD it ignores that cap, and only MKL_CBWR=COMPATIBLE,
# its portable kernels, moves it. ATEN_CPU_CAPABILITY=default turns off ATen's SIMD kernels (another reduction
# order). One pass per word of NUMERICS_KERNELS (a comma joins the settings of one pass); only the files
# that mark a test are collected, to keep the lane short.
NUMERICS_KERNELS := MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
                    MKL_ENABLE_INSTRUCTIONS=AVX2 \
                    ATEN_CPU_CAPABILITY=default,MKL_CBWR=COMPATIBLE
test-numerics: $(STAMP)
	@for kernels in $(NUMERICS_KERNELS); do \
	    echo "numerics lane: $$kernels"; \
	    env $$(echo $$kernels | tr , ' ') $(BIN)/python -m pytest -q -m numerics -p no:cacheprovider \
	        $$(grep -rl --include='test_*.py' 'pytest.mark.numerics' tests) || exit 1; \
	done

# The documentation site, from docs/ into site/ (warnings are errors); `$(BIN)/mkdocs serve` to browse it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/data_parallel.py

clean:
	rm -rf $(VENV) *.egg-info site
