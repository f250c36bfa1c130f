"""Real Celery workers, in subprocesses, against a real broker; always stopped."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider
from idemmail_celery.testing.redis_server import RedisServer

from ..conftest import POSTGRES_URL, REDIS_URL, require_module, service_missing, unique, wait_for

ROOT = Path(__file__).resolve().parents[2]


def terminate(proc: subprocess.Popen[bytes]) -> bool:
    """SIGTERM a process started with ``start_new_session=True`` and its children (SIGCONT first: a
    stopped group cannot act on it); False when it has already exited."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process group (see :func:`terminate`) and wait for it; SIGKILL after 15 s."""
    if terminate(proc):
        reap(proc)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a process group's leader told to stop; SIGKILL the group after 15 s."""
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


class Reaper:
    """Processes a fixture is done with: SIGTERMed (warm shutdown) at teardown, waited for in a thread.

    A warm shutdown takes about a second under prefork and four under gevent (its consumer loop
    polls for two seconds before it sees the signal); the next test need not wait for it. Every
    process is reaped, and SIGKILLed if it hangs, before the session ends (``worker_reaper``).
    Everything such a process touches is in its own test's namespace.
    """

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if not terminate(proc):
            return
        thread = threading.Thread(target=reap, args=(proc,), name=f"reap-{proc.pid}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        self.threads.clear()


@pytest.fixture(scope="session")
def worker_reaper() -> Iterator[Reaper]:
    reaper = Reaper()
    yield reaper
    reaper.join()  # before the session's Redis sweep (tests/conftest.py)


_WORKER_SERIAL = itertools.count()


class WorkerProcess:
    """``celery worker`` for one test namespace: start, kill, restart, stop."""

    def __init__(self, ns: str, env: dict[str, str], log_dir: Path, args: list[str]) -> None:
        self.ns, self.env, self.log_dir, self.args = ns, env, log_dir, args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # Each worker of a test logs to files of its own: a second worker must not overwrite the first's log.
        self.serial = next(_WORKER_SERIAL)

    def start(self) -> WorkerProcess:
        self.starts += 1
        log = open(self.log_path(), "wb")  # noqa: SIM115
        cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "worker",
               "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-n", f"{self.ns}-{id(self) % 10**6}-{self.starts}@%h", *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        wait_for(lambda: b"ready." in self.log(), timeout=60)
        return self

    def log_path(self) -> Path:
        """This start's log file (``worker-<n>-<start>.log``, n numbering the test's workers)."""
        return self.log_dir / f"worker-{self.serial}-{self.starts}.log"

    def log(self) -> bytes:
        return self.log_path().read_bytes()

    def stop(self) -> None:
        if self.proc:
            stop_group(self.proc)

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and pool children."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=15)


def refusing_worker(env: dict[str, str], log_path: Path) -> tuple[int, str]:
    """Run ``celery worker`` (the test app, solo pool) with ``idemmail_refuse_to_start`` set until it exits:
    its exit code and what it wrote. Fails the test if it is still running after 60 s."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "worker", "-P", "solo",
             "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env={**env, "IDEMMAIL_TEST_REFUSE_TO_START": "1"}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        code = proc.wait(timeout=60)
    finally:
        stop_group(proc)
    return code, log_path.read_text(errors="replace")


class Sink:
    """Reads what the side effects wrote, and sets per-test controls."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.r = redis.Redis.from_url(REDIS_URL, decode_responses=True)

    def k(self, name: str) -> str:
        return f"sink.{self.ns}.{name}"

    def deliveries(self) -> list[str]:
        return list(self.r.lrange(self.k("deliveries"), 0, -1))

    def attempts(self) -> list[str]:
        return list(self.r.lrange(self.k("attempts"), 0, -1))

    def pids(self) -> list[int]:
        return [int(p) for p in self.r.lrange(self.k("pids"), 0, -1)]

    def control(self, name: str, value: str) -> None:
        self.r.set(self.k(f"ctl.{name}"), value)

    def push_failure(self, kind: str) -> None:
        self.r.rpush(self.k("ctl.fail_with"), kind)

    def cleanup(self) -> None:
        # SCAN walks the whole shared keyspace (results of every run, for a day): in pages of 1,000, not 10.
        keys = [*self.r.scan_iter(f"sink.{self.ns}.*", count=1000), *self.r.scan_iter(f"led.{self.ns}:*", count=1000)]
        if keys:
            self.r.delete(*keys)


@pytest.fixture
def ns() -> str:
    return unique("w").replace("_", "")


@pytest.fixture
def sink(ns: str) -> Iterator[Sink]:
    s = Sink(ns)
    try:
        s.r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    yield s
    s.cleanup()


@pytest.fixture
def worker_env(ns: str) -> dict[str, str]:
    return {**os.environ, "IDEMMAIL_TEST_NS": ns, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def start_worker(
    ns: str, worker_env: dict[str, str], tmp_path: Path, worker_reaper: Reaper
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        w = WorkerProcess(ns, {**worker_env, **(env or {})}, tmp_path, list(args) or ["-P", "prefork", "-c", "2"])
        started.append(w)
        return w.start()

    yield start
    for w in started:
        if w.proc is not None:
            worker_reaper.stop(w.proc)


@pytest.fixture
def app_module(ns: str, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The worker app module, configured for this test's namespace, in this process (the caller)."""
    import importlib

    for name, value in worker_env.items():
        if name.startswith("IDEMMAIL_TEST"):
            monkeypatch.setenv(name, value)
    sys.modules.pop("tests.integration.workerapp", None)
    module = importlib.import_module("tests.integration.workerapp")
    yield module
    sys.modules.pop("tests.integration.workerapp", None)


class EventTap:
    """Every event on the app's broker, received in a thread of the test process; :meth:`of_type` keeps
    this test's workers' (named after its namespace ``ns``): events are fanned out to every listener,
    and other tests' workers send theirs on the same broker meanwhile."""

    def __init__(self, app: Any, ns: str) -> None:
        self.app, self.ns = app, ns
        self.events: list[dict[str, Any]] = []
        self.conn = app.connection_for_read()
        self.receiver = app.events.Receiver(self.conn, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, name="event-tap", daemon=True)

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> EventTap:
        self.thread.start()
        # Events are fanned out: only those sent after the tap's queue exists arrive. Probe until one does.
        with self.app.connection_for_write() as conn:
            dispatcher = self.app.events.Dispatcher(conn, hostname="event-tap-probe")

            def seen() -> bool:
                dispatcher.send("tap-probe")
                return any(e["type"] == "tap-probe" for e in self.events[:])

            wait_for(seen, timeout=20, interval=0.2)
            dispatcher.close()
        return self

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events[:] if e["type"] == kind and str(e.get("hostname", "")).startswith(self.ns)]

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(timeout=10)
        self.conn.release()


@pytest.fixture
def event_tap(app_module: Any, ns: str) -> Iterator[EventTap]:
    tap = EventTap(app_module.app, ns).start()
    try:
        yield tap
    finally:
        tap.stop()


def results(async_results: list[Any], timeout: float = 60) -> list[Any]:
    deadline = time.monotonic() + timeout
    return [ar.get(timeout=max(1.0, deadline - time.monotonic()), propagate=False) for ar in async_results]



@pytest.fixture
def ledger_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis ledger the test can stop and start (``.stop()``, ``.start()``); use ``.url`` as the ledger URL."""
    server = RedisServer(tmp_path / "ledger-redis")
    try:
        server.start()
    except FileNotFoundError as exc:
        service_missing("redis-server (to start a private one)", exc)
    yield server
    server.stop()
def web_services(ns: str) -> tuple[redis.Redis, sa.URL]:
    """Redis (pinged) and a new PostgreSQL schema ``ns`` for a web example's module: the URL's search_path.

    Drop the schema with :func:`drop_schema`.
    """
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
        ddl(POSTGRES_URL, f'CREATE SCHEMA "{ns}"')
    except Exception as exc:
        service_missing("redis and postgresql", exc)
    return r, sa.make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={ns}"})


def drop_schema(ns: str) -> None:
    ddl(POSTGRES_URL, f'DROP SCHEMA "{ns}" CASCADE')


def ddl(url: str, statement: str) -> None:
    """Run one statement on a server (a test's own schema or database, made or dropped)."""
    server = sa.create_engine(url)
    try:
        with server.begin() as conn:
            conn.execute(sa.text(statement))
    finally:
        server.dispose()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """The fake email provider over real sockets, de-duplicating on the key (a module needing other
    options, no de-duplication or slow answers, defines its own ``fake``)."""
    with FakeProvider() as f:
        yield f


@pytest.fixture
def fake_app(fake: FakeProvider, worker_env: dict[str, str], request: pytest.FixtureRequest) -> Any:
    """``app_module``, its workers (and its own tasks) sending through ``fake``; a fixture that sets more of
    ``worker_env`` does so before asking for this one."""
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY)
    return request.getfixturevalue("app_module")


#: Each pool at a small concurrency, for tests of what every pool must do alike (:func:`fake_pool_worker`).
POOL_CONCURRENCY = {"prefork": "2", "threads": "4", "gevent": "20"}


@pytest.fixture(params=sorted(POOL_CONCURRENCY))
def fake_pool_worker(request: pytest.FixtureRequest, fake_app: Any, start_worker: Any) -> WorkerProcess:
    """A worker of ``fake_app`` on each pool in turn, at its :data:`POOL_CONCURRENCY` (gevent must be installed)."""
    pool = request.param
    if pool == "gevent":
        require_module("gevent")
    worker: WorkerProcess = start_worker("-P", pool, "-c", POOL_CONCURRENCY[pool])
    return worker
