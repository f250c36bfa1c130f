"""SQL ledger through SQLAlchemy 2: PostgreSQL, MariaDB/MySQL and SQLite.

One row per intent, keyed by the intent key. The hot path runs in autocommit
with no multi-statement transactions, on a connection kept open between calls:

* claim: ``INSERT ... ON CONFLICT DO NOTHING`` (PostgreSQL, SQLite) or a no-op
  ``ON DUPLICATE KEY UPDATE`` (MariaDB; not ``INSERT IGNORE``, which would hide
  data errors). A new key is claimed in that one statement. Otherwise the row
  is read, and a released claim, an expired lease or a record past retention
  is taken over with one conditional ``UPDATE`` that names the token it saw,
  so two claimers can never both win.
* complete / fail / park / release: one conditional ``UPDATE`` on key, state
  and token.
* mark_hop: one upsert into a small companion table (``<table>_hops``) of
  digests of (key, hop) with an expiry, which replaces an expired mark only.

Lease times use the worker's clock: keep worker clocks in sync (NTP) to well
within the lease. The tables are created on first use; ``migrations/`` holds the
same DDL per dialect, one numbered file per step, for teams that apply schema
changes themselves.

SQLite is the embedded default: fine for one machine and the demo, with WAL
and a busy timeout so several worker processes can share the file (see
:func:`_ensure_wal` for why the switch to WAL is retried).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from .._common import after_fork
from ..errors import (
    ConfigurationError,
    IdemmailError,
    LedgerUnavailableError,
    RecordNotFoundError,
    StaleTokenError,
)
from .base import (
    AHEAD_JSON_PREFIX,
    DEFAULT_RETENTION_SECONDS,
    MAX_MEMBER_LENGTH,
    MAX_SECRET_IDS_LENGTH,
    UNKNOWN_STAGE,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Ledger,
    Record,
    RosterEntry,
    State,
    _check_unique,
    ahead_error,
    ahead_mark,
    check_roster_entry,
    dumps_json,
    loads_json,
    owner_writes_ahead,
)
from .listing import Counts, Position, RecordQuery, Selection

log = logging.getLogger("idemmail_celery")

DEFAULT_TABLE = "idemmail_ledger"
_LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_FINAL_EXPIRING = (State.SENT.value, State.FAILED.value)
_HOP_DIGEST_BYTES = 16
#: A new claim's stored owner is ``request.owner + "/" + nonce`` (see :func:`_fresh_row`).
_OWNER_NONCE_HEX = 6


def _hop_digest(key: str, hop: str) -> str:
    """The name a reschedule's mark is stored under: a digest of key and hop, never either."""
    return hashlib.blake2b(f"{key}\0{hop}".encode(), digest_size=_HOP_DIGEST_BYTES).hexdigest()


def ledger_table(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The ledger table definition (also used to generate ``migrations/``)."""
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("intent_key", sa.String(128), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("reclaims", sa.Integer, nullable=False),
        sa.Column("payload", _LONG_TEXT, nullable=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("result", _LONG_TEXT, nullable=True),
        sa.Column("error", _LONG_TEXT, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=True),
        sa.Index(f"ix_{name}_state", "state"),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
    )


def hops_table(ledger_name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The reschedule marks kept by :meth:`SQLLedger.mark_hop`: ``<ledger_name>_hops``.

    One row per (intent key, hop): a digest of the two (never the key or the task id
    itself), a nonce telling the caller whether its own write landed, and an expiry.
    """
    name = f"{ledger_name}_hops"
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("digest", sa.String(_HOP_DIGEST_BYTES * 2), primary_key=True),
        sa.Column("marker", sa.String(16), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
    )


def roster_table(ledger_name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The key-secret roster kept by :meth:`SQLLedger.announce`: ``<ledger_name>_roster``, one row per
    live worker (its ``host:pid``, the ids of the key secrets it holds, when the row lapses)."""
    name = f"{ledger_name}_roster"
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("member", sa.String(MAX_MEMBER_LENGTH), primary_key=True),
        sa.Column("secret_ids", sa.String(MAX_SECRET_IDS_LENGTH), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )


def listing_index(table: sa.Table) -> sa.Index:
    """The index the review queue's pages walk (:meth:`SQLLedger.list_records`): the records of one state in
    the order they entered it, ties by key (a keyset page is one range of it). Added to ``table``."""
    return sa.Index(f"ix_{table.name}_listing", table.c.state, table.c.updated_at, table.c.intent_key)


def _listing_step(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Index:
    return listing_index(ledger_table(name, metadata))


#: The schema, one step per migration file: ``migrations/00<step>_<name>.<dialect>.sql``.
MIGRATIONS: tuple[tuple[str, str, Any], ...] = (
    ("create_ledger", "ledger table", ledger_table),
    ("create_hops", "reschedule marks table (step 2)", hops_table),
    ("create_roster", "key-secret roster table (step 3)", roster_table),
    ("create_listing_index", "review queue's listing index (step 4)", _listing_step),
)


def schema_sql(dialect: str, table: str = DEFAULT_TABLE, step: int = 1) -> str:
    """The ``CREATE TABLE``/``CREATE INDEX`` script of migration ``step`` for ``dialect``.

    ``dialect`` is postgresql, mysql or sqlite. Step 1 creates the ledger table, step 2
    its reschedule marks (``<table>_hops``, used by :meth:`SQLLedger.mark_hop`), step 3 its
    key-secret roster (``<table>_roster``, :meth:`SQLLedger.announce`), step 4 the index the
    review queue's pages walk (:func:`listing_index`); a ledger created by an
    earlier version needs only the steps after those it has. ``migrations/`` holds
    the output for the default table name; a test keeps the two in step.
    """
    from sqlalchemy.schema import CreateIndex, CreateTable

    modules: dict[str, Any] = {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}
    d = modules[dialect].dialect()
    _, title, make = MIGRATIONS[step - 1]
    t = make(table)
    if isinstance(t, sa.Index):  # a step that adds an index to a table an earlier step made
        parts = [str(CreateIndex(t).compile(dialect=d)).strip()]
    else:
        parts = [str(CreateTable(t).compile(dialect=d)).strip()]
        parts += [str(CreateIndex(ix).compile(dialect=d)).strip()
                  for ix in sorted(t.indexes, key=lambda i: str(i.name))]
    header = f"-- idemmail-celery {title}, {dialect}. Generated by idemmail_celery.ledger.sql.schema_sql.\n"
    return header + ";\n\n".join(parts) + ";\n"


def migration_file(dialect: str, step: int) -> str:
    """The file name of migration ``step`` for ``dialect`` in ``migrations/``."""
    return f"{step:03d}_{MIGRATIONS[step - 1][0]}.{dialect}.sql"


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
    """Put the file in WAL mode, once: a file already in WAL is left alone.

    Switching a new file to WAL needs its exclusive lock, and SQLite refuses at once,
    without waiting out the busy timeout, when another connection holds a write lock on
    it (the busy handler is skipped where waiting could deadlock). Several pool children
    opening a new file together (a prefork worker's first claims) met exactly that:
    "database is locked" at connect, reported as an unreachable ledger. So the switch is
    retried within the same busy window; only a file still locked after it is an error.
    """
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


class SQLLedger(Ledger):
    """Ledger in one SQL table (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///path``).

    Options: ``table`` (default ``"idemmail_ledger"``), ``retention_seconds``,
    ``keep_payload`` (keep the first payload after ``sent``, for audit),
    ``create_table`` (default True: create it on first use), and any
    ``sqlalchemy.create_engine`` keyword.
    """

    marks_takeovers = True  # a reclaim from a holder without the write-ahead promise marks it 'unknown'

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        create_table: bool = True,
        keep_payload: bool = False,
        **engine_options: Any,
    ) -> None:
        super().__init__(retention_seconds=retention_seconds, keep_payload=keep_payload)
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        if self.dialect not in ("postgresql", "mysql", "mariadb", "sqlite"):
            raise ConfigurationError(f"unsupported SQL dialect for the ledger: {self.dialect!r}")
        self.table = ledger_table(table)
        self.hops = hops_table(table, self.table.metadata)
        self.roster_table = roster_table(table, self.table.metadata)
        #: The review queue's index (migration 004), created with the table, or added to one made before it.
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
        options: dict[str, Any] = {
            "isolation_level": "AUTOCOMMIT",
            "pool_reset_on_return": None,  # autocommit: there is never anything to roll back
            **self._engine_options,
        }
        if self.dialect == "sqlite":
            database = self.url.database or ""
            if database in ("", ":memory:"):
                options.setdefault("poolclass", StaticPool)
                options.setdefault("connect_args", {"check_same_thread": False})
            engine = sa.create_engine(self.url, **options)
            event.listen(engine, "connect", _sqlite_pragmas)
            return engine
        options.setdefault("pool_pre_ping", False)
        if self.dialect == "postgresql":
            options.setdefault("connect_args", {"connect_timeout": 5})
        else:
            options.setdefault("connect_args", {"connect_timeout": 5})
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
                    # A ledger created before mark_hop, its schema managed by hand: until
                    # migration 002 is applied, no marks (callers fall back to countdowns).
                    log.warning("idemmail: SQL ledger table %s is missing (apply migration %s): "
                                "reschedule marks are off", table.name, migration_file(self.dialect, 2))
                    self._hops_ready = False
                elif table is self.roster_table and not sa.inspect(conn).has_table(table.name):
                    log.warning("idemmail: SQL ledger table %s is missing (apply migration %s): a key-secret "
                                "rotation takes two deploys", table.name, migration_file(self.dialect, 3))
                    self._roster_ready = False
            self._ensure_listing_index(conn)
            self._ready = True

    def _ensure_listing_index(self, conn: Connection) -> None:
        """Add the listing index to a table made before it (migration 004), or say that pages scan without it."""
        index = self.listing_index
        if not sa.inspect(conn).has_table(self.table.name):
            return  # a hand-managed schema not applied yet: the statements say so
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

    def _run(self, fn: Any) -> Any:
        """Run ``fn(conn)``, on the spare connection kept open between calls when it is free.

        Checking a connection out of SQLAlchemy's pool and closing it again cost
        more client CPU than the statement (a third of a claim + complete on
        PostgreSQL); autocommit leaves nothing open between statements, so one
        ``Connection`` is kept for the next call. Only one: a thread that finds it
        taken uses the pool as usual, so connections parked here can never starve
        a thread waiting on the pool. A connection that saw a database error is
        closed, not kept; so is one interrupted by anything but the ledger's own verdicts.

        Every database, driver or pool error comes out as :class:`LedgerUnavailableError`:
        autocommit means a refused statement changed nothing, so the caller fails closed and
        retries, like an outage; a raw error would fail the task and ack the message.
        """
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
        except BaseException:
            # Anything else (a soft time limit, a gevent timeout) may have struck mid-statement:
            # the connection's protocol state is unknown, so it is thrown away, not reused.
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

    def _insert(self) -> Any:
        if self.dialect == "postgresql":
            return postgresql.insert(self.table)
        if self.dialect == "sqlite":
            return sqlite.insert(self.table)
        return mysql.insert(self.table)

    def _record(self, row: Any) -> Record:
        return self._from_row(row._mapping)

    @functools.cached_property
    def _stmts(self) -> dict[str, Any]:
        """The hot-path statements, built once with bound parameters.

        Building a Core statement per call (values coerced into literals, a cache key
        computed each time) cost several times the database round trip itself; a
        reused statement keeps its compiled form and cache key.
        """
        t = self.table
        p = {c.name: sa.bindparam(f"p_{c.name}", type_=c.type) for c in t.c}
        ins = self._insert().values(p)
        out: dict[str, Any] = {"select": sa.select(t).where(t.c.intent_key == sa.bindparam("k"))}
        if self.dialect == "postgresql":
            # One statement for both outcomes: the insert, or else the row already there.
            # (A row committed by a concurrent claimer after this statement's snapshot
            # shows as neither; the caller then reads it.)
            new = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(*t.c).cte("new")
            out["insert"] = sa.union_all(
                sa.select(new, sa.literal(True).label("inserted")),
                sa.select(t, sa.literal(False).label("inserted")).where(
                    t.c.intent_key == p["intent_key"], ~sa.exists(sa.select(new.c.intent_key))
                ),
            )
        elif self.dialect == "sqlite":
            out["insert"] = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(t.c.token)
        else:
            out["insert"] = ins.on_duplicate_key_update(intent_key=ins.inserted.intent_key).returning(*t.c)
        # A transition: NULL result/error parameters keep what the row has, but for a write-ahead mark.
        kept_error = sa.case((t.c.error.startswith(AHEAD_JSON_PREFIX, autoescape=True), sa.null()), else_=t.c.error)
        finish_values = {
            "state": sa.bindparam("st"), "lease_expires_at": None, "updated_at": sa.bindparam("now"),
            "expires_at": sa.bindparam("exp", type_=sa.Double),
            "result": sa.func.coalesce(sa.bindparam("res", type_=_LONG_TEXT), t.c.result),
            "error": sa.func.coalesce(sa.bindparam("err", type_=_LONG_TEXT), kept_error),
        }
        # Moving to sent erases the first payload in the same statement, unless kept for audit.
        sent_values = finish_values if self.keep_payload else {**finish_values, "payload": None}
        mine = sa.update(t).where(
            t.c.intent_key == sa.bindparam("k"), t.c.state == State.CLAIMED.value, t.c.token == sa.bindparam("tok")
        )
        out["finish_mine"] = mine.values(finish_values)
        out["finish_sent"] = mine.values(sent_values)
        out["finish_late"] = sa.update(t).where(
            t.c.intent_key == sa.bindparam("k"), t.c.token > sa.bindparam("tok"),
            t.c.state.in_([State.REVIEW.value, State.RELEASED.value, State.CLAIMED.value]),
        ).values(sent_values)
        h = self.hops
        hop: dict[str, Any] = {"digest": sa.bindparam("d"), "marker": sa.bindparam("m"),
                               "expires_at": sa.bindparam("exp")}
        expired = h.c.expires_at <= sa.bindparam("now")
        if self.dialect in ("postgresql", "sqlite"):
            ins_hop = (postgresql.insert(h) if self.dialect == "postgresql" else sqlite.insert(h)).values(hop)
            out["mark_hop"] = ins_hop.on_conflict_do_update(
                index_elements=["digest"], where=expired,
                set_={"marker": ins_hop.excluded.marker, "expires_at": ins_hop.excluded.expires_at},
            ).returning(h.c.marker)
        else:
            # MariaDB has no conditional upsert: both columns keep their value unless the mark
            # expired. Assignments run left to right, so ``marker`` is decided first, on the old
            # expiry. RETURNING gives the row as it now is: ours if it carries our nonce.
            my_ins = mysql.insert(h).values(hop)
            out["mark_hop"] = my_ins.on_duplicate_key_update([
                ("marker", sa.func.if_(expired, my_ins.inserted.marker, h.c.marker)),
                ("expires_at", sa.func.if_(expired, my_ins.inserted.expires_at, h.c.expires_at)),
            ]).returning(h.c.marker)
        return out

    @functools.cached_property
    def _driver_sql(self) -> dict[str, tuple[str, tuple[str, ...] | None, dict[str, Any]]]:
        """The first-send statements as the driver's SQL text, compiled once by SQLAlchemy.

        For each: the text, the order of its parameters for a positional paramstyle (SQLite's
        ``?``; None for named ones), and the values of the parameters SQLAlchemy fixed itself.
        """
        out = {}
        for name in ("insert", "finish_mine", "finish_sent"):
            compiled = self._stmts[name].compile(dialect=self.engine.dialect)
            fixed = {bind_name: bp.value for bp, bind_name in compiled.bind_names.items() if not bp.required}
            order = compiled.positiontup
            out[name] = (compiled.string, tuple(order) if order else None, fixed)
        return out

    def _execute(self, conn: Connection, name: str, params: dict[str, Any], *, returns_rows: bool) -> tuple[Any, int]:
        """Run hot statement ``name`` on the connection's DB-API cursor: (its first row or None, row count).

        A claim and a completion are each one such statement per first send; through
        SQLAlchemy's execution layer (parameter processing, result metadata) they cost
        about twice the driver's client CPU. Same SQL, same connection; a driver error
        comes out as SQLAlchemy's, flagged as a disconnect as ``execute()`` would. An
        engine with statement listeners (tracing, statement counters) gets ``execute()``,
        so that they see every statement.
        """
        if conn._has_events or self.engine._has_events:
            result = conn.execute(self._stmts[name], params)
            return (result.first() if returns_rows else None), result.rowcount
        sql, order, fixed = self._driver_sql[name]
        params = {**fixed, **params}
        dbapi_conn = conn.connection.dbapi_connection
        cursor = dbapi_conn.cursor()  # type: ignore[union-attr]
        dialect = self.engine.dialect
        try:
            cursor.execute(sql, params if order is None else tuple(params[k] for k in order))
            return (cursor.fetchone() if returns_rows else None), cursor.rowcount
        except dialect.loaded_dbapi.Error as exc:
            raise DBAPIError.instance(
                sql, params, exc, dialect.loaded_dbapi.Error, dialect=dialect,
                connection_invalidated=dialect.is_disconnect(exc, dbapi_conn, cursor),
            ) from exc
        finally:
            cursor.close()

    def _select(self, conn: Connection, key: str) -> Record | None:
        row = conn.execute(self._stmts["select"], {"k": key}).first()
        return None if row is None else self._record(row)

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        result: Claim = self._run(lambda conn: self._claim_on(conn, request))
        return result

    def _claim_on(self, conn: Connection, request: ClaimRequest) -> Claim:
        for _ in range(20):  # each loop means another claimer moved the row under us
            fresh = _fresh_row(request)
            inserted, seen = self._insert_new(conn, fresh)
            if inserted:
                return Claim(ClaimStatus.ACQUIRED, self._from_row(fresh))
            if seen is None:
                seen = self._select(conn, request.key)
            if seen is None:
                continue  # purged between the insert and the read
            claim = self._settle(conn, request, seen)
            if claim is not None:
                return claim
        raise LedgerUnavailableError(f"claim of {request.key} kept losing races; giving up this attempt")

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """One multi-row insert for the batch, one read for the keys already there.

        Keys that need a takeover (released, expired lease, resumed) cost one conditional
        ``UPDATE`` each; a lost race falls back to a single claim for that key, on the
        same connection.
        """
        _check_unique(requests)
        if not requests:
            return []
        t = self.table

        def do(conn: Connection) -> list[Claim]:
            fresh = {r.key: _fresh_row(r) for r in requests}
            ins = self._insert().values(list(fresh.values()))
            existing: dict[str, Record] = {}
            if self.dialect in ("postgresql", "sqlite"):
                stmt = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(t.c.intent_key)
                inserted = {row.intent_key for row in conn.execute(stmt)}
                others = [k for k in fresh if k not in inserted]
                if others:
                    rows = conn.execute(sa.select(t).where(t.c.intent_key.in_(others)))
                    existing = {row.intent_key: self._record(row) for row in rows}
            else:  # MariaDB: RETURNING gives every row, ours (matching owner nonce) or the existing one
                stmt = ins.on_duplicate_key_update(intent_key=ins.inserted.intent_key).returning(*t.c)
                inserted = set()
                for row in conn.execute(stmt):
                    record = self._record(row)
                    if record.owner == fresh[record.key]["owner"] and record.token == 1:
                        inserted.add(record.key)
                    else:
                        existing[record.key] = record
            claims: list[Claim] = []
            for r in requests:
                claim = None
                if r.key in inserted:
                    claim = Claim(ClaimStatus.ACQUIRED, self._from_row(fresh[r.key]))
                elif r.key in existing:
                    claim = self._settle(conn, r, existing[r.key])
                claims.append(claim if claim is not None else self._claim_on(conn, r))  # None: lost a race
            return claims

        result: list[Claim] = self._run(do)
        return result

    def _settle(self, conn: Connection, request: ClaimRequest, seen: Record) -> Claim | None:
        """Decide about a key that was already there; take it over if allowed. None: lost a race."""
        now = time.time()
        expired_final = seen.state.expires and (seen.expires_at or 0) <= now
        resume = _resumes(seen, request)
        if seen.state is State.CLAIMED and (seen.lease_expires_at or 0) > now and not resume:
            return Claim(ClaimStatus.BUSY, seen)
        if seen.state.is_final and not expired_final:
            return Claim(ClaimStatus.DONE, seen)
        if expired_final:
            status, values = ClaimStatus.ACQUIRED, {**_fresh_row(request), "token": seen.token + 1}
        else:
            status = _takeover_status(seen, resume=resume)
            values = _takeover_values(seen, request, status, now)
        t = self.table
        moved = conn.execute(
            sa.update(t)
            .where(t.c.intent_key == request.key, t.c.token == seen.token, t.c.state == seen.state.value)
            .values(**values)
        ).rowcount
        if moved != 1:
            return None
        if status is ClaimStatus.ACQUIRED:
            return Claim(status, self._from_row(values))
        previous = seen.owner if seen.state is State.CLAIMED else None
        return Claim(status, self._from_row({**_row_of(seen), **values}), previous_owner=previous)

    def _insert_new(self, conn: Connection, values: dict[str, Any]) -> tuple[bool, Record | None]:
        """Insert a new claim. Returns (inserted, the existing record when the store told us)."""
        params = {f"p_{name}": v for name, v in values.items()}
        row, _ = self._execute(conn, "insert", params, returns_rows=True)
        if self.dialect == "postgresql":  # the table's columns, then "inserted"
            if row is None:
                return False, None
            inserted = bool(row[-1])
            return inserted, None if inserted else self._from_row(dict(zip(self._columns, row[:-1], strict=True)))
        if self.dialect == "sqlite":
            return row is not None, None
        # MariaDB: a no-op update on the duplicate key; RETURNING then gives the
        # row that is there, ours or the existing one, in the same round trip.
        # (Rows affected cannot tell: SQLAlchemy sets CLIENT_FOUND_ROWS.) The
        # owner string carries a per-call nonce, so "ours" is unambiguous.
        if row is None:
            return False, None
        record = self._from_row(dict(zip(self._columns, row, strict=True)))
        mine = record.owner == values["owner"] and record.token == 1 and record.state is State.CLAIMED
        return mine, None if mine else record

    def _from_row(self, values: dict[str, Any]) -> Record:
        return Record(
            key=values["intent_key"], task_name=values["task_name"], state=State(values["state"]),
            token=int(values["token"]), owner=values["owner"], lease_expires_at=values["lease_expires_at"],
            attempts=int(values["attempts"]), reclaims=int(values["reclaims"]), payload=values["payload"],
            fingerprint=values["fingerprint"], result=loads_json(values["result"]),
            error=loads_json(values["error"]), created_at=values["created_at"],
            updated_at=values["updated_at"], expires_at=values["expires_at"],
        )

    def _finish(
        self,
        key: str,
        token: int,
        state: State,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> float | None:
        def do(conn: Connection) -> float | None:
            now = time.time()
            params = {
                "k": key, "tok": token, "st": state.value, "now": now,
                "exp": now + self.retention_seconds if state.expires else None,
                "res": dumps_json(result), "err": dumps_json(error),
            }
            if self._execute(conn, "finish_sent" if state is State.SENT else "finish_mine", params,
                             returns_rows=False)[1] == 1:
                return now
            # A late holder reporting the truth (see ledger.base).
            if state is State.SENT and conn.execute(self._stmts["finish_late"], params).rowcount == 1:
                return now
            seen = self._select(conn, key)
            if seen is None:
                raise RecordNotFoundError(f"no ledger record for key {key}")
            if seen.state is state and seen.token == token:
                return seen.updated_at  # this very move, run twice (its commit landed, its reply did not)
            raise StaleTokenError(
                f"token {token} no longer holds {key}: it is {seen.state.value} with token {seen.token}"
            )

        written: float | None = self._run(do)
        return written

    def _held(self, key: str, token: int) -> sa.ColumnElement[bool]:
        """The row of a claim still held with ``token``: the fence of every move a holder makes."""
        t = self.table
        return sa.and_(t.c.intent_key == key, t.c.state == State.CLAIMED.value, t.c.token == token)

    def _one_row(self, stmt: Any) -> bool:
        """Run a fenced single-row statement: did it match its row?"""
        return bool(self._run(lambda conn: conn.execute(stmt).rowcount == 1))

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return self._one_row(sa.update(self.table).where(self._held(key, token))
                             .values(lease_expires_at=time.time() + lease_seconds))

    def withdraw(self, key: str, token: int) -> bool:
        """One ``DELETE`` fenced by state and token (see :meth:`Ledger.withdraw`)."""
        return self._one_row(sa.delete(self.table).where(self._held(key, token)))

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        """One ``UPDATE`` fenced by state and token (see :meth:`Ledger.write_ahead`)."""
        now = time.time()
        return self._one_row(sa.update(self.table).where(self._held(key, token)).values(
            error=dumps_json(ahead_error(stage, now, token, owner)), lease_expires_at=now + lease_seconds))

    def get(self, key: str) -> Record | None:
        record: Record | None = self._run(lambda conn: self._select(conn, key))
        if record is not None and record.state.expires and (record.expires_at or 0) <= time.time():
            return None
        return record

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        stmt = sa.select(self.table).order_by(self.table.c.created_at)
        if state is not None:
            stmt = stmt.where(self.table.c.state == state.value)
        rows = self._run(lambda conn: conn.execute(stmt).fetchall())
        now = time.time()
        for row in rows:
            record = self._record(row)
            if not (record.state.expires and (record.expires_at or 0) <= now):
                yield record

    def stats(self) -> dict[str, int]:
        """Records per state in one ``GROUP BY``; expired ``sent``/``failed`` rows excluded."""
        t = self.table
        stmt = (
            sa.select(t.c.state, sa.func.count())
            .where(sa.or_(t.c.expires_at.is_(None), t.c.expires_at > time.time()))
            .group_by(t.c.state)
        )
        counts = {s.value: 0 for s in State}
        for state, n in self._run(lambda conn: conn.execute(stmt).all()):
            counts[state] = int(n)
        return counts

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        t = self.table
        values: dict[str, Any] = {
            "state": new.state.value, "token": new.token, "owner": new.owner,
            "lease_expires_at": new.lease_expires_at, "result": dumps_json(new.result),
            "error": dumps_json(new.error), "updated_at": new.updated_at, "expires_at": new.expires_at,
        }
        if new.state is State.SENT and not self.keep_payload:
            values["payload"] = None
        return self._one_row(sa.update(t).where(t.c.intent_key == key, t.c.token == expected_token).values(values))

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None) -> bool:
        t = self.table
        marked = sa.and_(t.c.state == State.CLAIMED.value, t.c.error.startswith(AHEAD_JSON_PREFIX, autoescape=True))
        as_read = sa.and_(t.c.intent_key == key, t.c.token == expected_token, t.c.state == expected_state.value)
        stmt = (sa.update(t).where(as_read)
                .values(payload=None, result=dumps_json(result),
                        error=sa.case((marked, t.c.error), else_=sa.literal(dumps_json(error), _LONG_TEXT))))
        # Rows matched, not changed (MariaDB gets CLIENT_FOUND_ROWS): erasing twice is still True.
        return self._one_row(stmt)

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        """One upsert: a new mark, or an expired one replaced, is True; a live one is False.

        The row stores a digest of ``key`` and ``hop``, never either. None when the marks
        table is missing from a hand-managed schema (migration 002 not applied yet).
        """
        now = time.time()
        marker = secrets.token_hex(8)
        params = {"d": _hop_digest(key, hop), "m": marker, "exp": now + ttl_seconds, "now": now}

        def do(conn: Connection) -> bool | None:
            if not self._hops_ready:  # known once the first call has looked at the schema
                return None
            row = conn.execute(self._stmts["mark_hop"], params).first()
            return row is not None and row[0] == marker

        marked: bool | None = self._run(do)
        return marked

    def hop_marked(self, key: str, hop: str) -> bool | None:
        """One ``SELECT`` of a live mark; None without the marks table (as :meth:`mark_hop`)."""
        h = self.hops
        stmt = sa.select(h.c.digest).where(h.c.digest == _hop_digest(key, hop), h.c.expires_at > sa.bindparam("now"))

        def do(conn: Connection) -> bool | None:
            if not self._hops_ready:
                return None
            return conn.execute(stmt, {"now": time.time()}).first() is not None

        marked: bool | None = self._run(do)
        return marked

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """One upsert (or a delete for ``ttl_seconds <= 0``) of the member's row, on this process's clock:
        keep the hosts' clocks in step (NTP) well within the announcements' life. Then the rows that lapsed
        are pruned (:meth:`_prune_roster`): reads never write."""
        ids = check_roster_entry(member, secret_ids)
        r = self.roster_table

        self._need_roster()

        def do(conn: Connection) -> None:
            if ttl_seconds <= 0:
                conn.execute(sa.delete(r).where(r.c.member == member))
                return
            row = {"member": member, "secret_ids": ids, "expires_at": time.time() + ttl_seconds}
            if self.dialect in ("postgresql", "sqlite"):
                ins = (postgresql.insert(r) if self.dialect == "postgresql" else sqlite.insert(r)).values(row)
                stmt: Any = ins.on_conflict_do_update(index_elements=["member"], set_={
                    "secret_ids": ins.excluded.secret_ids, "expires_at": ins.excluded.expires_at})
            else:
                my_ins = mysql.insert(r).values(row)
                stmt = my_ins.on_duplicate_key_update(secret_ids=my_ins.inserted.secret_ids,
                                                      expires_at=my_ins.inserted.expires_at)
            conn.execute(stmt)

        self._run(do)
        self._prune_roster()

    def _prune_roster(self) -> None:
        """Delete the roster rows that lapsed, by their primary keys (a statement of its own, after the
        announcement landed: a prune that fails costs it nothing). Rows are looked for first, without a
        lock: most announcements find none, and the delete then locks only rows that lapsed (a scan under
        InnoDB would lock every row and wait on other workers' upserts)."""
        r = self.roster_table

        def do(conn: Connection) -> None:
            now = time.time()
            lapsed = [m for (m,) in conn.execute(sa.select(r.c.member).where(r.c.expires_at <= now)).all()]
            if lapsed:  # re-announced since: its new expiry keeps it
                conn.execute(sa.delete(r).where(r.c.member.in_(lapsed), r.c.expires_at <= now))

        try:
            self._run(do)
        except LedgerUnavailableError as exc:  # the next announcement prunes them; reads leave them out meanwhile
            log.debug("idemmail: lapsed roster rows not pruned yet (%s)", type(exc).__name__)

    def roster(self) -> list[RosterEntry]:
        """The live rows, read only (lapsed rows are left out, and pruned by :meth:`announce`)."""
        r = self.roster_table

        self._need_roster()

        def do(conn: Connection) -> list[RosterEntry]:
            now = time.time()
            rows = conn.execute(sa.select(r.c.member, r.c.secret_ids, r.c.expires_at)
                                .where(r.c.expires_at > now)).all()
            return [RosterEntry(m, tuple(str(ids).split(",")), float(exp)) for m, ids, exp in rows]

        entries: list[RosterEntry] = self._run(do)
        return entries

    def _need_roster(self) -> None:
        if not self._ready:
            self.ping()  # looks at the schema: is the roster table there?
        if not self._roster_ready:
            raise NotImplementedError(f"{self.roster_table.name} is missing: apply migration "
                                      f"{migration_file(self.dialect, 3)}")

    # -- listing: the review queue (see ``listing``) --

    def _reason(self) -> sa.ColumnElement[Any]:
        """The ``reason`` of a row's error, read by the database (NULL without one)."""
        error = self.table.c.error
        if self.dialect == "postgresql":
            found: sa.ColumnElement[Any] = sa.cast(error, postgresql.JSON)["reason"].astext  # json takes any JSON text
            return found
        if self.dialect == "sqlite":
            return sa.func.json_extract(error, "$.reason")
        return self._exact(sa.func.json_value(error, "$.reason"))

    def _exact(self, text: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """``text`` compared and grouped byte for byte (MariaDB's default collation ignores case)."""
        if self.dialect in ("mysql", "mariadb"):
            return text.collate("utf8mb4_bin")
        return text

    def _where(self, query: RecordQuery, now: float, *, task: bool = True, reason: bool = True,
               search: bool = True) -> list[sa.ColumnElement[bool]]:
        """The conditions of ``query`` (those named False left out). Words are looked for in the raw text
        (key, task, result, payload): more rows than match, which the caller checks one by one."""
        t = self.table
        out: list[sa.ColumnElement[bool]] = [sa.or_(t.c.expires_at.is_(None), t.c.expires_at > now)]
        if query.state is not None:
            out.append(t.c.state == query.state.value)
        if query.since is not None:
            out.append(t.c.updated_at >= query.since)
        if query.until is not None:
            out.append(t.c.updated_at < query.until)
        if task and query.task:
            out.append(self._exact(t.c.task_name) == query.task)
        if reason and query.reason:
            out.append(self._reason() == query.reason)
        for word in query.plain_words if search else ():
            out.append(sa.or_(sa.func.lower(t.c.intent_key).startswith(word, autoescape=True),
                              *(sa.func.lower(c).contains(word, autoescape=True)
                                for c in (t.c.task_name, t.c.result, t.c.payload))))
        return out

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """One keyset page of the listing index: ``(updated_at, key)`` after ``position``, ``want`` rows."""
        t = self.table
        now = time.time()
        order = (t.c.updated_at.desc(), t.c.intent_key.desc()) if query.newest_first else (t.c.updated_at,
                                                                                            t.c.intent_key)
        stmt = sa.select(t).where(*self._where(query, now)).order_by(*order).limit(want)
        if position is not None:
            row, bound = sa.tuple_(t.c.updated_at, t.c.intent_key), sa.tuple_(
                sa.literal(position.at, t.c.updated_at.type), sa.literal(position.key, t.c.intent_key.type))
            stmt = stmt.where(row < bound if query.newest_first else row > bound)
        skipped = skip if skip and not query.words else 0  # every other condition is exact
        if skipped:
            stmt = stmt.offset(skipped)
        rows = self._run(lambda conn: conn.execute(stmt).fetchall())
        items = [(Position(float(r.updated_at), str(r.intent_key)), self._record(r)) for r in rows]
        return Selection(items, items[-1][0] if len(items) == want else None, skipped)

    def count(self, query: RecordQuery | None = None) -> Counts:
        """One ``GROUP BY`` reason, task and UTC day over the rows of the state and time range."""
        query = query or RecordQuery()
        t = self.table
        plain = RecordQuery(state=query.state, since=query.since, until=query.until)
        reason, task = sa.func.coalesce(self._reason(), ""), self._exact(t.c.task_name)
        # The UTC day: SQLite has no floor() unless built with its math functions (times are positive: a cast).
        day = (sa.cast(t.c.updated_at / 86400, sa.Integer) if self.dialect == "sqlite"
               else sa.func.floor(t.c.updated_at / 86400))
        stmt = (sa.select(reason, task, day, sa.func.count()).where(*self._where(plain, time.time()))
                .group_by(reason, task, day))
        rows = self._run(lambda conn: conn.execute(stmt).all())
        return Counts({(str(r), str(k), int(d)): int(n) for r, k, d, n in rows})

    def purge_expired(self, now: float | None = None) -> int:
        """Delete ``sent``/``failed`` records past retention (and expired reschedule marks).

        Returns how many records went; the marks are not counted.
        """
        t, h = self.table, self.hops
        cutoff = time.time() if now is None else now
        stmt = sa.delete(t).where(t.c.state.in_(_FINAL_EXPIRING), t.c.expires_at <= cutoff)

        def do(conn: Connection) -> int:
            gone = int(conn.execute(stmt).rowcount)
            if self._hops_ready:
                conn.execute(sa.delete(h).where(h.c.expires_at <= cutoff))
            return gone

        return int(self._run(do))

    def ping(self) -> None:
        self._run(lambda conn: conn.execute(sa.text("SELECT 1")).scalar())

    def prepare(self) -> None:
        """Create the tables (and put a SQLite file in WAL mode) now, then close the connection.

        A worker calls this in its main process before the pool forks: the pool children
        then find the schema ready instead of all creating it at their first claim, and no
        connection is carried across the fork (SQLite forbids using one in a child).
        """
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
        """Drop the ledger table and its marks table (tests and teardown)."""

        def do(conn: Connection) -> None:
            self.roster_table.drop(conn, checkfirst=True)
            self.hops.drop(conn, checkfirst=True)
            self.table.drop(conn, checkfirst=True)

        self._run(do)
        self._ready = False


def _fresh_row(request: ClaimRequest) -> dict[str, Any]:
    """The row a brand-new claim inserts.

    The owner gets a nonce per call, not just per request: MariaDB tells "my insert" from
    "a row already there" by the owner it reads back, and a caller may reuse a request.
    """
    now = time.time()
    return {
        "intent_key": request.key, "task_name": request.task_name, "state": State.CLAIMED.value,
        "token": 1, "owner": f"{request.owner}/{secrets.token_hex(_OWNER_NONCE_HEX // 2)}",
        "lease_expires_at": now + request.lease_seconds,
        "attempts": 1, "reclaims": 0, "payload": request.payload, "fingerprint": request.fingerprint,
        "result": None, "error": None, "created_at": now, "updated_at": now, "expires_at": None,
    }


def _resumes(seen: Record, request: ClaimRequest) -> bool:
    """Does ``request`` resume the claim ``seen``: this chain's earlier claim, or this very request run twice
    (a statement retried after its reply was lost)? The stored owner carries a nonce, so nobody else matches."""
    return seen.state is State.CLAIMED and (
        _owned_by(seen.owner, request.owner)
        or (request.resume_owner is not None and _owned_by(seen.owner, request.resume_owner)))


def _takeover_status(seen: Record, *, resume: bool) -> ClaimStatus:
    """What taking over ``seen`` (not a final record past retention) is called."""
    if resume:
        return ClaimStatus.RESUMED  # this delivery's own chain held it: no takeover to count
    return ClaimStatus.RECLAIMED if seen.state is State.CLAIMED else ClaimStatus.REOPENED


def _takeover_values(seen: Record, request: ClaimRequest, status: ClaimStatus, now: float) -> dict[str, Any]:
    """The columns a takeover of ``seen`` writes: a new token, owner and lease, one more attempt (and reclaim)."""
    values: dict[str, Any] = {
        "state": State.CLAIMED.value, "token": seen.token + 1, "owner": request.owner,
        "lease_expires_at": now + request.lease_seconds, "attempts": seen.attempts + 1,
        "reclaims": seen.reclaims + (1 if status is ClaimStatus.RECLAIMED else 0), "updated_at": now,
    }
    if status is ClaimStatus.RECLAIMED and not owner_writes_ahead(seen.owner) and ahead_mark(seen) is None:
        # Taken over from a holder that made no write-ahead promise and left no mark: it may have run.
        values["error"] = dumps_json(ahead_error(UNKNOWN_STAGE, int(now), seen.token))
    return values


def _owned_by(stored: str, owner: str) -> bool:
    """Was the record claimed under ``owner``? A new claim stores it with a nonce appended."""
    return stored == owner or (
        len(stored) == len(owner) + 1 + _OWNER_NONCE_HEX and stored.startswith(owner) and stored[len(owner)] == "/"
    )


_live: weakref.WeakSet[SQLLedger] = weakref.WeakSet()


@after_fork
def _reset_after_fork() -> None:
    for ledger in list(_live):
        ledger._after_fork()


def _row_of(record: Record) -> dict[str, Any]:
    return {
        "intent_key": record.key, "task_name": record.task_name, "state": record.state.value,
        "token": record.token, "owner": record.owner, "lease_expires_at": record.lease_expires_at,
        "attempts": record.attempts, "reclaims": record.reclaims, "payload": record.payload,
        "fingerprint": record.fingerprint, "result": dumps_json(record.result),
        "error": dumps_json(record.error), "created_at": record.created_at,
        "updated_at": record.updated_at, "expires_at": record.expires_at,
    }


def _unavailable(exc: BaseException, what: str) -> LedgerUnavailableError:
    """The fail-closed error for a store error, naming the driver's message (never the statement)."""
    detail = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    return LedgerUnavailableError(f"SQL ledger {what}: {type(detail).__name__}: {detail}")


def _is_disconnect(exc: OperationalError) -> bool:
    text = str(exc.orig or exc).lower()
    if "statement timeout" in text or "lock wait timeout" in text:
        return False  # the server gave up on the statement, the connection is fine
    return any(w in text for w in ("connect", "server has gone away", "lost connection", "timeout"))
