# The two set-up commands the README promises: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

ADAPTERS := adapters/verl adapters/openrlhf
ADAPTER_REQS := adapters/requirements.txt adapters/requirements-nodeps.txt

# verl and OpenRLHF are installed without their dependencies (vLLM, flash-attn, DeepSpeed
# and CUDA builds, which pip extras cannot leave out): see adapters/requirements.txt. The
# adapters' own distributions (tangram-verl, tangram-openrlhf) need only tangram, installed
# editable above: --no-deps keeps pip from resolving it again.
$(STAMP): pyproject.toml $(ADAPTER_REQS) $(ADAPTERS:%=%/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -r adapters/requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r adapters/requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps $(ADAPTERS:%=-e %)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tangram bench

lint: $(STAMP)
	$(BIN)/ruff check tangram adapters tests benchmarks
	$(BIN)/ruff format --check tangram adapters tests benchmarks
	$(BIN)/mypy

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site

bench: $(STAMP)
	for b in benchmarks/[!_]*.py; do $(BIN)/python $$b --quick || exit 1; done

test: lint docs $(STAMP)
	$(BIN)/python -m pytest
	$(MAKE) bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
