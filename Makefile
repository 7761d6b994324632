# The two set-up commands the README promises: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tangram demo

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
