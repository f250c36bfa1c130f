"""Transactional outbox: a task call written as a row in your own database transaction, published by a relay.

How it works, the relay's locking per database and the Django path: docs/outbox-and-digests.md.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from celery import Celery, Task
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads as _kombu_loads
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, scoped_session

from ._common import after_fork, backoff, logsafe
from .chain import KEY_HEADER, RELAYED_HEADER
from .config import Settings
from .errors import ConfigurationError
from .keys import Seal, untrusted_removed
from .task import IdempotentTask, first_run_time

log = logging.getLogger("idemmail_celery")

__all__ = [
    "ALLOWED_OPTIONS", "DEFAULT_TABLE", "DISPATCHED", "PENDING", "RELAY_TASK", "Bind", "OutboxSQL",
    "create_outbox_table", "drain", "enqueue", "enqueue_email", "enqueue_sql", "outbox_table", "purge_dispatched",
    "register_relay", "relay", "run_relay", "schema_sql",
]

DEFAULT_TABLE = "idemmail_outbox"
PENDING = "pending"
DISPATCHED = "dispatched"
RELAY_TASK = "idemmail_celery.outbox_relay"

#: ``apply_async`` options a row may carry (not what is tied to one process: ``producer``, ``link``, ...).
ALLOWED_OPTIONS = frozenset({"queue", "routing_key", "exchange", "priority", "countdown", "eta", "expires",
                             "time_limit", "soft_time_limit", "headers"})

_LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
# Fractional seconds: MariaDB's DATETIME would otherwise drop them, and a backoff of 0.5 s with them.
_TIMESTAMP = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
# SQLite only autoincrements an INTEGER PRIMARY KEY.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_MAX_ERROR = 2000


#: What :func:`enqueue` writes through: an ORM session or a Core connection, in the caller's transaction.
Bind = Session | scoped_session[Any] | Connection


# -- the table --

_tables: dict[str, sa.Table] = {}
_tables_lock = threading.Lock()


def outbox_table(metadata: sa.MetaData | None = None, name: str = DEFAULT_TABLE) -> sa.Table:
    """The outbox table, added to ``metadata`` (yours, so your migrations create it) or to a private one (once)."""
    if metadata is not None:
        return metadata.tables[name] if name in metadata.tables else _define(metadata, name)
    with _tables_lock:
        if name not in _tables:
            _tables[name] = _define(sa.MetaData(), name)
        return _tables[name]


def _define(metadata: sa.MetaData, name: str) -> sa.Table:
    return sa.Table(
        name, metadata,
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("intent_key", sa.String(128), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("args", _LONG_TEXT, nullable=False),
        sa.Column("kwargs", _LONG_TEXT, nullable=False),
        sa.Column("headers", sa.Text, nullable=False),
        sa.Column("options", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", _TIMESTAMP, nullable=False),
        sa.Column("created_at", _TIMESTAMP, nullable=False),
        sa.Column("dispatched_at", _TIMESTAMP, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.UniqueConstraint("intent_key", name=f"uq_{name}_intent_key"),
        # The relay's scan (InnoDB appends the primary key: ORDER BY next_attempt_at, id needs no sort).
        sa.Index(f"ix_{name}_pending", "state", "next_attempt_at"),
    )


def _table(table: sa.Table | str | None) -> sa.Table:
    return table if isinstance(table, sa.Table) else outbox_table(name=table or DEFAULT_TABLE)


def create_outbox_table(engine: Engine | Connection, table: sa.Table | str | None = None) -> sa.Table:
    """Create the outbox table (and its indexes) if it does not exist; returns it."""
    t = _table(table)
    t.create(engine, checkfirst=True)
    return t


def schema_sql(dialect: str, name: str = DEFAULT_TABLE) -> str:
    """The ``CREATE TABLE``/``CREATE INDEX`` script for ``dialect`` (``postgresql``, ``mysql``, ``sqlite``)."""
    from sqlalchemy.schema import CreateIndex, CreateTable

    d = _dialect(dialect)
    t = _define(sa.MetaData(), name)
    parts = [str(CreateTable(t).compile(dialect=d)).strip()]
    parts += [str(CreateIndex(ix).compile(dialect=d)).strip() for ix in sorted(t.indexes, key=lambda i: str(i.name))]
    return ";\n\n".join(parts) + ";\n"


def _dialect(name: str, paramstyle: str | None = None) -> sa.engine.Dialect:
    """A dialect to compile with (no driver is loaded); psycopg2's renders no casts into the SQL."""
    options: dict[str, Any] = {"paramstyle": paramstyle} if paramstyle else {}
    dialects = {"postgresql": postgresql.psycopg2.dialect, "mysql": mysql.pymysql.dialect,
                "mariadb": mysql.pymysql.dialect, "sqlite": sqlite.pysqlite.dialect}
    if name in dialects:
        return dialects[name](**options)  # type: ignore[no-any-return]
    raise ConfigurationError(f"the outbox supports postgresql, mysql/mariadb and sqlite, not {name!r}")


# -- writing an intent --


def _utcnow() -> dt.datetime:
    # Naive UTC in every column: MariaDB and SQLite have no zone-aware timestamp type.
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _dumps(value: Any) -> str:
    return str(_kombu_dumps(value))  # type: ignore[no-untyped-call]


def _loads(text: str) -> Any:
    return _kombu_loads(text)  # type: ignore[no-untyped-call]


def _row(task: Task, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, idempotency_key: str | None,
         idempotency_tenant: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Validate a call the way ``apply_async`` would and return the row that stands for it."""
    if not isinstance(task, IdempotentTask):
        raise TypeError(f"{getattr(task, 'name', task)!r} is not an IdempotentTask: the outbox relays at least once, "
                        "and only a task that claims its key in the ledger turns that into exactly once")
    unknown = sorted(set(options) - ALLOWED_OPTIONS)
    if unknown:
        raise TypeError(f"options the outbox cannot store: {', '.join(unknown)} (allowed: {sorted(ALLOWED_OPTIONS)})")
    # Headers the seal covers (chain state copied from another message) would break the row key's seal, and the
    # relay would publish the intent under another key than the one returned here: dropped, as apply_async does.
    headers: dict[str, Any] = untrusted_removed(options.pop("headers", None) or {}, keep=())
    now = _utcnow()
    # Relative times become absolute now: a row relayed late (or twice) still means what the caller meant.
    aware_now = dt.datetime.now(dt.timezone.utc)
    countdown = options.pop("countdown", None)
    if countdown is not None:
        if options.get("eta") is not None:
            raise TypeError("pass countdown or eta, not both")
        options["eta"] = aware_now + dt.timedelta(seconds=float(countdown))
    # Sealed now, with the row: a relay publishing it late (or again) cannot make it look newer.
    headers.update(task.intent_headers(args, kwargs, explicit=idempotency_key, tenant=idempotency_tenant,
                                       due=first_run_time(task.app, eta=options.get("eta"))))
    if isinstance(options.get("expires"), (int, float)):
        options["expires"] = aware_now + dt.timedelta(seconds=float(options["expires"]))
    return {
        "intent_key": headers[KEY_HEADER], "task_name": task.name, "args": _dumps(list(args or ())),
        "kwargs": _dumps(dict(kwargs or {})), "headers": _dumps(headers), "options": _dumps(options),
        "state": PENDING, "attempts": 0, "next_attempt_at": now, "created_at": now, "dispatched_at": None,
        "last_error": None,
    }


def _insert(dialect: str, table: sa.TableClause, row: dict[str, Any]) -> Any:
    """``INSERT`` that does nothing when the intent key is already there."""
    if dialect in ("postgresql", "sqlite"):
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        return insert(table).values(**row).on_conflict_do_nothing(index_elements=["intent_key"])
    if dialect in ("mysql", "mariadb"):
        # Not INSERT IGNORE: that would also turn data errors (a too-long value) into warnings.
        ins = mysql.insert(table).values(**row)
        return ins.on_duplicate_key_update(intent_key=ins.inserted.intent_key)
    raise ConfigurationError(f"the outbox supports postgresql, mysql/mariadb and sqlite, not {dialect!r}")


def _dialect_name(bind: Bind) -> str:
    written_to = bind if isinstance(bind, Connection) else bind.get_bind()  # a session: what it writes to
    return str(written_to.dialect.name)


def enqueue(session_or_connection: Bind, task: Task, args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None, *, idempotency_key: str | None = None,
            idempotency_tenant: str | None = None, table: sa.Table | str | None = None, **options: Any) -> str:
    """Write ``task.apply_async(args, kwargs, **options)`` (an ORM ``Session`` or a Core ``Connection``) into the
    outbox, uncommitted; validated as ``apply_async`` would, before anything is written. Returns the intent key."""
    t = _table(table)
    row = _row(task, args, kwargs, idempotency_key, idempotency_tenant, options)
    session_or_connection.execute(_insert(_dialect_name(session_or_connection), t, row))
    return str(row["intent_key"])


def _email_task(app: Celery | None, task: Task | None) -> Task:
    if task is not None:
        return task
    from celery import current_app

    from .mail import TASK_NAME

    chosen = app if app is not None else current_app
    try:
        found: Task = chosen.tasks[TASK_NAME]
    except KeyError:
        raise ConfigurationError(f"{TASK_NAME} is not registered on {chosen.main!r}: import idemmail_celery where "
                                 "the app is defined, or call idemmail_celery.mail.register(app)") from None
    return found


def enqueue_email(session_or_connection: Bind, *, app: Celery | None = None, task: Task | None = None,
                  options: Mapping[str, Any] | None = None, table: sa.Table | str | None = None, **email: Any) -> str:
    """:func:`enqueue` a ``send_email`` call (``task``, else ``app``'s, else ``current_app``'s) with ``email`` as
    its keywords and publishing ``options`` (``{"queue": "mail"}``); returns the intent key."""
    return enqueue(session_or_connection, _email_task(app, task), (), email, table=table, **dict(options or {}))


class OutboxSQL(NamedTuple):
    """A ready statement for a DB-API cursor: ``cursor.execute(sql, params)``; ``key`` is the intent key."""

    sql: str
    params: tuple[Any, ...]
    key: str


def enqueue_sql(vendor: str, task: Task, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, *,
                idempotency_key: str | None = None, idempotency_tenant: str | None = None, table: str = DEFAULT_TABLE,
                **options: Any) -> OutboxSQL:
    """:func:`enqueue` for code that writes through its own DB-API connection (Django): ``vendor`` is
    ``postgresql``, ``mysql`` (MariaDB too) or ``sqlite``, as Django's ``connection.vendor``; ``%s`` placeholders."""
    row = _row(task, args, kwargs, idempotency_key, idempotency_tenant, options)
    d = _dialect(vendor, paramstyle="format")
    # No id column: no RETURNING id the caller's cursor would not read. Typed as the outbox's columns, so each
    # value goes through the dialect's bind processing (not sqlite3's timestamp adapter, deprecated in 3.12).
    typed = outbox_table().c
    t = sa.table(table, *(sa.column(name, typed[name].type) for name in row))
    compiled = _insert(d.name, t, row).compile(dialect=d)
    names = compiled.positiontup or []
    params = tuple(_bound(compiled.binds[name].type, d, compiled.params[name]) for name in names)
    return OutboxSQL(str(compiled), params, str(row["intent_key"]))


# -- the relay --


def _bound(type_: sa.types.TypeEngine[Any], dialect: sa.Dialect, value: Any) -> Any:
    process = type_.dialect_impl(dialect).bind_processor(dialect)
    return process(value) if process is not None and value is not None else value


def _claim_sql(conn: Connection, t: sa.Table, batch_size: int, now: dt.datetime) -> Any:
    query = (sa.select(t).where(t.c.state == PENDING, t.c.next_attempt_at <= now)
             .order_by(t.c.next_attempt_at, t.c.id).limit(batch_size))
    if conn.dialect.name == "sqlite":
        return query  # the write lock taken by BEGIN IMMEDIATE already excludes other relays
    return query.with_for_update(skip_locked=True)


def _begin(conn: Connection, t: sa.Table) -> None:
    """Open the batch's transaction; on SQLite, with the database's write lock taken up front."""
    if conn.dialect.name != "sqlite":
        # READ COMMITTED: InnoDB takes no gap locks, so inserting web requests never wait for a relay.
        conn.execution_options(isolation_level="READ COMMITTED")
        conn.begin()
        _check_skip_locked(conn)
        return
    conn.begin()
    driver = conn.connection.driver_connection
    if not getattr(driver, "in_transaction", False):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        # A deferred transaction is open (SQLAlchemy's pysqlite recipe): a write matching nothing takes the lock.
        conn.execute(sa.update(t).where(sa.false()).values(state=t.c.state))


def _check_skip_locked(conn: Connection) -> None:
    dialect = conn.dialect
    version = dialect.server_version_info or ()
    if getattr(dialect, "is_mariadb", False) and tuple(version[:2]) < (10, 6):
        raise ConfigurationError(f"the outbox relay needs SKIP LOCKED: MariaDB 10.6 or later (this server is "
                                 f"{version}); or run a single relay")


def relay(engine: Engine, app: Celery, *, batch_size: int = 100, table: sa.Table | str | None = None,
          retry_backoff: float = 1.0, retry_backoff_max: float = 300.0,
          before_commit: Callable[[Sequence[int]], None] | None = None) -> int:
    """Publish one batch of due pending rows and mark them dispatched; returns how many were published.

    A row that cannot be published stays pending, retried after ``retry_backoff`` doubling up to
    ``retry_backoff_max`` seconds; a broker error ends the batch. ``before_commit`` gets the published row ids.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    t = _table(table)
    with engine.connect() as conn:
        _begin(conn, t)
        now = _utcnow()
        rows = conn.execute(_claim_sql(conn, t, batch_size, now)).all()
        if not rows:
            conn.rollback()
            return 0
        done: list[int] = []
        failed: list[tuple[Any, BaseException]] = []
        with app.producer_or_acquire() as producer:
            for row in rows:
                try:
                    _publish(app, row, producer)
                except Exception as exc:
                    failed.append((row, exc))
                    if isinstance(exc, (KombuOperationalError, ConnectionError, OSError)):
                        break  # a broker error: the other rows would only fail the same way
                else:
                    done.append(row.id)
        if done:
            conn.execute(sa.update(t).where(t.c.id.in_(done)).values(
                state=DISPATCHED, dispatched_at=_utcnow(), attempts=t.c.attempts + 1, last_error=None))
        for row, error in failed:
            delay = backoff(row.attempts, retry_backoff, retry_backoff_max)
            log.warning("idemmail outbox: publishing row %s (%s) failed, next try in %.1fs: %s",
                        row.id, logsafe(row.task_name), delay, logsafe(error))
            conn.execute(sa.update(t).where(t.c.id == row.id).values(
                attempts=t.c.attempts + 1, next_attempt_at=_utcnow() + dt.timedelta(seconds=delay),
                last_error=f"{type(error).__name__}: {error}"[:_MAX_ERROR]))
        if before_commit is not None:
            before_commit(list(done))
        conn.commit()
        return len(done)


def _publish(app: Celery, row: Any, producer: Any) -> None:
    args, kwargs = _loads(row.args), _loads(row.kwargs)
    headers, options = _loads(row.headers), _loads(row.options)
    task = app.tasks.get(row.task_name)
    if isinstance(task, IdempotentTask):
        headers = _relayed(task, args, kwargs, headers)
    if task is not None:
        task.apply_async(args, kwargs, headers=headers, producer=producer, **options)
    else:
        app.send_task(row.task_name, args, kwargs, headers=headers, producer=producer, **options)


def _relayed(task: IdempotentTask, args: Any, kwargs: Any, headers: dict[str, Any]) -> dict[str, Any]:
    """A row's stored headers with the time of this publish sealed in (``idemmail_relayed``), from which the retry
    deadline counts; as stored if this process cannot check their seal (a key secret it lacks)."""
    builder = task.key_builder
    payload = builder.payload(args, kwargs)
    if builder.check_seal(headers, payload) is not Seal.VALID:
        return headers
    return task.sealed({**headers, RELAYED_HEADER: f"{time.time():.3f}"}, payload)


def drain(engine: Engine, app: Celery, *, batch_size: int = 100, table: sa.Table | str | None = None,
          max_seconds: float = 10.0, **relay_options: Any) -> int:
    """Run :func:`relay` until a batch comes back short or ``max_seconds`` have passed; rows published."""
    deadline = time.monotonic() + max_seconds
    total = 0
    while True:
        n = relay(engine, app, batch_size=batch_size, table=table, **relay_options)
        total += n
        if n < batch_size or time.monotonic() >= deadline:
            return total


def purge_dispatched(engine: Engine, *, older_than: float, table: sa.Table | str | None = None) -> int:
    """Delete rows dispatched more than ``older_than`` seconds ago; returns how many. A purged key enqueued
    again is a new row and a new publish (a duplicate while the ledger remembers it)."""
    t = _table(table)
    cutoff = _utcnow() - dt.timedelta(seconds=older_than)
    with engine.begin() as conn:
        result = conn.execute(sa.delete(t).where(t.c.state == DISPATCHED, t.c.dispatched_at < cutoff))
        return int(result.rowcount)


# -- the relay as a Celery task --

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


@after_fork
def _forget_engines() -> None:
    """A forked pool child builds its own engines (dropped, not disposed: the connections are the parent's)."""
    global _engines_lock
    _engines.clear()
    _engines_lock = threading.Lock()


def _engine_for(url: str) -> Engine:
    with _engines_lock:
        if url not in _engines:
            _engines[url] = sa.create_engine(url, pool_pre_ping=True)
        return _engines[url]


def register_relay(app: Celery, url: str | None = None, *, name: str = RELAY_TASK, table: str | None = None,
                   batch_size: int | None = None, max_seconds: float | None = None) -> Task:
    """Register the relay task on ``app`` and return it (run it from beat: docs/outbox-and-digests.md); what is
    not given here is read at run time from the ``idemmail_outbox_*`` settings."""

    def outbox_relay() -> int:
        return run_relay(app, url, table=table, batch_size=batch_size, max_seconds=max_seconds)

    outbox_relay.__doc__ = "Publish committed outbox rows to the broker (idemmail_celery.outbox.drain)."
    task: Task = app.task(name=name, shared=False, ignore_result=True)(outbox_relay)
    return task


def run_relay(app: Celery, url: str | None = None, *, table: str | None = None, batch_size: int | None = None,
              max_seconds: float | None = None) -> int:
    """What the relay task runs: :func:`drain` with the app's settings for what is not given."""
    settings = Settings.resolve(app.conf)
    db_url = url or settings.outbox_url
    if not db_url:
        raise ConfigurationError("set idemmail_outbox_url (or pass url= to register_relay)")
    return drain(_engine_for(str(db_url)), app, batch_size=batch_size or settings.outbox_batch_size,
                 table=table or settings.outbox_table, max_seconds=max_seconds or settings.outbox_max_seconds)
