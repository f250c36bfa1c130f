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
	$(BIN)/ruff check idemmail_celery tests examples bench chaos

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache .hypothesis

.PHONY: chaos bench

## The long fault-injection suite (about 8 min here): SIGKILLs, provider faults, Redis and RabbitMQ,
## Redis and PostgreSQL ledgers, the ledger-loss drill; prints the table. CHAOS_ARGS="--intents 2000 --no-write" for a look.
chaos: install
	$(BIN)/python -m chaos.run $(CHAOS_ARGS)

## Plain Celery vs IdempotentTask (Redis, PostgreSQL, SQLite ledgers) vs celery-once, same run;
## writes docs/benchmarks.md (about 5 min). BENCH_ARGS="--tasks 500 --repeat 1 --no-write" for a look.
bench: install
	$(BIN)/pip install -q -c constraints.txt -r bench/requirements.txt
	$(BIN)/python -m bench.run $(BENCH_ARGS)
