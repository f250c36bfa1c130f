"""SQL ledger through SQLAlchemy 2: PostgreSQL, MariaDB/MySQL and SQLite.

One row per intent, keyed by the intent key. The hot path runs in autocommit
with no multi-statement transactions:

* claim: ``INSERT ... ON CONFLICT DO NOTHING`` (PostgreSQL, SQLite) or a no-op
  ``ON DUPLICATE KEY UPDATE`` (MariaDB; not ``INSERT IGNORE``, which would hide
  data errors). A new key is claimed in that one statement. Otherwise the row
  is read, and a released claim, an expired lease or a record past retention
  is taken over with one conditional ``UPDATE`` that names the token it saw,
  so two claimers can never both win.
* complete / fail / park / release: one conditional ``UPDATE`` on key, state
  and token.

Lease times use the worker's clock: keep worker clocks in sync (NTP) to well
within the lease. The table is created on first use; ``migrations/`` holds the
same DDL per dialect for teams that apply schema changes themselves.

SQLite is the embedded default: fine for one machine and the demo, with WAL
and a busy timeout so several worker processes can share the file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from ..errors import ConfigurationError, LedgerUnavailableError, RecordNotFoundError, StaleTokenError
from .base import (
    DEFAULT_RETENTION_SECONDS,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Ledger,
    Record,
    State,
    dumps_json,
    loads_json,
)

DEFAULT_TABLE = "idemmail_ledger"
_LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_FINAL_EXPIRING = (State.SENT.value, State.FAILED.value)


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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


class SQLLedger(Ledger):
    """Ledger in one SQL table (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///path``).

    Options: ``table`` (default ``"idemmail_ledger"``), ``retention_seconds``,
    ``create_table`` (default True: create it on first use), and any
    ``sqlalchemy.create_engine`` keyword.
    """

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        create_table: bool = True,
        **engine_options: Any,
    ) -> None:
        super().__init__(retention_seconds=retention_seconds)
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        if self.dialect not in ("postgresql", "mysql", "mariadb", "sqlite"):
            raise ConfigurationError(f"unsupported SQL dialect for the ledger: {self.dialect!r}")
        self.table = ledger_table(table)
        self._create_table = create_table
        self._ready = False
        self._lock = threading.Lock()
        self._engine_options = engine_options
        self._engine: Engine | None = None
        self._pid = 0

    # -- plumbing --

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is not None and self._pid != os.getpid():
                    self._engine.dispose(close=False)  # a forked child must not share sockets
                    self._engine = None
                if self._engine is None:
                    self._engine = self._make_engine()
                    self._pid = os.getpid()
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
        except (OperationalError, DBAPIError) as exc:
            raise LedgerUnavailableError(f"SQL ledger unreachable: {exc.orig or exc}") from exc
        if not self._ready:
            self._ensure_table(conn)
        return conn

    def _ensure_table(self, conn: Connection) -> None:
        with self._lock:
            if self._ready:
                return
            if self._create_table:
                try:
                    self.table.create(conn, checkfirst=True)
                except (IntegrityError, ProgrammingError, OperationalError):
                    # Another process created it between our check and our CREATE.
                    if not sa.inspect(conn).has_table(self.table.name):
                        raise
            self._ready = True

    def _run(self, fn: Any) -> Any:
        try:
            with self._conn() as conn:
                return fn(conn)
        except OperationalError as exc:
            if exc.connection_invalidated or _is_disconnect(exc):
                raise LedgerUnavailableError(f"SQL ledger unreachable: {exc.orig or exc}") from exc
            raise

    def _insert(self) -> Any:
        if self.dialect == "postgresql":
            return postgresql.insert(self.table)
        if self.dialect == "sqlite":
            return sqlite.insert(self.table)
        return mysql.insert(self.table)

    def _record(self, row: Any) -> Record:
        m = row._mapping
        return Record(
            key=m["intent_key"], task_name=m["task_name"], state=State(m["state"]),
            token=int(m["token"]), owner=m["owner"], lease_expires_at=m["lease_expires_at"],
            attempts=int(m["attempts"]), reclaims=int(m["reclaims"]), payload=m["payload"],
            fingerprint=m["fingerprint"], result=loads_json(m["result"]), error=loads_json(m["error"]),
            created_at=m["created_at"], updated_at=m["updated_at"], expires_at=m["expires_at"],
        )

    def _select(self, conn: Connection, key: str) -> Record | None:
        row = conn.execute(sa.select(self.table).where(self.table.c.intent_key == key)).first()
        return None if row is None else self._record(row)

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        t = self.table

        def do(conn: Connection) -> Claim:
            for _ in range(20):  # each loop means another claimer moved the row under us
                now = time.time()
                lease = now + request.lease_seconds
                fresh = {
                    "intent_key": request.key, "task_name": request.task_name,
                    "state": State.CLAIMED.value, "token": 1, "owner": request.owner,
                    "lease_expires_at": lease, "attempts": 1, "reclaims": 0,
                    "payload": request.payload, "fingerprint": request.fingerprint,
                    "result": None, "error": None, "created_at": now, "updated_at": now,
                    "expires_at": None,
                }
                inserted, seen = self._insert_new(conn, fresh)
                if inserted:
                    return Claim(ClaimStatus.ACQUIRED, self._from_row(fresh))
                if seen is None:
                    seen = self._select(conn, request.key)
                if seen is None:
                    continue  # purged between the insert and the read
                expired_final = seen.state.expires and (seen.expires_at or 0) <= now
                if seen.state is State.CLAIMED and (seen.lease_expires_at or 0) > now:
                    return Claim(ClaimStatus.BUSY, seen)
                if seen.state.is_final and not expired_final:
                    return Claim(ClaimStatus.DONE, seen)
                if expired_final:
                    status, values = ClaimStatus.ACQUIRED, {**fresh, "token": seen.token + 1}
                else:
                    reclaim = seen.state is State.CLAIMED
                    status = ClaimStatus.RECLAIMED if reclaim else ClaimStatus.REOPENED
                    values = {
                        "state": State.CLAIMED.value, "token": seen.token + 1, "owner": request.owner,
                        "lease_expires_at": lease, "attempts": seen.attempts + 1,
                        "reclaims": seen.reclaims + (1 if reclaim else 0), "updated_at": now,
                    }
                moved = conn.execute(
                    sa.update(t)
                    .where(t.c.intent_key == request.key, t.c.token == seen.token,
                           t.c.state == seen.state.value)
                    .values(**values)
                ).rowcount
                if moved == 1:
                    if status is ClaimStatus.ACQUIRED:
                        return Claim(status, self._from_row(values))
                    merged = {**_row_of(seen), **values}
                    return Claim(status, self._from_row(merged))
            raise LedgerUnavailableError(f"claim of {request.key} kept losing races; giving up this attempt")

        result: Claim = self._run(do)
        return result

    def _insert_new(self, conn: Connection, values: dict[str, Any]) -> tuple[bool, Record | None]:
        """Insert a new claim. Returns (inserted, the existing record when the store told us)."""
        ins = self._insert().values(**values)
        if self.dialect == "postgresql":
            # One statement for both outcomes: the insert, or else the row already there.
            # (A row committed by a concurrent claimer after this statement's snapshot
            # shows as neither; the caller then reads it.)
            t = self.table
            new = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(*t.c).cte("new")
            stmt = sa.union_all(
                sa.select(new, sa.literal(True).label("inserted")),
                sa.select(t, sa.literal(False).label("inserted")).where(
                    t.c.intent_key == values["intent_key"], ~sa.exists(sa.select(new.c.intent_key))
                ),
            )
            row = conn.execute(stmt).first()
            if row is None:
                return False, None
            return bool(row.inserted), None if row.inserted else self._record(row)
        if self.dialect == "sqlite":
            stmt = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(self.table.c.token)
            return conn.execute(stmt).first() is not None, None
        # MariaDB: a no-op update on the duplicate key; RETURNING then gives the
        # row that is there, ours or the existing one, in the same round trip.
        # (Rows affected cannot tell: SQLAlchemy sets CLIENT_FOUND_ROWS.) The
        # owner string carries a per-claim nonce, so "ours" is unambiguous.
        stmt = ins.on_duplicate_key_update(intent_key=ins.inserted.intent_key).returning(*self.table.c)
        row = conn.execute(stmt).first()
        if row is None:
            return False, None
        record = self._record(row)
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
    ) -> None:
        t = self.table

        def do(conn: Connection) -> None:
            now = time.time()
            values: dict[str, Any] = {
                "state": state.value, "lease_expires_at": None, "updated_at": now,
                "expires_at": now + self.retention_seconds if state.expires else None,
            }
            if result is not None:
                values["result"] = dumps_json(result)
            if error is not None:
                values["error"] = dumps_json(error)
            mine = sa.update(t).where(
                t.c.intent_key == key, t.c.state == State.CLAIMED.value, t.c.token == token
            )
            if conn.execute(mine.values(**values)).rowcount == 1:
                return
            if state is State.SENT:  # a late holder reporting the truth (see ledger.base)
                late = sa.update(t).where(
                    t.c.intent_key == key, t.c.token > token,
                    t.c.state.in_([State.REVIEW.value, State.RELEASED.value, State.CLAIMED.value]),
                )
                if conn.execute(late.values(**values)).rowcount == 1:
                    return
            seen = self._select(conn, key)
            if seen is None:
                raise RecordNotFoundError(f"no ledger record for key {key}")
            raise StaleTokenError(
                f"token {token} no longer holds {key}: it is {seen.state.value} with token {seen.token}"
            )

        self._run(do)

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.intent_key == key, t.c.state == State.CLAIMED.value, t.c.token == token)
            .values(lease_expires_at=time.time() + lease_seconds)
        )
        return bool(self._run(lambda conn: conn.execute(stmt).rowcount == 1))

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

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.intent_key == key, t.c.token == expected_token)
            .values(
                state=new.state.value, token=new.token, owner=new.owner,
                lease_expires_at=new.lease_expires_at, result=dumps_json(new.result),
                error=dumps_json(new.error), updated_at=new.updated_at, expires_at=new.expires_at,
            )
        )
        return bool(self._run(lambda conn: conn.execute(stmt).rowcount == 1))

    def purge_expired(self, now: float | None = None) -> int:
        t = self.table
        cutoff = time.time() if now is None else now
        stmt = sa.delete(t).where(t.c.state.in_(_FINAL_EXPIRING), t.c.expires_at <= cutoff)
        return int(self._run(lambda conn: conn.execute(stmt).rowcount))

    def ping(self) -> None:
        self._run(lambda conn: conn.execute(sa.text("SELECT 1")))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def drop_table(self) -> None:
        """Drop the ledger table (tests and teardown)."""
        self._run(lambda conn: self.table.drop(conn, checkfirst=True))
        self._ready = False


def _row_of(record: Record) -> dict[str, Any]:
    return {
        "intent_key": record.key, "task_name": record.task_name, "state": record.state.value,
        "token": record.token, "owner": record.owner, "lease_expires_at": record.lease_expires_at,
        "attempts": record.attempts, "reclaims": record.reclaims, "payload": record.payload,
        "fingerprint": record.fingerprint, "result": dumps_json(record.result),
        "error": dumps_json(record.error), "created_at": record.created_at,
        "updated_at": record.updated_at, "expires_at": record.expires_at,
    }


def _is_disconnect(exc: OperationalError) -> bool:
    text = str(exc.orig or exc).lower()
    return any(w in text for w in ("connect", "server has gone away", "lost connection", "timeout"))
