# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'

install: $(BIN)/python

## The main job on the embedded default: SQLite ledger, no servers.
demo: install
	$(BIN)/python examples/demo.py

## Lint, types and the whole suite against the real services on loopback.
test: install lint typecheck
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check idemmail_celery tests examples

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache .hypothesis
