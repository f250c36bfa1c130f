"""The SQL ledger keeps one connection open between calls; a dead one must not stick.

The database server kills the ledger's connection (as a restart or a failover
would): the next call reports the ledger unreachable (the task then retries,
fail closed), and the call after it works on a new connection.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from idemmail_celery.errors import LedgerUnavailableError, StaleTokenError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus
from idemmail_celery.ledger.sql import SQLLedger

from .conftest import MARIADB_URL, POSTGRES_URL, drop_ledger, service_missing, unique

KILL = {
    "postgresql": (
        POSTGRES_URL, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :tag"
    ),
    "mariadb": (MARIADB_URL, None),
}


def request(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t", payload='{"args":[],"kwargs":{}}', fingerprint="f" * 64,
                        owner=f"o:{uuid.uuid4().hex[:6]}", lease_seconds=60)


@pytest.fixture(params=["postgresql", "mariadb"])
def kept(request: pytest.FixtureRequest) -> Iterator[tuple[str, SQLLedger]]:
    url, _ = KILL[request.param]
    options: dict[str, object] = {"table": unique("conn")}
    if request.param == "postgresql":
        options["connect_args"] = {"application_name": options["table"], "connect_timeout": 5}
    led = SQLLedger(url, **options)  # type: ignore[arg-type]
    try:
        led.ping()
    except Exception as exc:
        service_missing(request.param, exc)
    yield request.param, led
    drop_ledger(led)


def _kill_spare(dialect: str, led: SQLLedger) -> int:
    """Kill, from another session, the server connection the ledger keeps open."""
    assert led._spare is not None, "the ledger should keep its connection between calls"
    admin = sa.create_engine(KILL[dialect][0], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            if dialect == "postgresql":
                return len(c.execute(sa.text(KILL[dialect][1] or ""), {"tag": led.table.name}).fetchall())
            conn_id = led._spare.execute(sa.text("SELECT CONNECTION_ID()")).scalar()
            c.execute(sa.text(f"KILL {int(conn_id or 0)}"))
            return 1
    finally:
        admin.dispose()


def test_killed_connection_fails_closed_once_then_recovers(kept: tuple[str, SQLLedger]) -> None:
    dialect, led = kept
    first = led.claim(request("k1"))
    assert first.status is ClaimStatus.ACQUIRED
    assert _kill_spare(dialect, led) == 1

    with pytest.raises(LedgerUnavailableError):
        led.claim(request("k2"))  # the kept connection is dead: unreachable, nothing claimed
    assert led._spare is None  # and it was not kept

    again = led.claim(request("k2"))  # a new connection
    assert again.status is ClaimStatus.ACQUIRED
    led.complete("k1", first.token, {"value": 1})
    replay = led.claim(request("k1"))
    assert replay.status is ClaimStatus.DONE and replay.record.result == {"value": 1}


def test_refusals_keep_the_connection(kept: tuple[str, SQLLedger]) -> None:
    _, led = kept
    first = led.claim(request("k1"))
    spare = led._spare
    with pytest.raises(StaleTokenError):
        led.complete("k1", first.token + 5, {"value": 1})
    assert led._spare is spare  # our own verdict, not a database error: still kept


def test_more_threads_than_the_pool_holds_all_finish(kept: tuple[str, SQLLedger]) -> None:
    """20 threads on a pool of 2 + 2 overflow: the kept connection never starves a waiter."""
    dialect, _ = kept
    url = KILL[dialect][0]
    led = SQLLedger(url, table=unique("pool"), pool_size=2, max_overflow=2, pool_timeout=20)
    errors: list[BaseException] = []
    done: list[ClaimStatus] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                c = led.claim(request(f"t{n}-{i}"))
                led.complete(c.record.key, c.token, {"value": i})
                done.append(c.status)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert done.count(ClaimStatus.ACQUIRED) == 200
    finally:
        drop_ledger(led)


class _SoftTimeLimit(Exception):
    """Stands for Celery's SoftTimeLimitExceeded: raised into the process at any point."""


def test_a_connection_interrupted_mid_call_is_thrown_away(kept: tuple[str, SQLLedger]) -> None:
    _, led = kept
    led.claim(request("k1"))
    spare = led._spare
    assert spare is not None

    def interrupted(conn: sa.Connection) -> None:
        conn.execute(sa.text("SELECT 1")).scalar()
        raise _SoftTimeLimit

    with pytest.raises(_SoftTimeLimit):
        led._run(interrupted)
    assert led._spare is None and spare.closed  # its protocol state is unknown: never reused
    assert led.claim(request("k2")).status is ClaimStatus.ACQUIRED  # a new connection serves the next call


def test_a_refused_statement_fails_closed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """SQLite locked past its busy timeout: the claim is unavailable (the task retries), not a raw error."""
    path = tmp_path_factory.mktemp("locked") / "ledger.sqlite3"
    led = SQLLedger(f"sqlite:///{path}")
    led.ping()
    assert led._spare is not None
    led._spare.exec_driver_sql("PRAGMA busy_timeout=200")  # the ledger waits 30 s by default
    holder = sa.create_engine(f"sqlite:///{path}", isolation_level="AUTOCOMMIT")
    with holder.connect() as c:
        c.exec_driver_sql("PRAGMA busy_timeout=0")
        c.exec_driver_sql("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            with pytest.raises(LedgerUnavailableError, match="refused"):
                led.claim(request("locked"))
        finally:
            c.exec_driver_sql("ROLLBACK")
    assert led.claim(request("locked")).status is ClaimStatus.ACQUIRED  # nothing was written before
    holder.dispose()
    led.close()
