# The two set-up commands the README promises: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

ADAPTER_REQS := adapters/requirements.txt adapters/requirements-nodeps.txt

# verl and OpenRLHF are installed without their dependencies (vLLM, flash-attn, DeepSpeed
# and CUDA builds, which pip extras cannot leave out): see adapters/requirements.txt.
$(STAMP): pyproject.toml $(ADAPTER_REQS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -r adapters/requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r adapters/requirements-nodeps.txt
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
	for b in benchmarks/*.py; do $(BIN)/python $$b --quick || exit 1; done

test: lint docs $(STAMP)
	$(BIN)/python -m pytest
	$(MAKE) bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
