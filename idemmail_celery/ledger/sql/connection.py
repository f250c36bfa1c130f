"""How the SQL ledger reaches its database (:class:`SQLConnections`): the engine, the schema checked on the first
connection, one connection kept between calls, and every database error as ``LedgerUnavailableError``."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ..._common import after_fork
from ...errors import ConfigurationError, IdemmailError, LedgerUnavailableError
from ..base import DEFAULT_RETENTION_SECONDS, Ledger
from .schema import (
    DEFAULT_TABLE,
    add_column_sql,
    hops_table,
    ledger_table,
    listing_index,
    migration_file,
    record_fields,
    roster_table,
)

log = logging.getLogger("idemmail_celery")

T = TypeVar("T")

#: How long a SQLite statement waits for another process's lock before the ledger gives up.
SQLITE_BUSY_SECONDS = 30.0


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cur = dbapi_connection.cursor()
    try:
        # First: every step after this one waits on another process's lock instead of failing.
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_SECONDS * 1000)}")
        cur.execute("PRAGMA synchronous=NORMAL")
        _ensure_wal(cur)
    finally:
        cur.close()


def _ensure_wal(cur: Any) -> None:
    """Put the file in WAL mode, once: the switch is refused at once, busy timeout or not, while another connection
    writes (pool children opening a new file together), so it is retried within the busy window."""
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    pause = 0.002
    while True:
        row = cur.execute("PRAGMA journal_mode").fetchone()
        if row is None or str(row[0]).lower() in ("wal", "memory"):
            return  # already WAL (set by another connection), or an in-memory database
        try:
            cur.execute("PRAGMA journal_mode=WAL").fetchone()
            return
        except Exception as exc:  # the driver's OperationalError; anything else is not ours to retry
            if "locked" not in str(exc).lower() or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


class SQLConnections(Ledger):
    """Reaching a ledger's SQL database (the moves are :class:`.SQLLedger`'s): ``url`` is SQLAlchemy's; ``table``
    names the tables; ``create_table=False`` leaves the schema to ``ledger/migrations/``; other keywords go to
    ``sqlalchemy.create_engine``."""

    def __init__(self, url: str, *, table: str = DEFAULT_TABLE, retention_seconds: float = DEFAULT_RETENTION_SECONDS,
                 create_table: bool = True, keep_payload: bool = False, **engine_options: Any) -> None:
        super().__init__(retention_seconds=retention_seconds, keep_payload=keep_payload)
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        if self.dialect not in ("postgresql", "mysql", "mariadb", "sqlite"):
            raise ConfigurationError(f"unsupported SQL dialect for the ledger: {self.dialect!r}")
        self.table = ledger_table(table)
        self.hops = hops_table(table, self.table.metadata)
        self.roster_table = roster_table(table, self.table.metadata)
        #: The review queue's index (migration 004).
        self.listing_index = listing_index(self.table)
        self._hops_ready = True  # False: created by hand without migration 002 (see _ensure_tables)
        self._roster_ready = True  # False: created by hand without migration 003
        self._columns = tuple(c.name for c in self.table.c)
        self._create_table = create_table
        self._ready = False
        self._lock = threading.Lock()
        self._engine_options = engine_options
        self._engine: Engine | None = None
        self._spare: Connection | None = None  # kept open between calls (see _run)
        self._spare_lock = threading.Lock()
        _live.add(self)

    def _after_fork(self) -> None:
        """In a forked child: never use the parent's sockets, nor a lock one of its threads held."""
        self._lock, self._spare_lock, self._spare = threading.Lock(), threading.Lock(), None
        if self._engine is not None:
            self._engine.dispose(close=False)  # the pool's connections are the parent's: left alone
            self._engine = None

    # -- plumbing --

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    self._spare = None
                    self._engine = self._make_engine()
        return self._engine

    def _make_engine(self) -> Engine:
        # Autocommit: there is never anything to roll back.
        options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None,
                                   **self._engine_options}
        if self.dialect == "sqlite":
            database = self.url.database or ""
            if database in ("", ":memory:"):
                options.setdefault("poolclass", StaticPool)
                options.setdefault("connect_args", {"check_same_thread": False})
            engine = sa.create_engine(self.url, **options)
            event.listen(engine, "connect", _sqlite_pragmas)
            return engine
        options.setdefault("pool_pre_ping", False)
        options.setdefault("connect_args", {"connect_timeout": 5})  # psycopg and PyMySQL both take it
        return sa.create_engine(self.url, **options)

    def _conn(self) -> Connection:
        try:
            conn = self.engine.connect()
        except SQLAlchemyError as exc:
            # Unreachable, refused, or the pool exhausted (every connection busy past pool_timeout).
            raise _unavailable(exc, "unreachable") from exc
        if not self._ready:
            try:
                self._ensure_tables(conn)
            except SQLAlchemyError as exc:
                self._discard(conn, invalidate=isinstance(exc, DBAPIError) and exc.connection_invalidated)
                raise _unavailable(exc, "refused the schema check") from exc
        return conn

    def _ensure_tables(self, conn: Connection) -> None:
        with self._lock:
            if self._ready:
                return
            for table in (self.table, self.hops, self.roster_table):
                if self._create_table:
                    try:
                        table.create(conn, checkfirst=True)
                    except (IntegrityError, ProgrammingError, OperationalError):
                        # Another process created it between our check and our CREATE.
                        if not sa.inspect(conn).has_table(table.name):
                            raise
                elif table is self.hops and not sa.inspect(conn).has_table(table.name):
                    # Managed by hand without migration 002: no marks (callers fall back to countdowns).
                    log.warning("idemmail: SQL ledger table %s is missing (apply migration %s): "
                                "reschedule marks are off", table.name, migration_file(self.dialect, 2))
                    self._hops_ready = False
                elif table is self.roster_table and not sa.inspect(conn).has_table(table.name):
                    log.warning("idemmail: SQL ledger table %s is missing (apply migration %s): a key-secret "
                                "rotation takes two deploys", table.name, migration_file(self.dialect, 3))
                    self._roster_ready = False
            if sa.inspect(conn).has_table(self.table.name):  # else hand-managed, not applied yet: statements say so
                self._ensure_listing_index(conn)
                self._ensure_record_fields(conn)
            self._ready = True

    def _ensure_listing_index(self, conn: Connection) -> None:
        """Add the listing index to a table made before it (migration 004), or say that pages scan without it."""
        index = self.listing_index
        if any(ix.get("name") == index.name for ix in sa.inspect(conn).get_indexes(self.table.name)):
            return
        if not self._create_table:
            log.warning("idemmail: SQL ledger table %s has no index %s (apply migration %s): the review queue's "
                        "pages read the whole state", self.table.name, index.name, migration_file(self.dialect, 4))
            return
        try:
            index.create(conn)
        except (IntegrityError, ProgrammingError, OperationalError):
            # Another process added it between our look and our CREATE.
            if not any(ix.get("name") == index.name for ix in sa.inspect(conn).get_indexes(self.table.name)):
                raise

    def _ensure_record_fields(self, conn: Connection) -> None:
        """Add migration 005's columns to an older table; refuse a hand-managed schema without them."""
        have = {c["name"] for c in sa.inspect(conn).get_columns(self.table.name)}
        missing = [c.name for c in record_fields() if c.name not in have]
        if not missing:
            return
        if not self._create_table:
            raise ConfigurationError(
                f"SQL ledger table {self.table.name} has no column {', '.join(missing)}: apply migration "
                f"{migration_file(self.dialect, 5)} (ledger/migrations/), or let the ledger create its tables")
        for name in missing:
            try:
                conn.execute(sa.text(add_column_sql(self.table, self.table.c[name], conn.dialect)))
            except (IntegrityError, ProgrammingError, OperationalError):
                # Another process added it between our look and our ALTER.
                if name not in {c["name"] for c in sa.inspect(conn).get_columns(self.table.name)}:
                    raise

    def _run(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` on the connection kept between calls when free (a pool checkout cost more CPU than the
        statement), else a pooled one; kept unless it saw an error. Any database, driver or pool error comes out as
        :class:`LedgerUnavailableError`: in autocommit a refused statement changed nothing (fail closed, retry)."""
        with self._spare_lock:
            conn, self._spare = self._spare, None
        if conn is None:
            conn = self._conn()
        try:
            out = fn(conn)
        except (SQLAlchemyError, OSError) as exc:
            disconnected = isinstance(exc, OSError) or (
                isinstance(exc, OperationalError) and (exc.connection_invalidated or _is_disconnect(exc)))
            self._discard(conn, invalidate=disconnected)
            raise _unavailable(exc, "unreachable" if disconnected else "refused the statement") from exc
        except IdemmailError:
            self._keep(conn)  # our own verdicts (stale token, unknown key), between statements: it is fine
            raise
        except BaseException:  # a soft time limit may strike mid-statement: the connection is unusable
            self._discard(conn, invalidate=True)
            raise
        self._keep(conn)
        return out

    def _keep(self, conn: Connection) -> None:
        with self._spare_lock:
            if self._spare is None:
                self._spare = conn
                return
        conn.close()  # back to the pool

    @staticmethod
    def _discard(conn: Connection, *, invalidate: bool) -> None:
        try:
            if invalidate:
                conn.invalidate()
            conn.close()
        except SQLAlchemyError:
            pass

    def ping(self) -> None:
        self._run(lambda conn: conn.execute(sa.text("SELECT 1")).scalar())

    def prepare(self) -> None:
        """Create the tables (a SQLite file in WAL mode) now, then close the connection before the pool forks."""
        try:
            self.ping()
        finally:
            self.close()

    def close(self) -> None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            self._discard(spare, invalidate=False)
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def drop_table(self) -> None:
        """Drop the ledger table and its companions (tests and teardown)."""

        def do(conn: Connection) -> None:
            self.roster_table.drop(conn, checkfirst=True)
            self.hops.drop(conn, checkfirst=True)
            self.table.drop(conn, checkfirst=True)

        self._run(do)
        self._ready = False


_live: weakref.WeakSet[SQLConnections] = weakref.WeakSet()


@after_fork
def _reset_after_fork() -> None:
    for ledger in list(_live):
        ledger._after_fork()


def _unavailable(exc: BaseException, what: str) -> LedgerUnavailableError:
    """The fail-closed error for a store error, naming the driver's message, never the statement."""
    detail = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    return LedgerUnavailableError(f"SQL ledger {what}: {type(detail).__name__}: {detail}")


def _is_disconnect(exc: OperationalError) -> bool:
    text = str(exc.orig or exc).lower()
    if "statement timeout" in text or "lock wait timeout" in text:
        return False  # the server gave up on the statement, the connection is fine
    return any(w in text for w in ("connect", "server has gone away", "lost connection", "timeout"))
