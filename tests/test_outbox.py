"""The transactional outbox against real PostgreSQL, MariaDB and SQLite, publishing to a real Redis broker.

What a worker does with the messages is in tests/integration/test_outbox_worker.py;
here the relay's messages are read straight from the broker's queue.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from sqlalchemy import event
from sqlalchemy.orm import Session

from idemmail_celery import (
    ConfigurationError,
    IdempotencyKeyError,
    IdempotentTask,
    InvalidEmail,
    send_email,  # noqa: F401  # registers send_email on every app
)
from idemmail_celery.chain import (
    ENQUEUED_HEADER,
    FORMAT_HEADER,
    KEY_HEADER,
    KEY_MARK_HEADER,
    OWNER_HEADER,
    TENANT_HEADER,
)
from idemmail_celery.keys import Seal
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.outbox import (
    DISPATCHED,
    PENDING,
    create_outbox_table,
    drain,
    enqueue,
    enqueue_email,
    enqueue_sql,
    outbox_table,
    purge_dispatched,
    register_relay,
    relay,
    schema_sql,
)

from .conftest import MARIADB_URL, POSTGRES_URL, REDIS_URL, service_missing, unique

BACKENDS = ["postgresql", "mariadb", "sqlite"]
EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "html": "<p>Thanks</p>", "event_id": "order-1",
         "template": "receipt"}


def make_engine(backend: str, tmp_path: Path) -> sa.Engine:
    url = {"postgresql": POSTGRES_URL, "mariadb": MARIADB_URL, "sqlite": f"sqlite:///{tmp_path / 'app.sqlite3'}"}
    engine = sa.create_engine(url[backend])
    try:
        engine.connect().close()
    except Exception as exc:
        service_missing(backend, exc)
    return engine


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    e = make_engine(request.param, tmp_path)
    yield e
    e.dispose()


@pytest.fixture
def table(engine: sa.Engine) -> Iterator[sa.Table]:
    t = create_outbox_table(engine, unique("outbox"))
    yield t
    t.drop(engine)


@pytest.fixture
def app() -> Iterator[Celery]:
    """A caller's app on the real Redis broker, with a queue of its own (read back by `queued`)."""
    a = Celery(unique("app"), broker=REDIS_URL, set_as_current=False)
    a.conf.update(
        task_default_queue=unique("q"), task_serializer="json", accept_content=["json"],
        idemmail_ledger_url=REDIS_URL, idemmail_key_secret="test-secret", idemmail_provider_url="console://",
        idemmail_default_from="Shop <shop@example.com>", broker_connection_retry_on_startup=True,
    )
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    yield a
    r.delete(a.conf.task_default_queue)
    a.close()


@pytest.fixture
def charge(app: Celery) -> Any:
    @app.task(shared=False, base=IdempotentTask, bind=True, idempotency_key=("customer", "invoice"))
    def charge(self: Any, customer: str, invoice: int, amount: int = 0) -> None:
        """An idempotent side effect other than email."""

    return charge


def queued(app: Celery, queue: str | None = None) -> list[dict[str, Any]]:
    """The messages waiting in a queue of the app's Redis broker, oldest first."""
    r = redis.Redis.from_url(REDIS_URL)
    raw = r.lrange(queue or app.conf.task_default_queue, 0, -1)
    return [json.loads(m) for m in reversed(raw)]


def rows(engine: sa.Engine, table: sa.Table) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.id)).all())


# -- writing inside the caller's transaction --


def test_rollback_writes_no_row_and_commit_writes_one(engine: sa.Engine, table: sa.Table, app: Celery) -> None:
    with Session(engine) as session:
        enqueue_email(session, app=app, table=table, **EMAIL)
        session.rollback()  # the order was not saved after all
    assert rows(engine, table) == []
    with engine.connect() as conn:  # a Core connection works the same
        enqueue_email(conn, app=app, table=table, **{**EMAIL, "to": "bob@example.com"})
        conn.rollback()
    assert rows(engine, table) == []

    with Session(engine) as session, session.begin():
        key = enqueue_email(session, app=app, table=table, **EMAIL)
    [row] = rows(engine, table)
    assert (row.intent_key, row.task_name, row.state, row.attempts) == (key, TASK_NAME, PENDING, 0)
    headers = json.loads(row.headers)
    builder = app.tasks[TASK_NAME].key_builder
    assert builder.check_seal(headers, builder.payload((), EMAIL)) is Seal.VALID  # the library's own key
    assert headers.pop(KEY_HEADER) == key
    assert time.time() - 60 < float(headers.pop(ENQUEUED_HEADER)) <= time.time()  # dated when written
    headers.pop(KEY_MARK_HEADER)
    assert headers == {FORMAT_HEADER: "1"}  # and the format it is written in
    assert json.loads(row.kwargs) == EMAIL and json.loads(row.args) == []


def test_ten_enqueues_in_one_transaction_write_one_row(engine: sa.Engine, table: sa.Table, app: Celery) -> None:
    with Session(engine) as session, session.begin():
        keys = {enqueue_email(session, app=app, table=table, **EMAIL) for _ in range(10)}
        # A retried request rewrote the body: the same intent (event, template, recipient), no new row.
        keys.add(enqueue_email(session, app=app, table=table, **{**EMAIL, "html": "<p>Thanks!!</p>"}))
    with engine.begin() as conn:  # and again in a later transaction
        keys.add(enqueue_email(conn, app=app, table=table, **EMAIL))
    assert len(keys) == 1
    [row] = rows(engine, table)
    assert json.loads(row.kwargs)["html"] == "<p>Thanks</p>"  # the first one written stands


def test_row_key_is_the_key_apply_async_would_send(engine: sa.Engine, table: sa.Table, app: Celery,
                                                   charge: Any) -> None:
    with engine.begin() as conn:
        k1 = enqueue(conn, charge, ("cus_1", 7), {"amount": 100}, table=table)
        k2 = enqueue(conn, charge, kwargs={"customer": "cus_1", "invoice": 8}, idempotency_tenant="acme",
                     table=table)
        k3 = enqueue(conn, charge, ("cus_1", 9), idempotency_key="inv-9:charge", table=table)
    assert k1 == charge.intent_key("cus_1", 7, amount=100)
    assert k2 == charge.intent_headers((), {"customer": "cus_1", "invoice": 8}, tenant="acme")[KEY_HEADER]
    assert k3 == charge.intent_headers(("cus_1", 9), {}, explicit="inv-9:charge")[KEY_HEADER]
    stored = json.loads(rows(engine, table)[1].headers)
    assert {k: stored[k] for k in (KEY_HEADER, TENANT_HEADER)} == {KEY_HEADER: k2, TENANT_HEADER: "acme"}
    assert set(stored) == {KEY_HEADER, TENANT_HEADER, ENQUEUED_HEADER, KEY_MARK_HEADER, FORMAT_HEADER}


def test_bad_input_raises_before_anything_is_written(engine: sa.Engine, table: sa.Table, app: Celery,
                                                     charge: Any) -> None:
    @app.task(shared=False, name=unique("plain"))
    def plain() -> None:
        """A task without a ledger."""

    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidEmail):
            enqueue_email(session, app=app, table=table, **{**EMAIL, "to": "not-an-address"})
        with pytest.raises(InvalidEmail):
            enqueue_email(session, app=app, table=table, **{**EMAIL, "subject": "Hi\r\nBcc: x@example.com"})
        with pytest.raises(TypeError, match="not an IdempotentTask"):
            enqueue(session, plain, table=table)
        with pytest.raises(TypeError, match="cannot store"):
            enqueue(session, charge, ("c", 1), table=table, link=plain.s())
        with pytest.raises(TypeError, match="not both"):
            enqueue(session, charge, ("c", 1), table=table, countdown=5, eta=dt.datetime.now(dt.timezone.utc))
        with pytest.raises(IdempotencyKeyError):
            enqueue(session, charge, ("c",), {"nope": 1}, table=table)
        # The caller's transaction is intact: what it writes next still commits.
        enqueue(session, charge, ("c", 1), table=table)
    assert [r.intent_key for r in rows(engine, table)] == [charge.intent_key("c", 1)]


# -- the relay --


def test_relay_publishes_each_row_once_with_its_stored_key_and_options(
    engine: sa.Engine, table: sa.Table, app: Celery, charge: Any
) -> None:
    other_queue = unique("q")
    with engine.begin() as conn:
        k_mail = enqueue_email(conn, app=app, table=table, options={"countdown": 60}, **EMAIL)
        k_charge = enqueue(conn, charge, ("cus_1", 7), table=table, queue=other_queue, expires=3600,
                           headers={"trace": "abc"})
    enqueued_at = dt.datetime.now(dt.timezone.utc)
    time.sleep(0.2)
    assert relay(engine, app, table=table) == 2
    assert relay(engine, app, table=table) == 0  # nothing left: dispatched rows are not published again

    [mail] = queued(app)
    assert mail["headers"]["task"] == TASK_NAME and mail["headers"][KEY_HEADER] == k_mail
    eta = dt.datetime.fromisoformat(mail["headers"]["eta"])
    assert abs((eta - enqueued_at).total_seconds() - 60) < 1.0  # counted from enqueue, not from the relay
    [other] = queued(app, other_queue)
    redis.Redis.from_url(REDIS_URL).delete(other_queue)
    assert other["headers"][KEY_HEADER] == k_charge and other["headers"]["trace"] == "abc"
    assert other["headers"]["expires"] is not None
    assert [(r.state, r.attempts, r.last_error) for r in rows(engine, table)] == [(DISPATCHED, 1, None)] * 2
    assert all(r.dispatched_at is not None for r in rows(engine, table))


def test_a_header_only_the_library_writes_does_not_change_the_rows_key(
    engine: sa.Engine, table: sa.Table, app: Celery, charge: Any
) -> None:
    """Chain state among the caller's headers (copied from another message) would break the row key's seal:
    the relay's apply_async would then hash the key again, and the intent would run under another key."""
    with engine.begin() as conn:
        key = enqueue(conn, charge, ("cus_1", 7), table=table, headers={"trace": "abc", OWNER_HEADER: "copied"})
    assert relay(engine, app, table=table) == 1
    [message] = queued(app)
    assert message["headers"][KEY_HEADER] == key == charge.intent_key("cus_1", 7)
    assert message["headers"]["trace"] == "abc" and OWNER_HEADER not in message["headers"]


def test_relay_publishes_by_name_when_its_app_does_not_know_the_task(
    engine: sa.Engine, table: sa.Table, app: Celery, charge: Any
) -> None:
    with engine.begin() as conn:
        key = enqueue(conn, charge, ("cus_2", 1), table=table)
    relay_app = Celery(unique("relay"), broker=REDIS_URL, set_as_current=False)
    relay_app.conf.task_default_queue = app.conf.task_default_queue
    assert charge.name not in relay_app.tasks
    assert relay(engine, relay_app, table=table) == 1
    [message] = queued(app)
    assert message["headers"]["task"] == charge.name and message["headers"][KEY_HEADER] == key


def test_publish_failure_keeps_the_row_pending_with_backoff(
    engine: sa.Engine, table: sa.Table, app: Celery
) -> None:
    with engine.begin() as conn:
        for n in range(3):
            enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
    broken = Celery(unique("down"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    broken.conf.update(broker_connection_timeout=0.5, task_publish_retry=False, broker_connection_max_retries=0,
                       idemmail_provider_url="console://", idemmail_default_from="shop@example.com")
    before = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    assert relay(engine, broken, table=table, retry_backoff=30) == 0
    first, *rest = rows(engine, table)
    assert first.state == PENDING and first.attempts == 1 and "OperationalError" in (first.last_error or "")
    assert first.next_attempt_at >= before + dt.timedelta(seconds=14)  # half of 30 s at least (jitter)
    # The broker is down for everyone: the batch stopped at the first failure, the others were not tried.
    assert [(r.attempts, r.last_error) for r in rest] == [(0, None), (0, None)]

    assert relay(engine, app, table=table) == 2  # the failed row waits for its next attempt
    with engine.begin() as conn:
        conn.execute(sa.update(table).values(next_attempt_at=before))
    assert relay(engine, app, table=table) == 1
    assert [(r.state, r.attempts) for r in rows(engine, table)] == [(DISPATCHED, 2), (DISPATCHED, 1), (DISPATCHED, 1)]
    assert rows(engine, table)[0].last_error is None


def test_drain_publishes_everything_in_batches(engine: sa.Engine, table: sa.Table, app: Celery) -> None:
    with engine.begin() as conn:
        for n in range(25):
            enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
    assert drain(engine, app, table=table, batch_size=10) == 25
    assert len(queued(app)) == 25


def test_purge_dispatched_keeps_pending_and_recent(engine: sa.Engine, table: sa.Table, app: Celery) -> None:
    with engine.begin() as conn:
        for n in range(3):
            enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
    relay(engine, app, table=table, batch_size=2)
    assert purge_dispatched(engine, older_than=3600, table=table) == 0
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.state == DISPATCHED)
                     .values(dispatched_at=dt.datetime(2000, 1, 1)))
    assert purge_dispatched(engine, older_than=3600, table=table) == 2
    assert [r.state for r in rows(engine, table)] == [PENDING]


def _sqlite_recipe(engine: sa.Engine) -> None:
    """SQLAlchemy's documented pysqlite recipe: the driver's own BEGIN off, SQLAlchemy emits BEGIN."""

    @event.listens_for(engine, "connect")
    def _no_driver_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")


@pytest.mark.parametrize("recipe", [False, True], ids=["driver-begin", "sqlalchemy-begin"])
def test_sqlite_relays_take_turns_and_share_no_row(tmp_path: Path, app: Celery, recipe: bool) -> None:
    path = tmp_path / "app.sqlite3"
    engines = [sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 15}) for _ in range(2)]
    if recipe:
        for e in engines:
            _sqlite_recipe(e)
    table = create_outbox_table(engines[0], unique("outbox"))
    with engines[0].begin() as conn:
        for n in range(30):
            enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
    published: list[list[int]] = [[], []]
    first_holds_lock = threading.Event()
    second_started = threading.Event()

    def first() -> None:
        def hold(ids: Any) -> None:
            published[0].extend(ids)
            first_holds_lock.set()
            second_started.wait(10)
            time.sleep(0.5)  # the second relay is now waiting for the write lock, not reading our rows

        relay(engines[0], app, table=table, batch_size=20, before_commit=hold)

    def second() -> None:
        first_holds_lock.wait(10)
        second_started.set()
        relay(engines[1], app, table=table, batch_size=20, before_commit=published[1].extend)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(published[0]) == 20 and len(published[1]) == 10
    assert not set(published[0]) & set(published[1])
    assert len(queued(app)) == 30


# -- the relay task --


def test_registered_relay_task_drains_the_configured_outbox(tmp_path: Path, app: Celery) -> None:
    url = f"sqlite:///{tmp_path / 'relay.sqlite3'}"
    engine = sa.create_engine(url)
    name = unique("outbox")
    table = create_outbox_table(engine, name)
    app.conf.update(idemmail_outbox_url=url, idemmail_outbox_table=name, idemmail_outbox_batch_size=2)
    task = register_relay(app)
    assert app.tasks["idemmail_celery.outbox_relay"].name == task.name
    with engine.begin() as conn:
        for n in range(5):
            enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
    assert task() == 5  # drains in batches of 2 until a short one
    assert task() == 0
    assert len(queued(app)) == 5


def test_relay_task_without_a_database_url_says_what_to_set(app: Celery) -> None:
    task = register_relay(app, name=unique("relay"))
    with pytest.raises(ConfigurationError, match="idemmail_outbox_url"):
        task()


# -- Django and hand-made migrations: plain SQL --


def dbapi_connect(backend: str, tmp_path: Path) -> Any:
    if backend == "postgresql":
        import psycopg

        return psycopg.connect("host=127.0.0.1 user=postgres dbname=test")
    if backend == "mariadb":
        import pymysql

        return pymysql.connect(host="127.0.0.1", user="root", database="test")
    return sqlite3.connect(tmp_path / "app.sqlite3")


@pytest.mark.parametrize("backend", BACKENDS)
def test_enqueue_sql_on_a_dbapi_cursor_follows_its_transaction(backend: str, tmp_path: Path, app: Celery) -> None:
    """What the Django app runs on ``connection.cursor()`` (tests/integration/test_django.py), here on the bare
    drivers: MariaDB too."""
    engine = make_engine(backend, tmp_path)
    name = unique("outbox")
    vendor = "mysql" if backend == "mariadb" else backend  # Django's connection.vendor
    ddl = schema_sql(vendor, name)  # the migration a Django project would RunSQL
    conn = dbapi_connect(backend, tmp_path)
    try:
        cur = conn.cursor()
        for statement in ddl.split(";"):
            if statement.strip():
                cur.execute(statement)
        conn.commit()
        task = app.tasks[TASK_NAME]

        def write(**email: Any) -> str:
            stmt = enqueue_sql(vendor, task, kwargs=email, table=name)
            # Django's SQLite backend turns %s into ? itself; the bare sqlite3 driver needs it done.
            cur.execute(stmt.sql.replace("%s", "?") if backend == "sqlite" else stmt.sql, stmt.params)
            return stmt.key

        write(**EMAIL)
        conn.rollback()
        cur.execute(f"SELECT COUNT(*) FROM {name}")
        assert cur.fetchone()[0] == 0
        keys = {write(**EMAIL) for _ in range(10)}
        conn.commit()
        cur.execute(f"SELECT intent_key, state FROM {name}")
        assert len(keys) == 1
        assert [tuple(row) for row in cur.fetchall()] == [(keys.pop(), PENDING)]
    finally:
        conn.close()
    # The relay reads what the foreign connection wrote.
    assert relay(engine, app, table=name) == 1
    outbox_table(name=name).drop(engine)
    engine.dispose()


def test_schema_sql_creates_the_same_table_as_the_metadata() -> None:
    metadata = sa.MetaData()
    t = outbox_table(metadata, "my_outbox")
    assert outbox_table(metadata, "my_outbox") is t and "my_outbox" in metadata.tables
    for dialect in ("postgresql", "mysql", "sqlite"):
        ddl = schema_sql(dialect, "my_outbox")
        assert "CREATE TABLE my_outbox" in ddl and "uq_my_outbox_intent_key" in ddl
        assert "CREATE INDEX ix_my_outbox_pending ON my_outbox (state, next_attempt_at)" in ddl
    assert "DATETIME(6)" in schema_sql("mysql")  # MariaDB keeps the sub-second backoff


# -- many rows, in batches (the throughput figure is bench/outbox_relay.py's) --


def test_relay_publishes_300_rows_in_batches_once_each_on_postgresql(tmp_path: Path, app: Celery) -> None:
    engine = make_engine("postgresql", tmp_path)
    table = create_outbox_table(engine, unique("outbox"))
    try:
        with engine.begin() as conn:
            for n in range(300):
                enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
        assert relay(engine, app, table=table, batch_size=1) == 1
        assert drain(engine, app, table=table, batch_size=100, max_seconds=120) == 299
        assert drain(engine, app, table=table, batch_size=100, max_seconds=5) == 0
        messages = queued(app)
        assert len(messages) == 300
        assert len({m["headers"]["id"] for m in messages}) == 300
        assert {r.state for r in rows(engine, table)} == {DISPATCHED}
    finally:
        table.drop(engine)
        engine.dispose()
