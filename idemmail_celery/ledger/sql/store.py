"""The SQL ledger's moves, each one statement (or one read and one conditional ``UPDATE``) in autocommit."""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from ...errors import LedgerUnavailableError, RecordNotFoundError, StaleTokenError
from ..base import (
    UNKNOWN_STAGE,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Mark,
    Record,
    RosterEntry,
    State,
    _check_unique,
    check_roster_entry,
    dumps_json,
    loads_json,
)
from ..listing import Counts, Position, RecordQuery, Selection
from .connection import SQLConnections
from .schema import LONG_TEXT, hop_digest, migration_file

log = logging.getLogger("idemmail_celery")

_FINAL_EXPIRING = (State.SENT.value, State.FAILED.value)
#: A new claim's stored owner is ``request.owner + "/" + nonce`` (see :func:`_fresh_row`).
_OWNER_NONCE_HEX = 6


class SQLLedger(SQLConnections):
    """Ledger in one SQL table (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///path``); options as
    :class:`~.connection.SQLConnections` (``table``, ``retention_seconds``, ``keep_payload``, ``create_table``)."""

    marks_takeovers = True  # a reclaim from a holder without the write-ahead promise marks it 'unknown'

    def _insert(self, table: sa.Table | None = None) -> Any:
        """The dialect's ``INSERT`` into ``table`` (the ledger's by default), which has its upsert clauses."""
        insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(self.dialect, mysql.insert)
        return insert(self.table if table is None else table)

    def _record(self, row: Any) -> Record:
        return self._from_row(row._mapping)

    @functools.cached_property
    def _stmts(self) -> dict[str, Any]:
        """The hot-path statements, built once (one built per call cost more than the round trip)."""
        t = self.table
        p = {c.name: sa.bindparam(f"p_{c.name}", type_=c.type) for c in t.c}
        ins = self._insert().values(p)
        out: dict[str, Any] = {"select": sa.select(t).where(t.c.intent_key == sa.bindparam("k"))}
        if self.dialect == "postgresql":
            # The insert, or else the row already there (one committed after this snapshot shows as neither).
            new = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(*t.c).cte("new")
            out["insert"] = sa.union_all(
                sa.select(new, sa.literal(True).label("inserted")),
                sa.select(t, sa.literal(False).label("inserted")).where(
                    t.c.intent_key == p["intent_key"], ~sa.exists(sa.select(new.c.intent_key))))
        elif self.dialect == "sqlite":
            out["insert"] = ins.on_conflict_do_nothing(index_elements=["intent_key"]).returning(t.c.token)
        else:
            out["insert"] = ins.on_duplicate_key_update(intent_key=ins.inserted.intent_key).returning(*t.c)
        # A transition: NULL result/error parameters keep what the row has; the mark is the move's own (NULL: none).
        finish_values = {
            "state": sa.bindparam("st"), "lease_expires_at": None, "updated_at": sa.bindparam("now"),
            "expires_at": sa.bindparam("exp", type_=sa.Double),
            "result": sa.func.coalesce(sa.bindparam("res", type_=LONG_TEXT), t.c.result),
            "error": sa.func.coalesce(sa.bindparam("err", type_=LONG_TEXT), t.c.error),
            "mark": sa.bindparam("mark", type_=sa.Text)}
        # Moving to sent erases the first payload in the same statement, unless kept for audit.
        sent_values = finish_values if self.keep_payload else {**finish_values, "payload": None}
        mine = sa.update(t).where(t.c.intent_key == sa.bindparam("k"), t.c.state == State.CLAIMED.value,
                                  t.c.token == sa.bindparam("tok"))
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
        ins_hop = self._insert(h).values(hop)
        if self.dialect in ("postgresql", "sqlite"):
            out["mark_hop"] = ins_hop.on_conflict_do_update(
                index_elements=["digest"], where=expired,
                set_={"marker": ins_hop.excluded.marker, "expires_at": ins_hop.excluded.expires_at},
            ).returning(h.c.marker)
        else:
            # MariaDB has no conditional upsert: assignments run left to right, so ``marker`` is decided on the
            # old expiry. RETURNING gives the row as it now is: ours if it carries our nonce.
            out["mark_hop"] = ins_hop.on_duplicate_key_update([
                ("marker", sa.func.if_(expired, ins_hop.inserted.marker, h.c.marker)),
                ("expires_at", sa.func.if_(expired, ins_hop.inserted.expires_at, h.c.expires_at)),
            ]).returning(h.c.marker)
        return out

    @functools.cached_property
    def _driver_sql(self) -> dict[str, tuple[str, tuple[str, ...] | None, dict[str, Any]]]:
        """The first-send statements compiled once: text, positional parameter order (or None), fixed values."""
        out = {}
        for name in ("insert", "finish_mine", "finish_sent"):
            compiled = self._stmts[name].compile(dialect=self.engine.dialect)
            fixed = {bind_name: bp.value for bp, bind_name in compiled.bind_names.items() if not bp.required}
            order = compiled.positiontup
            out[name] = (compiled.string, tuple(order) if order else None, fixed)
        return out

    def _execute(self, conn: Connection, name: str, params: dict[str, Any], *, returns_rows: bool) -> tuple[Any, int]:
        """(First row or None, row count) of hot statement ``name`` run on the DB-API cursor, past SQLAlchemy's
        execution layer (it doubled the client CPU), raising as ``execute()``, which listeners (tracing) get."""
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
        return self._run(lambda conn: self._claim_on(conn, request))

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
        """One multi-row insert, one read of the keys already there, one ``UPDATE`` per takeover."""
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

        return self._run(do)

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
        else:  # a resumed claim is its own chain's: no takeover to count
            status = ClaimStatus.RESUMED if resume else (
                ClaimStatus.RECLAIMED if seen.state is State.CLAIMED else ClaimStatus.REOPENED)
            values = _takeover_values(seen, request, status, now)
        t = self.table
        as_seen = (t.c.intent_key == request.key, t.c.token == seen.token, t.c.state == seen.state.value)
        if conn.execute(sa.update(t).where(*as_seen).values(**values)).rowcount != 1:
            return None
        if status is ClaimStatus.ACQUIRED:
            return Claim(status, self._from_row(values))
        record = self._from_row({**_row_of(seen), **values})
        if seen.state is not State.CLAIMED:
            return Claim(status, record)
        return Claim(status, record, previous_owner=seen.owner, previous_writes_ahead=seen.writes_ahead)

    def _insert_new(self, conn: Connection, values: dict[str, Any]) -> tuple[bool, Record | None]:
        """Insert a new claim. Returns (inserted, the existing record when the store told us)."""
        params = {f"p_{name}": v for name, v in values.items()}
        row, _ = self._execute(conn, "insert", params, returns_rows=True)
        if row is None or self.dialect == "sqlite":
            return row is not None, None
        if self.dialect == "postgresql":  # the table's columns, then "inserted"
            inserted = bool(row[-1])
            return inserted, None if inserted else self._from_row(dict(zip(self._columns, row[:-1], strict=True)))
        # MariaDB: RETURNING gives the row there, ours if it has our nonce (rows affected cannot: CLIENT_FOUND_ROWS).
        record = self._from_row(dict(zip(self._columns, row, strict=True)))
        mine = record.owner == values["owner"] and record.token == 1 and record.state is State.CLAIMED
        return mine, None if mine else record

    def _from_row(self, values: dict[str, Any]) -> Record:
        v = values
        return Record(
            key=v["intent_key"], task_name=v["task_name"], state=State(v["state"]), token=int(v["token"]),
            owner=v["owner"], lease_expires_at=v["lease_expires_at"], attempts=int(v["attempts"]),
            reclaims=int(v["reclaims"]), payload=v["payload"], fingerprint=v["fingerprint"],
            result=loads_json(v["result"]), error=loads_json(v["error"]), created_at=v["created_at"],
            updated_at=v["updated_at"], expires_at=v["expires_at"], mark=Mark.from_dict(loads_json(v["mark"])),
            resolution=loads_json(v["resolution"]), writes_ahead=bool(v["writes_ahead"]))

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        def do(conn: Connection) -> float | None:
            now = time.time()
            params = {"k": key, "tok": token, "st": state.value, "now": now,
                      "exp": now + self.retention_seconds if state.expires else None,
                      "res": dumps_json(result), "err": dumps_json(error), "mark": _mark_json(mark)}
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
            raise StaleTokenError(f"token {token} no longer holds {key}: it is {seen.state.value} "
                                  f"with token {seen.token}")

        return self._run(do)

    def _held(self, key: str, token: int) -> sa.ColumnElement[bool]:
        """The fence of every move a holder makes: the row of a claim still held with ``token``."""
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
            mark=_mark_json(Mark(stage, now, token, owner)), lease_expires_at=now + lease_seconds))

    def get(self, key: str) -> Record | None:
        record = self._run(lambda conn: self._select(conn, key))
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
        stmt = (sa.select(t.c.state, sa.func.count())
                .where(sa.or_(t.c.expires_at.is_(None), t.c.expires_at > time.time())).group_by(t.c.state))
        rows = self._run(lambda conn: conn.execute(stmt).all())
        return {s.value: 0 for s in State} | {str(state): int(n) for state, n in rows}

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        t = self.table
        values: dict[str, Any] = {
            "state": new.state.value, "token": new.token, "owner": new.owner, "lease_expires_at": new.lease_expires_at,
            "result": dumps_json(new.result), "error": dumps_json(new.error), "updated_at": new.updated_at,
            "expires_at": new.expires_at, "mark": _mark_json(new.mark), "resolution": dumps_json(new.resolution),
            "writes_ahead": new.writes_ahead}
        if new.state is State.SENT and not self.keep_payload:
            values["payload"] = None
        return self._one_row(sa.update(t).where(t.c.intent_key == key, t.c.token == expected_token).values(values))

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        t = self.table
        as_read = sa.and_(t.c.intent_key == key, t.c.token == expected_token, t.c.state == expected_state.value)
        # Rows matched, not changed (MariaDB gets CLIENT_FOUND_ROWS): erasing twice is still True.
        return self._one_row(sa.update(t).where(as_read).values(
            payload=None, result=dumps_json(result), error=dumps_json(error), resolution=dumps_json(resolution)))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        """One upsert of a digest of ``key`` and ``hop``; None without the marks table (migration 002)."""
        now = time.time()
        marker = secrets.token_hex(8)
        params = {"d": hop_digest(key, hop), "m": marker, "exp": now + ttl_seconds, "now": now}

        def do(conn: Connection) -> bool | None:
            if not self._hops_ready:  # known once the first call has looked at the schema
                return None
            row = conn.execute(self._stmts["mark_hop"], params).first()
            return row is not None and row[0] == marker

        return self._run(do)

    def hop_marked(self, key: str, hop: str) -> bool | None:
        """One ``SELECT`` of a live mark; None without the marks table (as :meth:`mark_hop`)."""
        h = self.hops
        stmt = sa.select(h.c.digest).where(h.c.digest == hop_digest(key, hop), h.c.expires_at > sa.bindparam("now"))

        def do(conn: Connection) -> bool | None:
            if not self._hops_ready:
                return None
            return conn.execute(stmt, {"now": time.time()}).first() is not None

        return self._run(do)

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """One upsert (or delete) on this process's clock (keep hosts' clocks in step), then a prune."""
        ids = check_roster_entry(member, secret_ids)
        r = self.roster_table
        self._need_roster()

        def do(conn: Connection) -> None:
            if ttl_seconds <= 0:
                conn.execute(sa.delete(r).where(r.c.member == member))
                return
            ins = self._insert(r).values(member=member, secret_ids=ids, expires_at=time.time() + ttl_seconds)
            if self.dialect in ("postgresql", "sqlite"):
                conn.execute(ins.on_conflict_do_update(index_elements=["member"], set_={
                    "secret_ids": ins.excluded.secret_ids, "expires_at": ins.excluded.expires_at}))
            else:
                conn.execute(ins.on_duplicate_key_update(secret_ids=ins.inserted.secret_ids,
                                                         expires_at=ins.inserted.expires_at))

        self._run(do)
        self._prune_roster()

    def _prune_roster(self) -> None:
        """Delete lapsed roster rows by primary key, found first without a lock (an InnoDB scan locks every row)."""
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
        """The live rows (lapsed ones are pruned by :meth:`announce`)."""
        r = self.roster_table
        self._need_roster()

        def do(conn: Connection) -> list[RosterEntry]:
            now = time.time()
            rows = conn.execute(sa.select(r.c.member, r.c.secret_ids, r.c.expires_at)
                                .where(r.c.expires_at > now)).all()
            return [RosterEntry(m, tuple(str(ids).split(",")), float(exp)) for m, ids, exp in rows]

        return self._run(do)

    def _need_roster(self) -> None:
        if not self._ready:
            self.ping()  # looks at the schema: is the roster table there?
        if not self._roster_ready:
            raise NotImplementedError(f"{self.roster_table.name} is missing: apply migration "
                                      f"{migration_file(self.dialect, 3)}")

    # -- listing: the review queue (see ``listing``) --

    def _reason(self) -> sa.ColumnElement[Any]:
        """The ``reason`` of a row's error, read by the database: NULL unless a string (as ``reason_of``)."""
        error = self.table.c.error
        if self.dialect == "postgresql":
            reason = sa.cast(error, postgresql.JSON)["reason"]  # json takes any JSON text
            kind, text = sa.func.json_typeof(reason), reason.astext
        elif self.dialect == "sqlite":
            kind, text = sa.func.json_type(error, "$.reason"), sa.func.json_extract(error, "$.reason")
        else:
            kind = sa.func.json_type(sa.func.json_extract(error, "$.reason"))
            text = self._exact(sa.func.json_value(error, "$.reason"))
        string = {"postgresql": "string", "sqlite": "text"}.get(self.dialect, "STRING")
        return sa.case((kind == string, text), else_=sa.null())

    def _exact(self, text: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """``text`` compared and grouped byte for byte (MariaDB's default collation ignores case)."""
        return text.collate("utf8mb4_bin") if self.dialect in ("mysql", "mariadb") else text

    def _where(self, query: RecordQuery, now: float, *, task: bool = True, reason: bool = True,
               search: bool = True) -> list[sa.ColumnElement[bool]]:
        """The conditions of ``query`` (those named False left out); words match the raw text, a superset."""
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
        """Delete ``sent``/``failed`` records past retention and expired reschedule marks; returns the records."""
        t, h = self.table, self.hops
        cutoff = time.time() if now is None else now
        stmt = sa.delete(t).where(t.c.state.in_(_FINAL_EXPIRING), t.c.expires_at <= cutoff)

        def do(conn: Connection) -> int:
            gone = int(conn.execute(stmt).rowcount)
            if self._hops_ready:
                conn.execute(sa.delete(h).where(h.c.expires_at <= cutoff))
            return gone

        return self._run(do)


def _fresh_row(request: ClaimRequest) -> dict[str, Any]:
    """The row a brand-new claim inserts; its owner gets a nonce per call (how MariaDB tells its own insert)."""
    now = time.time()
    return {
        "intent_key": request.key, "task_name": request.task_name, "state": State.CLAIMED.value, "token": 1,
        "owner": f"{request.owner}/{secrets.token_hex(_OWNER_NONCE_HEX // 2)}",
        "lease_expires_at": now + request.lease_seconds, "attempts": 1, "reclaims": 0, "payload": request.payload,
        "fingerprint": request.fingerprint, "result": None, "error": None, "created_at": now, "updated_at": now,
        "expires_at": None, "mark": None, "resolution": None, "writes_ahead": request.writes_ahead}


def _resumes(seen: Record, request: ClaimRequest) -> bool:
    """Does ``request`` resume the claim ``seen``: this chain's earlier claim, or this very request run twice?"""
    return seen.state is State.CLAIMED and (
        _owned_by(seen.owner, request.owner)
        or (request.resume_owner is not None and _owned_by(seen.owner, request.resume_owner)))


def _takeover_values(seen: Record, request: ClaimRequest, status: ClaimStatus, now: float) -> dict[str, Any]:
    """The columns a takeover of ``seen`` writes."""
    values: dict[str, Any] = {
        "state": State.CLAIMED.value, "token": seen.token + 1, "owner": request.owner, "updated_at": now,
        "lease_expires_at": now + request.lease_seconds, "attempts": seen.attempts + 1,
        "reclaims": seen.reclaims + (1 if status is ClaimStatus.RECLAIMED else 0), "writes_ahead": request.writes_ahead}
    if status is ClaimStatus.RECLAIMED and not seen.writes_ahead and seen.mark is None:
        # No write-ahead promise and no mark: the holder may have run.
        values["mark"] = _mark_json(Mark(UNKNOWN_STAGE, int(now), seen.token))
    return values


def _owned_by(stored: str, owner: str) -> bool:
    """Was the record claimed under ``owner``? A new claim stores it with a nonce appended."""
    nonced = len(stored) == len(owner) + 1 + _OWNER_NONCE_HEX and stored[len(owner)] == "/"
    return stored == owner or (nonced and stored.startswith(owner))


def _mark_json(mark: Mark | None) -> str | None:
    """A write-ahead mark as its column holds it (NULL for none)."""
    return None if mark is None else dumps_json(mark.to_dict())


def _row_of(record: Record) -> dict[str, Any]:
    row = {**record.to_dict(), "intent_key": record.key, "payload": record.payload, "mark": _mark_json(record.mark)}
    return {**row, **{name: dumps_json(row[name]) for name in ("result", "error", "resolution")}}
