# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo check test lint typecheck docs dist clean sim

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

## Installed again when pyproject.toml or constraints.txt changes (a new test dependency reaches an old venv).
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[test,docs]'
	touch $@

install: $(VENV)/.installed

## The main job on the embedded default: SQLite ledger, no servers.
demo: install
	$(BIN)/python examples/demo.py

## Test processes side by side (pytest-xdist); the tests are wait-bound, so more than the cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4

## The inner loop: lint, types and every test that needs no process of its own (no `worker` mark; see
## docs/development.md), against the real services on loopback.
check: install lint typecheck
	$(BIN)/python -m pytest -q -m "not worker and not valkey" -n $(TEST_WORKERS) --dist worksteal
	$(BIN)/python -m sim --budget 30

## Lint, types and the whole suite against the real services on loopback, worker tests included; the
## few tests marked `serial` (they keep pace with a deadline of seconds) run alone, after the rest.
test: install lint typecheck
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial"
	$(BIN)/python -m pytest -q -m serial

lint: install
	$(BIN)/ruff check idemmail_celery tests examples bench chaos sim upgrade docs/hooks.py

typecheck: install
	$(BIN)/mypy

## The documentation site in site/ (MkDocs with Material); any warning fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## The sdist and the wheel in dist/; any warning from the build fails it. (The byte-compiling
## notice that PYTHONDONTWRITEBYTECODE causes is the environment's, not the package's.)
dist: install
	rm -rf dist build
	mkdir -p dist
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m build --outdir dist . > dist/build.log 2>&1 \
	  || { cat dist/build.log; exit 1; }
	! grep -i 'warning' dist/build.log || { echo 'make dist: the build warned (above)'; exit 1; }
	ls dist/*.whl dist/*.tar.gz

clean:
	rm -rf $(VENV) .demo .upgrade .pytest_cache .mypy_cache .ruff_cache .hypothesis site dist build

.PHONY: chaos bench upgrade-check

## The deterministic simulator (sim/, docs/guarantee.md): the real handler and campaign code under every
## interleaving of copies, crashes, store and provider faults and clock steps within small bounds, 100,000
## random schedules of larger worlds, and the planted defects it must catch (about 2.5 min on 2 cores). It ends
## with `sim: <S> schedules, <V> violations, planted defects caught <c>/<n>`. SIM_ARGS="--budget 60" for a look.
sim: install
	$(BIN)/python -m sim $(SIM_ARGS)

## The long fault-injection suite (about 35 min here): SIGKILLs, provider faults, Redis and RabbitMQ,
## Redis and PostgreSQL ledgers, the ledger-loss drill; prints the table. CHAOS_ARGS="--intents 2000 --no-write" for a look.
chaos: install
	$(BIN)/python -m chaos.run $(CHAOS_ARGS)

## The release before this code (upgrade/releases.json; installed once, in .upgrade/) and this code's callers and
## workers on one broker and ledger, through an upgrade and a rollback, and the golden fixtures sent by this code;
## workers SIGKILLed on the way, RabbitMQ with a Redis and a PostgreSQL ledger: 0 duplicates, 0 lost, 0 stranded
## (about 3 min here). UPGRADE_ARGS="--against fixtures" for the fixtures alone (docs/upgrading.md).
upgrade-check: install
	$(BIN)/python -m upgrade.check $(UPGRADE_ARGS)

## Plain Celery vs IdempotentTask (Redis, PostgreSQL, SQLite ledgers) vs celery-once, I/O-bound sends on
## threads and gevent, ledger capacity, a 100,000-recipient campaign, Redis bytes per record; writes
## docs/benchmarks.md (about 25 min). BENCH_ARGS="--parts memory --memory-records 2000 --no-write" for a look.
bench: install
	$(BIN)/pip install -q -c constraints.txt -r bench/requirements.txt
	$(BIN)/python -m bench.run $(BENCH_ARGS)
