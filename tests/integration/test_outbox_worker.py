"""The outbox end to end: the app's transaction, the relay, a real worker, the fake provider.

The fake provider does not de-duplicate here (``dedupe=False``): every request that
reaches it is a delivery, so "one delivery" is the ledger's doing, not the provider's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from idemmail_celery.mail import TASK_NAME
from idemmail_celery.outbox import DISPATCHED, PENDING, create_outbox_table, enqueue_email, relay
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import MARIADB_URL, POSTGRES_URL, service_missing, unique, wait_for
from .conftest import ROOT
from .test_beat import CeleryProcess, celery_process  # noqa: F401  # the fixture, for the beat-driven relay

EMAIL = {"subject": "Your receipt", "html": "<p>Thanks</p>", "template": "receipt"}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(dedupe=False) as f:
        yield f


@pytest.fixture
def provider_env(fake: FakeProvider, worker_env: dict[str, str]) -> dict[str, str]:
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY)
    return worker_env


def db_url(backend: str, tmp_path: Path) -> str:
    return {"postgresql": POSTGRES_URL, "mariadb": MARIADB_URL,
            "sqlite": f"sqlite:///{tmp_path / 'app.sqlite3'}"}[backend]


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[sa.Engine, sa.Table]]:
    engine = sa.create_engine(db_url(request.param, tmp_path))
    try:
        engine.connect().close()
    except Exception as exc:
        service_missing(request.param, exc)
    table = create_outbox_table(engine, unique("outbox"))
    yield engine, table
    table.drop(engine)
    engine.dispose()


@pytest.fixture
def pg_outbox() -> Iterator[tuple[sa.Engine, sa.Table]]:
    """An outbox table of its own on PostgreSQL, dropped at the end."""
    engine = sa.create_engine(POSTGRES_URL)
    try:
        engine.connect().close()
    except Exception as exc:
        service_missing("postgresql", exc)
    table = create_outbox_table(engine, unique("outbox"))
    try:
        yield engine, table
    finally:
        table.drop(engine)
        engine.dispose()


def rows(engine: sa.Engine, table: sa.Table) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.id)).all())


def per_recipient(fake: FakeProvider) -> Counter[str]:
    return Counter(r for d in fake.deliveries() for r in d.recipients)


def test_rollback_sends_nothing_and_commit_sends_exactly_once(
    provider_env: dict[str, str], fake: FakeProvider, db: tuple[sa.Engine, sa.Table],
    request: pytest.FixtureRequest, start_worker: Any,
) -> None:
    engine, table = db
    app = request.getfixturevalue("app_module").app
    start_worker("-P", "prefork", "-c", "2")
    with Session(engine) as session:  # the request failed after writing its order
        enqueue_email(session, app=app, table=table, to="gone@example.com", event_id="order-1", **EMAIL)
        session.rollback()
    with Session(engine) as session, session.begin():  # the request that succeeded
        enqueue_email(session, app=app, table=table, to="ann@example.com", event_id="order-2", **EMAIL)
    assert relay(engine, app, table=table) == 1
    wait_for(lambda: fake.delivery_count() >= 1)
    assert relay(engine, app, table=table) == 0
    key = rows(engine, table)[0].intent_key
    wait_for(lambda: (record := app.tasks[TASK_NAME].ledger.get(key)) is not None and record.state.value == "sent")
    assert per_recipient(fake) == {"ann@example.com": 1}
    assert fake.attempt_count() == 1
    assert [r.state for r in rows(engine, table)] == [DISPATCHED]


def test_ten_enqueues_in_one_transaction_are_one_row_and_one_delivery(
    provider_env: dict[str, str], fake: FakeProvider, db: tuple[sa.Engine, sa.Table],
    request: pytest.FixtureRequest, start_worker: Any,
) -> None:
    engine, table = db
    app = request.getfixturevalue("app_module").app
    start_worker("-P", "prefork", "-c", "2")
    with Session(engine) as session, session.begin():
        keys = {enqueue_email(session, app=app, table=table, to="bob@example.com", event_id="order-3", **EMAIL)
                for _ in range(10)}
    assert len(keys) == 1 and len(rows(engine, table)) == 1
    assert relay(engine, app, table=table) == 1
    [key] = keys
    wait_for(lambda: (record := app.tasks[TASK_NAME].ledger.get(key)) is not None and record.state.value == "sent")
    assert per_recipient(fake) == {"bob@example.com": 1} and fake.attempt_count() == 1


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_two_relays_draining_at_once_publish_each_row_once(
    backend: str, provider_env: dict[str, str], fake: FakeProvider, tmp_path: Path,
    request: pytest.FixtureRequest, start_worker: Any,
) -> None:
    app = request.getfixturevalue("app_module").app
    engines = [sa.create_engine(db_url(backend, tmp_path)) for _ in range(2)]  # each relay its own pool
    try:
        engines[0].connect().close()
    except Exception as exc:
        service_missing(backend, exc)
    table = create_outbox_table(engines[0], unique("outbox"))
    n = 200
    recipients = [f"user{i}@example.com" for i in range(n)]
    with engines[0].begin() as conn:
        for i, to in enumerate(recipients):
            enqueue_email(conn, app=app, table=table, to=to, event_id=f"order-{i}", **EMAIL)
    start_worker("-P", "prefork", "-c", "4")
    published: list[list[int]] = [[], []]
    go = threading.Barrier(2)

    def run(i: int) -> None:
        go.wait()
        while relay(engines[i], app, table=table, batch_size=10, before_commit=published[i].extend):
            pass

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert published[0] and published[1], "both relays should have had a share"
        assert not set(published[0]) & set(published[1])
        assert sorted(published[0] + published[1]) == [r.id for r in rows(engines[0], table)]
        assert {(r.state, r.attempts) for r in rows(engines[0], table)} == {(DISPATCHED, 1)}
        wait_for(lambda: fake.delivery_count() >= n, timeout=60)
        assert per_recipient(fake) == dict.fromkeys(recipients, 1)
    finally:
        table.drop(engines[0])
        for e in engines:
            e.dispose()


# A relay in its own process, as on a worker or a cron box. It reports the rows it published,
# then waits before its commit: the moment the test kills it.
RELAY_SCRIPT = """
import os, sys, time
import sqlalchemy as sa
from idemmail_celery.outbox import relay
from tests.integration.workerapp import app

def pause(ids):
    print("published", *ids, flush=True)
    time.sleep(float(os.environ["IDEMMAIL_TEST_RELAY_PAUSE"]))

print("relayed", relay(sa.create_engine(sys.argv[1]), app, table=sys.argv[2], before_commit=pause), flush=True)
"""


def held_locks(engine: sa.Engine, table: str) -> int:
    """PostgreSQL: the locks other sessions hold on ``table`` or its rows' tuples."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON l.relation = c.oid "
            "WHERE c.relname = :t AND l.pid <> pg_backend_pid()"), {"t": table}).scalar_one())


def test_relay_killed_between_publish_and_commit_publishes_again_and_still_delivers_once(
    provider_env: dict[str, str], fake: FakeProvider, db: tuple[sa.Engine, sa.Table],
    request: pytest.FixtureRequest, start_worker: Any, tmp_path: Path,
) -> None:
    engine, table = db
    app = request.getfixturevalue("app_module").app
    worker = start_worker("-P", "prefork", "-c", "2")
    with engine.begin() as conn:
        key = enqueue_email(conn, app=app, table=table, to="cat@example.com", event_id="order-4", **EMAIL)

    out = tmp_path / "relay.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", RELAY_SCRIPT, str(engine.url.render_as_string(False)),
                                 table.name], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env={**provider_env, "IDEMMAIL_TEST_RELAY_PAUSE": "60"}, start_new_session=True)
    try:
        wait_for(lambda: b"published" in out.read_bytes(), timeout=30)
        # The message is on its way to the worker; the row is not marked: the relay dies now.
        wait_for(lambda: fake.delivery_count() == 1, timeout=30)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert b"relayed" not in out.read_bytes()
    [row] = rows(engine, table)
    assert (row.state, row.attempts) == (PENDING, 0)  # the kill rolled the mark back
    if engine.dialect.name == "postgresql":
        # The server ends the killed relay's backend (and its row lock, which the next relay would skip) only
        # once it notices the closed socket: a moment, seen to outlast the kill under make test's load.
        wait_for(lambda: not held_locks(engine, table.name), timeout=30)

    assert relay(engine, app, table=table) == 1  # so the next relay publishes the row again
    assert [(r.state, r.attempts) for r in rows(engine, table)] == [(DISPATCHED, 1)]

    def finished() -> list[bytes]:
        return [line for line in worker.log().splitlines() if f"Task {TASK_NAME}[".encode() in line
                and b"] succeeded in " in line]

    # Both copies ran to the end: the first sent, the second found the key and replayed it.
    wait_for(lambda: len(finished()) >= 2, timeout=30)
    assert sorted(b"'status': 'duplicate'" in line for line in finished()) == [False, True]
    assert per_recipient(fake) == {"cat@example.com": 1}
    assert fake.attempt_count() == 1  # the second copy never reached the provider
    assert app.tasks[TASK_NAME].ledger.get(key).state.value == "sent"


def test_relay_task_on_beat_delivers_committed_rows_once(
    provider_env: dict[str, str], fake: FakeProvider, celery_process: Callable[..., CeleryProcess],  # noqa: F811
    request: pytest.FixtureRequest, tmp_path: Path, pg_outbox: tuple[sa.Engine, sa.Table],
) -> None:
    """``register_relay`` on a worker, fired by a real beat every half second, several runs overlapping."""
    engine, table = pg_outbox
    env = {**provider_env, "IDEMMAIL_TEST_BEAT_ENTRIES": "relay", "IDEMMAIL_TEST_OUTBOX_URL": POSTGRES_URL,
           "IDEMMAIL_TEST_OUTBOX_TABLE": table.name}
    app = request.getfixturevalue("app_module").app  # the web side: same key secret as the worker's app
    celery_process("worker", ["worker", "-P", "prefork", "-c", "4", "--loglevel=INFO", "--without-gossip",
                              "--without-mingle", "--without-heartbeat", "-n", f"{env['IDEMMAIL_TEST_NS']}-r@%h"],
                   env, b"ready.")
    celery_process("beat", ["beat", "-s", str(tmp_path / "schedule"), "--loglevel=INFO"], env, b"beat: Starting")
    recipients = [f"reader{i}@example.com" for i in range(60)]
    with Session(engine) as session, session.begin():
        for i, to in enumerate(recipients):
            for _ in range(2):  # a retried request writes its intents again: still one row each
                enqueue_email(session, app=app, table=table, to=to, event_id=f"order-{i}", **EMAIL)
    wait_for(lambda: fake.delivery_count() >= len(recipients), timeout=30)
    wait_for(lambda: {r.state for r in rows(engine, table)} == {DISPATCHED}, timeout=10)
    assert per_recipient(fake) == dict.fromkeys(recipients, 1)
    assert len(rows(engine, table)) == len(recipients)


def test_a_row_relayed_seven_hours_after_its_write_still_has_its_whole_retry_budget(
    provider_env: dict[str, str], fake: FakeProvider, request: pytest.FixtureRequest, start_worker: Any,
    monkeypatch: pytest.MonkeyPatch, pg_outbox: tuple[sa.Engine, sa.Table],
) -> None:
    """The retry deadline (6 h here, the default) counted from the row's write: a relay that came back after a
    7 h outage published a row whose first transient failure (the provider refusing it before accepting it)
    ended it ``failed``, ``retry_deadline``, never retried. It counts from the relay's publish now.

    The failure is a 429 (``TransientSendError``: certainly not sent, so retried on the deadline; a 503 is
    ambiguous and retried on the task's count instead)."""
    from idemmail_celery import task as task_module

    engine, table = pg_outbox
    app = request.getfixturevalue("app_module").app
    assert app.tasks[TASK_NAME].idem_settings.retry_deadline_seconds == 6 * 3600
    written_at = time.time() - 7 * 3600
    with monkeypatch.context() as m, engine.begin() as conn:  # the row is written 7 hours ago
        m.setattr(task_module, "time", types.SimpleNamespace(time=lambda: written_at))
        key = enqueue_email(conn, app=app, table=table, to="dee@example.com", event_id="order-7h", **EMAIL)
    fake.fail_next("429")
    start_worker("-P", "prefork", "-c", "1")
    assert relay(engine, app, table=table) == 1  # the relay is back
    ledger = app.tasks[TASK_NAME].ledger
    wait_for(lambda: (record := ledger.get(key)) is not None and record.state.value not in ("claimed", "released"),
             timeout=45)
    record = ledger.get(key)
    assert record is not None and record.state.value == "sent", record.error
    assert per_recipient(fake) == {"dee@example.com": 1} and fake.attempt_count() == 2
